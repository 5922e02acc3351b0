"""The whole register verified beside `bothy serve`'s start (issue 18, engine/chaincheck.py): a
long register is walked by a process of its own while serve imports, and its verdict is the
one `bothy audit verify` gives; a tampered one still stops serve, naming the record; a child
that gives no verdict leaves the walk to serve itself. A short register is walked in-process.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import psutil
import pytest

from bothy.engine.audit import AuditLog
from bothy.engine.chaincheck import BESIDE_FROM_BYTES, ChainCheck
from tests.fakes.model_server import ModelServer
from tests.fakes.shell import Shell
from tests.fakes.site import Site
from tests.test_audit_repair import TAMPERS
from tests.test_serve import SECRET, records, serve_site, start_serve

_PAD = "x" * (BESIDE_FROM_BYTES // 5)  # six records of it: a register past the threshold

needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="the walk goes beside the start only where a second core can take it")


def _long_register(path: Path) -> list[bytes]:
    """Six records (the tamper variants' shape), long enough to be walked beside; its lines."""
    log = AuditLog(path)
    for n in range(1, 7):
        log.append("sop", "saved", "ok", subject=f"sop:s{n}", details={"n": n, "pad": _PAD})
    assert path.stat().st_size >= BESIDE_FROM_BYTES
    return path.read_bytes().splitlines(keepends=True)


def _walkers() -> list[psutil.Process]:
    """This process's children walking a register (the beside check's interpreter)."""
    return [child for child in psutil.Process().children()
            if "bothy.engine.chaincheck" in child.cmdline()]


@needs_two_cores
@pytest.mark.parametrize("variant", ["intact", *TAMPERS])
async def test_a_long_register_is_walked_beside_and_its_verdict_is_verifys(
    tmp_path: Path, variant: str
) -> None:
    """The child's verdict is `verify`'s, word for word, for an intact register and for every
    tamper that stops serve."""
    register = tmp_path / "audit.jsonl"
    lines = _long_register(register)
    if variant != "intact":
        tamper, named = TAMPERS[variant]
        register.write_bytes(b"".join(tamper(lines)))
    check = ChainCheck.start(register)
    assert check.beside and len(_walkers()) == 1

    checked = await check.checked()

    assert checked.beside and checked.report == AuditLog(register).verify()
    assert checked.report.ok == (variant == "intact")
    if variant != "intact":
        assert named in checked.report.problem
    assert not _walkers()  # the child has exited and been reaped


async def test_a_short_register_is_walked_in_process(tmp_path: Path) -> None:
    """Under the threshold no interpreter is started for it: serve walks it itself."""
    register = tmp_path / "audit.jsonl"
    AuditLog(register).append("sop", "saved", "ok", subject="sop:s1", details={"n": 1})

    check = ChainCheck.start(register)
    assert not check.beside and not _walkers()
    checked = await check.checked()

    assert not checked.beside and checked.report.ok and checked.report.count == 1
    assert checked.walk_ms == checked.waited_ms


@needs_two_cores
async def test_a_walk_killed_beside_is_made_in_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A child killed before its verdict (SIGKILL: the OOM killer, an operator) leaves serve
    to walk the chain itself, saying why; a tampered register is still named."""
    register = tmp_path / "audit.jsonl"
    tamper, named = TAMPERS["middle record edited"]
    register.write_bytes(b"".join(tamper(_long_register(register))))
    check = ChainCheck.start(register)
    [walker] = _walkers()
    walker.send_signal(signal.SIGKILL)

    with caplog.at_level(logging.WARNING, logger="bothy.engine.chaincheck"):
        checked = await check.checked()

    assert not checked.beside and not checked.report.ok and named in checked.report.problem
    assert "gave no verdict: it was ended by SIGKILL" in caplog.text
    assert "serve walks the chain itself" in caplog.text


@needs_two_cores
async def test_closing_a_check_nobody_takes_ends_its_walk(tmp_path: Path) -> None:
    """A start that fails before its check (a config error, another serve's lock) ends the
    child and reaps it: nothing walks on after serve has gone."""
    register = tmp_path / "audit.jsonl"
    _long_register(register)
    check = ChainCheck.start(register)
    [walker] = _walkers()

    check.close()

    assert not walker.is_running() and not _walkers()


@pytest.mark.codex
@needs_two_cores
async def test_serve_on_a_long_tampered_register_exits_78_naming_the_record(
    tmp_path: Path,
) -> None:
    """The walk beside the start stops serve as the in-process one does: exit 78 naming the
    record and what to do, and not one byte appended."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")  # nothing here runs a model
    tamper, named = TAMPERS["records swapped"]
    site.audit_path.write_bytes(b"".join(tamper(_long_register(site.audit_path))))
    broken = site.audit_path.read_bytes()

    serve = await site.bothy("serve", timeout_s=30)

    assert serve.code == 78, serve.stderr
    assert named in serve.stderr and "bothy audit repair" in serve.stderr, serve.stderr
    assert site.audit_path.read_bytes() == broken


@pytest.mark.codex
@needs_two_cores
async def test_serve_on_a_long_register_says_its_walk_was_made_beside(
    server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve starting` says how many records the start verified, how long the walk took,
    how long serve waited for it, and that a process of its own made it."""
    monkeypatch.setenv("GH_SECRET", SECRET)
    site = serve_site(tmp_path, server)
    _long_register(site.audit_path)

    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [starting] = records(site, "serve", "starting")
        assert await serving.stop() == 0

    details = starting.details
    assert details["chain_verified"] == 6 and details["chain_beside"] is True
    assert details["chain_waited_ms"] >= 0 and details["chain_verify_ms"] >= 0
