"""A package's surface, loaded on first use (PEP 562): the one ``__getattr__`` behind
``bothy.chat``, ``bothy.commands``, ``bothy.engine``, ``bothy.wakes`` and ``bothy.web``.

Such a package lists in ``_SURFACE`` which module holds each name of its ``__all__``, and
defines ``__getattr__`` as a call to :func:`surface_attribute`; ``from bothy.engine import
AuditLog`` then imports ``bothy.engine.audit`` and nothing else of the package, so importing
one module never loads the rest.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

TYPE_CHECKING = False  # typing is for mypy only here (bothy status: see bothy/cli.py)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["surface_attribute"]


def surface_attribute(package: str, surface: Mapping[str, str], name: str) -> Any:
    """``name`` of ``package``, imported from the module ``surface`` says holds it.

    Raises AttributeError, as a module does, for a name that is not on the surface.
    """
    module = surface.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
