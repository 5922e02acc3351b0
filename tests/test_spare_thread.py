"""The thread the spare app-server starts ahead (issue 18): taken by the run whose thread would
be started alike, and by no other, nor once the workspace's AGENTS.md changed (codex reads it
into a thread at thread/start); left unused, it leaves nothing under CODEX_HOME once its
app-server ends in order.

The real ``bothy serve`` as a subprocess with the real pinned codex against the scripted
model, a real Slack mention through the fake Slack and a real signed delivery; what is checked
is what an operator sees: the answer posted, the register (`spare started` naming the thread
it made, `turn started` saying how the run came by its thread), `bothy trace`, the files under
CODEX_HOME, and the spare's process group proven empty by psutil.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.engine.audit import AuditRecord
from bothy.engine.procgroup import live_members
from tests.fakes import github
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_serve import free_port, queued, serve_site, start_serve, until_count

pytestmark = pytest.mark.codex

OPERATOR = "UOPERATOR"
CHANNEL = "CWORK"


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", "It's a Secret to Everybody")


@pytest.fixture
async def slack(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeSlack]:
    slack_environment(monkeypatch)
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


def _chat_site(root: Path, server: ModelServer, slack: FakeSlack) -> Site:
    """A site with Slack and a GitHub route (its job's runs keep no thread)."""
    return serve_site(root, server, chat={
        "slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR]}})


def _of(site: Site, kind: str, event: str, run_id: str | None = None) -> list[AuditRecord]:
    return audit_records(site, lambda r: (r.kind, r.event) == (kind, event)
                         and (run_id is None or r.run_id == run_id))


async def _spares_started(site: Site, count: int) -> list[AuditRecord]:
    await until(lambda: len(_of(site, "spare", "started")) >= count,
                f"{count} `spare started` record(s)")
    return _of(site, "spare", "started")


def _left_of(codex_home: Path, thread_id: str) -> list[str]:
    """What CODEX_HOME holds that is named for the thread (its rollout, shell snapshot, lock)."""
    return sorted(str(path.relative_to(codex_home)) for path in codex_home.rglob("*")
                  if thread_id in path.name)


async def test_a_mention_runs_on_the_thread_the_spare_started_and_its_reply_resumes_it(
    server: ModelServer, slack: FakeSlack, tmp_path: Path
) -> None:
    """A Slack mention's run takes the spare and the kept thread it started ahead: the answer
    is posted, `turn started` names the spare's thread (`thread: ahead`, no thread/start of
    its own), the model was asked the mention's words, `bothy trace` shows the whole run; a
    reply in the Slack thread resumes that Codex thread from its rollout, history and all."""
    server.script(text("Warm answer."), text("Still the same thread."))
    site = Site(tmp_path, server.base_url, listen={"tailnet_port": free_port()},
                chat={"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR]}})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [spare] = await _spares_started(site, 1)
        ts = slack.send_mention(OPERATOR, CHANNEL, "what is the weather in the glen?")
        await until(lambda: any(p.thread_ts == ts for p in slack.posts), "the answer")
        [first] = await until_count(site, "run", "finished", "ok", 1)
        slack.send_message(OPERATOR, CHANNEL, "and tomorrow?", thread_ts=ts)
        finished = await until_count(site, "run", "finished", "ok", 2)
        assert await serving.stop() == 0

    assert (spare.details["thread_kept"], spare.details["thread_sandbox"]) == (True,
                                                                               "read-only")
    assert [p.text for p in slack.posts if p.thread_ts == ts] == ["Warm answer.",
                                                                  "Still the same thread."]
    [started] = _of(site, "run", "started", str(first.run_id))
    assert (started.details["spare"], started.details["pgid"]) == ("taken",
                                                                  spare.details["pgid"])
    [turn] = _of(site, "turn", "started", str(first.run_id))
    assert (turn.details["thread"], turn.details["thread_id"]) == ("ahead",
                                                                  spare.details["thread_id"])
    assert turn.details["thread_start_ms"] is None
    assert "thread_ahead_unused" not in turn.details
    asked = server.requests[0]
    assert "what is the weather in the glen?" in str(asked["input"])

    tree = await site.bothy("trace", str(first.run_id))
    assert tree.code == 0, tree.stderr
    lines = tree.stdout.splitlines()
    assert re.match(rf"run {first.run_id} ok ", lines[0]), tree.stdout
    for step in (r"├─ wake chat ok ", r"├─ gate budget admitted ok ", r"├─ worker ok ",
                 r"│  └─ turn 1 ok .*model fake-model", r"settlement ok "):
        assert any(re.search(step, line) for line in lines), (step, tree.stdout)

    [turn_again] = _of(site, "turn", "started", str(finished[-1].run_id))
    assert (turn_again.details["thread"], turn_again.details["thread_id"]) == (
        "resumed", spare.details["thread_id"])
    [rollout] = [p for p in _left_of(site.codex_home, str(spare.details["thread_id"]))
                 if p.startswith("sessions/")]
    # Kept in codex's plain rollout (Bothy starts every thread with historyMode "legacy"),
    # and resumed from it with its history: the reply's request carries the first exchange.
    meta = json.loads((site.codex_home / rollout).read_text().splitlines()[0])
    assert (meta["type"], meta["payload"]["history_mode"]) == ("session_meta", "legacy")
    resumed = str(server.requests[1]["input"])
    assert "what is the weather in the glen?" in resumed and "Warm answer." in resumed
    assert "and tomorrow?" in resumed


async def test_a_run_whose_thread_differs_starts_its_own_on_the_spare(
    server: ModelServer, slack: FakeSlack, tmp_path: Path
) -> None:
    """With chat configured the spare's thread is a kept one; a webhook job's run keeps none:
    it takes the spare but starts a thread of its own (`thread: started`, saying the one made
    ahead differs in `keep`), is answered, and the next spare's thread is started as that
    run's was (not kept), taken by the next such run. The unused thread left nothing."""
    server.script(text("Reviewed one."), text("Reviewed two."))
    site = _chat_site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [kept] = await _spares_started(site, 1)
        await queued(serving, github.pull_request_opened(1))
        [first] = await until_count(site, "run", "finished", "ok", 1)
        [_, plain] = await _spares_started(site, 2)
        await queued(serving, github.pull_request_opened(2))
        finished = await until_count(site, "run", "finished", "ok", 2)
        assert await serving.stop() == 0

    assert kept.details["thread_kept"] is True
    [started] = _of(site, "run", "started", str(first.run_id))
    assert (started.details["spare"], started.details["pgid"]) == ("taken", kept.details["pgid"])
    [turn] = _of(site, "turn", "started", str(first.run_id))
    assert turn.details["thread"] == "started"
    assert turn.details["thread_id"] != kept.details["thread_id"]
    assert turn.details["thread_ahead_unused"] == (
        "the run's thread differs from the one started ahead in keep")
    assert isinstance(turn.details["thread_start_ms"], float)
    assert first.details["final_chars"] == len("Reviewed one.")
    assert _left_of(site.codex_home, str(kept.details["thread_id"])) == []

    assert plain.details["thread_kept"] is False
    [turn_two] = _of(site, "turn", "started", str(finished[-1].run_id))
    assert (turn_two.details["thread"], turn_two.details["thread_id"]) == (
        "ahead", plain.details["thread_id"])


async def test_a_run_after_agents_md_changed_starts_its_own_thread_with_the_new_rules(
    server: ModelServer, slack: FakeSlack, tmp_path: Path
) -> None:
    """AGENTS.md rewritten after the spare made its thread: the mention's run takes the spare
    but not that thread (codex read the old AGENTS.md into it), `turn started` says why
    (`thread: started`, AGENTS.md changed), and the model is asked under the new rules."""
    server.script(text("Understood."))
    site = _chat_site(tmp_path, server, slack)
    agents_md = site.workspace / "AGENTS.md"
    agents_md.write_text("Old rule: push wherever you like.\n")
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [spare] = await _spares_started(site, 1)
        agents_md.write_text("New rule: never push to main.\n")
        ts = slack.send_mention(OPERATOR, CHANNEL, "ship the fix")
        await until(lambda: any(p.thread_ts == ts for p in slack.posts), "the answer")
        [first] = await until_count(site, "run", "finished", "ok", 1)
        assert await serving.stop() == 0

    [started] = _of(site, "run", "started", str(first.run_id))
    assert (started.details["spare"], started.details["pgid"]) == ("taken", spare.details["pgid"])
    [turn] = _of(site, "turn", "started", str(first.run_id))
    assert turn.details["thread"] == "started"
    assert turn.details["thread_id"] != spare.details["thread_id"]
    assert turn.details["thread_ahead_unused"] == (
        f"{agents_md} changed after the thread was started ahead")
    asked = str(server.requests[0]["input"])
    assert "New rule: never push to main." in asked
    assert "Old rule" not in asked


async def test_the_stop_ends_the_spare_and_its_unused_thread_leaves_nothing(
    server: ModelServer, slack: FakeSlack, tmp_path: Path
) -> None:
    """SIGTERM with a spare waiting on the kept thread it made: `spare ended ok` (bothy is
    stopping), its group empty (psutil), its row gone, and CODEX_HOME holds nothing named for
    that thread — no rollout, no shell snapshot, no lock — nor any session at all."""
    site = _chat_site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [spare] = await _spares_started(site, 1)
        thread_id = str(spare.details["thread_id"])
        await until(lambda: bool(_left_of(site.codex_home, thread_id)),
                    "codex's files for the thread it started")
        assert await serving.stop() == 0

    [ended] = _of(site, "spare", "ended")
    assert (ended.outcome, ended.details["pgid"], ended.details["why"]) == (
        "ok", spare.details["pgid"], "bothy is stopping")
    assert live_members(int(spare.details["pgid"])) == []  # type: ignore[call-overload]
    assert _left_of(site.codex_home, thread_id) == []
    assert not (site.codex_home / "sessions").exists()
    assert site.audit_lines()[-1].endswith(" serve stopped ok - -")
