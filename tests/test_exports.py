"""Each package declares its surface, and no package reaches into another's private parts.

A package's ``__init__`` lists in ``__all__`` the names the other packages use (STYLE.md,
"Private by default"). A name starting with ``_``, or anything in a module whose name starts
with ``_`` (``commands/_shared.py``), belongs to its own room: a module of another room that
imports it fails here. Rooms are as in ``test_import_cycles``: each package under ``bothy/``,
and each top-level module on its own.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "bothy"


def _room(module: str) -> str:
    """``bothy.chat.router`` → ``bothy.chat``; a top-level module is its own room."""
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(source: str, module: str) -> list[str]:
    """``module``'s imports (at any depth, lazy ones too) of another room's private names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bothy"):
            targets = [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [(alias.name, "") for alias in node.names if alias.name.startswith("bothy")]
        else:
            continue
        for target, name in targets:
            if _room(target) == _room(module):
                continue
            if _is_private(name) or any(_is_private(part) for part in target.split(".")):
                found.append(f"{module} imports {target}{'.' + name if name else ''}")
    return found


def _modules() -> list[tuple[str, Path]]:
    return sorted(
        (".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
         .removesuffix(".__init__"), path)
        for path in PACKAGE.rglob("*.py")
    )


def _packages() -> list[str]:
    return sorted(".".join(init.parent.relative_to(PACKAGE.parent).parts)
                  for init in PACKAGE.rglob("__init__.py"))


def test_no_module_imports_a_private_name_of_another_room() -> None:
    """`from bothy.engine.audit import _Tail` in wakes/, or `bothy.commands._shared` from
    daemon.py, is reaching into another room: make the name public in its package, or keep
    the work there."""
    reached = [line for module, path in _modules()
               for line in private_imports(path.read_text(), module)]
    assert reached == []


@pytest.mark.parametrize(("source", "module", "expected"), [
    ("from bothy.engine.audit import _Tail", "bothy.wakes.inbox",
     ["bothy.wakes.inbox imports bothy.engine.audit._Tail"]),
    ("def f():\n    from bothy.commands._shared import site\n", "bothy.daemon",
     ["bothy.daemon imports bothy.commands._shared.site"]),
    ("import bothy.config._private", "bothy.chat.router",
     ["bothy.chat.router imports bothy.config._private"]),
    ("from bothy.engine.audit import _Tail", "bothy.engine.recovery", []),  # same room
    ("from bothy import __version__", "bothy.engine.worker", []),  # a dunder is not private
])
def test_the_rule_sees_what_it_should(source: str, module: str, expected: list[str]) -> None:
    """The check itself: another room's private name is caught, its own room's and dunders
    are not."""
    assert private_imports(source, module) == expected


@pytest.mark.parametrize("package", _packages())
def test_each_package_declares_its_surface(package: str) -> None:
    """Every package's ``__init__`` has ``__all__``: public names only, each of which loads."""
    loaded = importlib.import_module(package)
    surface = getattr(loaded, "__all__", None)
    assert isinstance(surface, list) and surface, f"{package} declares no __all__"
    assert [name for name in surface if _is_private(name)] == []
    assert [name for name in surface if not hasattr(loaded, name)] == []


_LAZY_PACKAGES = ["bothy.chat", "bothy.commands", "bothy.engine", "bothy.wakes", "bothy.web"]


def _init_source(package: str) -> str:
    return (PACKAGE.parent / package.replace(".", "/") / "__init__.py").read_text()


def test_a_lazy_surface_has_one_loader() -> None:
    """The packages whose surface loads on first use all get it from ``bothy.surface``: none
    carries its own copy of the loader (``importlib`` in its ``__init__``)."""
    lazy = [package for package in _packages() if "_SURFACE" in _init_source(package)]
    assert lazy == _LAZY_PACKAGES
    assert [package for package in lazy if "importlib" in _init_source(package)] == []


@pytest.mark.parametrize("package", _LAZY_PACKAGES)
def test_a_lazy_surface_loads_only_what_is_used(package: str) -> None:
    """Importing the package loads none of its modules, using a name loads its module, and a
    name off the surface is an AttributeError naming the package (in a fresh interpreter)."""
    script = f"""
import sys
import {package} as package
before = sorted(name for name in sys.modules if name.startswith("{package}."))
first = package.__all__[0]
getattr(package, first)
module = package._SURFACE[first]
after = sorted(name for name in sys.modules if name.startswith("{package}."))
try:
    package.no_such_name
except AttributeError as exc:
    print(before, module in after, exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == (
        f"[] True module '{package}' has no attribute 'no_such_name'")
