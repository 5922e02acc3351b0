"""What recovery reads of the register (bothy/wakes/history.py): asked about a few deliveries,
it answers for them as a read of everything would, keeps nothing of the others' runs, and
keeps every ignored delivery for intake; its read starts early enough for all of them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from bothy.engine.audit import AuditLog
from bothy.engine.auditindex import wake_id_for
from bothy.wakes.delivery import wake_details
from bothy.wakes.history import Deferred, RunHistory, history_since

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


def _register(tmp_path: Path) -> AuditLog:
    """Two deliveries that ran, one refused and deferred, and a batch of ignored ones."""
    log = AuditLog(tmp_path / "audit.jsonl", clock=lambda: T0)
    for key, run_id in (("ran-a:h", "run_20261102T090000Z_0000000a"),
                        ("ran-b:h", "run_20261102T090000Z_0000000b"),
                        ("refused:h", "run_20261102T090000Z_0000000c")):
        wake = {"wake_id": wake_id_for(run_id)}
        details = wake_details("github", "pull_request", "opened", key, 0, 1)
        log.append("wake", "received", "ok", subject="pr:1", details={**wake, **details})
        if key.startswith("ran"):
            log.append("run", "admitted", "ok", subject="pr:1", run_id=run_id, details=wake)
            log.append("run", "started", "ok", subject="pr:1", run_id=run_id)  # names no wake
        else:
            log.append("run", "refused", "refused", subject="pr:1", run_id=run_id,
                       details={**wake, "gate": "budget", "message": "over the ceiling"})
            log.append("wake", "deferred", "pending", subject="pr:1",
                       details={**details, "reason": "over the ceiling", "retry_in_s": 60})
    log.append("wake", "ignored", "ok", subject="github", details={
        "route": "github", "count": 2, "deliveries": [
            {"delivery": "unwanted-1:h", "reason": "no job"},
            {"delivery": "unwanted-2:h", "reason": "no job"}]})
    return log


def test_asked_about_some_deliveries_it_answers_for_them_as_a_full_read_does(
    tmp_path: Path,
) -> None:
    log = _register(tmp_path)
    everything = RunHistory.from_register(log)
    asked = RunHistory.from_register(log, deliveries={("github", "ran-a:h"),
                                                      ("github", "refused:h")})
    refused_run = "run_20261102T090000Z_0000000c"

    assert asked.ran_as("github", "ran-a:h") == everything.ran_as("github", "ran-a:h") \
        == "run_20261102T090000Z_0000000a"
    assert asked.refused_step(refused_run, "github", "refused:h", 1) \
        == everything.refused_step(refused_run, "github", "refused:h", 1) \
        == Deferred(T0 + timedelta(seconds=60), "over the ceiling")
    assert asked.ran_as("github", "ran-b:h") is None  # not asked: not kept
    assert everything.ran_as("github", "ran-b:h") == "run_20261102T090000Z_0000000b"
    for history in (asked, everything, RunHistory.from_register(log, deliveries=set())):
        assert history.ignored("github", "unwanted-1:h") and history.ignored("github",
                                                                              "unwanted-2:h")
        assert not history.ignored("github", "ran-a:h")


def test_a_read_from_after_the_records_knows_nothing_of_them(tmp_path: Path) -> None:
    history = RunHistory.from_register(_register(tmp_path), since=T0 + timedelta(seconds=1))

    assert history.ran_as("github", "ran-a:h") is None
    assert not history.ignored("github", "unwanted-1:h")


def test_the_read_starts_a_day_before_the_kept_week_or_the_oldest_arrival_asked_about() -> None:
    now = T0 + timedelta(days=30)

    assert history_since(now, 7, []) == now - timedelta(days=8)
    assert history_since(now, 7, [now - timedelta(days=2)]) == now - timedelta(days=8)
    assert history_since(now, 7, [now - timedelta(days=20), now - timedelta(days=3)]) \
        == now - timedelta(days=21)


def test_a_read_further_back_for_a_few_deliveries_keeps_only_theirs_and_is_learnt(
    tmp_path: Path,
) -> None:
    """What a read of the whole register, asked about a few deliveries a recent stretch knew
    nothing of, found of them is taken in; of the ignored ones it keeps only theirs."""
    log = _register(tmp_path)
    recent = RunHistory.from_register(log, since=T0 + timedelta(seconds=1), deliveries=set())
    earlier = RunHistory.from_register(
        log, deliveries={("github", "ran-b:h"), ("github", "unwanted-1:h")}, every_ignored=False)

    assert not recent.knows("github", "ran-b:h") and not recent.knows("github", "unwanted-1:h")
    assert not earlier.ignored("github", "unwanted-2:h")
    recent.learn(earlier)
    assert recent.ran_as("github", "ran-b:h") == "run_20261102T090000Z_0000000b"
    assert recent.ignored("github", "unwanted-1:h") and recent.knows("github", "unwanted-1:h")
    assert not recent.ignored_deliveries.holds("github", "unwanted-1:h")  # intake's: its own
