"""``RecentIds``: the ids an adapter has seen lately, at most a fixed number of them.

A serve runs for months. A set that gains an id with every conversation and never loses one
grows with the site's whole history; this keeps the newest ``limit`` ids, the ones a reply
can still arrive in, and forgets the oldest first. Seeing an id again makes it the newest.
"""

from __future__ import annotations


class RecentIds:
    """At most ``limit`` ids, the most recently added ones."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"RecentIds needs room for at least one id, not {limit}")
        self._limit = limit
        self._ids: dict[int, None] = {}  # insertion order is age: the first key is the oldest

    def add(self, id_: int) -> None:
        self._ids.pop(id_, None)
        self._ids[id_] = None
        if len(self._ids) > self._limit:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, id_: object) -> bool:
        return id_ in self._ids

    def __len__(self) -> int:
        return len(self._ids)
