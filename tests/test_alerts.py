"""Alerts name the site and subject, are deduplicated, and are audited sent or undelivered."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from bothy.engine.alerts import Alert, Alerts
from bothy.engine.audit import AuditLog


class _Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 9, 24, 10, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def _events(log: AuditLog) -> list[tuple[str, str, str]]:
    return [(r.kind, r.event, r.outcome) for r in log.records()]


async def test_an_alert_with_no_route_is_audited_as_undelivered(tmp_path: Path) -> None:
    """Nowhere to send it: the register says so, naming the missing route."""
    log = AuditLog(tmp_path / "audit.jsonl")
    alerts = Alerts(log, site="acme-mini", clock=_Clock())
    await alerts.raise_alert("wake d-1", "abandoned after 5 attempts", subject="run:pr:42")
    (record,) = list(log.records())
    assert (record.kind, record.event, record.outcome) == ("alert", "undelivered", "failed")
    assert record.details["route"] == "none configured"


async def test_an_alert_goes_to_its_route_once_within_the_window(tmp_path: Path) -> None:
    """The text names level, site, what, why, the wake and the run; a repeat is folded until
    the window passes."""
    log = AuditLog(tmp_path / "audit.jsonl")
    clock = _Clock()
    sent: list[str] = []

    async def sink(alert: Alert) -> str:
        sent.append(alert.text())
        return "slack:C-ALERTS"

    alerts = Alerts(log, site="acme-mini", clock=clock, repeat_after_s=600)
    alerts.route_to(sink)
    for _ in range(2):
        await alerts.raise_alert("tool gmail.send", "needs a person", subject="pr:42",
                                 run_id="run_1")
    clock.now += timedelta(seconds=601)
    await alerts.raise_alert("tool gmail.send", "needs a person", subject="pr:42",
                             run_id="run_1")
    assert sent == ["! **WARNING** `acme-mini` — tool gmail.send: needs a person\n"
                    "wake `pr:42` · run `run_1`"] * 2
    assert _events(log) == [("alert", "sent", "ok"), ("alert", "suppressed", "ok"),
                            ("alert", "sent", "ok")]


async def test_a_failing_route_is_audited_as_undelivered(tmp_path: Path) -> None:
    """A route that fails does not lose the alert silently."""
    log = AuditLog(tmp_path / "audit.jsonl")

    async def broken(alert: Alert) -> str:
        raise ConnectionError("slack is down")

    alerts = Alerts(log, site="acme-mini", clock=_Clock())
    alerts.route_to(broken)
    await alerts.raise_alert("poller feed", "3 polls failed", subject="poll:feed")
    (record,) = list(log.records())
    assert (record.event, record.details["route"]) == ("undelivered", "failed")
    assert "slack is down" in record.details["error"]


async def test_a_failing_first_route_falls_back_to_the_next(tmp_path: Path) -> None:
    """bothy serve's connection first, the one-shot Web API after: a failure of the first is
    recorded beside the route that delivered; both failing is undelivered with both errors."""
    log = AuditLog(tmp_path / "audit.jsonl")
    delivered: list[str] = []

    async def one_shot(alert: Alert) -> str:
        if "twice" in alert.reason:
            raise ConnectionError("the Web API is down too")
        delivered.append(alert.text())
        return "slack:C-ALERTS"

    async def connection(alert: Alert) -> str:
        raise ConnectionError("the socket is dead")

    alerts = Alerts(log, site="acme-mini", clock=_Clock())
    alerts.route_to(one_shot)
    alerts.add_route(connection)
    await alerts.raise_alert("chat", "silent for 300 s", subject="slack")
    await alerts.raise_alert("chat", "silent twice", subject="slack")
    sent, undelivered = list(log.records())
    assert (sent.event, sent.details["route"], sent.details["failed_first"]) == (
        "sent", "slack:C-ALERTS", ["the socket is dead"])
    assert delivered == ["! **WARNING** `acme-mini` — chat: silent for 300 s\nwake `slack`"]
    assert (undelivered.event, undelivered.details["error"]) == (
        "undelivered", "the socket is dead; the Web API is down too")
