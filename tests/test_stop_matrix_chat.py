"""A clean stop of a real `bothy serve` with chat wakes in flight (issue 10 item 1, for chat):
the real slack-bolt against the fake Slack.

A mention whose run had not started when SIGTERM came is queued again and runs after the
restart: its thread hears one honest thing first (it will run when Bothy starts again), never
a cancellation followed by the answer; a run the stop cut short is told as cancelled (it will
not run again); and the chat stays connected until those runs have ended, so both are heard,
and a mention made while the daemon drains is kept and runs after the restart. Under SIGKILL
nobody can speak before the restart: the waiting mention hears only its answer.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fakes.model_server import ModelServer, stall, text
from tests.fakes.shell import DEADLINE_S, Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_chat_serve import CHANNEL, OPERATOR, _posts_in, _site
from tests.test_serve import accepting, records, start_serve

pytestmark = pytest.mark.codex


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens for `bothy serve`; no proxy may hijack loopback (chat-testing.md, pitfall 1)."""
    slack_environment(monkeypatch)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake

RUNS_AFTER = "Bothy is stopping, so this has not started yet: it will run when Bothy starts again."


RESTARTED = "Bothy was restarted while it worked on this"

SLOW_DISK = Path(__file__).parent / "fakes" / "slowdisk"


def _one_slot(site: Site, *, grace_s: float) -> None:
    site.config["pool"] = {"max_workers": 1}
    site.config["wakes"] = {"shutdown_grace_s": grace_s}
    site.write_config(site.config)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_a_mention_stopped_before_its_run_hears_one_honest_thing_then_its_answer(
    tmp_path: Path, server: ModelServer, slack: FakeSlack, signum: signal.Signals
) -> None:
    """Pool of one: A mid-turn, B waiting for the slot; then the signal. SIGTERM: A's thread
    hears it was cancelled, B's that it runs after the restart; SIGKILL: nothing is said until
    the restart tells A it was cut short. Either way B is answered once, after the restart."""
    server.script(stall("Looking"), text("B is done."))
    site = _site(tmp_path, server, slack)
    _one_slot(site, grace_s=0.5)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        first = slack.send_mention(OPERATOR, CHANNEL, "task A")
        await server.wait_for_requests(1)
        second = slack.send_mention(OPERATOR, CHANNEL, "task B")
        await until(lambda: len(records(site, "run", "admitted")) == 2, "B admitted, waiting")
        serving.command.signal(signum)
        stopped = await serving.command.finish(timeout_s=DEADLINE_S)
        heard_before_restart = (_posts_in(slack, first), _posts_in(slack, second))

        restarted = await start_serve(shell)
        await until(lambda: "B is done." in _posts_in(slack, second), "B's answer")
        if signum == signal.SIGKILL:
            await until(lambda: bool(_posts_in(slack, first)), "A told of the restart")
        assert await restarted.stop() == 0

    if signum == signal.SIGTERM:
        assert stopped.code == 0, stopped.stderr
        [cut] = heard_before_restart[0]
        assert cut.startswith("(cancelled) "), cut
        assert heard_before_restart[1] == [RUNS_AFTER]
        assert _posts_in(slack, second) == [RUNS_AFTER, "B is done."]
    else:
        assert heard_before_restart == ([], [])
        [cut] = _posts_in(slack, first)
        assert cut.startswith(RESTARTED), cut
        assert _posts_in(slack, second) == ["B is done."]
    assert _posts_in(slack, first) == [cut]  # A is not run again
    [requeued] = records(site, "wake", "requeued")
    assert requeued.details["delivery"] == f"{CHANNEL}:{second}"
    assert records(site, "wake", "crashed") == []
    assert audit_records(site, lambda r: r.kind == "chat") == []  # every post went through
    assert len(server.requests) == 2  # A once (cut), B once (after the restart)


async def test_a_mention_made_while_serve_drains_is_kept_and_runs_after_the_restart(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Chat stays connected through the drain: a mention then is acked once it is durable,
    is not run by the stopping daemon, and is answered once after the restart."""
    server.script(stall("Looking"), text("C is done."))
    site = _site(tmp_path, server, slack)
    _one_slot(site, grace_s=20.0)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        slack.send_mention(OPERATOR, CHANNEL, "task A")
        await server.wait_for_requests(1)
        serving.command.signal(signal.SIGTERM)
        await until(lambda: not accepting(serving.port), "the daemon draining")
        late = slack.send_mention(OPERATOR, CHANNEL, "task C")
        await until(lambda: slack.envelopes_acked(late), "C acked while the daemon drains")
        serving.command.signal(signal.SIGTERM)  # the second: skip the rest of the grace
        stopped = await serving.command.finish(timeout_s=DEADLINE_S)
        runs_before_restart = len(records(site, "wake", "received"))

        restarted = await start_serve(shell)
        await until(lambda: "C is done." in _posts_in(slack, late), "C's answer")
        assert await restarted.stop() == 0

    assert stopped.code == 0, stopped.stderr
    assert runs_before_restart == 1  # only A: C was kept, not run, by the stopping daemon
    assert _posts_in(slack, late) == ["C is done."]
    assert len(server.requests) == 2


async def test_a_mention_made_as_the_stop_begins_is_not_taken_by_the_stopping_daemon(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """From the signal on, no wake is taken: with the stop held at its first step after the
    signal (the waiting spare's `spare ended` slow to become durable, before the listeners
    close), a mention is acked once durable, is not run nor received by the stopping daemon,
    and is answered once after the restart."""
    server.script(stall("Looking"), text("C is done."))
    site = _site(tmp_path, server, slack)
    _one_slot(site, grace_s=20.0)
    hold = tmp_path / "hold"
    site.extra_env.update({"PYTHONPATH": str(SLOW_DISK),
                           "FAKE_SLOW_FSYNC_MARK": "bothy is stopping",  # `spare ended`'s why
                           "FAKE_SLOW_FSYNC_WHILE": str(hold)})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: bool(records(site, "spare", "started")), "a spare waiting")
        slack.send_mention(OPERATOR, CHANNEL, "task A")
        await server.wait_for_requests(1)
        await until(lambda: len(records(site, "spare", "started")) == 2,
                    "A on the first spare, the next one waiting")
        hold.touch()
        serving.command.signal(signal.SIGTERM)
        await until((tmp_path / "hold.holding").exists, "the stop under way, held")
        late = slack.send_mention(OPERATOR, CHANNEL, "task C")
        await until(lambda: slack.envelopes_acked(late), "C acked while the stop is held")
        hold.unlink()
        serving.command.signal(signal.SIGTERM)  # the second: skip the rest of the grace
        stopped = await serving.command.finish(timeout_s=DEADLINE_S)
        received_before_restart = [r.subject for r in records(site, "wake", "received")]

        restarted = await start_serve(shell)
        await until(lambda: "C is done." in _posts_in(slack, late), "C's answer")
        assert await restarted.stop() == 0

    assert stopped.code == 0, stopped.stderr
    assert len(received_before_restart) == 1  # only A: C was kept for the restart
    assert _posts_in(slack, late) == ["C is done."]
    assert len(server.requests) == 2
