"""A delivery, and the forms it is kept in on disk (one line of a segment; a file of its own).

A delivery is kept as one JSON document (:func:`encode_payload_file`): its source, route, key,
event, action, headers and arrival time, and its body byte for byte (as text when it is
UTF-8, else base64). The inbox appends that document as one line of a segment
(:mod:`bothy.wakes.segments`); an older Bothy kept each in a file of its own, named by
:func:`payload_name`, which are still read, recovered and pruned (the helpers at the end:
blocking, always called through ``asyncio.to_thread``).

What a wake's own records say of it (``wake received``, ``wake ignored``…) starts with
:func:`wake_details`, the one place that says it. A ``wake ignored`` comes in two forms:
one delivery (the dispatcher's, a schedule's, and intake's before batches), or intake's batch
of up to :data:`IGNORED_PER_RECORD` deliveries of one route
(:func:`ignored_batch_details`); every reader takes both through :func:`ignored_in`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from bothy.clock import from_us, to_us
from bothy.fsync import fsync_directory

_FORMAT_VERSION = 1
WEBHOOK = "webhook"  # the source of a delivery that names none (files written before sources)
POLL = "poll"  # the source of what a poller saw (wakes/poller.py); named here so that the
# dispatcher and its handlers need not import the poller on a site that has none (issue 18)
_SUFFIX = ".json"
_TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Delivery:
    """One received delivery, as it is kept on disk and handed to the dispatcher.

    ``key`` is the dedupe key: for GitHub ``X-GitHub-Delivery + ":" + X-GitHub-Hook-ID``
    (the GUID names the event, shared by every hook it goes to: contracts.md §1.1).
    ``headers`` have lower-case names. ``body`` is the raw bytes the signature covered.
    ``source`` says what woke it: ``webhook``, or ``schedule`` (``route`` is then the
    schedule's name, ``key`` the fire time and ``body`` a JSON snapshot of the schedule).
    """

    route: str
    key: str
    event: str
    action: str | None
    headers: dict[str, str]
    body: bytes
    received_at: datetime
    source: str = WEBHOOK


def delivery_details(delivery: Delivery, *, attempt: int = 1) -> dict[str, Any]:
    """What a wake's own records (``wake received``, ``wake ignored``) say of its delivery."""
    return wake_details(delivery.route, delivery.event, delivery.action, delivery.key,
                        to_us(delivery.received_at), attempt)


def wake_details(route: str, event: str, action: str | None, key: str, received_us: int,
                 attempt: int) -> dict[str, Any]:
    """The details every record of a wake starts with (the one place that says them)."""
    return {"route": route, "event": event, "action": action, "delivery": key,
            "received_at": from_us(received_us).isoformat(), "attempt": attempt}


IGNORED_PER_RECORD = 100  # deliveries named by one batch `wake ignored` (~30 KB of details)


@dataclass(frozen=True)
class IgnoredDelivery:
    """One delivery a ``wake ignored`` record closes: its route, its key, and why."""

    route: str
    key: str
    reason: str | None


def ignored_batch_details(route: str, deliveries: Sequence[tuple[Delivery, str]]) -> dict[str, Any]:
    """The details of the one ``wake ignored`` that closes ``deliveries`` (each with the
    reason no job wants it; at most :data:`IGNORED_PER_RECORD`) of ``route`` at intake,
    naming every delivery in order."""
    return {"route": route, "count": len(deliveries), "deliveries": [
        {**_without_route(delivery_details(delivery)), "reason": reason}
        for delivery, reason in deliveries]}


def ignored_in(details: Mapping[str, Any]) -> list[IgnoredDelivery]:
    """Every delivery a ``wake ignored`` record closes, whichever its form: a batch's
    ``deliveries`` under its ``route``, or the one ``delivery`` of a single record (none for
    a record that names no delivery, a schedule's whose SOP is gone, or a malformed one)."""
    route = details.get("route")
    if not isinstance(route, str):
        return []
    batch = details.get("deliveries")
    if isinstance(batch, list):
        return [IgnoredDelivery(route, item["delivery"], _reason(item)) for item in batch
                if isinstance(item, dict) and isinstance(item.get("delivery"), str)]
    key = details.get("delivery")
    return [IgnoredDelivery(route, key, _reason(details))] if isinstance(key, str) else []


def _without_route(details: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in details.items() if name != "route"}


def _reason(details: Mapping[str, Any]) -> str | None:
    reason = details.get("reason")
    return reason if isinstance(reason, str) else None


def payload_name(route: str, key: str, source: str = WEBHOOK) -> str:
    """The file name of a delivery: the same source, route and key always give the same name.

    A webhook's name hashes only its route and key (as before sources existed), so files
    already on disk keep their names.
    """
    ident = f"{route}\0{key}" if source == WEBHOOK else f"{source}\0{route}\0{key}"
    digest = hashlib.sha256(ident.encode()).hexdigest()
    return digest + _SUFFIX


def encode_payload_file(delivery: Delivery) -> bytes:
    """The payload file: one line of JSON (UTF-8) with the body as text if it is UTF-8, else
    base64."""
    try:
        body, encoding = delivery.body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        body, encoding = base64.b64encode(delivery.body).decode("ascii"), "base64"
    document: dict[str, Any] = {
        "version": _FORMAT_VERSION,
        "source": delivery.source,
        "route": delivery.route,
        "key": delivery.key,
        "event": delivery.event,
        "action": delivery.action,
        "headers": delivery.headers,
        "received_at": delivery.received_at.isoformat(),
        "body_encoding": encoding,
        "body": body,
    }
    # orjson writes the same JSON (compact, one line: a newline in a string is escaped) in a
    # fifth of the time json.dumps takes, and intake writes one per delivery; json.loads
    # reads it back to the same values. Only json.dumps writes a header holding a lone
    # surrogate (aiohttp keeps undecodable header bytes so), as an escape.
    try:
        return orjson.dumps(document)
    except TypeError:
        return json.dumps(document, separators=(",", ":")).encode("ascii")


def decode_payload_file(data: bytes) -> Delivery:
    """Read back what :func:`encode_payload_file` wrote; ValueError if it is not that."""
    try:
        document: Any = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("version") != _FORMAT_VERSION:
        raise ValueError(f"not an inbox payload of format version {_FORMAT_VERSION}")
    try:
        body_text: str = document["body"]
        if document["body_encoding"] == "base64":
            body = base64.b64decode(body_text, validate=True)
        else:
            body = body_text.encode("utf-8")
        received_at = datetime.fromisoformat(document["received_at"])
        return Delivery(
            route=str(document["route"]),
            key=str(document["key"]),
            event=str(document["event"]),
            action=document["action"],
            headers={str(k): str(v) for k, v in document["headers"].items()},
            body=body,
            received_at=received_at,
            source=str(document.get("source", WEBHOOK)),
        )
    except (KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise ValueError(f"a field is missing or malformed ({exc!r})") from exc


# -- files of an older Bothy, one per delivery (blocking: through asyncio.to_thread) ------


def payload_file_names(root: Path) -> list[str]:
    """The payload files of an older Bothy (one per delivery) in ``root``, by name."""
    if not root.is_dir():
        return []
    return sorted(entry.name for entry in os.scandir(root)
                  if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."))


def remove_payload_files(root: Path, names: list[str], older_than_us: int) -> None:
    """Remove the payload files ``names``, and temporary files older than ``older_than_us``
    that an older Bothy left; make their removal durable."""
    if not root.is_dir():
        return
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(root / name)
    for entry in os.scandir(root):
        if entry.name.startswith(_TEMP_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime_ns // 1000 < older_than_us:
                    os.unlink(entry.path)
    fsync_directory(root)  # the names are gone for good before their rows are
