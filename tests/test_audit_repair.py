"""Nothing is appended to a broken register, and a repair never makes it look clean (issue 10,
item 4): every tamper variant named by `audit verify` and `doctor` and refused by a real
`bothy serve`; another appending process (`bothy sop set`) checked from the checkpoint;
`bothy audit repair` keeping the broken file aside and starting a new segment.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bothy.engine.audit import AuditLog
from bothy.engine.auditrecord import body_of
from tests.fakes.shell import Shell, until
from tests.fakes.site import Site
from tests.test_doctor import checks

_NO_MODEL = "http://127.0.0.1:9/v1"  # nothing here runs a model


def _site_with_records(root: Path, count: int = 6) -> Site:
    site = Site(root, _NO_MODEL)
    log = AuditLog(site.audit_path)
    for n in range(1, count + 1):
        log.append("sop", "saved", "ok", subject=f"sop:s{n}", details={"n": n})
    return site


def _lines(site: Site) -> list[bytes]:
    return site.audit_path.read_bytes().splitlines(keepends=True)


def _edit_middle(lines: list[bytes]) -> list[bytes]:
    lines[2] = lines[2].replace(b'"n":3', b'"n":9')
    return lines


def _delete_middle(lines: list[bytes]) -> list[bytes]:
    return lines[:2] + lines[3:]


def _swap(lines: list[bytes]) -> list[bytes]:
    lines[2], lines[3] = lines[3], lines[2]
    return lines


def _duplicate(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], lines[2], *lines[3:]]


def _insert_at_start(lines: list[bytes]) -> list[bytes]:
    return [lines[0], *lines]


def _forge_last(lines: list[bytes]) -> list[bytes]:
    """A last record with a correct hash of its own content whose prev links to nothing."""
    return [*lines, _forged(lines[-1], seq=7, prev="f" * 64)]


def _forged(model: bytes, *, seq: int, prev: str) -> bytes:
    import hashlib

    fields = json.loads(model)
    del fields["hash"]
    fields.update(seq=seq, prev=prev)
    body = json.dumps(fields, separators=(",", ":")).encode()
    digest = hashlib.sha256(body).hexdigest()
    line = body[:-1] + f',"hash":"{digest}"}}'.encode()
    assert body_of(line) == body
    return line + b"\n"


TAMPERS: dict[str, tuple[Callable[[list[bytes]], list[bytes]], str]] = {
    "middle record edited": (_edit_middle, "record 0003 was altered"),
    "middle record deleted": (_delete_middle, "record 0003 is missing"),
    "records swapped": (_swap, "record 0004 is out of order"),
    "record duplicated": (_duplicate, "record 0003 is out of order"),
    "record inserted at the start": (_insert_at_start, "record 0001 is out of order"),
    "forged last record badly linked": (_forge_last, "record 0007 does not follow 0006"),
}


@pytest.mark.codex
@pytest.mark.parametrize("variant", list(TAMPERS))
async def test_every_tamper_is_named_by_verify_and_doctor_and_refused_by_serve(
    tmp_path: Path, variant: str
) -> None:
    """The whole chain is checked: verify and doctor name the record, serve exits 78 naming it
    and what to do, and not one byte is appended."""
    tamper, named = TAMPERS[variant]
    site = _site_with_records(tmp_path)
    site.audit_path.write_bytes(b"".join(tamper(_lines(site))))
    broken = site.audit_path.read_bytes()

    verify = await site.bothy("audit", "verify")
    assert verify.code == 1 and named in verify.stdout, verify.stdout
    doctor = await site.bothy("doctor")
    assert f"[fail] audit chain intact: broken: {named}" in doctor.stdout, doctor.stdout
    serve = await site.bothy("serve", timeout_s=30)
    assert serve.code == 78, serve.stderr
    assert named in serve.stderr and "bothy audit repair" in serve.stderr, serve.stderr
    assert site.audit_path.read_bytes() == broken


async def test_serve_under_launchd_keeps_the_broken_register_message_and_exits_zero(
    tmp_path: Path,
) -> None:
    """launchd cannot filter 78: the message is kept in config-error.txt, as for config errors."""
    site = _site_with_records(tmp_path)
    site.audit_path.write_bytes(b"".join(_edit_middle(_lines(site))))

    serve = await site.bothy("serve", BOTHY_SERVICE_MANAGER="launchd", timeout_s=30)

    assert serve.code == 0, serve.stderr
    kept = (site.home / "state" / "config-error.txt").read_text()
    assert "record 0003 was altered" in kept and "bothy audit repair" in kept


async def test_another_appender_checks_what_was_appended_since_its_checkpoint(
    tmp_path: Path,
) -> None:
    """`bothy sop set` appends after checking from the checkpoint: a forged last record or a
    record inserted at the start is refused, naming it; without a checkpoint that still
    describes the file, the whole chain is checked."""
    source = tmp_path / "sop.md"
    source.write_text("Back up.\n")
    site = _site_with_records(tmp_path)
    assert site.audit_path.with_name("audit.jsonl.checkpoint").exists()
    good = _lines(site)

    for tamper, named in (TAMPERS["forged last record badly linked"],
                          TAMPERS["record inserted at the start"]):
        site.audit_path.write_bytes(b"".join(tamper(list(good))))
        broken = site.audit_path.read_bytes()
        refused = await site.bothy("sop", "set", "backup", "--file", str(source))
        assert refused.code == 1 and named in refused.stderr, refused.stderr
        assert "bothy audit repair" in refused.stderr
        assert site.audit_path.read_bytes() == broken

    # An edit in the middle, of the same length, lies before the checkpoint: a run does not
    # re-read it (that is what keeps `bothy run` fast) -- but with no checkpoint it is found.
    site.audit_path.write_bytes(b"".join(_edit_middle(list(good))))
    site.audit_path.with_name("audit.jsonl.checkpoint").unlink()
    refused = await site.bothy("sop", "set", "backup", "--file", str(source))
    assert refused.code == 1 and "record 0003 was altered" in refused.stderr, refused.stderr

    site.audit_path.write_bytes(b"".join(good))
    saved = await site.bothy("sop", "set", "backup", "--file", str(source))
    assert saved.code == 0, saved.stderr
    assert site.audit_lines()[-1].split()[2:5] == ["sop", "saved", "ok"]


@pytest.mark.codex
async def test_repair_keeps_the_broken_file_and_the_register_says_so_from_then_on(
    tmp_path: Path,
) -> None:
    """repair: the broken file kept byte for byte, a new segment after the last good record,
    an alert; audit, --run and verify read across segments; verify and doctor warn forever;
    and a later edit of the kept part is still found."""
    site = _site_with_records(tmp_path)
    site.audit_path.write_bytes(b"".join(_edit_middle(_lines(site))))
    broken = site.audit_path.read_bytes()

    repaired = await site.bothy("audit", "repair")

    assert repaired.code == 0, repaired.stderr
    assert "record 0003 was altered" in repaired.stdout, repaired.stdout
    kept = [p for p in site.audit_path.parent.iterdir() if ".broken-" in p.name]
    assert len(kept) == 1 and kept[0].read_bytes() == broken
    first = json.loads(site.audit_path.read_bytes().splitlines()[0])
    assert (first["seq"], first["kind"], first["event"]) == (3, "audit", "repaired")
    good_two = json.loads(broken.splitlines()[1])
    assert first["prev"] == good_two["hash"]
    assert first["details"]["kept"] == kept[0].name
    assert (first["details"]["last_good_seq"], first["details"]["last_good_hash"]) == (
        2, good_two["hash"])
    lines = site.audit_lines()
    assert [line.split()[0] for line in lines] == ["0001", "0002", "0003", "0004"]
    assert lines[2].split()[2:5] == ["audit", "repaired", "ok"]
    assert lines[3].split()[2:4] == ["alert", "undelivered"]  # no alert route configured here

    verify = await site.bothy("audit", "verify")
    assert verify.code == 0, verify.stdout
    assert verify.stdout.splitlines() == [
        "audit chain intact: 4 records verified",
        "[warn] repaired at seq 3: records before it were set aside by 'bothy audit repair'"
        " (the kept file is named in that record)",
    ]
    doctor = await site.bothy("doctor")
    found = checks(doctor)  # the page's eight first, every row in the table's shape, the count
    assert found["repaired at seq 3"][0] == "warn"
    shown = doctor.stdout.splitlines()
    assert shown[1] == "[warn] audit chain intact: 4 records verified, across a repair (see below)"
    assert shown[8] == (  # the first row after the page's eight, in the table's shape
        "[warn] repaired at seq 3: records before it were set aside by 'bothy audit repair'"
        " (the kept file is named in that record)"), doctor.stdout
    listed = await site.bothy("audit")
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [
        "0001", "0002", "0003", "0004"]
    (tmp_path / "sop.md").write_text("Back up.\n")
    appended = await site.bothy("sop", "set", "b", "--file", str(tmp_path / "sop.md"))
    assert appended.code == 0, appended.stderr
    assert (await site.bothy("audit", "verify")).code == 0

    # Editing the kept part after the repair is found: a repair never launders a register.
    kept[0].write_bytes(broken.replace(b'"n":1', b'"n":8', 1))
    verify = await site.bothy("audit", "verify")
    assert verify.code == 1 and "record 0001 was altered" in verify.stdout, verify.stdout


async def test_repair_of_an_intact_register_changes_nothing(tmp_path: Path) -> None:
    site = _site_with_records(tmp_path)
    before = site.audit_path.read_bytes()
    done = await site.bothy("audit", "repair")
    assert done.code == 0 and "nothing to repair" in done.stdout, done.stdout
    assert site.audit_path.read_bytes() == before


@pytest.mark.codex
async def test_repair_is_refused_while_serve_runs(tmp_path: Path) -> None:
    site = _site_with_records(tmp_path)
    async with Shell(site) as shell:
        serving = await shell.start("serve")
        # Ready, and its spare app-server settled (it is recorded a moment after ready).
        await until(lambda: any(" spare " in line for line in site.audit_lines())
                    or not serving.running, "`bothy serve` ready with its spare")
        # Had serve ended instead, the repair would meet no lock: say why serve ended.
        assert serving.running, f"`bothy serve` ended: {serving.stderr.text()}"
        before = site.audit_path.read_bytes()
        refused = await shell.bothy("audit", "repair")
        assert refused.code == 75, refused.stderr
        assert "refusing to repair the register while bothy serve" in refused.stderr
        assert site.audit_path.read_bytes() == before
        serving.signal(signal.SIGTERM)
        assert (await serving.finish()).code == 0


async def test_a_truncated_last_line_is_repaired_after_the_last_whole_record(
    tmp_path: Path,
) -> None:
    site = _site_with_records(tmp_path)
    site.audit_path.write_bytes(site.audit_path.read_bytes()[:-20])
    assert (await site.bothy("audit", "verify")).code == 1

    repaired = await site.bothy("audit", "repair")

    assert repaired.code == 0 and "truncated" in repaired.stdout, repaired.stdout
    assert [line.split()[0] for line in site.audit_lines()][:7] == [
        "0001", "0002", "0003", "0004", "0005", "0006", "0007"]
    assert site.audit_lines()[5].split()[2:4] == ["audit", "repaired"]


@pytest.mark.codex
async def test_a_register_cut_back_to_a_record_boundary_is_named_as_missing_records(
    tmp_path: Path,
) -> None:
    """The head anchored in state after each append: whole records cut from the end are
    missing records N..M to verify and doctor, and nothing is appended after them."""
    site = _site_with_records(tmp_path)
    site.audit_path.write_bytes(b"".join(_lines(site)[:4]))
    named = "records 0005–0006 are missing from the end"

    verify = await site.bothy("audit", "verify")
    assert verify.code == 1 and named in verify.stdout, verify.stdout
    doctor = await site.bothy("doctor")
    assert f"[fail] audit chain intact: broken: {named}" in doctor.stdout, doctor.stdout
    source = tmp_path / "sop.md"
    source.write_text("Back up.\n")
    refused = await site.bothy("sop", "set", "backup", "--file", str(source))
    assert refused.code == 1 and named in refused.stderr, refused.stderr
    assert len(_lines(site)) == 4


async def test_audit_head_prints_the_verified_head(tmp_path: Path) -> None:
    site = _site_with_records(tmp_path)
    last = json.loads(_lines(site)[-1])

    head = await site.bothy("audit", "head")
    assert head.code == 0 and head.stdout == f"head 0006 {last['hash']}\n", head.stdout
    site.audit_path.write_bytes(b"".join(_lines(site)[:4]))
    cut = await site.bothy("audit", "head")
    assert cut.code == 1 and "records 0005–0006 are missing" in cut.stdout, cut.stdout


def _anchored_seq(site: Site) -> int:
    seq: int = json.loads(site.audit_path.with_name("audit.jsonl.checkpoint").read_bytes())["seq"]
    return seq


async def test_verify_while_a_writer_appends_never_names_records_missing(
    tmp_path: Path,
) -> None:
    """verify and head while another writer commits record after record (its checkpoint
    advancing past what a reader walked): never a false `missing from the end`; once the
    writer stops, a register cut back is still named."""
    site = _site_with_records(tmp_path, count=1)
    log = AuditLog(site.audit_path)
    await asyncio.gather(*(log.record("sop", "saved", "ok", subject=f"sop:s{n}")
                           for n in range(2000)))  # a walk long enough for appends to land in
    stop = threading.Event()

    def write() -> None:
        writer = AuditLog(site.audit_path)
        while not stop.is_set():
            writer.append("sop", "saved", "ok", subject="sop:burst")

    before = _anchored_seq(site)
    thread = threading.Thread(target=write, name="burst-writer")
    thread.start()
    try:
        reports = [await asyncio.to_thread(log.verify) for _ in range(40)]
        verified = [await site.bothy("audit", "verify") for _ in range(3)]
        heads = [await site.bothy("audit", "head") for _ in range(3)]
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()

    assert _anchored_seq(site) > before + len(reports)  # the checkpoint moved all along
    assert [r.problem for r in reports if not r.ok] == []
    for done in verified + heads:
        assert done.code == 0 and "missing" not in done.stdout, done.stdout
    site.audit_path.write_bytes(b"".join(_lines(site)[:-3]))
    cut = await site.bothy("audit", "verify")
    assert cut.code == 1 and "are missing from the end" in cut.stdout, cut.stdout


def _cut_in_place(site: Site) -> None:
    site.audit_path.write_bytes(b"".join(_lines(site)[:4]))  # `head -n 4 > t && cat t >`


def _replaced_by_older_copy(site: Site) -> None:
    older = site.audit_path.with_name("older-copy")
    older.write_bytes(b"".join(_lines(site)[:4]))
    older.replace(site.audit_path)


@pytest.mark.codex
@pytest.mark.parametrize("cut", [_cut_in_place, _replaced_by_older_copy])
async def test_a_register_cut_below_its_anchored_head_is_repaired_naming_the_missing_records(
    tmp_path: Path, cut: Callable[[Site], None]
) -> None:
    """Records cut from the end: serve refuses and sends the operator to `audit repair`,
    which keeps the file aside and starts a new segment after the last good record naming
    the missing records; then verify passes with its warning and serve starts."""
    site = _site_with_records(tmp_path)
    cut(site)
    short = site.audit_path.read_bytes()
    named = "records 0005–0006 are missing from the end"
    serve = await site.bothy("serve", timeout_s=30)
    assert serve.code == 78 and "bothy audit repair" in serve.stderr, serve.stderr

    repaired = await site.bothy("audit", "repair")

    assert repaired.code == 0 and named in repaired.stdout, repaired.stdout
    assert "nothing to repair" not in repaired.stdout
    kept = [p for p in site.audit_path.parent.iterdir() if ".broken-" in p.name]
    assert len(kept) == 1 and kept[0].read_bytes() == short
    first = json.loads(site.audit_path.read_bytes().splitlines()[0])
    assert (first["seq"], first["kind"], first["event"]) == (5, "audit", "repaired")
    assert first["details"]["last_good_seq"] == 4 and named in first["details"]["problem"]
    assert first["prev"] == json.loads(short.splitlines()[3])["hash"]
    verify = await site.bothy("audit", "verify")
    assert verify.code == 0, verify.stdout
    assert verify.stdout.splitlines()[1].startswith("[warn] repaired at seq 5: "), verify.stdout
    assert (await site.bothy("audit", "repair")).stdout.startswith("audit chain intact")

    async with Shell(site) as shell:
        serving = await shell.start("serve")
        await until(lambda: any(" serve ready " in line for line in site.audit_lines())
                    or not serving.running, "`bothy serve` ready")
        assert serving.running
        serving.signal(signal.SIGTERM)
        assert (await serving.finish()).code == 0
    assert (await site.bothy("audit", "verify")).code == 0
