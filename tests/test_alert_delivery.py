"""Alerts from any command reach the alert channel with one Web API call (issue 11).

The real ``bothy`` CLI as a subprocess (``bothy run`` with the real codex and the scripted
model; ``bothy audit repair`` where no model is needed), pointed at the fake Slack by
``chat.slack.api_url`` and at the fake Discord by ``chat.discord.api_url`` (its certificate
names 127.0.0.1, trusted through ``SSL_CERT_FILE``). What the fake received, the register's
``alert sent`` / ``alert undelivered`` record and the command's exit are asserted.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bothy.chat.oneshot import OneShotPoster, Tokens
from bothy.config import ChatConfig, DiscordConfig, SlackConfig
from bothy.engine.alerts import Alert, AlertThread
from bothy.engine.audit import AuditLog
from tests.fakes.discord import ALERT_CHANNEL_ID, GUILD_ID, Certificates, FakeDiscord
from tests.fakes.discord import BOT_TOKEN as DISCORD_TOKEN
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.site import Site
from tests.fakes.slack import BOT_TOKEN as SLACK_TOKEN
from tests.fakes.slack import PERMALINK_BASE, FakeSlack

pytestmark = [pytest.mark.codex, pytest.mark.timeout(90)]

_NO_MODEL = "http://127.0.0.1:9/v1"  # nothing here runs a model
_ALERTS = "C0ALERTS"
_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_NO_TOKENS = {"SLACK_BOT_TOKEN": "", "DISCORD_BOT_TOKEN": "", **dict.fromkeys(_PROXIES, "")}


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(echo_own_posts=False) as fake:
        yield fake


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates.create(Path(tmp_path_factory.mktemp("discord-tls")))


@pytest.fixture
async def discord(certificates: Certificates) -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(certificates) as fake:
        yield fake


def _slack_chat(slack: FakeSlack) -> dict[str, Any]:
    return {"slack": {"api_url": slack.api_url, "alert_channel": _ALERTS}}


def _broken_register(site: Site) -> None:
    """Six records, the third edited: `bothy audit repair` has something to repair (and
    raises its alert) without any model."""
    log = AuditLog(site.audit_path)
    for n in range(1, 7):
        log.append("sop", "saved", "ok", subject=f"sop:s{n}", details={"n": n})
    lines = site.audit_path.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"n":3', b'"n":9')
    site.audit_path.write_bytes(b"".join(lines))


def _alert_records(site: Site) -> list[dict[str, Any]]:
    return [json.loads(line) for line in site.audit_path.read_bytes().splitlines()
            if b'"kind":"alert"' in line]


def _secrets_file(site: Site, mode: int, **values: str) -> Path:
    path = site.root / "service.env"
    path.write_text("# as bothy install writes it\n"
                    + "".join(f"{name}={value}\n" for name, value in values.items()))
    path.chmod(mode)
    return path


async def test_an_alert_from_bothy_run_arrives_in_the_slack_alert_channel(
    tmp_path: Path, slack: FakeSlack,
) -> None:
    """A `bothy run` whose tool needs a person nobody set up posts its alert to the alert
    channel by chat.postMessage, naming the site, the wake and the run id; `alert sent`; the
    run goes on and exits as it would have."""
    async with ModelServer() as server:
        server.script(tool_call("bothy_checklist", {"action": "read"}), text("done"))
        site = Site(tmp_path, server.base_url, chat=_slack_chat(slack), profiles={
            "selfcare": {"tools": ["bothy_checklist"], "ask": ["bothy_checklist"]}})
        done = await site.bothy("run", "read the checklist", "--subject", "nightly",
                                "--profile", "selfcare",
                                **{**_NO_TOKENS, "SLACK_BOT_TOKEN": SLACK_TOKEN})
    assert done.code == 0, done.stderr
    run_id = done.stdout.split()[1]
    assert done.stdout == f"completed {run_id} {done.stdout.split()[2]} usd done\n"
    (post,) = slack.posts
    assert (post.channel, post.thread_ts) == (_ALERTS, None)
    assert post.text == ("! *WARNING* `test-site` — bothy_checklist: 'bothy_checklist' is in"
                         " ask but has no approvals rule: refused, alert raised\n"
                         f"wake `nightly` · run `{run_id}`")
    (call,) = slack.calls_to("chat.postMessage")
    assert call.token == SLACK_TOKEN
    (record,) = _alert_records(site)
    assert (record["event"], record["outcome"], record["run_id"]) == ("sent", "ok", run_id)
    assert record["details"]["route"] == f"slack:{_ALERTS}"


async def test_a_discord_alert_uses_the_token_from_the_secrets_file(
    tmp_path: Path, discord: FakeDiscord, certificates: Certificates,
) -> None:
    """With no token in the environment, the 0600 secrets_file's is used: the alert is one
    REST POST to the alert channel, allowed_mentions none; no gateway is opened."""
    site = Site(tmp_path, _NO_MODEL)
    secrets = _secrets_file(site, 0o600, DISCORD_BOT_TOKEN=DISCORD_TOKEN)
    site.config["chat"] = {"discord": {"api_url": discord.api_url,
                                       "alert_channel": ALERT_CHANNEL_ID}}
    site.config["secrets_file"] = str(secrets)
    site.write_config(site.config)
    _broken_register(site)

    repaired = await site.bothy("audit", "repair", SSL_CERT_FILE=str(certificates.ca_pem),
                                **_NO_TOKENS)

    assert repaired.code == 0, repaired.stderr
    (post,) = discord.posts
    assert post.channel_id == ALERT_CHANNEL_ID and post.allowed_mentions == {"parse": []}
    assert post.content.startswith("! **CRITICAL** `test-site` — the register: repaired at seq 3")
    assert post.enforce_nonce and post.nonce
    assert [r.path for r in discord.requests] == [f"/api/v10/channels/{ALERT_CHANNEL_ID}/messages"]
    assert discord.connections == []
    (record,) = _alert_records(site)
    assert (record["event"], record["details"]["route"]) == ("sent", f"discord:{ALERT_CHANNEL_ID}")


async def test_a_missing_token_is_undelivered_naming_the_variable(
    tmp_path: Path, slack: FakeSlack,
) -> None:
    """No token anywhere: `alert undelivered` names the variable; the command exits as it
    would have; nothing reaches Slack."""
    site = Site(tmp_path, _NO_MODEL, chat=_slack_chat(slack))
    _broken_register(site)
    repaired = await site.bothy("audit", "repair", **_NO_TOKENS)
    assert repaired.code == 0, repaired.stderr
    (record,) = _alert_records(site)
    assert (record["event"], record["outcome"]) == ("undelivered", "failed")
    assert record["details"]["error"] == ("SLACK_BOT_TOKEN (chat.slack.bot_token_env) is not set"
                                          " in the environment, and no secrets_file is configured")
    assert slack.calls == []


async def test_a_secrets_file_others_may_read_is_refused(tmp_path: Path, slack: FakeSlack) -> None:
    """A group-readable secrets_file is not read: undelivered, naming the file and the fix."""
    site = Site(tmp_path, _NO_MODEL, chat=_slack_chat(slack))
    secrets = _secrets_file(site, 0o640, SLACK_BOT_TOKEN=SLACK_TOKEN)
    site.config["secrets_file"] = str(secrets)
    site.write_config(site.config)
    _broken_register(site)
    repaired = await site.bothy("audit", "repair", **_NO_TOKENS)
    assert repaired.code == 0, repaired.stderr
    (record,) = _alert_records(site)
    assert record["event"] == "undelivered"
    assert record["details"]["error"] == (
        f"Refusing to read secrets_file {secrets}: group or others may read it (mode 0640);"
        " make it private with chmod 600")
    assert slack.calls == []


@pytest.mark.parametrize("status", [500, 429])
async def test_a_failing_slack_is_retried_within_a_bound_then_undelivered(
    tmp_path: Path, slack: FakeSlack, status: int,
) -> None:
    """Slack answering 500 (or 429) every time: three attempts, then `alert undelivered` with
    Slack's answer; the command's exit is unaffected."""
    if status == 429:
        slack.rate_limit_posts(100, retry_after_s=0)
    else:
        slack.fail_method("chat.postMessage", status=500, error="internal_error", count=None)
    site = Site(tmp_path, _NO_MODEL, chat=_slack_chat(slack))
    _broken_register(site)
    repaired = await site.bothy("audit", "repair", **{**_NO_TOKENS, "SLACK_BOT_TOKEN": SLACK_TOKEN})
    assert repaired.code == 0, repaired.stderr
    assert [c.status for c in slack.calls_to("chat.postMessage")] == [status] * 3
    (record,) = _alert_records(site)
    assert record["event"] == "undelivered"
    assert re.fullmatch(rf"Cannot post in Slack {_ALERTS}: Slack answered \w+ \(HTTP {status}\)",
                        record["details"]["error"]), record["details"]["error"]


async def test_a_failing_discord_is_retried_within_a_bound_then_undelivered(
    tmp_path: Path, discord: FakeDiscord, certificates: Certificates,
) -> None:
    """Discord answering 503 three times: three attempts, then undelivered; exit unaffected."""
    for _ in range(3):
        discord.fail_next("create_message", 503)
    site = Site(tmp_path, _NO_MODEL, chat={"discord": {"api_url": discord.api_url,
                                                       "alert_channel": ALERT_CHANNEL_ID}})
    _broken_register(site)
    repaired = await site.bothy("audit", "repair", SSL_CERT_FILE=str(certificates.ca_pem),
                                **{**_NO_TOKENS, "DISCORD_BOT_TOKEN": DISCORD_TOKEN})
    assert repaired.code == 0, repaired.stderr
    assert [r.status for r in discord.requests] == [503] * 3
    assert discord.posts == []
    (record,) = _alert_records(site)
    assert record["event"] == "undelivered"
    assert record["details"]["error"] == (
        f"Cannot post in Discord channel {ALERT_CHANNEL_ID}: Discord answered HTTP 503:"
        " Internal Server Error (after 3 attempts)")


async def test_an_alert_about_a_slack_thread_links_to_it(slack: FakeSlack) -> None:
    """An alert concerning a thread carries its permalink, as a Slack link."""
    cfg = ChatConfig(slack=SlackConfig(api_url=slack.api_url, alert_channel=_ALERTS))
    poster = OneShotPoster(cfg, Tokens(None, environ={"SLACK_BOT_TOKEN": SLACK_TOKEN}))
    alert = Alert("acme-mini", "warning", "chat message slack:1.000200", "lost", "slack:1.000100",
                  None, AlertThread("slack", "C0GENERAL", "1.000100"))
    assert await poster.post_alert(alert) == f"slack:{_ALERTS}"
    assert [p.text for p in slack.posts] == [
        "! *WARNING* `acme-mini` — chat message slack:1.000200: lost\n"
        f"wake `slack:1.000100` · <{PERMALINK_BASE}/archives/C0GENERAL/p1000100|the thread>"]


async def test_an_alert_about_a_discord_thread_links_to_it(
    discord: FakeDiscord, certificates: Certificates,
) -> None:
    """An alert concerning a Discord thread carries its jump URL (guild and thread)."""
    cfg = ChatConfig(discord=DiscordConfig(api_url=discord.api_url,
                                           alert_channel=ALERT_CHANNEL_ID))
    poster = OneShotPoster(cfg, Tokens(None, environ={"DISCORD_BOT_TOKEN": DISCORD_TOKEN}),
                           ssl_context=certificates.client_context())
    alert = Alert("acme-mini", "warning", "run", "stuck", None, "run_1",
                  AlertThread("discord", "1200000000000000002", "1200000000000000002"))
    await poster.post_alert(alert)
    (post,) = discord.posts
    assert post.content == ("! **WARNING** `acme-mini` — run: stuck\nrun `run_1` · [the thread]"
                            f"(https://discord.com/channels/{GUILD_ID}/1200000000000000002)")


async def test_a_slack_that_never_answers_is_cut_off_at_the_timeout(
    tmp_path: Path, slack: FakeSlack,
) -> None:
    """chat.postMessage hanging: the post is abandoned at chat.alert_timeout_s and audited
    undelivered saying so; the command still ends as it would have."""
    slack.hang_method("chat.postMessage")
    site = Site(tmp_path, _NO_MODEL, chat={**_slack_chat(slack), "alert_timeout_s": 1})
    _broken_register(site)
    repaired = await site.bothy("audit", "repair", timeout_s=20,
                                **{**_NO_TOKENS, "SLACK_BOT_TOKEN": SLACK_TOKEN})
    assert repaired.code == 0, repaired.stderr
    (record,) = _alert_records(site)
    assert record["event"] == "undelivered"
    assert record["details"]["error"] == (f"Cannot post an alert to slack:{_ALERTS}: no answer"
                                          " within 1 s (chat.alert_timeout_s)")


async def test_an_alert_from_bothy_schedule_run_arrives_in_the_slack_alert_channel(
    tmp_path: Path, slack: FakeSlack,
) -> None:
    """A schedule fired by `bothy schedule run` that stays unverified alerts the channel,
    naming the schedule's wake and its run."""
    async with ModelServer() as server:
        server.script(*[text("not yet") for _ in range(5)])
        site = Site(tmp_path, server.base_url, chat=_slack_chat(slack))
        env = {**_NO_TOKENS, "SLACK_BOT_TOKEN": SLACK_TOKEN}
        added = await site.bothy("schedule", "add", "backups", "--cron", "0 3 * * *",
                                 "--prompt", "Check the backups, then say DONE",
                                 "--verify-regex", "DONE", **env)
        assert added.code == 0, added.stderr
        done = await site.bothy("schedule", "run", "backups", **env)
    (record,) = _alert_records(site)
    assert (record["event"], record["details"]["about"]) == ("sent", "unverified run")
    (post,) = slack.posts
    assert post.channel == _ALERTS
    assert post.text.startswith("! *WARNING* `test-site` — unverified run: still failing"
                                " verification after 5 attempts")
    assert post.text.endswith(f"\nwake `{record['subject']}` · run `{record['run_id']}`")
    assert record["run_id"] in done.stdout
