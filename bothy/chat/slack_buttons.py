"""Approval buttons as Slack draws and delivers them (Block Kit; contracts.md §2).

A question is a ``section`` block with its text and an ``actions`` block of two buttons whose
``action_id`` is :data:`~bothy.chat.buttons.ACTION_PREFIX` + the choice and whose ``value``
names the question (``chat/buttons.py`` decides what either means). A press arrives over
Socket Mode as an ``interactive`` envelope carrying a ``block_actions`` payload; Slack shows
the presser an error unless the envelope is acknowledged within 3 s
(https://docs.slack.dev/interactivity/handling-user-interaction).

:func:`press_of` turns that payload into a :class:`~bothy.chat.base.Press`, marking it
forged when it names another workspace (``team.id``) or another app (``api_app_id``) than the
bot's own, as ``auth.test`` reported them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bothy.chat.base import Press
from bothy.chat.buttons import ACTION_PREFIX, APPROVE, DECLINE

PLATFORM = "slack"
_BLOCK_ID = "bothy_question"
_SECTION_MAX_CHARS = 3000  # a section's text: at most 3,000 characters (Block Kit reference)


def question_blocks(text: str, value: str) -> list[dict[str, Any]]:
    """The question and its Approve / Decline buttons."""
    return [
        _section(text),
        {
            "type": "actions",
            "block_id": _BLOCK_ID,
            "elements": [
                _button("Approve", APPROVE, value, style="primary"),
                _button("Decline", DECLINE, value, style="danger"),
            ],
        },
    ]


def settled_blocks(text: str, verdict: str) -> list[dict[str, Any]]:
    """The question once decided: its text and the verdict, no buttons."""
    return [_section(text), _section(verdict)]


def press_of(body: Mapping[str, Any], *, team_id: str, app_id: str | None) -> Press:
    """The press a ``block_actions`` payload carries (forged when not for this bot)."""
    action = _first_action(body)
    action_id = str(action.get("action_id") or "")
    message = _mapping(body.get("message"))
    container = _mapping(body.get("container"))
    ts = str(message.get("ts") or container.get("message_ts") or "")
    thread = str(message.get("thread_ts") or container.get("thread_ts") or ts)
    return Press(
        platform=PLATFORM,
        press_id=str(action.get("action_ts") or body.get("trigger_id") or ""),
        user=str(_mapping(body.get("user")).get("id") or ""),
        channel=str(_mapping(body.get("channel")).get("id") or container.get("channel_id")
                    or ""),
        thread=thread,
        message_id=ts,
        choice=action_id[len(ACTION_PREFIX):] if action_id.startswith(ACTION_PREFIX) else "",
        value=str(action.get("value") or ""),
        forged=_forged(body, team_id=team_id, app_id=app_id),
    )


def _forged(body: Mapping[str, Any], *, team_id: str, app_id: str | None) -> str | None:
    team = str(_mapping(body.get("team")).get("id") or "")
    if team != team_id:
        return f"the press names workspace {team or '(none)'!r}, not this bot's {team_id!r}"
    app = str(body.get("api_app_id") or "")
    if app_id and app != app_id:
        return f"the press names app {app or '(none)'!r}, not this bot's {app_id!r}"
    return None


def _first_action(body: Mapping[str, Any]) -> Mapping[str, Any]:
    actions = body.get("actions")
    if isinstance(actions, list) and actions and isinstance(actions[0], Mapping):
        return actions[0]
    return {}


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _section(text: str) -> dict[str, Any]:
    if len(text) > _SECTION_MAX_CHARS:
        text = text[: _SECTION_MAX_CHARS - 1] + "…"
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def _button(label: str, choice: str, value: str, *, style: str) -> dict[str, Any]:
    return {"type": "button", "text": {"type": "plain_text", "text": label},
            "action_id": ACTION_PREFIX + choice, "value": value, "style": style}
