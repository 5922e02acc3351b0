"""Posts in the platform's own form, and harmless (issue 11): what the fake servers receive.

The adapters run as in production — the real slack_sdk against ``tests/fakes/slack.py``, the
real discord.py against ``tests/fakes/discord.py`` — and each test asserts the exact text (and
Discord's ``allowed_mentions``) the fake received for a hostile or Markdown text.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.chat.base import DISCORD_MAX_CHARS, SLACK_MAX_CHARS
from bothy.chat.discord import DiscordAdapter
from bothy.chat.formatting import (
    DISCORD_NO_PINGS,
    discord_markdown,
    slack_mrkdwn,
    slack_pieces,
)
from bothy.chat.slack import SlackAdapter
from bothy.config import DiscordConfig, SlackConfig
from tests.fakes.discord import ALERT_CHANNEL_ID, BOT_TOKEN, CHANNEL_ID, Certificates, FakeDiscord
from tests.fakes.slack import APP_TOKEN, FakeSlack
from tests.fakes.slack import BOT_TOKEN as SLACK_BOT_TOKEN

with warnings.catch_warnings():  # the audioop DeprecationWarning: see bothy/chat/discord.py
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord

pytestmark = pytest.mark.timeout(20)

HOSTILE = ("<!channel> <!here> <!everyone> ping <@U0BOSS> in <#C0OPS> and <!subteam^S0ALL>;"
           " a < b && c > d")
SLACK_HOSTILE = ("&lt;!channel&gt; &lt;!here&gt; &lt;!everyone&gt; ping &lt;@U0BOSS&gt; in"
                 " &lt;#C0OPS&gt; and &lt;!subteam^S0ALL&gt;; a &lt; b &amp;&amp; c &gt; d")


@pytest.fixture
def _slack_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def slack_adapter(_slack_env: None) -> AsyncIterator[tuple[FakeSlack, SlackAdapter]]:
    async with FakeSlack(ack_timeout_s=0.5) as fake:
        adapter = SlackAdapter(SlackConfig(api_url=fake.api_url), ping_interval_s=1.0,
                               environ={"SLACK_BOT_TOKEN": SLACK_BOT_TOKEN,
                                        "SLACK_APP_TOKEN": APP_TOKEN})

        async def ignore(_message: object) -> None:
            return None

        await adapter.start(ignore)
        try:
            yield fake, adapter
        finally:
            await adapter.stop()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates.create(Path(tmp_path_factory.mktemp("discord-tls")))


@pytest.fixture
async def discord_adapter(
    certificates: Certificates,
) -> AsyncIterator[tuple[FakeDiscord, DiscordAdapter]]:
    async with FakeDiscord(certificates) as fake:
        adapter = DiscordAdapter(DiscordConfig(alert_channel=ALERT_CHANNEL_ID),
                                 environ={"DISCORD_BOT_TOKEN": BOT_TOKEN},
                                 connector=fake.connector, guild_ready_s=0.05,
                                 ready_timeout_s=5.0)

        async def ignore(_message: object) -> None:
            return None

        await adapter.start(ignore)
        try:
            yield fake, adapter
        finally:
            await adapter.stop()


# ---------------------------------------------------------------- Slack


async def test_slack_receives_every_ping_escaped(
    slack_adapter: tuple[FakeSlack, SlackAdapter],
) -> None:
    """An untrusted run's <!channel>, <!here>, <@U…>, <#C…>, <!subteam^…> and raw &<> reach
    Slack escaped, so they show as text and notify nobody."""
    fake, adapter = slack_adapter
    await adapter.post("C1", "1.000100", HOSTILE)
    assert [(p.channel, p.thread_ts, p.text) for p in fake.posts] == [
        ("C1", "1.000100", SLACK_HOSTILE)]


async def test_slack_alerts_show_bold_not_asterisks(
    slack_adapter: tuple[FakeSlack, SlackAdapter],
) -> None:
    """Bothy's own ``! **WARNING**`` reaches Slack as mrkdwn ``*WARNING*``, code kept."""
    fake, adapter = slack_adapter
    await adapter.post_alert("C0ALERTS", "! **WARNING** `acme-mini` — run:pr:42: unverified")
    assert [p.text for p in fake.posts] == ["! *WARNING* `acme-mini` — run:pr:42: unverified"]


async def test_slack_gets_the_models_markdown_as_mrkdwn(
    slack_adapter: tuple[FakeSlack, SlackAdapter],
) -> None:
    """Headings, emphasis, strikes and links become mrkdwn; code is escaped but unchanged."""
    fake, adapter = slack_adapter
    answer = ("## Backups **all** green\n"
              "*Three* hosts, ~~one~~ none failed; see [the log](https://ops.example/log?a=1&b=2).\n"
              "```\nif a < b && c: **keep**\n```\n"
              "Run `ls <dir>` and ping <@U0BOSS>.")
    await adapter.post("C1", "1.000100", answer)
    assert [p.text for p in fake.posts] == [
        "*Backups all green*\n"
        "_Three_ hosts, ~one~ none failed; see <https://ops.example/log?a=1&amp;b=2|the log>.\n"
        "```\nif a &lt; b &amp;&amp; c: **keep**\n```\n"
        "Run `ls &lt;dir&gt;` and ping &lt;@U0BOSS&gt;."]


async def test_a_long_slack_text_is_split_without_cutting_an_escape(
    slack_adapter: tuple[FakeSlack, SlackAdapter],
) -> None:
    """A long run of '&' is cut within Slack's limit, never inside an '&amp;'."""
    fake, adapter = slack_adapter
    await adapter.post("C1", "1.000100", "&" * 3000)
    texts = [p.text for p in fake.posts]
    assert len(texts) == 4
    assert all(len(t) <= SLACK_MAX_CHARS and t.startswith("&amp;") and t.endswith("&amp;")
               for t in texts)
    assert "".join(texts) == "&amp;" * 3000


@pytest.mark.parametrize(("markdown", "mrkdwn"), [
    ("**bold** and *italic*", "*bold* and _italic_"),
    ("2*3*4 and __init__ and snake_case", "2*3*4 and __init__ and snake_case"),
    ("# Title **x** #", "*Title x*"),
    ("[docs](https://x.io/a_b) and [bad](javascript:alert)", "<https://x.io/a_b|docs> and"
     " [bad](javascript:alert)"),
    ("[<!here>](https://x.io)", "<https://x.io|&lt;!here&gt;>"),
    ("``` unclosed <@U1>", "``` unclosed &lt;@U1&gt;"),
    ("@here stays text over the Web API", "@here stays text over the Web API"),
])
def test_slack_mrkdwn(markdown: str, mrkdwn: str) -> None:
    """Markdown becomes mrkdwn; nothing in a converted link or an open fence can ping."""
    assert slack_mrkdwn(markdown) == mrkdwn


def test_slack_pieces_keep_within_the_limit() -> None:
    """Every piece of a long mixed text is within Slack's limit and nothing is lost."""
    text = ("<x> " * 3000).strip()
    pieces = slack_pieces(text)
    assert all(len(p) <= SLACK_MAX_CHARS for p in pieces)
    assert " ".join(pieces) == slack_mrkdwn(text)


# ---------------------------------------------------------------- Discord


async def test_discord_receives_allowed_mentions_none_and_defused_mass_pings(
    discord_adapter: tuple[FakeDiscord, DiscordAdapter],
) -> None:
    """Every Discord post carries allowed_mentions parse none; @everyone/@here are defused."""
    fake, adapter = discord_adapter
    await adapter.post(CHANNEL_ID, CHANNEL_ID,
                       "@everyone look, @here too, and <@1100000000000000002> **bold** stays"
                       " Markdown")
    await adapter.post_alert(ALERT_CHANNEL_ID, "! **WARNING** `acme-mini` — @Everyone")
    assert [(p.channel_id, p.content, p.allowed_mentions) for p in fake.posts] == [
        (CHANNEL_ID, "@\u200beveryone look, @\u200bhere too, and <@1100000000000000002>"
                     " **bold** stays Markdown", {"parse": []}),
        (ALERT_CHANNEL_ID, "! **WARNING** `acme-mini` — @\u200bEveryone", {"parse": []}),
    ]


async def test_every_piece_of_a_long_discord_post_pings_nobody(
    discord_adapter: tuple[FakeDiscord, DiscordAdapter],
) -> None:
    """A text split in pieces sends allowed_mentions none with each, each within 2,000."""
    fake, adapter = discord_adapter
    await adapter.post(CHANNEL_ID, CHANNEL_ID, "@here " * 700)
    assert len(fake.posts) == 3
    assert all(p.allowed_mentions == {"parse": []} and len(p.content) <= DISCORD_MAX_CHARS
               and "@here" not in p.content for p in fake.posts)


def test_discord_no_pings_is_what_discord_py_sends() -> None:
    """The payload the one-shot REST post sends is the one discord.py's adapter sends."""
    assert discord.AllowedMentions.none().to_dict() == DISCORD_NO_PINGS


def test_discord_markdown_is_left_as_written_but_for_mass_pings() -> None:
    """Discord renders Bothy's Markdown: only @everyone/@here change."""
    text = "**WARNING** `x` [log](https://x.io) everyone@here.io @heretic"
    assert discord_markdown(text) == "**WARNING** `x` [log](https://x.io) everyone@\u200bhere.io" \
                                     " @heretic"
