"""The status pages: the site's state on the tailnet door, read-only (``/bothy/``).

``DeferredSite`` is what ``bothy serve`` hands its tailnet listener: it builds the
``StatusSite`` (and imports its modules) on the first request for a page, not at start-up;
the rest is its own. Each name of ``__all__`` is loaded on first use (:mod:`bothy.surface`).
"""

from __future__ import annotations

from typing import Any

from bothy.surface import surface_attribute

_SURFACE = {
    "DeferredSite": "bothy.web.deferred",
    "StatusSite": "bothy.web.site",
}
__all__ = ["DeferredSite", "StatusSite"]


def __getattr__(name: str) -> Any:
    """Load a name of the surface from its module on first use (PEP 562)."""
    return surface_attribute(__name__, _SURFACE, name)
