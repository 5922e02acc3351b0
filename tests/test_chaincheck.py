"""The whole register verified beside `bothy serve`'s start (issue 18, engine/chaincheck.py): a
long register is walked by a process of its own while serve imports, and its verdict is the
one `bothy audit verify` gives; a tampered one still stops serve, naming the record; a child
that gives no verdict leaves the walk to serve itself, saying why. A short register is walked
in-process.

To hold a child mid-walk, a test holds the writers' lock: the walk waits for it before it
reads (it reads as far as the register reached when no writer was mid-append).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bothy.engine.audit import AuditLog
from bothy.engine.auditfile import exclusive_lock, lock_path_for
from bothy.engine.chaincheck import BESIDE_FROM_BYTES, ChainCheck
from tests.fakes.model_server import ModelServer
from tests.fakes.shell import Shell, until
from tests.fakes.site import Site
from tests.test_audit_repair import TAMPERS
from tests.test_serve import SECRET, records, serve_site, start_serve

_PAD = "x" * (BESIDE_FROM_BYTES // 5)  # six records of it: a register past the threshold
_NO_MODEL = "http://127.0.0.1:9/v1"  # nothing here runs a model
_CORES = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
          else os.cpu_count() or 1)

needs_two_cores = pytest.mark.skipif(
    _CORES < 2, reason="the walk goes beside the start only where a second core can take it")


def long_register(path: Path) -> list[bytes]:
    """Six records (the tamper variants' shape), long enough to be walked beside; its lines."""
    log = AuditLog(path)
    for n in range(1, 7):
        log.append("sop", "saved", "ok", subject=f"sop:s{n}", details={"n": n, "pad": _PAD})
    assert path.stat().st_size >= BESIDE_FROM_BYTES
    return path.read_bytes().splitlines(keepends=True)


def walkers(parent: int | None = None) -> list[psutil.Process]:
    """The children of this process (or of ``parent``) walking a register (the beside
    check's interpreter)."""
    walking = []
    for child in psutil.Process(parent).children():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            if "bothy.engine.chaincheck" in " ".join(child.cmdline()):
                walking.append(child)
    return walking


@contextlib.contextmanager
def held(register: Path) -> Iterator[None]:
    """The writers' lock, held: a walk of ``register`` waits before it reads."""
    with exclusive_lock(lock_path_for(register)):
        yield


async def _blocked_walker(check: ChainCheck) -> psutil.Process:
    """The check's child, once it waits on the writers' lock (it has imported and begun)."""
    assert check.beside
    await until(lambda: len(walkers()) == 1, "the walker started")
    [walker] = walkers()
    await until(lambda: opened_the_lock(walker), "the walker waiting on the lock")
    return walker


def opened_the_lock(walker: psutil.Process) -> bool:
    """Whether ``walker`` has the writers' lock file open: it waits on it from there on."""
    with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
        return any(f.path.endswith(".lock") for f in walker.open_files())
    return False


@needs_two_cores
@pytest.mark.parametrize("variant", ["intact", *TAMPERS])
async def test_a_long_register_is_walked_beside_and_says_what_audit_verify_says(
    tmp_path: Path, variant: str
) -> None:
    """The verdict taken from the child is the one `bothy audit verify --json` prints, field
    for field, for an intact register and for every tamper that stops serve."""
    site = Site(tmp_path, _NO_MODEL)
    lines = long_register(site.audit_path)
    if variant != "intact":
        tamper, named = TAMPERS[variant]
        site.audit_path.write_bytes(b"".join(tamper(lines)))
    check = await ChainCheck.start(site.audit_path)
    assert check.beside and len(walkers()) == 1

    checked = await check.checked()
    verify = await site.bothy("audit", "verify", "--json")

    assert checked.beside and checked.report.ok == (variant == "intact")
    assert json.loads(json.dumps(dataclasses.asdict(checked.report))) == json.loads(verify.stdout)
    if variant != "intact":
        assert named in checked.report.problem
    assert not walkers()  # the child has exited and been reaped


async def test_a_short_register_is_walked_in_process(tmp_path: Path) -> None:
    """Under the threshold no interpreter is started for it: serve walks it itself."""
    register = tmp_path / "audit.jsonl"
    AuditLog(register).append("sop", "saved", "ok", subject="sop:s1", details={"n": 1})

    check = await ChainCheck.start(register)
    assert not check.beside and not walkers()
    checked = await check.checked()

    assert not checked.beside and checked.report.ok and checked.report.count == 1


@needs_two_cores
@pytest.mark.parametrize(("sent", "said"), [
    (signal.SIGKILL, "it was ended by SIGKILL"),  # the OOM killer, an operator
    (signal.SIGRTMIN + 3, f"it was ended by signal {signal.SIGRTMIN + 3}"),  # no name of its own
])
async def test_a_walk_ended_beside_is_made_in_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, sent: int, said: str
) -> None:
    """A child ended before its verdict leaves serve to walk the chain itself, saying why;
    a tampered register is still named."""
    register = tmp_path / "audit.jsonl"
    tamper, named = TAMPERS["middle record edited"]
    register.write_bytes(b"".join(tamper(long_register(register))))
    with held(register):
        check = await ChainCheck.start(register)
        walker = await _blocked_walker(check)
        walker.send_signal(sent)
        await until(lambda: not walker.is_running() or walker.status() == psutil.STATUS_ZOMBIE,
                    "the walker ended")

    with caplog.at_level(logging.WARNING, logger="bothy.engine.chaincheck"):
        checked = await check.checked()

    assert not checked.beside and not checked.report.ok and named in checked.report.problem
    assert f"gave no verdict: {said}; serve walks the chain itself" in caplog.text
    assert not walkers()


@needs_two_cores
async def test_a_walk_past_its_patience_is_ended_and_made_in_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A child that has not answered within its patience (a register on a stalled disk, say:
    here, held on the writers' lock) is ended and reaped, and the walk is made here, saying
    why."""
    register = tmp_path / "audit.jsonl"
    long_register(register)
    with held(register), caplog.at_level(logging.WARNING, logger="bothy.engine.chaincheck"):
        check = await ChainCheck.start(register, patience_s=0.5)
        walker = await _blocked_walker(check)
        waiting = asyncio.ensure_future(check.checked())
        await until(lambda: not walker.is_running() or walker.status() == psutil.STATUS_ZOMBIE,
                    "the walker ended at its patience")
    checked = await waiting

    assert not checked.beside and checked.report.ok and checked.report.count == 6
    assert "gave no verdict: it had not answered after 0.5 s; serve walks the chain itself" in (
        caplog.text)
    assert not walkers()


@needs_two_cores
async def test_a_start_stopped_while_it_waits_ends_the_walk_it_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Cancelled while it waits for the verdict (serve stopped), the check ends its child and
    reaps it, and says nothing of walking the chain itself: nobody will."""
    register = tmp_path / "audit.jsonl"
    long_register(register)
    with held(register), caplog.at_level(logging.WARNING, logger="bothy.engine.chaincheck"):
        check = await ChainCheck.start(register)
        walker = await _blocked_walker(check)
        waiting = asyncio.ensure_future(check.checked())
        await until(lambda: not check.beside, "the check waiting on its child")  # taken
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

        assert not walker.is_running() and not walkers()
    assert "gave no verdict" not in caplog.text


@needs_two_cores
async def test_closing_a_check_nobody_takes_ends_its_walk(tmp_path: Path) -> None:
    """A start that fails before its check (a config error, another serve's lock) ends the
    child and reaps it, mid-walk; a verdict is taken once."""
    register = tmp_path / "audit.jsonl"
    long_register(register)
    with held(register):
        check = await ChainCheck.start(register)
        walker = await _blocked_walker(check)

        await check.close()

        assert not walker.is_running() and not walkers()
    await check.checked()  # (closed: walked here)
    with pytest.raises(RuntimeError, match="taken already"):
        await check.checked()


@pytest.mark.codex
@needs_two_cores
async def test_serve_on_a_long_tampered_register_exits_78_naming_the_record(
    tmp_path: Path,
) -> None:
    """The walk beside the start stops serve as the in-process one does: exit 78 naming the
    record and what to do, and not one byte appended; the verdict is the child's."""
    site = Site(tmp_path, _NO_MODEL)
    tamper, named = TAMPERS["records swapped"]
    site.audit_path.write_bytes(b"".join(tamper(long_register(site.audit_path))))
    broken = site.audit_path.read_bytes()

    serve = await site.bothy("serve", timeout_s=30)

    assert serve.code == 78, serve.stderr
    assert named in serve.stderr and "bothy audit repair" in serve.stderr, serve.stderr
    assert "gave no verdict" not in serve.stderr, serve.stderr
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
    long_register(site.audit_path)

    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [starting] = records(site, "serve", "starting")
        assert await serving.stop() == 0

    details = starting.details
    assert details["chain_verified"] == 6 and details["chain_beside"] is True
    assert type(details["chain_verify_ms"]) is int and type(details["chain_waited_ms"]) is int
    assert 0 <= details["chain_waited_ms"] < 30_000


@pytest.mark.codex
@needs_two_cores
async def test_serve_whose_walker_is_killed_walks_the_chain_itself_and_starts(
    server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real serve's walker SIGKILLed mid-walk (held on the writers' lock): serve says why on
    its standard error, walks the chain itself, starts, and its `serve starting` says the walk
    was its own."""
    monkeypatch.setenv("GH_SECRET", SECRET)
    site = serve_site(tmp_path, server)
    long_register(site.audit_path)

    async with Shell(site) as shell:
        with held(site.audit_path):
            command = await shell.start("serve")
            await until(lambda: len(walkers(command.pid)) == 1
                        and opened_the_lock(walkers(command.pid)[0]), "serve's walker waiting")
            walkers(command.pid)[0].send_signal(signal.SIGKILL)
        await until(lambda: bool(records(site, "serve", "ready")) or not command.running,
                    "`bothy serve` ready")
        command.signal(signal.SIGTERM)
        done = await command.finish()

    assert done.code == 0, done.stderr
    assert ("made beside the start gave no verdict: it was ended by SIGKILL; serve walks the"
            " chain itself") in done.stderr
    [starting] = records(site, "serve", "starting")
    assert starting.details["chain_beside"] is False and starting.details["chain_verified"] == 6


@pytest.mark.codex
@needs_two_cores
async def test_a_second_serve_refused_by_the_lock_leaves_no_walker_behind(
    server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second `bothy serve` on a long register starts its walk before it meets the first
    one's lock: it exits 75, and the walker it started (held mid-walk) ends with it."""
    monkeypatch.setenv("GH_SECRET", SECRET)
    site = serve_site(tmp_path, server)
    long_register(site.audit_path)

    async with Shell(site) as shell:
        first = await start_serve(shell)
        with held(site.audit_path):
            second = await shell.bothy("serve")
            left = [p for p in psutil.process_iter(["cmdline"])
                    if str(site.audit_path) in " ".join(p.info["cmdline"] or ())]
        assert await first.stop() == 0

    assert second.code == 75, second
    assert left == []
