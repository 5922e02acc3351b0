"""Proofs of the home's modes (issue 10 item 7): a ``$BOTHY_HOME`` made by hand with
``mkdir -p`` (0755) is tightened to 0700 when a command that writes state starts, through the
real ``bothy`` CLI."""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fakes.model_server import ModelServer, text
from tests.fakes.site import Site


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.codex
async def test_bothy_run_tightens_a_home_others_may_enter_to_0700(
    tmp_path: Path, server: ModelServer
) -> None:
    """The README's `mkdir -p` leaves the home 0755; the first `bothy run` makes it 0700."""
    site = Site(tmp_path, server.base_url)
    site.home.chmod(0o755)
    server.script(text("done"))

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 0, done.stderr
    assert mode_of(site.home) == 0o700
    assert mode_of(site.home / "state") == 0o700


async def test_a_command_that_only_reads_leaves_the_home_alone(
    tmp_path: Path, server: ModelServer
) -> None:
    """`bothy audit` writes no state: it neither creates nor changes anything's mode."""
    site = Site(tmp_path, server.base_url)
    site.home.chmod(0o755)

    done = await site.bothy("audit")

    assert done.code == 0, done.stderr
    assert mode_of(site.home) == 0o755


async def test_doctor_warns_about_a_config_others_can_read(tmp_path: Path) -> None:
    """A 0644 config.json is a `[warn] config private` naming the mode and the fix; 0600 is ok."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    config = site.home / "config.json"
    config.chmod(0o644)

    loose = await site.bothy("doctor")
    config.chmod(0o600)
    private = await site.bothy("doctor")

    assert f"[warn] config private: {config} is mode 0644: group or others can read it; run" \
        f" chmod 600 {config}" in loose.stdout.splitlines()
    assert f"[ok ] config private: {config} is readable by its owner only" in (
        private.stdout.splitlines())
