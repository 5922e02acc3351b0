"""A run's trace ids, derived from its run id alone: the same run always has the same trace,
so ``bothy trace`` and the W3C trace context Codex is given agree without storing anything."""

from __future__ import annotations

import hashlib

__all__ = ["ROOT_SPAN", "span_id", "trace_id", "traceparent"]

ROOT_SPAN = "run"


def trace_id(run_id: str) -> str:
    """32 hex characters (never all zero, which W3C forbids)."""
    return _nonzero(hashlib.sha256(run_id.encode()).hexdigest()[:32])


def span_id(run_id: str, key: str) -> str:
    """16 hex characters for the span ``key`` of the run."""
    return _nonzero(hashlib.sha256(f"{run_id}/{key}".encode()).hexdigest()[:16])


def traceparent(run_id: str) -> str:
    """The W3C ``traceparent`` naming the run's root span, sampled: Codex's own spans join it."""
    return f"00-{trace_id(run_id)}-{span_id(run_id, ROOT_SPAN)}-01"


def _nonzero(hex_id: str) -> str:
    return hex_id if hex_id.strip("0") else hex_id[:-1] + "1"
