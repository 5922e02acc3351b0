"""pydantic's plugins, looked for only when they are on: without the entry-point scan's imports
when they are off, as the CLI turns them off (``PYDANTIC_DISABLE_PLUGINS``, bothy/cli.py).

pydantic asks ``pydantic.plugin._loader.get_plugins`` for its plugins every time it builds a
validator; that function returns nothing when the variable turns every plugin off, yet the
module imports ``importlib.metadata`` as it loads (with email, zipfile, csv and
importlib.resources behind it): about 100 M instructions, a tenth of a whole `bothy run`
(issue 18), for a scan that is never made. :func:`look_for_plugins_only_when_on` puts a
stand-in in its place before pydantic first imports it. The stand-in reads the variable at
each call as pydantic's loader does (its spellings of "all off": ``__all__``, ``1``,
``true``); when plugins are on after all, it hands the question, and its own place, to
pydantic's real loader, so that a plugin an operator installs and turns on is found as before.
"""

from __future__ import annotations

import os
import sys
import types

TYPE_CHECKING = False  # typing is for mypy only here (bothy status: see bothy/cli.py)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

__all__ = ["look_for_plugins_only_when_on"]

_LOADER = "pydantic.plugin._loader"
_ALL_OFF = ("__all__", "1", "true")  # pydantic's own test (pydantic/plugin/_loader.py)


def look_for_plugins_only_when_on() -> None:
    """Stand in for pydantic's plugin loader, unless it is loaded already (then it is left)."""
    if _LOADER in sys.modules:
        return
    stand_in = types.ModuleType(_LOADER, __doc__)
    stand_in.get_plugins = _get_plugins  # type: ignore[attr-defined]  # (a module made here)
    sys.modules[_LOADER] = stand_in


def _get_plugins() -> Iterable[Any]:
    """No plugins while the variable turns them all off; else the real loader's answer."""
    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") in _ALL_OFF:
        return ()
    if getattr(sys.modules.get(_LOADER), "get_plugins", None) is _get_plugins:
        del sys.modules[_LOADER]  # the real loader takes its place from now on
    import importlib

    plugins: Iterable[Any] = importlib.import_module(_LOADER).get_plugins()
    return plugins
