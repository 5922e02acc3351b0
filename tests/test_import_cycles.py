"""Bothy's packages import each other one way only: no package import cycles (issue 8)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bothy"


def _room(module: str) -> str:
    """``bothy.chat.router`` → ``bothy.chat``; a top-level module is its own room."""
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports() -> dict[str, set[str]]:
    """Room → the rooms its modules import at load time (not under TYPE_CHECKING, nor inside
    a function: those are lazy on purpose)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if _is_type_checking(node):
                continue
            named: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                named = [node.module]
            elif isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            for name in named:
                if name.startswith("bothy.") and _room(name) != _room(module):
                    edges.setdefault(_room(module), set()).add(_room(name))
    return edges


def _cycle_through(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from ``start`` back to itself, if there is one."""
    stack = [(start, [start])]
    seen: set[str] = set()
    while stack:
        room, path = stack.pop()
        for nxt in sorted(edges.get(room, ())):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_package_imports_another_that_imports_it_back() -> None:
    """chat/ may use wakes/ and engine/, wakes/ may use engine/; never the way back."""
    edges = _imports()
    cycles = [" → ".join(cycle) for room in sorted(edges)
              if (cycle := _cycle_through(room, edges)) is not None]
    assert cycles == []
    assert "bothy.wakes" in edges["bothy.chat"] and "bothy.chat" not in edges["bothy.wakes"]
