"""A heartbeat's preflight, in process with real commands: what wakes the model and what not.

The cases that need a whole `bothy serve` (quiet, woken by a failure, a change, a command that
cannot start) are in ``test_reports_serve.py``; here are the bounds: the time limit, the output
cap and its hash, and the scrubbed environment.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from bothy.wakes.preflight import OUTPUT_CAP_BYTES, Preflight

pytestmark = pytest.mark.timeout(30)


async def test_a_preflight_past_its_time_limit_wakes_the_model_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    """A command still running at the limit: woken, "did not finish", nothing kept to compare."""
    marker = tmp_path / "still-running"
    script = f"import time, pathlib; time.sleep(20); pathlib.Path({str(marker)!r}).touch()"
    check = Preflight([sys.executable, "-c", script], cwd=tmp_path, env={}, time_limit_s=0.5)
    seen = await check.check(last_sha256="0" * 64)
    assert (seen.woken, seen.why, seen.sha256) == (True, "did not finish within 0.5 s", None)
    assert not marker.exists()


async def test_output_past_the_cap_is_compared_by_its_first_64_kib_only(tmp_path: Path) -> None:
    """100 KiB of output: the hash covers the first 64 KiB, the rest is read and dropped (the
    command is not left blocked on a full pipe), and the same head is quiet next time."""
    script = "import sys; sys.stdout.write('a' * 65536 + 'b' * 40000)"
    check = Preflight([sys.executable, "-c", script], cwd=tmp_path, env={})
    first = await check.check(last_sha256=None)
    assert first.woken and first.why == "its output has no earlier fire to compare with"
    assert first.sha256 == hashlib.sha256(b"a" * OUTPUT_CAP_BYTES).hexdigest()
    assert first.output.endswith(f"[output past {OUTPUT_CAP_BYTES} bytes not shown nor compared]")
    again = await check.check(last_sha256=first.sha256)
    assert (again.woken, again.why) == (False, "exited 0 with the output of the last fire")


async def test_the_preflight_sees_only_the_environment_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bothy's own secrets in its environment do not reach the command."""
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-secret")
    script = "import os; print(sorted(os.environ))"
    check = Preflight([sys.executable, "-c", script], cwd=tmp_path, env={"LANG": "C.UTF-8"})
    seen = await check.check(last_sha256=None)
    assert "SLACK_BOT_TOKEN" not in seen.output
    assert "LANG" in seen.output
