"""The Discord adapter's memory of its threads keeps the newest ids and no more."""

from __future__ import annotations

import pytest

from bothy.chat.recent import RecentIds


def test_it_keeps_the_newest_ids_and_forgets_the_oldest_first() -> None:
    recent = RecentIds(3)
    for id_ in (1, 2, 3, 4):
        recent.add(id_)
    assert (1 in recent, 2 in recent, 4 in recent, len(recent)) == (False, True, True, 3)


def test_an_id_seen_again_becomes_the_newest() -> None:
    recent = RecentIds(2)
    recent.add(1)
    recent.add(2)
    recent.add(1)  # a reply in the first thread
    recent.add(3)
    assert (1 in recent, 2 in recent, 3 in recent) == (True, False, True)


def test_a_year_of_threads_stays_at_the_limit() -> None:
    recent = RecentIds(10_000)
    for id_ in range(200_000):
        recent.add(id_)
    assert len(recent) == 10_000
    assert 199_999 in recent and 189_999 not in recent


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one id"):
        RecentIds(0)
