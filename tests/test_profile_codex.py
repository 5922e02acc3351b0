"""A profile's settings reach Codex itself: its skills and its sandbox, through the real binary.

Each test runs ``bothy run --profile NAME`` against the pinned codex and the scripted model and
looks at what Codex did with the setting: the skill's description in what Codex told the
model, a file a sandboxed command could or could not write. A relative skill path is refused
when the config loads, since Codex needs absolute ones. What Bothy switches off in codex
unless told otherwise (its shadow skill-selection experiment) is asked of the real binary,
started with the worker's own overrides and environment: ``codex features list``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bothy.config import CodexConfig
from bothy.engine.launch import build_launch
from tests.fakes.codex import codex_binary
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.site import Site

SKILL = """---
name: bothy-door-paint
description: Paint the bothy door in the traditional green, never red.
---

# Bothy door paint

Use the green tin in the shed.
"""


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


@pytest.mark.codex
async def test_a_profiles_skills_reach_codex(server: ModelServer, tmp_path: Path) -> None:
    """Codex lists a profile's skill to the model: its name and description are in the request."""
    skill_dir = tmp_path / "skills" / "bothy-door-paint"
    skill_dir.mkdir(parents=True)
    (skill_dir / "SKILL.md").write_text(SKILL)
    server.script(text("noted"), text("noted"))
    site = Site(tmp_path, server.base_url,
                profiles={"painter": {"skills": [str(tmp_path / "skills")]}, "plain": {}})

    done = await site.bothy("run", "paint?", "--subject", "door", "--profile", "painter")
    assert done.code == 0, done.stderr
    plain = await site.bothy("run", "paint?", "--subject", "door", "--profile", "plain")
    assert plain.code == 0, plain.stderr

    with_skill, without = (json.dumps(request["input"]) for request in server.requests)
    assert "bothy-door-paint" in with_skill
    assert "Paint the bothy door in the traditional green, never red." in with_skill
    assert "bothy-door-paint" not in without


async def test_a_relative_skill_path_is_a_config_error(tmp_path: Path) -> None:
    """`skills: ["skills/mine"]`: exit 78 naming the key and that Codex needs absolute paths."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1", profiles={"painter": {"skills": ["skills/x"]}})

    done = await site.bothy("status")

    assert done.code == 78
    assert "profiles.painter.skills: skill path 'skills/x' is relative: Codex needs absolute" \
        " paths" in done.stderr


@pytest.mark.codex
@pytest.mark.parametrize(("sandbox", "written"), [("workspace-write", True),
                                                   ("read-only", False)])
async def test_a_profiles_sandbox_mode_reaches_codex(
    server: ModelServer, tmp_path: Path, sandbox: str, written: bool
) -> None:
    """A command inside Codex's sandbox can write the workspace only under 'workspace-write'."""
    server.script(tool_call("exec_command", {"cmd": "echo inside > sandboxed.txt"}),
                  text("tried"))
    site = Site(tmp_path, server.base_url, profiles={"box": {"sandbox": sandbox}})

    done = await site.bothy("run", "write it", "--subject", "box", "--profile", "box")

    assert done.code == 0, done.stderr
    assert (site.workspace / "sandboxed.txt").exists() is written
    told = [item["output"] for item in server.requests[-1]["input"]
            if item.get("type") == "function_call_output"]
    assert len(told) == 1
    assert ("Read-only file system" in str(told[0])) is not written


def _codex_features(tmp_path: Path, codex_config: dict[str, Any],
                    profile_config: dict[str, Any] | None = None) -> dict[str, str]:
    """What the pinned codex says of its features when started with a worker's overrides and
    environment (``codex features list``: name, stage, state)."""
    home = tmp_path / "codex-home"
    home.mkdir(exist_ok=True)
    cfg = CodexConfig(command=[str(codex_binary()), "app-server"], home=home, config=codex_config)
    launch = build_launch(cfg, {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                          profile_config=profile_config)
    overrides = [arg for arg in launch.argv[1:] if arg != "app-server"]
    listed = subprocess.run([launch.argv[0], *overrides, "features", "list"], env=launch.env,
                            capture_output=True, text=True, timeout=30, check=True)
    return {line.split()[0]: line.split()[-1] for line in listed.stdout.splitlines() if line}


@pytest.mark.codex
def test_codexs_shadow_skill_selection_is_off_unless_the_config_turns_it_on(
    tmp_path: Path
) -> None:
    """A worker's codex has `skill_search` (a metrics-only experiment run on every turn) off,
    beside the operator's own features; `codex.config` or a profile's `codex_config` turns it
    back on."""
    site_features = {"features": {"plugins": False}}

    plain = _codex_features(tmp_path, site_features)
    by_site = _codex_features(tmp_path, {"features": {"plugins": False, "skill_search": True}})
    by_profile = _codex_features(tmp_path, site_features,
                                 profile_config={"features": {"skill_search": True}})

    assert (plain["skill_search"], plain["plugins"]) == ("false", "false")
    assert (by_site["skill_search"], by_site["plugins"]) == ("true", "false")
    assert (by_profile["skill_search"], by_profile["plugins"]) == ("true", "false")
