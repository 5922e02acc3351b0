"""A run's start is made durable while codex starts its thread (issue 18), and a SIGKILL of a
real ``bothy serve`` in that window spends nothing and leaves nothing running.

The worker's group is attached to the run and `run started` recorded beside codex's first
steps (initialize when cold, thread/start), which spend nothing; turn/start, the first step
that can spend, goes out only once `run started` is durable. The test holds that record's
fsync (tests/fakes/slowdisk: a disk slow to make it durable), sees thread/start answered and
no turn/start sent while it is held, kills serve there, and restarts it: the group is ended
(psutil), the model was never asked, and the thread hears that Bothy restarted, once.

The real daemon as a subprocess, the real pinned codex against the scripted model, the real
slack-bolt against the fake Slack.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.engine.procgroup import live_members
from bothy.engine.rpc import RECORD_ENV
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import DEADLINE_S, Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_chat_serve import CHANNEL, OPERATOR, _posts_in
from tests.test_serve import free_port, start_serve
from tests.test_stop_matrix_chat import RESTARTED

pytestmark = pytest.mark.codex

SLOW_DISK = Path(__file__).parent / "fakes" / "slowdisk"
RUN_STARTED = '"kind":"run","event":"started"'  # the register's canonical form


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    slack_environment(monkeypatch)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


def _site(root: Path, server: ModelServer, slack: FakeSlack, *, spare: bool) -> Site:
    chat = {"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR]}}
    site = Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                limits={"stop_grace_s": 0.5}, codex={"spare": spare})
    site.extra_env.update({"PYTHONPATH": str(SLOW_DISK), RECORD_ENV: str(root / "rpc.jsonl"),
                           "FAKE_SLOW_FSYNC_MARK": RUN_STARTED,
                           "FAKE_SLOW_FSYNC_WHILE": str(root / "hold")})
    return site


def _rpc(site: Site) -> list[tuple[str, str, str | None]]:
    """What went between Bothy and codex: (direction, kind, method), in order."""
    path = site.root / "rpc.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(line["direction"], line["kind"], line["method"])
            for line in map(json.loads, lines)]


@pytest.mark.parametrize("spare", [True, False], ids=["on the spare", "cold"])
async def test_a_sigkill_while_run_started_is_made_durable_spends_nothing_and_ends_the_group(
    tmp_path: Path, server: ModelServer, slack: FakeSlack, spare: bool
) -> None:
    """With `run started`'s fsync held, codex answers thread/start but no turn/start goes
    out; a SIGKILL there, then a restart: the worker's group is ended, the model never
    asked, and the thread is told Bothy restarted, once."""
    server.script(text("never asked for"))
    site = _site(tmp_path, server, slack, spare=spare)
    hold = tmp_path / "hold"
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        if spare:
            await until(lambda: bool(audit_records(
                site, lambda r: (r.kind, r.event) == ("spare", "started"))), "`spare started`")
        hold.touch()  # from here on, `run started` is slow to become durable
        ts = slack.send_mention(OPERATOR, CHANNEL, "what changed this week?")
        await until(lambda: ("received", "response", "thread/start") in _rpc(site),
                    "codex's answer to thread/start")
        await until((tmp_path / "hold.holding").exists, "`run started`'s fsync held")
        sent_while_held = [method for direction, _, method in _rpc(site) if direction == "sent"]
        asked_while_held = len(server.requests)
        serving.command.signal(signal.SIGKILL)
        await serving.command.finish(timeout_s=DEADLINE_S)
        hold.unlink()

        [started] = audit_records(site, lambda r: (r.kind, r.event) == ("run", "started"))
        pgid = int(started.details["pgid"])  # type: ignore[call-overload]
        restarted = await start_serve(shell)
        await until(lambda: bool(_posts_in(slack, ts)), "the restart's notice in the thread")
        await until(lambda: live_members(pgid) == [], "the worker's group ended")
        assert await restarted.stop() == 0

    assert "thread/start" in sent_while_held and "turn/start" not in sent_while_held
    assert asked_while_held == 0 and server.requests == []
    assert audit_records(site, lambda r: (r.kind, r.event) == ("turn", "started")) == []
    [notice] = _posts_in(slack, ts)
    assert notice.startswith(RESTARTED)
