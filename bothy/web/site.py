"""The status pages on the tailnet door: ``/bothy/`` (overview), ``/bothy/runs``, a run's page,
and a small JSON API beside them (``/bothy/api/status`` is ``bothy status --json``).

Served by ``bothy serve``'s tailnet listener (:class:`bothy.wakes.webhook.WebhookListener`
hands over the paths :meth:`StatusSite.owns` once no webhook route has them), never by the
public (Funnel) one. Read-only: GET and HEAD only, everything else 405; no route changes
state. The pages are server-rendered with Jinja2, autoescaped (everything shown that came
from outside — answers, questions, reasons — is text, never markup), charts are SVG drawn on
the server, there is no script at all, and a content security policy forbids any: the pages
refresh themselves with ``<meta http-equiv="refresh">``.

State is read in one worker thread of the site's own (never the event loop, never the
default executor that the rest of the daemon uses), and at most ``_MAX_WAITING`` requests
wait for it; past that the answer is 503.

No aiohttp type leaves this module other than through the listener it plugs into.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import sqlite3
from collections.abc import Callable, Mapping
from datetime import datetime
from importlib import resources
from typing import Any

from aiohttp import web

from bothy.clock import Clock, utc_now
from bothy.config import PAGES_PREFIX, Config
from bothy.errors import BothyError
from bothy.home import BothyHome
from bothy.web.access import COOKIE, Access, Denied, Exchange
from bothy.web.deferred import pages_own
from bothy.web.pagedata import BadFilter, PageData, RunFilter

__all__ = ["CSP", "StatusSite"]

CSP = ("default-src 'self'; script-src 'none'; object-src 'none'; base-uri 'none';"
       " form-action 'self'; frame-ancestors 'none'")
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # a ?token= link never leaks through a Referer
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
_READ_ONLY = frozenset({"GET", "HEAD"})
_RUN_ID = re.compile(r"run_[A-Za-z0-9_]{1,80}")
_STATIC = {"site.css": "text/css; charset=utf-8", "icon.svg": "image/svg+xml"}
_MAX_WAITING = 8
_COOKIE_MAX_AGE_S = 30 * 86_400
_API = f"{PAGES_PREFIX}api/"


class StatusSite:
    """The pages and the API of one site, for the tailnet listener to hand requests to."""

    def __init__(
        self, home: BothyHome, cfg: Config, *, started_at: datetime,
        environ: Mapping[str, str], clock: Clock = utc_now,
    ) -> None:
        self._data = PageData(home, started_at=started_at)
        self._access = Access(environ.get(cfg.web.token_env) or None)
        self._refresh_s = cfg.web.refresh_s
        self._site = cfg.site
        self._clock = clock
        self._reader = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="bothy-web")
        self._waiting = 0
        self._templates: Any = None  # the Jinja2 environment, made on the first page
        self._files: dict[str, bytes] = {}

    def owns(self, path: str) -> bool:
        """The paths of the pages (:func:`~bothy.web.deferred.pages_own`)."""
        return pages_own(path)

    def close(self) -> None:
        """No more pages: let the reader thread end (the listener has stopped)."""
        self._reader.shutdown(wait=False, cancel_futures=True)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request; a failure reading state is a 503 naming it, never a traceback."""
        try:
            response = await self._answer(request)
        except (BothyError, sqlite3.Error, OSError) as exc:
            # A corrupt or locked state database, an unreadable register, a config edited
            # into an error: said, never a traceback.
            response = self._refusal(request, 503, f"cannot read the site's state: {exc}")
        response.headers.update(_HEADERS)
        return response

    async def _answer(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if request.method not in _READ_ONLY:
            response = self._refusal(request, 405, f"{request.method[:20]} is not allowed: these"
                                     " pages only show (GET, HEAD)")
            response.headers["Allow"] = "GET, HEAD"
            return response
        if path in ("/", PAGES_PREFIX.rstrip("/")):
            query = f"?{request.query_string}" if request.query_string else ""
            return web.Response(status=302, headers={"Location": PAGES_PREFIX + query})
        if path.startswith(f"{PAGES_PREFIX}static/"):
            return self._static(path.removeprefix(f"{PAGES_PREFIX}static/"))
        if path.startswith(_API):
            return await self._api(request, path.removeprefix(_API))
        return await self._page(request, path.removeprefix(PAGES_PREFIX))

    # -- pages ------------------------------------------------------------------------------

    async def _page(self, request: web.BaseRequest, rest: str) -> web.StreamResponse:
        query = {name: request.query[name] for name in request.query}
        allowed = self._access.for_page(request.path, query, request.cookies.get(COOKIE))
        if isinstance(allowed, Denied):
            return self._refusal(request, allowed.status, allowed.message)
        if isinstance(allowed, Exchange):
            return self._exchange(request, allowed)
        if rest == "":
            return await self._render("overview.html", lambda: self._data.overview(
                self._clock()))
        if rest == "runs":
            chosen = RunFilter.parse(query)
            if isinstance(chosen, BadFilter):
                return self._refusal(request, 400, chosen.message)
            return await self._render("runs.html", lambda: self._data.runs(chosen))
        if rest.startswith("runs/") and _RUN_ID.fullmatch(run_id := rest.removeprefix("runs/")):
            return await self._render("run.html", lambda: self._data.run(run_id),
                                      missing=f"no run {run_id} in the state or the register")
        return self._refusal(request, 404, "no such page: the overview is at /bothy/")

    def _exchange(self, request: web.BaseRequest, exchange: Exchange) -> web.StreamResponse:
        """Set the cookie, then go on to the address without the token. A page that refreshes
        to it rather than a 303: a SameSite=Strict cookie is withheld from a redirect chain
        that began on another site (a link in a chat), but sent on our own page's navigation."""
        response = self._html("exchange.html", {"location": exchange.location})
        response.set_cookie(COOKIE, exchange.cookie, path=PAGES_PREFIX, httponly=True,
                            samesite="Strict", max_age=_COOKIE_MAX_AGE_S,
                            secure=request.headers.get("X-Forwarded-Proto") == "https")
        return response

    async def _render(
        self, name: str, build: Callable[[], dict[str, Any] | None], *, missing: str = "",
    ) -> web.StreamResponse:
        def build_and_render() -> str | None:
            context = build()
            return None if context is None else self._template(name).render(
                **self._globals(), **context)

        body = await self._off_loop(build_and_render)
        if isinstance(body, web.StreamResponse):
            return body
        if body is None:
            return self._html("error.html", {"status": 404, "message": missing}, status=404)
        return web.Response(text=body, content_type="text/html", charset="utf-8")

    # -- the JSON API -----------------------------------------------------------------------

    async def _api(self, request: web.BaseRequest, rest: str) -> web.StreamResponse:
        allowed = self._access.for_api(request.headers.get("Authorization"),
                                       request.cookies.get(COOKIE))
        if isinstance(allowed, Denied):
            return _json({"error": allowed.message}, status=allowed.status,
                         headers={"WWW-Authenticate": 'Bearer realm="bothy"'})
        if rest == "status":
            found: Any = await self._off_loop(self._data.status)
        elif rest == "runs":
            chosen = RunFilter.parse({name: request.query[name] for name in request.query})
            if isinstance(chosen, BadFilter):
                return _json({"error": chosen.message}, status=400)
            found = await self._off_loop(lambda: _runs_json(self._data.runs(chosen)))
        elif rest.startswith("runs/") and _RUN_ID.fullmatch(run_id := rest.removeprefix("runs/")):
            found = await self._off_loop(lambda: self._data.run_json(run_id))
            if found is None:
                return _json({"error": f"no run {run_id}"}, status=404)
        else:
            return _json({"error": "no such API: /bothy/api/status, /bothy/api/runs,"
                          " /bothy/api/runs/RUN"}, status=404)
        if isinstance(found, web.StreamResponse):
            return found
        return _json(found)

    # -- pieces -----------------------------------------------------------------------------

    async def _off_loop(self, work: Callable[[], Any]) -> Any:
        """``work()`` in the site's reader thread; a 503 when too many already wait."""
        if self._waiting >= _MAX_WAITING:
            return self._html("error.html", {"status": 503, "message": "busy: too many page"
                                             " loads at once; this page reloads itself"},
                              status=503)
        self._waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._reader, work)
        finally:
            self._waiting -= 1

    def _static(self, name: str) -> web.StreamResponse:
        kind = _STATIC.get(name)
        if kind is None:
            return web.Response(status=404, text="no such file", content_type="text/plain")
        body = self._files.get(name)
        if body is None:  # read once (a few hundred bytes), then served from memory
            body = self._files[name] = resources.files("bothy.web").joinpath(
                "static", name).read_bytes()
        return web.Response(body=body, headers={"Content-Type": kind})

    def _refusal(self, request: web.BaseRequest, status: int, message: str) -> web.Response:
        if request.path.startswith(_API):
            return _json({"error": message}, status=status)
        return self._html("error.html", {"status": status, "message": message}, status=status)

    def _html(self, name: str, context: dict[str, Any], *, status: int = 200) -> web.Response:
        text = self._template(name).render(**self._globals(), **context)
        return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")

    def _globals(self) -> dict[str, Any]:
        return {"site": self._site, "refresh_s": self._refresh_s, "prefix": PAGES_PREFIX}

    def _template(self, name: str) -> Any:
        if self._templates is None:
            import jinja2

            self._templates = jinja2.Environment(
                loader=jinja2.PackageLoader("bothy.web", "templates"), autoescape=True,
                undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        return self._templates.get_template(name)


def _runs_json(page: dict[str, Any]) -> dict[str, Any]:
    return {"runs": page["runs"], "older_than": page["older"]}


def _json(value: Any, *, status: int = 200,
          headers: Mapping[str, str] | None = None) -> web.Response:
    # The same bytes `bothy status --json` prints (indent 2, a final newline).
    return web.Response(text=json.dumps(value, indent=2) + "\n", status=status,
                        content_type="application/json", headers=headers)
