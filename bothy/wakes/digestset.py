"""A set of deliveries held as 16-byte digests in one sorted ``bytes``: what a long-lived
process keeps of many deliveries it only needs to recognise (intake's guard against a second
``wake ignored``: bothy/wakes/history.py).

As a Python ``set`` of (route, key) tuples each delivery took ~250 bytes of `bothy serve`'s
memory for as long as it ran, and building one left the memory it went through held by the
interpreter's allocator afterwards. Here each takes 16 bytes, and building it makes no object
per delivery that outlives its sorted run of :data:`_RUN` (:class:`DigestSetBuilder`). Two
deliveries share a digest once in ~10^38 pairs.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator

__all__ = ["DigestSet", "DigestSetBuilder", "delivery_digest"]

_WIDTH = 16
_RUN = 4096  # digests sorted together before they join the rest


def delivery_digest(route: str, key: str) -> bytes:
    """The digest that stands for one delivery."""
    return hashlib.blake2b(f"{route}\0{key}".encode(), digest_size=_WIDTH).digest()


class DigestSet:
    """Sorted digests, searched by halves."""

    def __init__(self, sorted_digests: bytes = b"") -> None:
        self._sorted = sorted_digests

    def __len__(self) -> int:
        return len(self._sorted) // _WIDTH

    def holds(self, route: str, key: str) -> bool:
        """Whether this delivery is one of them."""
        if not self._sorted:  # the usual case: intake asks of every new delivery no job wants
            return False
        digest, run = delivery_digest(route, key), self._sorted
        low, high = 0, len(self)
        while low < high:
            middle = (low + high) // 2
            if run[middle * _WIDTH:(middle + 1) * _WIDTH] < digest:
                low = middle + 1
            else:
                high = middle
        return run[low * _WIDTH:(low + 1) * _WIDTH] == digest


class DigestSetBuilder:
    """Collects digests in sorted runs, then merges the runs into one :class:`DigestSet`."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self._runs: list[bytes] = []

    def add(self, route: str, key: str) -> None:
        self._pending.append(delivery_digest(route, key))
        if len(self._pending) >= _RUN:
            self._flush()

    def build(self) -> DigestSet:
        self._flush()
        merged = bytearray()
        last = b""
        for digest in heapq.merge(*(_digests_of(run) for run in self._runs)):
            if digest != last:  # a delivery ignored twice is held once
                merged += digest
                last = digest
        self._runs = []
        return DigestSet(bytes(merged))

    def _flush(self) -> None:
        if self._pending:
            self._runs.append(b"".join(sorted(self._pending)))
            self._pending = []


def _digests_of(run: bytes) -> Iterator[bytes]:
    for start in range(0, len(run), _WIDTH):
        yield run[start:start + _WIDTH]
