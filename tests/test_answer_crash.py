"""A chat answer goes out before its worker is stopped (issue 18), and a SIGKILL of a real ``bothy
serve`` at the points that opens loses no answer and posts none twice.

The run's end is settled and recorded (`budget settled`, `run finished`) before anything is
posted; the answer is posted; the wake is closed once it is posted; then the worker is stopped
and `worker stopped` recorded. So there are two new places to die:

- after `run finished`, before the answer is out (the fake Slack holds ``chat.postMessage``
  unanswered): the next start posts the kept answer, once, and ends the worker's group,
  recording its `worker stopped`;
- after the answer is out, before `worker stopped` (a member of the worker's group ignores
  SIGTERM, and the stop's grace is long): the next start posts nothing (no second answer, no
  "restarted" notice) and ends the group, recording its `worker stopped`.

The real daemon as a subprocess, the real pinned codex against the scripted model, the real
slack-bolt against the fake Slack; checked as an operator sees it: the thread's posts, the
register's records in order, and the worker's group empty by psutil.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.engine.audit import AuditRecord
from bothy.engine.procgroup import live_members
from tests.fakes.codex import codex_binary
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import DEADLINE_S, Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_chat_serve import CHANNEL, OPERATOR, _posts_in
from tests.test_serve import free_port, start_serve
from tests.test_stop_matrix_chat import RESTARTED

pytestmark = pytest.mark.codex

ANSWER = "Nothing changed in /srv/work this week."
# A worker command whose group keeps a member that ignores SIGTERM: its stop lasts the whole
# grace (then SIGKILL), which holds a run between its answer and its `worker stopped`.
DEAF_TO_TERM = ("(trap '' TERM; exec sleep 600) </dev/null >/dev/null 2>&1 &"
                 ' exec "$0" "$@"')


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    slack_environment(monkeypatch)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


def _site(root: Path, server: ModelServer, slack: FakeSlack, *, stop_grace_s: float) -> Site:
    chat = {"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR]}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                limits={"stop_grace_s": stop_grace_s},
                codex={"command": ["/bin/sh", "-c", DEAF_TO_TERM, str(codex_binary()),
                                   "app-server"]})


def _of(site: Site, run_id: str | None) -> list[str]:
    return [f"{r.kind} {r.event} {r.outcome}"
            for r in audit_records(site, lambda r: r.run_id == run_id)]


def _finished(site: Site) -> list[AuditRecord]:
    return audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished"))


def _stopped(site: Site, run_id: str | None) -> list[AuditRecord]:
    return audit_records(site, lambda r: r.run_id == run_id
                         and (r.kind, r.event) == ("worker", "stopped"))


def _wakes(site: Site) -> list[str]:
    """The wakes' states, read from outside as an operator's sqlite3 would."""
    with contextlib.closing(sqlite3.connect(site.home / "state" / "bothy.sqlite3",
                                            timeout=DEADLINE_S)) as db:
        return [status for (status,) in db.execute("SELECT status FROM wakes ORDER BY id")]


def _group_of(site: Site, run_id: str | None) -> int:
    [started] = audit_records(site, lambda r: r.run_id == run_id
                              and (r.kind, r.event) == ("run", "started"))
    return int(started.details["pgid"])  # type: ignore[call-overload]


async def test_an_answer_is_posted_before_its_worker_stops(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """With a worker slow to stop (a member deaf to SIGTERM, a 3 s grace), the answer is in
    the thread while the group still lives; `run finished` comes before the post, `worker
    stopped` after it, once the group is empty."""
    server.script(text(ANSWER))
    site = _site(tmp_path, server, slack, stop_grace_s=3.0)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "what changed this week?")
        await until(lambda: bool(_posts_in(slack, ts)), "the answer in the thread")
        [finished] = _finished(site)
        pgid = _group_of(site, finished.run_id)
        alive_at_answer = live_members(pgid)
        stopped_at_answer = _stopped(site, finished.run_id)
        await until(lambda: bool(_stopped(site, finished.run_id)), "`worker stopped`")
        assert await serving.stop() == 0

    assert _posts_in(slack, ts) == [ANSWER]
    assert alive_at_answer != [] and stopped_at_answer == []
    events = _of(site, finished.run_id)
    assert events[-3:] == ["budget settled ok", "run finished ok", "worker stopped ok"]
    assert live_members(pgid) == []


async def test_a_sigkill_after_the_run_finished_posts_its_answer_once_after_the_restart(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """SIGKILL with `run finished` recorded and the answer's post unanswered: the restart
    posts the kept answer, once, says nothing of a restart, and ends the worker's group,
    recording `worker stopped` (by the later Bothy) after `run finished`."""
    server.script(text(ANSWER))
    site = _site(tmp_path, server, slack, stop_grace_s=0.5)
    slack.hang_method("chat.postMessage")
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "what changed this week?")
        await until(lambda: bool(_finished(site)) and bool(slack.calls_to("chat.postMessage")),
                    "the run finished, its answer's post under way")
        [finished] = _finished(site)
        serving.command.signal(signal.SIGKILL)
        await serving.command.finish(timeout_s=DEADLINE_S)
        assert _posts_in(slack, ts) == []

        slack.clear_failures()
        restarted = await start_serve(shell)
        await until(lambda: bool(_posts_in(slack, ts)), "the kept answer in the thread")
        await until(lambda: bool(_stopped(site, finished.run_id)), "`worker stopped`")
        pgid = _group_of(site, finished.run_id)
        left = live_members(pgid)
        assert await restarted.stop() == 0

    assert _posts_in(slack, ts) == [ANSWER]
    assert not any(post.startswith(RESTARTED) for post in _posts_in(slack, ts))
    [stopped] = _stopped(site, finished.run_id)
    assert "a later bothy" in str(stopped.details["by"])
    events = _of(site, finished.run_id)
    assert events.index("run finished ok") < events.index("worker stopped ok")
    [interrupted] = audit_records(site, lambda r: (r.kind, r.event) == ("wake", "interrupted"))
    assert "after its run finished" in str(interrupted.details["note"])
    assert left == []
    assert len(server.requests) == 1  # the answer was not asked for again


async def test_a_sigkill_after_the_answer_before_worker_stopped_posts_nothing_more(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """SIGKILL with the answer posted, its wake closed, and the worker still stopping (a
    member deaf to SIGTERM, a 60 s grace): the restart posts nothing (no second answer, no
    restart notice), ends the group (psutil: empty) and records its `worker stopped`, once.

    The kill waits for the wake's row to say `done`: in the instant between Slack taking the
    post and that commit, a death posts the answer again after the restart (at least once,
    never lost; docs/RUNBOOK.md)."""
    server.script(text(ANSWER))
    site = _site(tmp_path, server, slack, stop_grace_s=60.0)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "what changed this week?")
        await until(lambda: bool(_posts_in(slack, ts)) and _wakes(site) == ["done"],
                    "the answer in the thread, its wake closed")
        [finished] = _finished(site)
        pgid = _group_of(site, finished.run_id)
        assert live_members(pgid) != []  # still stopping
        serving.command.signal(signal.SIGKILL)
        await serving.command.finish(timeout_s=DEADLINE_S)
        assert _stopped(site, finished.run_id) == []

        site.config["limits"] = {"stop_grace_s": 0.5}  # the next start ends it at once
        site.write_config(site.config)
        restarted = await start_serve(shell)
        await until(lambda: bool(_stopped(site, finished.run_id)), "`worker stopped`")
        left = live_members(pgid)
        assert await restarted.stop() == 0

    assert _posts_in(slack, ts) == [ANSWER]
    [stopped] = _stopped(site, finished.run_id)
    assert "a later bothy" in str(stopped.details["by"])
    assert audit_records(site, lambda r: (r.kind, r.event) == ("wake", "interrupted")) == []
    assert left == []
    assert len(server.requests) == 1
