"""CONTRIBUTING.md's layout table stays true: every package and top-level module has its row."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_ROW = re.compile(r"^\| `([^`]+)` \|")


def _layout_rows() -> list[str]:
    text = (REPO / "CONTRIBUTING.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return [match[1] for line in section.splitlines() if (match := _ROW.match(line))]


def test_every_package_and_top_level_module_is_in_the_layout() -> None:
    """A package (``bothy/chat/``) or a module of ``bothy/`` itself without a row is missing
    from the map: add one to CONTRIBUTING.md's layout table saying what lives there."""
    rows = set(_layout_rows())
    packages = {f"{init.parent.relative_to(REPO).as_posix()}/"
                for init in (REPO / "bothy").rglob("__init__.py")}
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "bothy").glob("*.py")}
    assert sorted((packages | modules) - rows) == []


def test_every_row_of_the_layout_names_something_that_exists() -> None:
    """A row for a path that is gone (renamed, removed) misleads the next reader."""
    assert [row for row in _layout_rows() if not (REPO / row).exists()] == []
