"""The set of deliveries intake keeps of the register's ignored ones (bothy/wakes/digestset.py):
each delivery added is held, nothing else is, across the sorted runs it is built from."""

from __future__ import annotations

from bothy.wakes.digestset import DigestSet, DigestSetBuilder


def test_it_holds_every_delivery_added_and_no_other() -> None:
    builder = DigestSetBuilder()
    added = [("github", f"guid-{n}:hook") for n in range(10_000)]  # several sorted runs
    for route, key in added + added[:50]:  # a delivery ignored twice is held once
        builder.add(route, key)

    held = builder.build()

    assert len(held) == len(added)
    assert all(held.holds(route, key) for route, key in added)
    assert not any(held.holds("github", f"guid-{n}:hook") for n in range(10_000, 11_000))
    assert not held.holds("gitlab", "guid-1:hook")  # the route is part of the delivery
    assert not held.holds("github", "guid-1")


def test_an_empty_set_holds_nothing() -> None:
    assert not DigestSet().holds("github", "guid-1:hook")
    assert len(DigestSetBuilder().build()) == 0
