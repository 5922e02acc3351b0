"""Approval buttons as Discord draws and delivers them (message components; contracts.md §3).

A question is a message with one action row of two buttons whose ``custom_id`` is
:data:`~bothy.chat.buttons.ACTION_PREFIX` + the choice + ``|`` + the value naming the question
(Discord buttons carry no separate value; a ``custom_id`` holds at most 100 characters).
A press arrives over the gateway as ``INTERACTION_CREATE`` (type 3, component) and must be
answered within 3 s (https://discord.com/developers/docs/interactions/receiving-and-responding):
the adapter answers once the press is recorded — a deferred update (type 6) when it counted,
an ephemeral message (type 4, flag 64) when the presser is to be told something.

:func:`press_of` turns the interaction into a :class:`~bothy.chat.base.Press`, marking it
forged when it names another application, a guild the bot is not in, or a message the bot did
not write.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection

from bothy.chat.base import Press
from bothy.chat.buttons import ACTION_PREFIX, APPROVE, DECLINE

with warnings.catch_warnings():  # see discord.py's import in chat/discord.py
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord

PLATFORM = "discord"
_SEPARATOR = "|"
_CUSTOM_ID_MAX = 100


def question_view(value: str) -> discord.ui.View:
    """The Approve / Decline buttons of one question (never dispatched by discord.py: the
    adapter reads presses itself, in ``on_interaction``)."""
    view = discord.ui.View(timeout=None)
    for label, choice, style in (("Approve", APPROVE, discord.ButtonStyle.success),
                                 ("Decline", DECLINE, discord.ButtonStyle.danger)):
        custom_id = f"{ACTION_PREFIX}{choice}{_SEPARATOR}{value}"
        if len(custom_id) > _CUSTOM_ID_MAX:
            raise ValueError(f"a button's custom_id would be {len(custom_id)} characters")
        view.add_item(discord.ui.Button(label=label, style=style, custom_id=custom_id))
    return view


def is_ours(interaction: discord.Interaction) -> bool:
    """Whether an interaction is a press of one of Bothy's buttons."""
    return (interaction.type is discord.InteractionType.component
            and _custom_id(interaction).startswith(ACTION_PREFIX))


def press_of(
    interaction: discord.Interaction, *, me: int, application_id: int | None,
    guilds: Collection[int],
) -> Press:
    """The press an interaction carries (forged when it cannot be this bot's)."""
    choice, _, value = _custom_id(interaction)[len(ACTION_PREFIX):].partition(_SEPARATOR)
    message = interaction.message
    channel_id = str(interaction.channel_id or "")
    return Press(
        platform=PLATFORM,
        press_id=str(interaction.id),
        user=str(interaction.user.id) if interaction.user else "",
        channel=channel_id,
        thread=channel_id,  # Bothy's questions are posted in the conversation's thread
        message_id=str(message.id) if message is not None else "",
        choice=choice if choice in (APPROVE, DECLINE) else "",
        value=value,
        forged=_forged(interaction, me=me, application_id=application_id, guilds=guilds),
    )


def _forged(
    interaction: discord.Interaction, *, me: int, application_id: int | None,
    guilds: Collection[int],
) -> str | None:
    if application_id is not None and interaction.application_id != application_id:
        return (f"the press names application {interaction.application_id}, not this bot's"
                f" {application_id}")
    if interaction.guild_id is None or interaction.guild_id not in guilds:
        return f"the press comes from guild {interaction.guild_id}, which this bot is not in"
    message = interaction.message
    if message is None or message.author.id != me:
        return "the pressed message is not this bot's"
    return None


def _custom_id(interaction: discord.Interaction) -> str:
    data = interaction.data
    custom_id = data.get("custom_id") if data is not None else None
    return custom_id if isinstance(custom_id, str) else ""
