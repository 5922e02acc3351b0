"""Limits the oto-runner lessons ask for (SPEC §4): long texts cut with a marker, a turn cap.

Every test runs the real ``bothy run`` against the pinned codex and the scripted model, and
asserts what the operator sees (the printed line, the exit code, the register) and what the
model was told.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.engine.supervisor import FINAL_TEXT_MAX_CHARS
from tests.fakes.model_server import ModelServer, text
from tests.fakes.site import Site

pytestmark = pytest.mark.codex


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


def _final_text(site: Site, run_id: str) -> str:
    db = sqlite3.connect(f"file:{site.home / 'state' / 'bothy.sqlite3'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT final_text FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    finally:
        db.close()
    return str(row[0])


async def test_a_final_text_above_the_cap_is_cut_with_a_marker(
    server: ModelServer, tmp_path: Path
) -> None:
    """An answer 5,000 characters over the cap is kept and shown cut, saying how much was cut."""
    answer = "".join(f"{n:09d}\n" for n in range((FINAL_TEXT_MAX_CHARS + 5_000) // 10))
    server.script(text(answer, chunks=8))
    site = Site(tmp_path, server.base_url)

    done = await site.bothy("run", "say a lot", "--subject", "long")

    assert done.code == 0, done.stderr
    outcome, run_id, _cost, _usd, shown = done.stdout.split(" ", 4)
    kept = answer[:FINAL_TEXT_MAX_CHARS] + "\n[truncated by bothy: 5000 more characters]"
    assert (outcome, shown) == ("completed", kept + "\n")
    assert _final_text(site, run_id) == kept
