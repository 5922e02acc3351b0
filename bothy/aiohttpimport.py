"""Importing aiohttp without what `bothy serve` never uses of it (the CA bundle parse of its
unverifying TLS context, the system's mime table, a C++ runtime for its signal lists), and
with the CA bundle parse its verifying context needs made beside the rest of the start.

aiohttp 3 makes two TLS client contexts when ``aiohttp.connector`` is imported: one that
verifies (the system's CA store, for every https and wss connection) and one that verifies
nothing (for a caller's ``ssl=False``), on which it still calls ``set_default_verify_paths``.
That second call parses the whole CA bundle again ($SSL_CERT_FILE or OpenSSL's default
file): ~35 ms of CPU and ~0.85 MB of `bothy serve`'s start here, for certificates a context
with ``verify_mode`` CERT_NONE never reads (issue 18). :func:`import_aiohttp` imports aiohttp
with that call skipped for such a context only, and ``ssl`` is left as it was.

``aiohttp.web_fileresponse`` makes its own ``mimetypes.MimeTypes`` table as it loads, for the
files a server sends (Bothy sends none), and that constructor first fills the standard
library's module-wide table from ``/etc/mime.types`` (~2,000 entries) when nobody has yet:
~0.4 MB of `bothy serve`'s idle memory for a table it never reads (issue 18). aiohttp's own
table holds only the standard library's built-in types either way (a ``MimeTypes()`` never
reads the system files itself). :func:`import_aiohttp` lets the module-wide one be filled as
``mimetypes`` does it when nothing asks ahead: at the first ``guess_type`` (a Slack or Discord
upload's, say), which reads the system files then.

aiohttp's signals (its callbacks per event: a response being prepared, a request sent) are
frozenlist's ``FrozenList``, whose compiled version is C++: importing it maps the C++ runtime
(libstdc++), ~0.9 MB of `bothy serve`'s resident pages, for lists of a callback or two that
a request walks once (issue 18). :func:`import_aiohttp` imports frozenlist first with its
Python ``FrozenList``, frozenlist's own reference version (the one ``FROZENLIST_NO_EXTENSIONS``
selects; an operator's own setting of that variable is left to decide), and leaves the
environment as it was, so that nothing serve starts inherits the variable.

The verifying context's own parse is as long again (~11 % of serve's start-up instructions,
though they run fast: ~10 ms here) and needs no Python: ``set_default_verify_paths`` releases
the GIL while OpenSSL reads the bundle. So :func:`import_aiohttp` does not make it inline:
once the import is over (nothing touches that context after), a thread of its own loads the
store while the caller goes on importing and validating, and the returned future is done when
it is loaded. The caller waits for it before anything may open a TLS connection (``bothy
serve`` does, before the daemon starts: commands/operate.py); a context used before would
verify against an empty store and refuse every server, never accept one.
"""

from __future__ import annotations

import mimetypes
import os
import ssl
import sys
import threading
from concurrent.futures import Future

__all__ = ["import_aiohttp"]

_PYTHON_FROZENLIST = "FROZENLIST_NO_EXTENSIONS"  # read once, as frozenlist loads


def import_aiohttp() -> Future[None]:
    """Import aiohttp (once per process; done at once if it is already imported), and load
    its verifying context's CA store in a thread: the future is done once it is loaded (its
    exception, if OpenSSL refused the bundle, is the future's)."""
    trusted: Future[None] = Future()
    if "aiohttp.connector" in sys.modules:
        trusted.set_result(None)
        return trusted
    _import_python_frozenlist()
    loading = ssl.SSLContext.set_default_verify_paths
    verifying: list[ssl.SSLContext] = []

    def later_unless_verifying_nothing(context: ssl.SSLContext) -> None:
        if context.verify_mode != ssl.CERT_NONE:
            verifying.append(context)

    # Replaced for the import only (one thread: serve has started none yet), put back after.
    # (typeshed spells the method's self twice, so no function matches its type.)
    ssl.SSLContext.set_default_verify_paths = later_unless_verifying_nothing  # type: ignore[method-assign, assignment]
    # Said filled for the import only, so that aiohttp's table does not fill it; said unfilled
    # after, so that the first guess fills it (mimetypes.guess_type: "if _db is None: init()").
    filled = mimetypes.inited
    mimetypes.inited = True
    try:
        # Imported for what they make as they load: the contexts, and the table.
        import aiohttp.connector
        import aiohttp.web_fileresponse  # noqa: F401  (only loaded: made while flagged)
    finally:
        ssl.SSLContext.set_default_verify_paths = loading  # type: ignore[method-assign]
        mimetypes.inited = filled

    def load() -> None:
        try:
            for context in verifying:
                loading(context)
        except BaseException as exc:  # (handed to whoever waits, as the import raised it)
            trusted.set_exception(exc)
        else:
            trusted.set_result(None)

    threading.Thread(target=load, name="bothy-ca-store", daemon=True).start()
    return trusted


def _import_python_frozenlist() -> None:
    """frozenlist, with its Python ``FrozenList`` unless the operator's environment says."""
    if "frozenlist" in sys.modules or _PYTHON_FROZENLIST in os.environ:
        return
    os.environ[_PYTHON_FROZENLIST] = "1"
    try:
        import frozenlist  # noqa: F401  (only loaded: it reads the variable as it loads)
    finally:
        del os.environ[_PYTHON_FROZENLIST]
