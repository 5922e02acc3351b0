"""From a delivery to a run request: which job it wakes, in which lane, with what prompt.

The payload is untrusted (rule 6). Placeholders in the operator's prompt template are filled
with payload values framed as data; the whole payload follows, framed too. The lane template
(``pr:{pull_request.number}``) is filled with values reduced to a safe token. A delivery that
matches no job, or whose author's association is not allowed, is ignored, with a reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bothy.config import WakeJob, WebhookJob, WebhookRoute
from bothy.engine.framing import frame, inline

_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.-]+)\}")
_UNSAFE_SUBJECT = re.compile(r"[^A-Za-z0-9:_.#/-]+")
_MAX_SUBJECT_CHARS = 120


@dataclass(frozen=True)
class Matched:
    job: WebhookJob
    subject: str
    prompt: str


@dataclass(frozen=True)
class Ignored:
    reason: str


def decode_payload(body: bytes) -> dict[str, Any] | None:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return payload if isinstance(payload, dict) else None


def match(
    route_name: str,
    route: WebhookRoute,
    event: str,
    action: str | None,
    payload: dict[str, Any],
    *,
    token: str,
) -> Matched | Ignored:
    """The first job of the route that this delivery wakes, rendered; or why none."""
    job = _wanted_by(route_name, route, event, action, payload)
    if isinstance(job, Ignored):
        return job
    subject = render_subject(job.subject, payload, route_name)
    return Matched(job, subject, render_prompt(job, payload, route_name, event, token))


def unwanted(
    route_name: str, route: WebhookRoute, event: str, action: str | None,
    payload: dict[str, Any],
) -> Ignored | None:
    """Why no job of the route wants this delivery, or None if one does (nothing rendered):
    asked at intake, so that what nobody wants is closed there and never queued."""
    job = _wanted_by(route_name, route, event, action, payload)
    return job if isinstance(job, Ignored) else None


def _wanted_by(
    route_name: str, route: WebhookRoute, event: str, action: str | None,
    payload: dict[str, Any],
) -> WebhookJob | Ignored:
    for job in route.jobs:
        if job.event != event or (job.actions and action not in job.actions):
            continue
        refusal = _author_refusal(job, payload)
        return job if refusal is None else Ignored(refusal)
    shown = f"{event}/{action}" if action else event
    return Ignored(f"no job of route '{route_name}' matches event {shown}")


def render_subject(template: str, payload: dict[str, Any], route_name: str) -> str:
    def fill(found: re.Match[str]) -> str:
        name = found.group(1)
        value = route_name if name == "route" else lookup(payload, name)
        return _UNSAFE_SUBJECT.sub("_", str(value if value is not None else "none"))

    subject = _PLACEHOLDER.sub(fill, template)[:_MAX_SUBJECT_CHARS]
    return subject or route_name


def render_ref(template: str, payload: dict[str, Any]) -> str:
    """A job's task ref with ``{dotted.path}`` placeholders filled from the payload as they are:
    not cleaned up here, so that the supervisor refuses (and records) one that is no ref."""
    def fill(found: re.Match[str]) -> str:
        value = lookup(payload, found.group(1))
        return "" if value is None else str(value)

    return _PLACEHOLDER.sub(fill, template)


def render_prompt(
    job: WakeJob,
    payload: dict[str, Any],
    route_name: str,
    event: str,
    token: str,
    *,
    raw: str | None = None,
    what: str = "webhook route",
) -> str:
    """The instruction with framed placeholders, then the payload (or ``raw``), framed."""
    def fill(found: re.Match[str]) -> str:
        value = lookup(payload, found.group(1))
        return inline("" if value is None else str(value), token=token)

    instruction = _PLACEHOLDER.sub(fill, job.prompt)
    body = raw if raw is not None else json.dumps(payload, indent=1, ensure_ascii=False,
                                                   sort_keys=True)
    source = f"the '{event}' delivery of {what} '{route_name}'"
    return f"{instruction}\n\n{frame(body, token=token, source=source)}"


def _author_refusal(job: WebhookJob, payload: dict[str, Any]) -> str | None:
    if not job.author_associations:
        return None
    association = None
    for holder in ("comment", "review", "pull_request", "issue"):
        found = lookup(payload, f"{holder}.author_association")
        if isinstance(found, str):
            association = found
            break
    if association in job.author_associations:
        return None
    allowed = ", ".join(job.author_associations)
    return f"author association {association or 'unknown'} may not wake this job ({allowed})"


def lookup(payload: Any, dotted: str) -> Any:
    """``payload["a"]["b"]`` for ``"a.b"``, or None where the path does not exist."""
    value = payload
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value
