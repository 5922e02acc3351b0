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
    # Any other name a later pydantic asks of its loader is the real loader's: a stand-in
    # that lacked it would break every command at its first model, on a site nobody watches.
    setattr(stand_in, "__getattr__", _real_name)  # noqa: B010  (a module's hook, PEP 562)
    sys.modules[_LOADER] = stand_in


def _get_plugins() -> Iterable[Any]:
    """No plugins while the variable turns them all off; else the real loader's answer."""
    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") in _ALL_OFF:
        return ()
    plugins: Iterable[Any] = _real_loader().get_plugins()
    return plugins


def _real_name(name: str) -> Any:
    """A name of pydantic's loader other than ``get_plugins``, from the real loader."""
    if name.startswith("__"):  # (import machinery probing the module: not the loader's)
        raise AttributeError(name)
    return getattr(_real_loader(), name)


def _real_loader() -> types.ModuleType:
    """pydantic's real loader, which takes the stand-in's place from now on."""
    if getattr(sys.modules.get(_LOADER), "get_plugins", None) is _get_plugins:
        del sys.modules[_LOADER]
    import importlib

    return importlib.import_module(_LOADER)
