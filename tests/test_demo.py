"""The README's first command stays true: the offline day on site runs and tells its story."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.codex
@pytest.mark.timeout(240)
async def test_the_demo_day_runs_offline_and_ends_with_an_intact_register() -> None:
    """`make demo`'s script exits 0 and shows a completed run, a refusal and a verified chain."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("BOTHY_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "tools" / "demo.py"), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(200):
        output, _ = await process.communicate()
    shown = output.decode()
    assert process.returncode == 0, shown[-3000:]
    assert "The model is SCRIPTED" in shown
    assert "usd BOTHY" in shown
    assert "refused at gate 'budget': would reach" in shown
    assert "POST /hooks/github -> 200" in shown
    assert "slack thread" in shown
    assert "audit chain intact" in shown
