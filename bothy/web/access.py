"""Who may look: the optional token of the status pages, as a value for each request.

With no token in the environment (``web.token_env``, ``BOTHY_WEB_TOKEN`` by default) the pages
are open to whoever reaches the tailnet door. With one, the JSON API wants it as a bearer
header, and a page wants a cookie: a browser cannot send a header on a page load, so the first
visit carries ``?token=…`` and is answered with an HttpOnly, SameSite=Strict cookie and a
redirect to the same address without the token (it leaves the address bar and the history).
The cookie holds an HMAC of the token, not the token itself. Every comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlencode

__all__ = ["COOKIE", "Access", "Denied", "Exchange", "Granted"]

COOKIE = "bothy_web"
_COOKIE_LABEL = b"bothy web pages cookie"


@dataclass(frozen=True)
class Granted:
    """Show it."""


@dataclass(frozen=True)
class Exchange:
    """A page link's good token: set the cookie, then send the browser to ``location``."""

    location: str
    cookie: str


@dataclass(frozen=True)
class Denied:
    """Not shown: the status and what the person should do."""

    message: str
    status: int = 401


class Access:
    """The token rule for one site; ``token`` None or empty: everything is granted."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None
        self._cookie = (hmac.new(self._token, _COOKIE_LABEL, hashlib.sha256).hexdigest()
                        if self._token else None)

    @property
    def required(self) -> bool:
        return self._token is not None

    def for_api(self, authorization: str | None, cookie: str | None) -> Granted | Denied:
        """The API: ``Authorization: Bearer TOKEN`` (or a page's cookie, same credential)."""
        if self._token is None or self._cookie_matches(cookie):
            return Granted()
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              self._token):
            return Granted()
        return Denied("this API needs the header 'Authorization: Bearer <token>' (the value"
                      " of the variable web.token_env names)")

    def for_page(
        self, path: str, query: Mapping[str, str], cookie: str | None
    ) -> Granted | Exchange | Denied:
        """A page: its cookie, or a ``?token=`` link exchanged once for the cookie."""
        if self._token is None:
            return Granted()
        given = query.get("token")
        if given is not None:
            if not hmac.compare_digest(given.encode(), self._token):
                return Denied("the token in this link is not the site's: ask for a new link")
            rest = {name: value for name, value in query.items() if name != "token"}
            location = quote(path) + (f"?{urlencode(rest)}" if rest else "")
            assert self._cookie is not None
            return Exchange(location, self._cookie)
        if self._cookie_matches(cookie):
            return Granted()
        return Denied("this page needs the site's link: open it once with ?token=<token>"
                      " added, and the browser keeps a cookie for it")

    def _cookie_matches(self, cookie: str | None) -> bool:
        return (self._cookie is not None and cookie is not None
                and hmac.compare_digest(cookie.encode(), self._cookie.encode()))
