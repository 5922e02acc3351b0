"""The guard on a dream's proposal: a consolidation may fold and tidy, never eat the memory.

A proposal is refused if, for any file it rewrites, the entry count or the character count
would fall by more than a quarter, the file would be emptied, or it would exceed its cap
(OpenClaw's ``maxPriorEntryLossFraction`` is 0.25 of entries; Bothy holds characters to the
same line). Whether the file changed since the dream began is checked by the store, under
the profile's lock, just before the replace.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOSS = 0.25


@dataclass(frozen=True)
class FileChange:
    """One file of a proposal: its entries before and after, and its cap in characters."""

    name: str
    before: list[str]
    after: list[str]
    cap_chars: int


def judge(change: FileChange, *, separator: str) -> str | None:
    """Why ``change`` may not be applied, or None when it may."""
    entries_before, entries_after = len(change.before), len(change.after)
    chars_before = len(separator.join(change.before))
    chars_after = len(separator.join(change.after))
    if entries_before and not entries_after:
        return f"{change.name} would be emptied ({entries_before} entries, {chars_before} chars)"
    if entries_after < entries_before * (1 - MAX_LOSS):
        return (f"{change.name} would fall from {entries_before} to {entries_after} entries"
                f" ({_percent(entries_before, entries_after)}), more than"
                f" {int(MAX_LOSS * 100)} %")
    if chars_after < chars_before * (1 - MAX_LOSS):
        return (f"{change.name} would fall from {chars_before} to {chars_after} characters"
                f" ({_percent(chars_before, chars_after)}), more than {int(MAX_LOSS * 100)} %")
    if chars_after > change.cap_chars:
        return (f"{change.name} would hold {chars_after} characters, over its cap of"
                f" {change.cap_chars}")
    return None


def _percent(before: int, after: int) -> str:
    return f"-{round((before - after) * 100 / before)} %"
