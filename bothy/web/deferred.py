"""The status pages as ``bothy serve`` hands them to its tailnet listener: which paths are
theirs is known at once, the :class:`~bothy.web.site.StatusSite` (its modules, its reader
thread) is made on the first request for one of them. A daemon nobody looks at never loads
them, and its start-up does not wait for them (issue 18).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from bothy.config import PAGES_PREFIX

if TYPE_CHECKING:
    from aiohttp import web

    from bothy.web.site import StatusSite

__all__ = ["DeferredSite", "pages_own"]


def pages_own(path: str) -> bool:
    """``/``, ``/bothy`` and everything under ``/bothy/`` (a webhook route at ``/`` wins: the
    listener looks at its routes first)."""
    return path in ("/", PAGES_PREFIX.rstrip("/")) or path.startswith(PAGES_PREFIX)


class DeferredSite:
    """The status pages, made by ``build`` on the first request they own."""

    def __init__(self, build: Callable[[], StatusSite]) -> None:
        self._build = build
        self._site: StatusSite | None = None

    def owns(self, path: str) -> bool:
        return pages_own(path)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request, making the site first if this is the first."""
        if self._site is None:
            self._site = self._build()
        return await self._site.handle(request)

    def close(self) -> None:
        """No more pages (the listener has stopped); nothing to end if none was asked for."""
        if self._site is not None:
            self._site.close()
