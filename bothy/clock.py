"""Time, injected: gates and schedules take a clock so tests control time."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, tzinfo

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(moment: datetime) -> int:
    """An aware datetime as integer microseconds since the epoch."""
    delta = moment - _EPOCH  # made once: intake converts a few times per delivery
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(micros: int) -> datetime:
    return datetime.fromtimestamp(micros // 1_000_000, UTC).replace(microsecond=micros % 1_000_000)


def minute_iso(micros: int, zone: tzinfo) -> str:
    """A time for a person, the one form every command shows: ISO 8601 to the minute, in
    ``zone`` (the budget's time zone) with its offset: ``2026-09-25T03:00+02:00``."""
    return from_us(micros).astimezone(zone).isoformat(timespec="minutes")
