"""A body from outside — a webhook delivery, a poll's answer — as JSON every later step can
handle, or why it is not (one owner for what "acceptable" means).

Acceptable is: JSON text (UTF-8, or the UTF-16/32 ``json.loads`` detects), nested no deeper
than :data:`MAX_DEPTH` levels, and holding no string a UTF-8 encoder would refuse later (a
lone surrogate, escaped as ``\\ud800``). The depth limit is what keeps every later step safe:
``json.loads`` itself gives up with a RecursionError near 1,000 levels, and ``json.dumps`` and
any walk over the value recurse too. A refusal is a value, :class:`Unacceptable`; nothing here
raises on what a sender sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MAX_DEPTH", "Parsed", "Unacceptable", "parse_body"]

MAX_DEPTH = 100
"""Levels of nesting accepted (GitHub's payloads, and any feed's, are a handful deep)."""

_SURROGATE = re.compile(r"[\ud800-\udfff]")
# How a surrogate can be written in a body json.loads accepts (see _may_be_unacceptable).
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


@dataclass(frozen=True)
class Parsed:
    """The parsed value: any JSON value (the caller decides which shape it needs)."""

    value: Any


@dataclass(frozen=True)
class Unacceptable:
    """Why a body was refused: ``kind`` to match on, ``text`` to complete "the body …"."""

    kind: Literal["not json", "too deep", "not unicode"]
    text: str


def parse_body(data: bytes) -> Parsed | Unacceptable:
    """``data`` parsed and checked, or why it is not acceptable."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Unacceptable("not json", f"is not JSON ({exc})")
    except RecursionError:  # the decoder gives up near 1,000 levels
        return _too_deep()
    if not _may_be_unacceptable(data):
        return Parsed(value)
    return _walk(value)


def _may_be_unacceptable(data: bytes) -> bool:
    """Whether the walk below could refuse this body, judged from its bytes (the walk costs
    more than the rest of a delivery's intake). Nesting past ``MAX_DEPTH`` needs more than
    that many brackets. A lone surrogate reaches the parsed text only as a ``\\uD800``-style
    escape or, since ``json.loads`` decodes bytes with ``surrogatepass``, as its three UTF-8
    style bytes (``ED A0..BF ..``) or in a UTF-16/32 body (which holds NUL bytes, as JSON in
    UTF-8 never does). Over-estimates all: when one may be there, the walk decides."""
    if data.count(b"{") + data.count(b"[") > MAX_DEPTH:
        return True
    # Three substring tests (a byte scan each) before the pattern, which steps through every
    # byte in Python's regex engine: on a delivery's few KB that was most of this check.
    if b"\\u" not in data and b"\xed" not in data and b"\x00" not in data:
        return False
    return _SURROGATE_BYTES.search(data) is not None


def _walk(value: Any) -> Parsed | Unacceptable:
    """Walk the value without recursion: no deeper than ``MAX_DEPTH``, no lone surrogate."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list) and depth > MAX_DEPTH:
            return _too_deep()
        if isinstance(item, dict):
            for key, inner in item.items():
                if _SURROGATE.search(key):
                    return _not_unicode()
                stack.append((inner, depth + 1))
        elif isinstance(item, list):
            stack.extend((inner, depth + 1) for inner in item)
        elif isinstance(item, str) and _SURROGATE.search(item):
            return _not_unicode()
    return Parsed(value)


def _too_deep() -> Unacceptable:
    return Unacceptable("too deep", f"is JSON nested deeper than {MAX_DEPTH} levels")


def _not_unicode() -> Unacceptable:
    return Unacceptable("not unicode",
                        "is JSON with a string that is not Unicode (a lone surrogate)")
