"""Verifying the register: the whole chain checked, and the first problem named.

A verifier reads lines in file order and checks, for each: that it is a record at all, that its
hash matches its content (``altered``), that its ``seq`` follows the last one (``missing`` or
``reordered``: a gap is a reordering if the expected record turns up further down), and that
its ``prev`` is the previous record's hash (``reordered``: spliced or re-hashed). A last line
without its newline is ``truncated``: cut off mid-write.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bothy.engine.auditrecord import GENESIS_HASH, body_of, parse_fields

__all__ = ["ChainVerifier", "Fault", "VerifyReport", "verify_lines"]

Lines = Callable[[], Iterator[tuple[int, bytes]]]
"""A fresh iterator over the register's numbered lines, each time it is called."""


class Fault(enum.StrEnum):
    """What kind of damage ``verify`` found first."""

    ALTERED = "altered"
    MISSING = "missing"
    REORDERED = "reordered"
    TRUNCATED = "truncated"
    UNPARSABLE = "unparsable"


@dataclass(frozen=True)
class VerifyReport:
    """The verdict on a whole chain. ``ok`` with ``count`` 0 for an empty or absent file."""

    ok: bool
    count: int
    first_bad_seq: int | None = None
    line_no: int | None = None
    problem: str = ""
    fault: Fault | None = None
    # The last good record (seq 0 and the genesis hash when there is none): where a repair
    # starts its new segment, and where a checkpoint stands.
    last_seq: int = 0
    last_hash: str = GENESIS_HASH
    # The seqs at which a segment was started by ``bothy audit repair``, oldest first.
    repaired_at: tuple[int, ...] = ()

    def describe(self) -> str:
        """One sentence for ``bothy doctor`` and ``bothy audit verify``."""
        if self.ok:
            return f"audit chain intact ({self.count} records verified)"
        return f"audit chain broken after {self.count} good records: {self.problem}"


def verify_lines(
    lines: Lines,
    *,
    start_seq: int = 0,
    start_hash: str = GENESIS_HASH,
    stop_after: int | None = None,
) -> VerifyReport:
    """Check the chain ``lines()`` yields and name the first problem; never raises.

    ``start_seq``/``start_hash``: the record the first line must follow (a checkpoint, or the
    last good record before a repaired segment). ``stop_after``: stop once that seq verified.
    """
    verifier = ChainVerifier(start_seq=start_seq, start_hash=start_hash)
    for line_no, raw in lines():
        if stop_after is not None and verifier.last_seq >= stop_after:
            break
        finding = verifier.feed(line_no, raw)
        if finding is not None:
            if finding.fault is Fault.MISSING:
                finding = _tell_missing_from_reordered(finding, lines())
            return finding.report(verifier)
    return VerifyReport(ok=True, count=verifier.count, last_seq=verifier.last_seq,
                        last_hash=verifier.last_hash)


@dataclass(frozen=True)
class _Finding:
    fault: Fault
    line_no: int
    seq: int | None
    problem: str
    # For a seq gap: the first seq we expected, so the rest of the file can be searched for it.
    expected_seq: int | None = None
    found_seq: int | None = None

    def report(self, verifier: ChainVerifier) -> VerifyReport:
        return VerifyReport(
            ok=False,
            count=verifier.count,
            first_bad_seq=self.seq,
            line_no=self.line_no,
            problem=self.problem,
            fault=self.fault,
            last_seq=verifier.last_seq,
            last_hash=verifier.last_hash,
        )


class ChainVerifier:
    """Feeds on lines in order; returns the first finding. ``count`` = records verified."""

    def __init__(self, *, start_seq: int = 0, start_hash: str = GENESIS_HASH) -> None:
        self.count = 0
        self.last_seq = start_seq
        self.last_hash = start_hash

    def feed(self, line_no: int, raw: bytes) -> _Finding | None:
        expected = self.last_seq + 1
        if not raw.endswith(b"\n"):
            return _Finding(
                Fault.TRUNCATED,
                line_no,
                expected,
                f"line {line_no} is truncated: record {expected:04d} was cut off mid-write "
                "(no end of line)",
            )
        line = raw[:-1]
        fields = parse_fields(line)
        if isinstance(fields, str):
            return _Finding(Fault.UNPARSABLE, line_no, expected, f"line {line_no} {fields}")
        seq: int = fields["seq"]
        digest: str = fields["hash"]
        if hashlib.sha256(body_of(line)).hexdigest() != digest:
            return _Finding(
                Fault.ALTERED,
                line_no,
                seq,
                f"record {seq:04d} was altered: its hash does not match its content "
                f"(line {line_no})",
            )
        if seq != expected:
            return self._out_of_sequence(line_no, seq, expected)
        if fields["prev"] != self.last_hash:
            return _Finding(Fault.REORDERED, line_no, seq, _broken_link_problem(seq, line_no))
        self.count += 1
        self.last_seq = seq
        self.last_hash = digest
        return None

    def _out_of_sequence(self, line_no: int, seq: int, expected: int) -> _Finding:
        if seq < expected:
            return _Finding(
                Fault.REORDERED,
                line_no,
                seq,
                f"record {seq:04d} is out of order at line {line_no}: "
                f"it follows {self.last_seq:04d}",
            )
        # A gap: records were deleted, or moved further down. The caller looks ahead to decide.
        return _Finding(
            Fault.MISSING,
            line_no,
            expected,
            _missing_problem(expected, seq),
            expected_seq=expected,
            found_seq=seq,
        )


def _tell_missing_from_reordered(gap: _Finding, lines: Iterator[tuple[int, bytes]]) -> _Finding:
    """A seq gap is a reordering if the expected record turns up further down the file."""
    assert gap.expected_seq is not None and gap.found_seq is not None
    for line_no, raw in lines:
        if line_no <= gap.line_no:
            continue
        fields = parse_fields(raw.rstrip(b"\n"))
        if not isinstance(fields, str) and fields["seq"] == gap.expected_seq:
            return _Finding(
                Fault.REORDERED,
                gap.line_no,
                gap.found_seq,
                f"record {gap.found_seq:04d} is out of order at line {gap.line_no}: "
                f"{gap.expected_seq:04d} belongs there and appears later, at line {line_no}",
            )
    return gap


def _missing_problem(expected: int, found: int) -> str:
    last = found - 1
    what = (
        f"record {expected:04d} is missing"
        if expected == last
        else f"records {expected:04d}–{last:04d} are missing"
    )
    if expected == 1:
        return f"{what}: the log starts at {found:04d}"
    return f"{what}: {expected - 1:04d} is followed by {found:04d}"


def _broken_link_problem(seq: int, line_no: int) -> str:
    if seq == 1:
        return "record 0001 does not start the chain: its prev is not the genesis hash (line 1)"
    return (
        f"record {seq:04d} does not follow {seq - 1:04d} (line {line_no}): its prev is not "
        f"the hash of {seq - 1:04d}, so records were reordered, spliced or re-hashed"
    )
