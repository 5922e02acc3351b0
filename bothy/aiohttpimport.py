"""Importing aiohttp without the CA bundle parse its unverifying TLS context never uses.

aiohttp 3 makes two TLS client contexts when ``aiohttp.connector`` is imported: one that
verifies (the system's CA store, for every https and wss connection) and one that verifies
nothing (for a caller's ``ssl=False``), on which it still calls ``set_default_verify_paths``.
That second call parses the whole CA bundle again ($SSL_CERT_FILE or OpenSSL's default
file): ~35 ms of CPU and ~0.85 MB of `bothy serve`'s start here, for certificates a context
with ``verify_mode`` CERT_NONE never reads (issue 18). :func:`import_aiohttp` imports aiohttp
with that call skipped for such a context only; the verifying context loads its store as
before, and ``ssl`` is left as it was.
"""

from __future__ import annotations

import ssl
import sys

__all__ = ["import_aiohttp"]


def import_aiohttp() -> None:
    """Import aiohttp (once per process; a no-op if it is already imported)."""
    if "aiohttp.connector" in sys.modules:
        return
    loading = ssl.SSLContext.set_default_verify_paths

    def unless_verifying_nothing(context: ssl.SSLContext) -> None:
        if context.verify_mode != ssl.CERT_NONE:
            loading(context)

    # Replaced for the import only (one thread: serve has started none yet), put back after.
    # (typeshed spells the method's self twice, so no function matches its type.)
    ssl.SSLContext.set_default_verify_paths = unless_verifying_nothing  # type: ignore[method-assign, assignment]
    try:
        import aiohttp.connector  # noqa: F401  (imported for its module-level contexts)
    finally:
        ssl.SSLContext.set_default_verify_paths = loading  # type: ignore[method-assign]
