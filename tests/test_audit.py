"""The register (SPEC §2): a hash-chained, append-only, fsynced audit log.

Real files in tmp_path; real processes for the concurrency proof.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import itertools
import json
import os
import select
import signal
import stat
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from bothy.engine.audit import GENESIS_HASH, AuditLog, AuditRecord, Fault, NewRecord
from bothy.engine.auditevents import EVENTS
from bothy.errors import AuditIntegrityError, StateError

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXED_TS = datetime(2026, 9, 24, 10, 14, 2, 118734, tzinfo=UTC)
# Tests of the file format name a few events Bothy itself never writes.
_FORMAT_EVENTS = EVENTS.including(
    {"run": ("settled",), "test": ("written",), "question": ("asked",)}
)


def _fixed_clock() -> datetime:
    return FIXED_TS


class _SteppingClock:
    """A clock that advances one second per reading, from FIXED_TS."""

    def __init__(self) -> None:
        self.readings = 0

    def __call__(self) -> datetime:
        self.readings += 1
        return FIXED_TS + timedelta(seconds=self.readings - 1)


def _log_with(tmp_path: Path, count: int) -> AuditLog:
    log = AuditLog(tmp_path / "state" / "audit.jsonl", clock=_SteppingClock())
    for n in range(1, count + 1):
        log.append("run", "admitted", "ok", subject=f"pr:{n}", details={"n": n})
    return log


def _read_lines(log: AuditLog) -> list[bytes]:
    return log.path.read_bytes().splitlines(keepends=True)


def _write_lines(log: AuditLog, lines: list[bytes]) -> None:
    log.path.write_bytes(b"".join(lines))


# -- the chain -----------------------------------------------------------------------------


def test_appended_records_form_a_chain_that_verifies(tmp_path: Path) -> None:
    """Records are numbered from 1, each linked to the previous hash, and the chain verifies."""
    log = _log_with(tmp_path, 5)

    records = list(log.records())

    assert [r.seq for r in records] == [1, 2, 3, 4, 5]
    assert records[0].prev == GENESIS_HASH
    assert all(later.prev == earlier.hash for earlier, later in itertools.pairwise(records))
    report = log.verify()
    assert report.ok and report.count == 5
    assert (report.first_bad_seq, report.line_no, report.problem, report.fault) == (
        None,
        None,
        "",
        None,
    )
    assert report.describe() == "audit chain intact (5 records verified)"


def test_append_returns_the_record_as_written(tmp_path: Path) -> None:
    """What append returns is exactly what a reader later finds on disk."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=_fixed_clock)

    written = log.append("run", "refused", "refused", subject="pr:7", details={"gate": "budget"})

    assert list(log.records()) == [written]


def test_line_on_disk_is_the_canonical_body_with_its_hash(tmp_path: Path) -> None:
    """A line is compact ASCII JSON in fixed field order; hash = sha256 of the line minus hash."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=_fixed_clock, events=_FORMAT_EVENTS)

    record = log.append(
        "run", "settled", "ok", subject="pr:42", details={"z": 1, "a": {"y": "é", "b": 2}}
    )

    body = (
        '{"seq":1,"ts":"2026-09-24T10:14:02.118734+00:00","kind":"run","event":"settled",'
        '"outcome":"ok","subject":"pr:42","run_id":null,'
        '"details":{"a":{"b":2,"y":"\\u00e9"},"z":1},'
        f'"prev":"{GENESIS_HASH}"}}'
    )
    digest = hashlib.sha256(body.encode("ascii")).hexdigest()
    assert log.path.read_text() == body[:-1] + f',"hash":"{digest}"}}\n'
    assert record.hash == digest
    assert record.to_json() == log.path.read_text().rstrip("\n")


def test_human_line_matches_the_spec_format(tmp_path: Path) -> None:
    """The human form is seq (4-digit), ts, kind, event, outcome, subject or -, run or -."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=_fixed_clock)

    record = log.append("wake", "received", "ok", subject="pr:42")

    assert record.human_line() == "0001 2026-09-24T10:14:02.118734+00:00 wake received ok pr:42 -"
    spec_example = AuditRecord(
        seq=417,
        ts=datetime(2026, 9, 24, 10, 14, 2, 391650, tzinfo=UTC),
        kind="run",
        event="admitted",
        outcome="ok",
        subject="pr:42",
        run_id="run_20260924T101402Z_8d41e7b2",
        details={},
        prev=GENESIS_HASH,
        hash=GENESIS_HASH,
    )
    assert spec_example.human_line() == (
        "0417 2026-09-24T10:14:02.391650+00:00 run admitted ok pr:42 run_20260924T101402Z_8d41e7b2"
    )


def test_human_line_widens_past_four_digits_and_dashes_empty_fields() -> None:
    """Seq 12345 prints whole; no subject and no run print as '-'."""
    record = AuditRecord(
        seq=12345,
        ts=FIXED_TS,
        kind="alert",
        event="sent",
        outcome="ok",
        subject=None,
        run_id=None,
        details={},
        prev=GENESIS_HASH,
        hash=GENESIS_HASH,
    )

    assert record.human_line() == "12345 2026-09-24T10:14:02.118734+00:00 alert sent ok - -"


def test_timestamps_are_utc_with_microseconds(tmp_path: Path) -> None:
    """A clock reading in another zone is stored in UTC, with microseconds even when zero."""
    paris = datetime(2026, 9, 24, 12, 14, 2, tzinfo=timezone(timedelta(hours=2)))
    log = AuditLog(tmp_path / "audit.jsonl", clock=lambda: paris)

    record = log.append("wake", "received", "ok")

    assert " 2026-09-24T10:14:02.000000+00:00 " in record.human_line()


# -- damage, named -------------------------------------------------------------------------


def test_edited_details_are_named_as_altered(tmp_path: Path) -> None:
    """Changing a figure in record 3 makes verify name record 0003 as altered."""
    log = _log_with(tmp_path, 5)
    lines = _read_lines(log)
    lines[2] = lines[2].replace(b'"details":{"n":3}', b'"details":{"n":30}')
    _write_lines(log, lines)

    report = log.verify()

    assert not report.ok
    assert (report.fault, report.first_bad_seq, report.line_no, report.count) == (
        Fault.ALTERED,
        3,
        3,
        2,
    )
    assert report.problem == (
        "record 0003 was altered: its hash does not match its content (line 3)"
    )


def test_deleted_middle_record_is_named_as_missing(tmp_path: Path) -> None:
    """Deleting line 3 makes verify say record 0003 is missing between 0002 and 0004."""
    log = _log_with(tmp_path, 5)
    lines = _read_lines(log)
    del lines[2]
    _write_lines(log, lines)

    report = log.verify()

    assert (report.ok, report.fault, report.first_bad_seq, report.line_no) == (
        False,
        Fault.MISSING,
        3,
        3,
    )
    assert report.problem == "record 0003 is missing: 0002 is followed by 0004"


def test_several_deleted_records_are_named_as_a_range(tmp_path: Path) -> None:
    """Deleting records 2–4 names the whole gap."""
    log = _log_with(tmp_path, 5)
    lines = _read_lines(log)
    del lines[1:4]
    _write_lines(log, lines)

    report = log.verify()

    assert report.fault is Fault.MISSING
    assert report.problem == "records 0002–0004 are missing: 0001 is followed by 0005"


def test_deleted_first_record_is_named_as_missing(tmp_path: Path) -> None:
    """A log that starts at 0002 is missing 0001."""
    log = _log_with(tmp_path, 3)
    _write_lines(log, _read_lines(log)[1:])

    report = log.verify()

    assert (report.fault, report.first_bad_seq, report.line_no) == (Fault.MISSING, 1, 1)
    assert report.problem == "record 0001 is missing: the log starts at 0002"


def test_swapped_records_are_named_as_reordered(tmp_path: Path) -> None:
    """Swapping lines 3 and 4 is reported as reordering, naming both records and lines."""
    log = _log_with(tmp_path, 5)
    lines = _read_lines(log)
    lines[2], lines[3] = lines[3], lines[2]
    _write_lines(log, lines)

    report = log.verify()

    assert (report.ok, report.fault, report.first_bad_seq, report.line_no, report.count) == (
        False,
        Fault.REORDERED,
        4,
        3,
        2,
    )
    assert report.problem == (
        "record 0004 is out of order at line 3: 0003 belongs there and appears later, at line 4"
    )


def test_duplicated_record_is_named_as_out_of_order(tmp_path: Path) -> None:
    """A record copied after a later one is a step backwards in seq."""
    log = _log_with(tmp_path, 4)
    lines = _read_lines(log)
    lines.insert(3, lines[1])
    _write_lines(log, lines)

    report = log.verify()

    assert (report.fault, report.first_bad_seq, report.line_no) == (Fault.REORDERED, 2, 4)
    assert report.problem == "record 0002 is out of order at line 4: it follows 0003"


def test_rehashed_record_breaks_the_link_to_the_next(tmp_path: Path) -> None:
    """Rewriting record 2 with a fresh hash is caught at 0003, whose prev commits to the old one."""
    log = _log_with(tmp_path, 4)
    lines = _read_lines(log)
    fields = json.loads(lines[1])
    fields["details"] = {"n": 200}
    del fields["hash"]
    body = json.dumps(fields, separators=(",", ":")).encode()
    forged = body[:-1] + f',"hash":"{hashlib.sha256(body).hexdigest()}"}}\n'.encode()
    lines[1] = forged
    _write_lines(log, lines)

    report = log.verify()

    assert (report.fault, report.first_bad_seq, report.line_no, report.count) == (
        Fault.REORDERED,
        3,
        3,
        2,
    )
    assert "record 0003 does not follow 0002 (line 3)" in report.problem


def test_truncated_last_line_is_named_and_append_refuses(tmp_path: Path) -> None:
    """A last record cut mid-write is named as truncated, and no record is chained onto it."""
    log = _log_with(tmp_path, 3)
    damaged = log.path.read_bytes()[:-40]
    log.path.write_bytes(damaged)

    report = log.verify()

    assert (report.ok, report.fault, report.first_bad_seq, report.line_no, report.count) == (
        False,
        Fault.TRUNCATED,
        3,
        3,
        2,
    )
    assert report.problem == (
        "line 3 is truncated: record 0003 was cut off mid-write (no end of line)"
    )
    with pytest.raises(AuditIntegrityError, match="last record is truncated"):
        log.append("wake", "received", "ok")
    with pytest.raises(AuditIntegrityError, match="last record is truncated"):
        AuditLog(log.path).append("wake", "received", "ok")
    assert log.path.read_bytes() == damaged


def test_append_refuses_after_an_altered_last_record(tmp_path: Path) -> None:
    """A writer that finds the last record altered refuses to extend the chain."""
    log = _log_with(tmp_path, 2)
    damaged = log.path.read_bytes().replace(b'"n":2', b'"n":9')
    log.path.write_bytes(damaged)

    with pytest.raises(AuditIntegrityError, match="last record 0002 was altered") as refused:
        log.append("wake", "received", "ok")

    assert refused.value.seq == 2
    assert log.path.read_bytes() == damaged


def test_garbage_line_is_named_as_unparsable(tmp_path: Path) -> None:
    """A line that is not a record is named with its line number and the seq expected there."""
    log = _log_with(tmp_path, 3)
    lines = _read_lines(log)
    lines[1] = b'{"seq":2, "note": "hand-written"}\n'
    _write_lines(log, lines)

    report = log.verify()

    assert (report.fault, report.first_bad_seq, report.line_no) == (Fault.UNPARSABLE, 2, 2)
    assert report.problem == "line 2 is unparsable: it does not end with a hash field"
    with pytest.raises(AuditIntegrityError, match="line 2 is unparsable"):
        list(log.records())


def test_absent_or_empty_log_verifies_with_no_records(tmp_path: Path) -> None:
    """No file, or an empty one, is an intact chain of zero records."""
    log = AuditLog(tmp_path / "never-written.jsonl")
    assert log.verify().ok and log.verify().count == 0
    assert list(log.records()) == []

    log.path.touch()
    assert log.verify().ok and log.verify().count == 0


# -- writers -------------------------------------------------------------------------------

_WRITER = """
import sys
from pathlib import Path
from bothy.engine.audit import AuditLog
from bothy.engine.auditevents import EVENTS

log = AuditLog(Path(sys.argv[1]), events=EVENTS.including({"test": ("written",)}))
name, count = sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
for i in range(count):
    log.append("test", "written", "ok", subject=f"writer:{name}", details={"i": i})
"""


def test_concurrent_writer_processes_keep_one_chain(tmp_path: Path) -> None:
    """Four processes appending at once leave one intact chain, seq 1..4N, nothing lost."""
    path, per_writer = tmp_path / "state" / "audit.jsonl", 40
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(n), str(per_writer)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        for n in range(4)
    ]
    try:
        for writer in writers:  # all imported and waiting: then release them together
            assert writer.stdout is not None and writer.stdout.readline() == b"ready\n"
        for writer in writers:
            assert writer.stdin is not None
            writer.stdin.write(b"go\n")
            writer.stdin.close()
        assert [writer.wait(timeout=30) for writer in writers] == [0, 0, 0, 0]
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
            if writer.stdout is not None:
                writer.stdout.close()

    log = AuditLog(path)
    report = log.verify()
    assert report.ok, report.problem
    records = list(log.records())
    assert [r.seq for r in records] == list(range(1, 4 * per_writer + 1))
    assert Counter(r.subject for r in records) == {f"writer:{n}": per_writer for n in range(4)}
    for n in range(4):
        mine = [r.details["i"] for r in records if r.subject == f"writer:{n}"]
        assert mine == list(range(per_writer))


def test_two_logs_on_one_file_keep_one_chain(tmp_path: Path) -> None:
    """A writer's cached tail is re-checked, so interleaved writers never fork the chain."""
    path = tmp_path / "audit.jsonl"
    first, second = AuditLog(path), AuditLog(path)

    for n in range(3):
        first.append("wake", "received", "ok", details={"n": n})
        second.append("wake", "received", "ok", details={"n": n})

    assert [r.seq for r in first.records()] == [1, 2, 3, 4, 5, 6]
    assert first.verify().ok


def test_verify_waits_for_an_append_in_progress(tmp_path: Path) -> None:
    """A half-written record held under the writers' lock is not reported as truncated."""
    source = _log_with(tmp_path / "source", 3)
    lines = _read_lines(source)
    log = AuditLog(tmp_path / "audit.jsonl")
    log.path.write_bytes(b"".join(lines[:2]))
    lock_fd = os.open(f"{log.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        with log.path.open("ab") as f:
            f.write(lines[2][:50])
            f.flush()
            with ThreadPoolExecutor(max_workers=1) as pool:
                verdict = pool.submit(log.verify)
                f.write(lines[2][50:])
                f.flush()
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                report = verdict.result(timeout=10)
    finally:
        os.close(lock_fd)

    assert report.ok and report.count == 3


async def test_record_appends_from_a_coroutine(tmp_path: Path) -> None:
    """The async form writes the same record without blocking the event loop."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=_fixed_clock, events=_FORMAT_EVENTS)

    record = await log.record("question", "asked", "pending", subject="pr:42", run_id="run_x")

    assert record.human_line() == (
        "0001 2026-09-24T10:14:02.118734+00:00 question asked pending pr:42 run_x"
    )
    assert list(log.records()) == [record]


def test_a_register_that_recorded_before_a_fork_records_in_the_child(tmp_path: Path) -> None:
    """A forked child's records go through commits of its own (the parent's committing
    thread is not in the child), and join the one chain."""
    log = AuditLog(tmp_path / "audit.jsonl")
    asyncio.run(log.record("serve", "starting", "ok"))  # the parent's commit thread runs

    came_back, said = os.pipe()
    child = os.fork()
    if child == 0:  # the child: record, and say so on the pipe once the record came back
        code = 1
        try:
            asyncio.run(log.record("serve", "stopped", "ok"))
            os.write(said, b"y")
            code = 0
        finally:
            os._exit(code)
    os.close(said)
    try:
        ready, _, _ = select.select([came_back], [], [], 20)
        if not ready:
            os.kill(child, signal.SIGKILL)
        assert ready and os.read(came_back, 1) == b"y", "the child's record never came back"
    finally:
        os.close(came_back)
        os.waitpid(child, 0)
    assert [(r.seq, r.event) for r in log.records()] == [(1, "starting"), (2, "stopped")]
    assert log.verify().ok


def test_files_are_private(tmp_path: Path) -> None:
    """The log and its lock are created 0600, in a directory created 0700."""
    log = AuditLog(tmp_path / "home" / "state" / "audit.jsonl")

    log.append("wake", "received", "ok")

    assert stat.S_IMODE(log.path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "home" / "state" / "audit.jsonl.lock").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "home" / "state").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o700


# -- input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", ""),
        ("kind", "two words"),
        ("event", "line\nbreak"),
        ("outcome", "tab\there"),
        ("subject", "pr 42"),
        ("run_id", "\x1b[31mred"),
    ],
)
def test_malformed_token_is_a_value_error(tmp_path: Path, field: str, value: str) -> None:
    """kind, event, outcome, subject and run id must be single printable tokens."""
    log = AuditLog(tmp_path / "audit.jsonl")
    tokens = {"kind": "wake", "event": "received", "outcome": "ok", field: value}
    subject, run_id = tokens.pop("subject", None), tokens.pop("run_id", None)

    with pytest.raises(ValueError, match=f"audit {field} must be a non-empty single token"):
        log.append(
            tokens["kind"], tokens["event"], tokens["outcome"], subject=subject, run_id=run_id
        )
    assert not log.path.exists()


@pytest.mark.parametrize(("kind", "event"), [("run", "settled"), ("wake", "recieved")])
def test_an_undeclared_event_is_refused_before_anything_is_written(
    tmp_path: Path, kind: str, event: str
) -> None:
    """A (kind, event) pair missing from the events table is a bug: ValueError, no record."""
    log = AuditLog(tmp_path / "audit.jsonl")

    with pytest.raises(ValueError, match=f"audit event '{kind} {event}' is not declared"):
        log.append(kind, event, "ok")
    assert not log.path.exists()


@pytest.mark.parametrize("details", [{"when": datetime.now(UTC)}, {"ratio": float("nan")}])
def test_details_must_be_json(tmp_path: Path, details: dict[str, object]) -> None:
    """Details that JSON cannot carry exactly are refused before anything is written."""
    log = AuditLog(tmp_path / "audit.jsonl")

    with pytest.raises(ValueError, match="audit details must be JSON-serialisable"):
        log.append("wake", "received", "ok", details=details)
    assert not log.path.exists()


# -- reading -------------------------------------------------------------------------------


def test_records_filter_by_run_and_since(tmp_path: Path) -> None:
    """records(run_id=...) keeps one run's lines; records(since=...) those stamped at or after."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=_SteppingClock(), events=_FORMAT_EVENTS)
    log.append("wake", "received", "ok", subject="pr:1")
    log.append("run", "admitted", "ok", subject="pr:1", run_id="run_a")
    log.append("run", "admitted", "ok", subject="pr:2", run_id="run_b")
    log.append("run", "settled", "ok", subject="pr:1", run_id="run_a")

    assert [r.seq for r in log.records(run_id="run_a")] == [2, 4]
    assert [r.seq for r in log.records(since=FIXED_TS + timedelta(seconds=2))] == [3, 4]
    assert [r.seq for r in log.records(run_id="run_a", since=FIXED_TS + timedelta(seconds=2))] == [
        4
    ]
    with pytest.raises(ValueError, match="aware"):
        list(log.records(since=datetime(2026, 1, 1)))


def test_records_filtered_by_kind_and_time_are_those_a_full_read_would_keep(
    tmp_path: Path,
) -> None:
    """records(kinds=..., since=...) passes over a line by its head (seq, time, kind) without
    decoding the rest, and returns exactly the records a full read then a filter would, across
    a repaired register too: the repair's kept file counts only up to its last good record."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=_SteppingClock(), events=_FORMAT_EVENTS)
    for n in range(12):
        kind, event = [("wake", "received"), ("run", "admitted"), ("test", "written")][n % 3]
        log.append(kind, event, "ok", subject=f"pr:{n}", details={"n": n, "kind": "run"})
    lines = _read_lines(log)
    _write_lines(log, [*lines[:9], lines[9].replace(b'"n":9', b'"n":99'), *lines[10:]])
    repair = log.repair()
    assert repair is not None
    # Line 6 of the kept file then says its instant in another form (+02:00), a head that is
    # not compared as text (records() reads; verify would name the line altered).
    kept = repair.kept.read_bytes().split(b"\n")
    stamp = json.loads(kept[5])["ts"]
    other = datetime.fromisoformat(stamp).astimezone(timezone(timedelta(hours=2))).isoformat()
    kept[5] = kept[5].replace(stamp.encode(), other.encode())
    repair.kept.write_bytes(b"\n".join(kept))
    log.append("run", "admitted", "ok", subject="pr:after")
    since = FIXED_TS + timedelta(seconds=4)

    every = list(log.records())
    assert every[5].ts.utcoffset() == timedelta(hours=2)
    for kinds in (("run",), ("wake", "run"), ("nothing",), ("wake", "test")):
        assert list(log.records(kinds=kinds)) == [r for r in every if r.kind in kinds]
        for moment in (since, FIXED_TS + timedelta(seconds=5), since.astimezone(
                timezone(timedelta(hours=-5)))):
            assert list(log.records(kinds=kinds, since=moment)) == [
                r for r in every if r.kind in kinds and r.ts >= moment]
    assert [r.details.get("n") for r in log.records(kinds=("run",))] == [1, 4, 7, None]


def test_a_recent_stretch_is_read_by_the_stamps_bytes_as_a_full_read_would_keep_it(
    tmp_path: Path,
) -> None:
    """records(since=...) passes over older lines of the current file by their stamp's bytes
    (UTC to the microsecond compares as text), and returns exactly what a full read then a
    filter would: at a record's own instant (kept), between two, in another time zone, with
    kinds, and beside lines whose stamp is in another form (another offset, no microseconds),
    which are read as times, not text."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=_SteppingClock(), events=_FORMAT_EVENTS)
    for n in range(12):
        kind, event = [("wake", "received"), ("run", "admitted"), ("test", "written")][n % 3]
        log.append(kind, event, "ok", subject=f"pr:{n}", details={"n": n})
    lines = _read_lines(log)
    for index, other in ((3, timezone(timedelta(hours=2))), (8, timezone(timedelta(hours=-7)))):
        stamp = json.loads(lines[index])["ts"]
        moved = datetime.fromisoformat(stamp).astimezone(other).isoformat()
        lines[index] = lines[index].replace(stamp.encode(), moved.encode())
    stamp = json.loads(lines[6])["ts"]  # 10:14:08.118734 → 10:14:08, a second form
    lines[6] = lines[6].replace(stamp.encode(), stamp[:19].encode() + b"+00:00")
    _write_lines(log, lines)

    every = list(log.records())
    assert every[3].ts.utcoffset() == timedelta(hours=2) and every[6].ts.microsecond == 0
    for moment in (FIXED_TS + timedelta(seconds=s) for s in (0, 3, 4.5, 6, 7, 8, 11, 12)):
        for at in (moment, moment.astimezone(timezone(timedelta(hours=5, minutes=30)))):
            assert list(log.records(since=at)) == [r for r in every if r.ts >= at]
            assert list(log.records(since=at, kinds=("run", "test"))) == [
                r for r in every if r.ts >= at and r.kind in ("run", "test")]


async def test_concurrent_writers_of_every_kind_keep_one_chain_in_seq_order(
    tmp_path: Path,
) -> None:
    """Sixteen coroutines sharing group commits, two threads and two processes appending at
    once: `bothy audit verify` passes, seq runs 1..N in file order, every caller's record is
    the one on disk, and each writer's records are in the order it wrote them."""
    from tests.fakes.site import Site

    site = Site(tmp_path, "http://127.0.0.1:9/v1")  # nothing here runs a model
    path, per_writer = site.audit_path, 40
    log = AuditLog(path, events=_FORMAT_EVENTS)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WRITER, str(path), f"p{n}", str(per_writer),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        for n in range(2)
    ]

    async def coroutine(name: str) -> list[AuditRecord]:
        return [await log.record("test", "written", "ok", subject=f"writer:{name}",
                                 details={"i": i}) for i in range(per_writer)]

    def thread(name: str) -> list[AuditRecord]:
        return [log.append("test", "written", "ok", subject=f"writer:{name}", details={"i": i})
                for i in range(per_writer)]

    try:
        async with asyncio.timeout(30):
            for process in processes:
                assert process.stdout is not None
                assert await process.stdout.readline() == b"ready\n"
            for process in processes:
                assert process.stdin is not None
                process.stdin.write(b"go\n")
                process.stdin.close()
            with ThreadPoolExecutor(max_workers=2) as pool:
                threads = [pool.submit(thread, f"t{n}") for n in range(2)]
                returned = await asyncio.gather(*(coroutine(f"c{n}") for n in range(16)))
                returned += [await asyncio.wrap_future(future) for future in threads]
            assert [await process.wait() for process in processes] == [0, 0]
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()

    verify = await site.bothy("audit", "verify")
    assert verify.code == 0, verify.stdout + verify.stderr
    records = list(AuditLog(path).records())
    writers = [f"c{n}" for n in range(16)] + ["t0", "t1", "p0", "p1"]
    assert [r.seq for r in records] == list(range(1, len(writers) * per_writer + 1))
    on_disk = {r.seq: r.hash for r in records}
    assert all(on_disk[r.seq] == r.hash for mine in returned for r in mine)
    for name in writers:
        assert [r.details["i"] for r in records if r.subject == f"writer:{name}"] == list(
            range(per_writer))


async def test_a_failed_fsync_fails_every_record_of_its_commit_and_anchors_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sixteen coroutines sharing a commit whose fsync fails all hear the disk's error, naming
    their records; none is anchored as the head; once the disk is back the next record is
    anchored and the register verifies."""
    from tests.fakes.shell import until

    log = AuditLog(tmp_path / "state" / "audit.jsonl", events=_FORMAT_EVENTS)
    before = await log.record("test", "written", "ok", subject="writer:before")
    await until(lambda: log.anchored_head() == (before.seq, before.hash), "first head anchored")
    trigger = tmp_path / "fsync-fails"
    trigger.write_text(str(log.path))  # the register's fsync fails, nothing else's
    monkeypatch.setenv("BOTHY_FAULT_FSYNC", str(trigger))

    failed = await asyncio.gather(
        *(log.record("test", "written", "ok", subject=f"writer:{n}") for n in range(16)),
        return_exceptions=True)

    assert all(isinstance(f, StateError) for f in failed), failed
    assert {str(f) for f in failed} == {
        f"Cannot append records 0002–0017 to audit log {log.path}: Input/output error"
        " (fault injected by BOTHY_FAULT_FSYNC)"}
    assert log.anchored_head() == (before.seq, before.hash)
    trigger.unlink()
    after = await log.record("test", "written", "ok", subject="writer:after")
    await until(lambda: log.anchored_head() == (after.seq, after.hash), "head anchored again")
    assert log.verify().ok


async def test_the_head_is_anchored_once_a_burst_of_writers_is_done(tmp_path: Path) -> None:
    """Under load the checkpoint and the index are kept once per run of commits, not after
    each: once sixteen writers' 200 records each have returned, the anchored head (what the
    status pages and `bothy audit head` show) reaches the last record, and each writer's
    records read through the index are those a scan of the register finds."""
    from tests.fakes.shell import until

    log = AuditLog(tmp_path / "state" / "audit.jsonl", events=_FORMAT_EVENTS)

    async def writer(n: int) -> list[AuditRecord]:
        return [await log.record("test", "written", "ok", subject=f"writer:{n}",
                                 run_id=f"run_{n}", details={"i": i}) for i in range(200)]

    returned = await asyncio.gather(*(writer(n) for n in range(16)))

    last = max((r for mine in returned for r in mine), key=lambda r: r.seq)
    assert last.seq == 16 * 200
    await until(lambda: log.anchored_head() == (last.seq, last.hash), "head anchored")
    scanned = list(log.records())
    for n, mine in enumerate(returned):
        assert log.index.records(f"run_{n}") == mine == [r for r in scanned
                                                        if r.run_id == f"run_{n}"]


@pytest.mark.parametrize("details", [
    {}, {"b": "x", "a": True, "c": None, "d": False, "e": -12, "f": 10**30},
    {"é": "ü\n\x00\"\\€😀"}, {"a": 1.5}, {"a": [1, {"z": 1, "y": 2}]}, {"b": {"d": 1, "c": 2}},
])
def test_details_are_stored_in_one_canonical_form_whatever_their_shape(
    tmp_path: Path, details: dict[str, object]
) -> None:
    """Plain and nested details alike: the line holds them keys sorted, compact, ASCII, and
    the record returned holds what the line holds."""
    log = AuditLog(tmp_path / "audit.jsonl", events=_FORMAT_EVENTS)

    record = log.append("test", "written", "ok", details=details)

    [line] = _read_lines(log)
    canonical = json.dumps(details, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert b'"details":' + canonical.encode() + b',"prev"' in line
    assert record.details == json.loads(canonical) == details


@pytest.mark.parametrize(("subject", "run_id"), [
    ("pr:42", None), ('pr:"quoted"\\back', "run_é"), ("ü€😀", 'run_"x"'), (None, "run_1"),
])
def test_names_are_stored_in_their_canonical_form_whatever_their_characters(
    tmp_path: Path, subject: str | None, run_id: str | None
) -> None:
    """Subject and run id, quoted once per token and kept: the line holds them as json.dumps
    writes them (every non-ASCII character escaped), on a whole second too, and the record
    returned is the one the line holds."""
    on_the_second = FIXED_TS.replace(microsecond=0)
    log = AuditLog(tmp_path / "audit.jsonl", clock=lambda: on_the_second, events=_FORMAT_EVENTS)

    records = [log.append("test", "written", "ok", subject=subject, run_id=run_id)
               for _ in range(2)]

    for line, record in zip(_read_lines(log), records, strict=True):
        body = json.dumps(
            {"seq": record.seq, "ts": "2026-09-24T10:14:02.000000+00:00", "kind": "test",
             "event": "written", "outcome": "ok", "subject": subject, "run_id": run_id,
             "details": {}, "prev": record.prev},
            separators=(",", ":"), ensure_ascii=True)
        digest = hashlib.sha256(body.encode("ascii")).hexdigest()
        assert line == (body[:-1] + f',"hash":"{digest}"}}\n').encode("ascii")
        assert record.hash == digest
    assert list(log.records()) == records
    assert log.verify().ok


async def test_records_submitted_together_come_back_in_order_each_with_its_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """record_all: twenty records in one call are written in the order given, each returned
    as the register holds it; one malformed refuses the call before anything is written; and
    when the fsync fails each slot holds the disk's error, naming the records of its commit."""
    from tests.fakes.shell import until

    log = AuditLog(tmp_path / "state" / "audit.jsonl", events=_FORMAT_EVENTS)
    wanted = [NewRecord("test", "written", "ok", subject=f"writer:{n}", details={"n": n})
              for n in range(20)]

    written = await log.record_all(wanted)

    assert written == list(log.records())
    assert [(r.seq, r.subject, r.details) for r in written if isinstance(r, AuditRecord)] == [
        (n + 1, f"writer:{n}", {"n": n}) for n in range(20)]
    last = written[-1]
    assert isinstance(last, AuditRecord)
    await until(lambda: log.anchored_head() == (last.seq, last.hash), "head anchored")

    with pytest.raises(ValueError, match="single token"):
        await log.record_all([NewRecord("test", "written", "ok"),
                              NewRecord("test", "written", "ok", subject="two words")])
    assert len(list(log.records())) == 20

    trigger = tmp_path / "fsync-fails"
    trigger.write_text(str(log.path))
    monkeypatch.setenv("BOTHY_FAULT_FSYNC", str(trigger))
    failed = await log.record_all(wanted[:3])
    assert [str(f) for f in failed] == 3 * [
        f"Cannot append records 0021–0023 to audit log {log.path}: Input/output error"
        " (fault injected by BOTHY_FAULT_FSYNC)"]
    assert log.anchored_head() == (last.seq, last.hash)
