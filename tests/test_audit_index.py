"""The register's index by run id (issue 14): `bothy audit --run` and `bothy trace` read a run's
records through it, and what they show is what a scan of the whole register shows — with the
index kept by the writer, missing, behind, stale after a repair, corrupt, or tampered with.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from bothy.engine.audit import AuditLog
from bothy.engine.auditindex import belongs_to, wake_id_for
from bothy.trace import build_spans, otlp_request
from tests.fakes.site import Site

_NO_MODEL = "http://127.0.0.1:9/v1"  # nothing here runs a model
_RUNS = ("run_20260101T000000Z_0000000a", "run_20260101T000000Z_0000000b",
         "run_20260101T000000Z_0000000c")


def _write_runs(log: AuditLog, rounds: int = 5) -> None:
    """Three runs side by side, each with its wake's record, and records of no run between."""
    for run_id in _RUNS:
        log.append("wake", "received", "ok", subject="pr:1",
                   details={"wake_id": wake_id_for(run_id), "source": "github"})
    for n in range(rounds):
        for run_id in _RUNS:
            log.append("run", "admitted" if n == 0 else "started", "ok", subject="pr:1",
                       run_id=run_id, details={"n": n, "wake_id": wake_id_for(run_id)})
        log.append("sop", "saved", "ok", subject=f"sop:s{n}", details={"n": n})


def _scanned(site: Site, run_id: str) -> list[str]:
    """The run's lines as a scan of every line of every segment finds them (no index)."""
    return [record.to_json() for record in AuditLog(site.audit_path).records()
            if belongs_to(record, run_id)]


def _bothy(site: Site, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bothy", *args], env=site.env(),
                          capture_output=True, text=True, timeout=60, check=False)


def _audit_run(site: Site, run_id: str) -> list[str]:
    shown = _bothy(site, "audit", "--run", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.splitlines()


def _index(site: Site) -> Path:
    return site.audit_path.with_name("audit.jsonl.index")


def _point(site: Site) -> tuple[int, int]:
    with sqlite3.connect(_index(site)) as db:
        offset, seq = db.execute("SELECT offset, seq FROM point").fetchone()
    return offset, seq


def _every_run_equals_a_scan(site: Site) -> None:
    for run_id in _RUNS:
        assert _audit_run(site, run_id) == _scanned(site, run_id), run_id


def test_a_run_read_through_the_index_is_what_a_scan_of_the_register_finds(
    tmp_path: Path,
) -> None:
    """`audit --run` and `trace --json` through the index equal a full scan, the wake's record
    included; the writer keeps the index complete at each append (no reader caught it up)."""
    site = Site(tmp_path, _NO_MODEL)
    log = AuditLog(site.audit_path)
    _write_runs(log)
    end = site.audit_path.stat().st_size
    assert _point(site) == (end, 23)  # kept by the writer alone
    _every_run_equals_a_scan(site)
    assert json.loads(_audit_run(site, _RUNS[1])[0])["kind"] == "wake"

    traced = _bothy(site, "trace", _RUNS[2], "--json")
    assert traced.returncode == 0, traced.stderr
    records = [r for r in AuditLog(site.audit_path).records() if belongs_to(r, _RUNS[2])]
    expected = otlp_request(_RUNS[2], build_spans(_RUNS[2], records),
                            version=json.loads(traced.stdout)["resourceSpans"][0]
                            ["scopeSpans"][0]["scope"]["version"])
    assert json.loads(traced.stdout) == expected
    unknown = _bothy(site, "audit", "--run", "run_20990101T000000Z_ffffffff")
    assert unknown.returncode == 0 and unknown.stdout == ""
    assert "no record of run run_20990101T000000Z_ffffffff" in unknown.stderr


def test_a_deleted_or_behind_index_is_rebuilt_or_caught_up(tmp_path: Path) -> None:
    """A deleted index is rebuilt by the next read. Appends while the index is busy (another
    process holding it) never wait for it: they leave it behind, and the next read catches it
    up — or the writer's next append does."""
    site = Site(tmp_path, _NO_MODEL)
    log = AuditLog(site.audit_path)
    _write_runs(log, rounds=2)
    for name in ("audit.jsonl.index", "audit.jsonl.index-wal", "audit.jsonl.index-shm"):
        site.audit_path.with_name(name).unlink(missing_ok=True)
    log.append("run", "started", "ok", subject="pr:1", run_id=_RUNS[0])  # no index: skipped
    assert not _index(site).exists()
    _every_run_equals_a_scan(site)
    assert _point(site) == (site.audit_path.stat().st_size, 12)

    for catch_up_by_reading in (True, False):
        busy = sqlite3.connect(_index(site), isolation_level=None)
        busy.execute("BEGIN IMMEDIATE")  # as a reader rebuilding the index would
        before = _point(site)
        _write_runs(log, rounds=1)  # four records, none noted: the index is busy
        busy.execute("ROLLBACK")
        busy.close()
        assert _point(site) == before
        if catch_up_by_reading:
            _every_run_equals_a_scan(site)
        else:
            log.append("run", "started", "ok", subject="pr:1", run_id=_RUNS[1])
        assert _point(site) == (site.audit_path.stat().st_size,
                                AuditLog(site.audit_path).verify().last_seq)
        _every_run_equals_a_scan(site)


def test_an_index_stale_after_a_repair_is_rebuilt_across_the_segments(tmp_path: Path) -> None:
    """After `bothy audit repair` the index describes a file set aside: the next read rebuilds
    it from every segment, and shows what the scan across segments shows."""
    site = Site(tmp_path, _NO_MODEL)
    log = AuditLog(site.audit_path)
    _write_runs(log, rounds=3)
    lines = site.audit_path.read_bytes().splitlines(keepends=True)
    lines[7] = lines[7].replace(b'"n":1', b'"n":7')  # record 0008 altered: 0001-0007 are good
    site.audit_path.write_bytes(b"".join(lines))
    repaired = _bothy(site, "audit", "repair")
    assert repaired.returncode == 0, repaired.stderr
    after = AuditLog(site.audit_path)
    for run_id in _RUNS:
        after.append("run", "finished", "ok", subject="pr:1", run_id=run_id)
    shown = _audit_run(site, _RUNS[0])
    assert shown == _scanned(site, _RUNS[0])
    kinds = [(json.loads(line)["seq"], json.loads(line)["event"]) for line in shown]
    assert kinds[:2] == [(1, "received"), (4, "admitted")] and kinds[2][1] == "finished", kinds
    assert len(kinds) == 3  # its `started` (0008) was in the part set aside
    _every_run_equals_a_scan(site)


def test_a_tampered_index_never_shows_a_record_of_another_run(tmp_path: Path) -> None:
    """An entry pointed at another run's record, at the middle of a line, or given another
    seq, and an index overwritten with garbage: each read shows the run's own records only,
    as the scan does, and the index is rebuilt."""
    site = Site(tmp_path, _NO_MODEL)
    log = AuditLog(site.audit_path)
    _write_runs(log)
    log.index.close()
    honest = _scanned(site, _RUNS[0])
    with sqlite3.connect(_index(site)) as db:
        [(other_offset, other_seq)] = db.execute(
            "SELECT offset, seq FROM entries WHERE key = ? AND seq = 5", (_RUNS[1],)).fetchall()
        db.execute("INSERT INTO entries VALUES (?, ?, 'audit.jsonl', ?)",
                   (_RUNS[0], other_seq, other_offset))  # "run a's record 5 lies there"
    assert _audit_run(site, _RUNS[0]) == honest
    assert _RUNS[1] not in "".join(_audit_run(site, _RUNS[0]))

    tampers = (
        "UPDATE entries SET offset = offset + 10 WHERE key = ? AND seq = 4",
        "UPDATE entries SET seq = 99 WHERE key = ? AND seq = 4",
        "UPDATE entries SET segment = '../audit.jsonl' WHERE key = ? AND seq = 4",
    )
    for tamper in tampers:
        with sqlite3.connect(_index(site)) as db:
            db.execute(tamper, (_RUNS[0],))
        assert _audit_run(site, _RUNS[0]) == honest, tamper
    traced = _bothy(site, "trace", _RUNS[0])
    assert traced.returncode == 0 and _RUNS[1] not in traced.stdout, traced.stdout

    for name in ("audit.jsonl.index-wal", "audit.jsonl.index-shm"):
        site.audit_path.with_name(name).unlink(missing_ok=True)
    _index(site).write_bytes(b"not an index at all\n" * 100)
    assert _audit_run(site, _RUNS[0]) == honest
    assert _point(site)[0] == site.audit_path.stat().st_size  # rebuilt


def test_a_register_that_breaks_mid_file_reads_as_the_scan_says(tmp_path: Path) -> None:
    """A line that is no record, appended behind the index's back: the read falls back to the
    scan, which shows the records before it and says which line it cannot read (exit 1)."""
    site = Site(tmp_path, _NO_MODEL)
    _write_runs(AuditLog(site.audit_path), rounds=2)
    with site.audit_path.open("ab") as f:
        f.write(b'{"seq": "not a record"}\n')
    shown = _bothy(site, "audit", "--run", _RUNS[0])
    assert shown.returncode == 1, shown.stdout
    assert "line 12" in shown.stderr and "Traceback" not in shown.stderr, shown.stderr
