"""The status pages: the site's state on the tailnet door, read-only (``/bothy/``).

``StatusSite`` is what ``bothy serve`` hands its tailnet listener; the rest is its own.
"""

from bothy.web.site import StatusSite

__all__ = ["StatusSite"]
