"""Shared bits of the benchmarks: where to write, how to print a figure beside its target."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def scratch(prefix: str) -> Path:
    """A fresh directory under the repo's .bench/ (gitignored; on disk, not tmpfs)."""
    root = REPO / ".bench"
    root.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def figure(label: str, value: float, unit: str, target: float, *, higher_is_better: bool) -> None:
    """``label  value unit  target ≥/≤ t  ratio``; ratio > 1 means the target is met."""
    ratio = value / target if higher_is_better else (target / value if value else float("inf"))
    sign = "≥" if higher_is_better else "≤"
    print(f"   {label:<46} {value:>12,.2f} {unit:<6} target {sign} {target:,.0f} {unit:<6}"
          f" {ratio:5.2f}×", flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]
