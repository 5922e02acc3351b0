"""Shared bits of the benchmarks: where to write, how to print a figure beside its target."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def scratch(prefix: str) -> Path:
    """A fresh directory under the repo's .bench/ (gitignored; on disk, not tmpfs)."""
    root = REPO / ".bench"
    root.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def free_port() -> int:
    """A loopback port nobody listens on now, for a server the bench starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def made(path: Path) -> Path:
    """``path``, created with its parents if need be."""
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_against_fakes(prefix: str, bench: Callable[[Path], Awaitable[None]]) -> None:
    """Run ``bench`` in a fresh scratch directory, with the tests' fakes importable and no
    proxy variable in the environment (a proxy would take loopback traffic elsewhere:
    chat-testing.md, pitfall 1); the directory is removed and the variables restored after."""
    sys.path.insert(0, str(REPO))
    root = scratch(prefix)
    saved = {name: os.environ.pop(name) for name in list(os.environ)
             if name.lower().endswith("_proxy")}
    try:
        asyncio.run(bench(root))
    finally:
        os.environ.update(saved)
        shutil.rmtree(root, ignore_errors=True)


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
