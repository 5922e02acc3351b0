"""What codex reads into a thread at its start, as Bothy records it for a thread made ahead
(bothy/engine/threadinputs.py): a change codex would see is one, a git command is not.

On a real directory tree; the end to end proof (a real ``bothy serve``, real codex, the model
asked under the new AGENTS.md) is in tests/test_spare_thread.py.
"""

from __future__ import annotations

from pathlib import Path

from bothy.engine.threadinputs import ThreadInputs

CODEX = ["codex", "app-server"]
WITH_FALLBACK = [*CODEX, "-c", 'project_doc_fallback_filenames=["CLAUDE.md"]']


def _tree(tmp_path: Path) -> Path:
    workspace = tmp_path / "repo" / "service"
    workspace.mkdir(parents=True)
    (tmp_path / "repo" / ".git").mkdir()
    return workspace


def test_an_agents_md_above_the_workspace_rewritten_is_a_change(tmp_path: Path) -> None:
    """The repository root's AGENTS.md, above the workspace, rewritten: named as changed."""
    workspace = _tree(tmp_path)
    root_md = tmp_path / "repo" / "AGENTS.md"
    root_md.write_text("Push to main.\n")
    before = ThreadInputs.read(workspace, CODEX)
    root_md.write_text("Never push to main.\n")
    assert ThreadInputs.read(workspace, CODEX).changed_since(before) == (
        f"{root_md} changed after the thread was started ahead")


def test_a_fallback_name_counts_only_when_codex_is_told_it(tmp_path: Path) -> None:
    """A CLAUDE.md written is a change when `-c project_doc_fallback_filenames` names it, and
    none otherwise (codex would not read it)."""
    workspace = _tree(tmp_path)
    plain, told = ThreadInputs.read(workspace, CODEX), ThreadInputs.read(workspace, WITH_FALLBACK)
    (workspace / "CLAUDE.md").write_text("Be brief.\n")
    assert ThreadInputs.read(workspace, CODEX).changed_since(plain) is None
    assert ThreadInputs.read(workspace, WITH_FALLBACK).changed_since(told) == (
        f"{workspace / 'CLAUDE.md'} changed after the thread was started ahead")


def test_a_git_command_is_no_change_but_a_new_project_root_is(tmp_path: Path) -> None:
    """Files written inside `.git` (its mtime moves) change nothing; a `.git` appearing in the
    workspace (codex's project root moves) does."""
    workspace = _tree(tmp_path)
    before = ThreadInputs.read(workspace, CODEX)
    (tmp_path / "repo" / ".git" / "index.lock").write_text("")
    assert ThreadInputs.read(workspace, CODEX).changed_since(before) is None
    (workspace / ".git").mkdir()
    assert ThreadInputs.read(workspace, CODEX).changed_since(before) == (
        f"{workspace / '.git'} changed after the thread was started ahead")
