"""Button presses at the adapters: the real slack-bolt and discord.py against the fakes.

``on_press`` stands in for the router and the buttons (which make the decision durable): it
records each press and can be held on a gate or fail, as a durable write would. What is
proven is the order the issue asks for — nothing is acknowledged before ``on_press``
returned, and a press whose recording failed is delivered again (Slack) or left unanswered
(Discord) — and what each adapter makes of a press.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.chat.base import ChatMessage, Press, PressAnswer
from bothy.chat.discord import DiscordAdapter
from bothy.chat.slack import SlackAdapter
from bothy.config import DiscordConfig, SlackConfig
from bothy.errors import StateError
from tests.fakes.discord import ALICE_ID, BOT_TOKEN, CHANNEL_ID, Certificates, FakeDiscord
from tests.fakes.slack import APP_TOKEN, FakeSlack
from tests.fakes.slack import BOT_TOKEN as SLACK_BOT_TOKEN

pytestmark = pytest.mark.timeout(30)

BOT_ENV = "BOTHY_TEST_SLACK_BOT_TOKEN"
APP_ENV = "BOTHY_TEST_SLACK_APP_TOKEN"
VALUE = "7:run_20261201T114500Z_0123abcd"


class Presses:
    """The test's on_press: records each press; can hold it on a gate, fail, or tell."""

    def __init__(self, *, notice: str | None = None, failures: int = 0) -> None:
        self.notice = notice
        self.failures = failures
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls: list[Press] = []
        self.returned_at: list[float] = []
        self.entered = asyncio.Event()

    async def __call__(self, press: Press) -> PressAnswer:
        self.calls.append(press)
        self.entered.set()
        await self.gate.wait()
        if self.failures > 0:
            self.failures -= 1
            raise StateError("database is locked (the test's on_press failed)")
        self.returned_at.append(time.monotonic())
        return PressAnswer(self.notice)


async def _ignore(message: ChatMessage) -> None:
    """on_message: these tests send no messages that matter."""


# ---------------------------------------------------------------- Slack


@pytest.fixture
async def slack(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeSlack]:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(BOT_ENV, SLACK_BOT_TOKEN)
    monkeypatch.setenv(APP_ENV, APP_TOKEN)
    async with FakeSlack(ack_timeout_s=0.5) as fake:
        yield fake


async def _slack_question(slack: FakeSlack, presses: Presses) -> tuple[SlackAdapter, str]:
    adapter = SlackAdapter(SlackConfig(bot_token_env=BOT_ENV, app_token_env=APP_ENV,
                                       api_url=slack.api_url), ping_interval_s=1.0)
    await adapter.start(_ignore, on_press=presses)
    ts = await adapter.post_question("C1", "1700000000.000001", "? May I?", VALUE)
    return adapter, ts


async def test_a_slack_press_is_acked_only_after_on_press_returned(slack: FakeSlack) -> None:
    """While on_press holds, a whole ack window passes unacked and Slack sends the press
    again; once it returns the press is acked, and the presser's notice follows the ack."""
    presses = Presses(notice="Only listed people may answer.")
    presses.gate.clear()
    adapter, ts = await _slack_question(slack, presses)
    try:
        envelope = slack.press_button("U9", ts, "bothy_question:approve")
        await slack.wait_for_delivery(envelope, attempt=1)
        assert envelope not in slack.acked and presses.returned_at == []
        presses.gate.set()
        await slack.wait_for_ack(envelope)
        await slack.wait_for(lambda: bool(slack.ephemerals))
    finally:
        await adapter.stop()
    [ack] = [a for a in slack.acks if a.envelope_id == envelope][:1]
    assert presses.returned_at[0] <= ack.at
    ephemeral = slack.calls_to("chat.postEphemeral")[0]
    assert ack.at <= ephemeral.at
    assert (ephemeral.args["user"], ephemeral.args["thread_ts"]) == ("U9", "1700000000.000001")
    press = presses.calls[0]
    assert (press.choice, press.value, press.user, press.channel, press.message_id,
            press.forged) == ("approve", VALUE, "U9", "C1", ts, None)


async def test_a_slack_press_whose_recording_failed_is_delivered_again(
    slack: FakeSlack,
) -> None:
    """on_press raising leaves the envelope unacked: Slack's retry reaches it again, and that
    one is acked."""
    presses = Presses(failures=1)
    adapter, ts = await _slack_question(slack, presses)
    try:
        envelope = slack.press_button("U9", ts, "bothy_question:decline")
        await slack.wait_for_ack(envelope)
    finally:
        await adapter.stop()
    sent = [d.attempt for d in slack.deliveries if d.envelope_id == envelope and d.sent]
    assert sent[:2] == [0, 1]
    assert [p.choice for p in presses.calls] == ["decline", "decline"]
    assert len(presses.returned_at) == 1 and slack.ephemerals == []


async def test_slack_buttons_carry_the_value_and_a_foreign_press_is_marked_forged(
    slack: FakeSlack,
) -> None:
    """The question has Approve / Decline with the value; a press naming another workspace
    reaches on_press marked forged; an action that is not Bothy's is acked, not handed over;
    settling replaces the text and drops the buttons."""
    presses = Presses()
    adapter, ts = await _slack_question(slack, presses)
    try:
        [post] = slack.posts
        actions = [b for b in post.blocks or [] if b["type"] == "actions"]
        assert [(e["action_id"], e["value"]) for e in actions[0]["elements"]] == [
            ("bothy_question:approve", VALUE), ("bothy_question:decline", VALUE)]
        forged = slack.press_button("U9", ts, "bothy_question:approve", team_id="TOTHER01")
        other = slack.press_button("U9", ts, "someone_elses_button", value="x")
        await slack.wait_for_ack(forged)
        await slack.wait_for_ack(other)
        await adapter.settle_question("C1", "1700000000.000001", ts, "? May I?", "Approved.")
    finally:
        await adapter.stop()
    [press] = presses.calls
    assert press.forged is not None and "TOTHER01" in press.forged
    assert post.text == "? May I?\nApproved."
    assert [b["type"] for b in post.blocks or []] == ["section", "section"]


# ---------------------------------------------------------------- Discord


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates.create(Path(tmp_path_factory.mktemp("discord-tls")))


@pytest.fixture
async def fake(certificates: Certificates) -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(certificates) as server:
        yield server


async def _discord_question(
    fake: FakeDiscord, presses: Presses
) -> tuple[DiscordAdapter, str]:
    adapter = DiscordAdapter(DiscordConfig(), environ={"DISCORD_BOT_TOKEN": BOT_TOKEN},
                             connector=fake.connector, guild_ready_s=0.05, ready_timeout_s=5.0)
    await adapter.start(_ignore, on_press=presses)
    message_id = await adapter.post_question(CHANNEL_ID, "", "? May I?", VALUE)
    return adapter, message_id


async def test_a_discord_press_is_answered_only_after_on_press_returned(
    fake: FakeDiscord,
) -> None:
    """No interaction response while on_press holds; then one deferred update (type 6)."""
    presses = Presses()
    presses.gate.clear()
    adapter, message_id = await _discord_question(fake, presses)
    try:
        interaction = await fake.press_button(ALICE_ID, message_id, label="Decline")
        await asyncio.wait_for(presses.entered.wait(), 10)
        await fake.caught_up()
        assert fake.callbacks_of(interaction) == []
        presses.gate.set()
        await fake.wait_for(lambda: fake.callbacks_of(interaction), "the answer")
    finally:
        await adapter.stop()
    assert [(c.type, c.status) for c in fake.callbacks_of(interaction)] == [(6, 200)]
    press = presses.calls[0]
    assert (press.choice, press.value, press.user, press.thread, press.forged) == (
        "decline", VALUE, ALICE_ID, CHANNEL_ID, None)


async def test_a_discord_press_whose_recording_failed_is_left_unanswered(
    fake: FakeDiscord,
) -> None:
    """on_press raising: no answer (Discord tells the presser it failed); a notice is an
    ephemeral message; settling edits the text and removes the buttons."""
    presses = Presses(failures=1)
    adapter, message_id = await _discord_question(fake, presses)
    try:
        failed = await fake.press_button(ALICE_ID, message_id)
        await asyncio.wait_for(presses.entered.wait(), 10)
        await fake.caught_up()
        presses.notice = "Only listed people may answer."
        told = await fake.press_button(ALICE_ID, message_id)
        await fake.wait_for(lambda: fake.callbacks_of(told), "the notice")
        await adapter.settle_question(CHANNEL_ID, "", message_id, "? May I?", "Declined.")
    finally:
        await adapter.stop()
    assert fake.callbacks_of(failed) == []
    [notice] = fake.callbacks_of(told)
    assert notice.type == 4 and notice.data is not None and notice.data["flags"] & 64
    assert fake.message(message_id)["content"] == "? May I?\nDeclined."
    assert fake.message(message_id)["components"] == []
