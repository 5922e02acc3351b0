"""A profile's settings reach Codex itself: its skills and its sandbox, through the real binary.

Each test runs ``bothy run --profile NAME`` against the pinned codex and the scripted model and
looks at what Codex did with the setting: the skill's description in what Codex told the
model, a file a sandboxed command could or could not write. A relative skill path is refused
when the config loads, since Codex needs absolute ones.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

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
