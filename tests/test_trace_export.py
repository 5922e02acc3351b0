"""`bothy serve` sends every finished run's trace to an OTLP/HTTP receiver (config `otel`,
issue 14): queued durably while the receiver is down (across a restart), then delivered once;
what people and the model wrote left out unless `otel.include_content`; given up after
`otel.max_attempts` with a `trace abandoned` record; a bad `otel` section refused (exit 78).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bothy.engine.audit import AuditLog
from bothy.trace import trace_id
from tests.fakes import github
from tests.fakes.codex import codex_binary
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.otlp import OtlpReceiver, problems
from tests.fakes.shell import Shell, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_answer_crash import DEAF_TO_TERM
from tests.test_chat_serve import CHANNEL, OPERATOR
from tests.test_serve import (
    SECRET,
    free_port,
    queued,
    records,
    serve_site,
    start_serve,
    until_count,
)

MARKER = "bothy-marker-7f3a"  # in the prompt, the command, the answer: never exported by default


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", SECRET)


def _otel(port: int, **extra: Any) -> dict[str, Any]:
    return {"endpoint": f"http://127.0.0.1:{port}/v1/traces", "retry_first_s": 0.2,
            "retry_max_s": 0.4, "timeout_s": 2, **extra}


def _queued(site: Site) -> dict[str, int]:
    """Run id → failed attempts, from the exporter's queue file (empty when there is none)."""
    path = site.home / "state" / "otel-queue.json"
    if not path.exists():
        return {}
    return {run["run_id"]: run["attempts"] for run in json.loads(path.read_text())["runs"]}


def _spans(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [span for rs in document["resourceSpans"] for ss in rs["scopeSpans"]
            for span in ss["spans"]]


async def _review_run(site: Site, server: ModelServer, shell: Shell) -> tuple[Any, str]:
    """`bothy serve` started, a pull request delivered and its run finished: (serve, run id).
    Codex runs a command without asking, then answers; the title, the command and the answer
    all carry MARKER."""
    server.script(tool_call("exec_command", {"cmd": f"echo {MARKER}"}), text(f"Done {MARKER}"))
    serving = await start_serve(shell)
    await queued(serving, github.pull_request_opened(42, title=f"Add {MARKER}"))
    [finished] = await until_count(site, "run", "finished", "ok", 1)
    return serving, str(finished.run_id)


@pytest.mark.codex
async def test_a_trace_waits_for_a_receiver_that_is_down_across_a_restart_then_arrives_once(
    tmp_path: Path,
) -> None:
    """The receiver is down: the run completes all the same, its trace is retried and kept in
    the queue file across a stop; once the receiver is up, the next `bothy serve` delivers it,
    once, valid OTLP/JSON, with nothing of the prompt, the command or the answer in it."""
    port = free_port()
    async with ModelServer() as server:
        site = serve_site(tmp_path, server, otel=_otel(port))
        async with Shell(site) as shell:
            serving, run_id = await _review_run(site, server, shell)
            await until(lambda: _queued(site).get(run_id, 0) >= 2, "two failed attempts")
            assert await serving.stop() == 0
            assert _queued(site).get(run_id, 0) >= 2  # still queued after the stop
            status = await shell.bothy("status")
            assert "traces waiting for the otel receiver: 1" in status.stdout, status.stdout
            assert re.search(rf"^  {run_id}  \d+ failed attempt\(s\), last: cannot reach"
                             rf" http://127\.0\.0\.1:{port}/v1/traces", status.stdout, re.M)

            async with OtlpReceiver(port=port) as receiver:
                serving = await start_serve(shell)
                await until(lambda: _queued(site) == {}, "the queued trace delivered")
                await until(lambda: len(records(site, "serve", "ready")) == 2, "serve ready")
                assert await serving.stop() == 0

    assert [records(site, "run", "finished")[0].outcome] == ["ok"]
    [document] = receiver.received  # once
    assert problems(document) == []
    spans = _spans(document)
    assert {span["traceId"] for span in spans} == {trace_id(run_id)}
    assert any(span["name"] == "command ran" for span in spans)
    assert MARKER not in json.dumps(document)
    assert records(site, "trace", "abandoned") == []
    assert "traces waiting for the otel receiver: 0" in (await site.bothy("status")).stdout


@pytest.mark.codex
async def test_content_is_exported_only_when_include_content_is_set(tmp_path: Path) -> None:
    """With `otel.include_content` the command Codex ran is in its span's summary (and the
    prompt and answer still are not: no span holds them)."""
    async with OtlpReceiver() as receiver, ModelServer() as server:
        site = serve_site(tmp_path, server, otel=_otel(receiver.port, include_content=True))
        async with Shell(site) as shell:
            serving, run_id = await _review_run(site, server, shell)
            await until(lambda: _queued(site) == {} and len(receiver.received) == 1,
                        "the trace delivered and taken off the queue")
            assert await serving.stop() == 0
    [document] = receiver.received
    assert {span["traceId"] for span in _spans(document)} == {trace_id(run_id)}
    [ran] = [span for span in _spans(document) if span["name"] == "command ran"]
    summary = {a["key"]: a["value"] for a in ran["attributes"]}["bothy.summary"]["stringValue"]
    assert f"echo {MARKER}" in summary
    sent = json.dumps(document)
    assert f"Add {MARKER}" not in sent and f"Done {MARKER}" not in sent


async def test_a_trace_the_receiver_keeps_refusing_is_given_up_and_recorded(
    tmp_path: Path,
) -> None:
    """A receiver answering 503 every time: after `otel.max_attempts` the run's trace is given
    up with `trace abandoned failed` naming the attempts and the receiver's message; serve
    stays up and stops cleanly."""
    answer = (503, {"code": 14, "message": "collector queue full"})
    async with OtlpReceiver(answer=answer) as receiver:
        site = Site(tmp_path, "http://127.0.0.1:9/v1", listen={"tailnet_port": free_port()},
                    otel=_otel(receiver.port, max_attempts=3, retry_first_s=0.05))
        run_id = "run_20260101T000000Z_0000abcd"
        async with Shell(site) as shell:
            serving = await start_serve(shell)
            queue = site.home / "state" / "otel-queue.json"
            await until(queue.exists, "the exporter following the register")
            log = AuditLog(site.audit_path)  # a run of another process on the site (bothy run)
            log.append("run", "admitted", "ok", subject="ops", run_id=run_id)
            log.append("run", "finished", "ok", subject="ops", run_id=run_id,
                       details={"outcome": "completed"})
            await until(lambda: records(site, "trace", "abandoned") != [],
                        f"trace abandoned; register: {site.audit_lines()}")
            assert serving.command.running
            assert await serving.stop() == 0
    [abandoned] = records(site, "trace", "abandoned")
    assert (abandoned.outcome, abandoned.run_id) == ("failed", run_id)
    assert abandoned.details["attempts"] == 3
    assert "answered 503: collector queue full" in abandoned.details["problem"]
    assert abandoned.details["endpoint"] == receiver.url
    assert len(receiver.received) == 3 and _queued(site) == {}


@pytest.mark.parametrize(("otel", "named"), [
    ({"endpoint": "ftp://collector/v1/traces"}, "otel.endpoint"),
    ({"endpoint": "http://collector:4318/v1/traces", "retry_first_s": 0}, "otel.retry_first_s"),
    ({"endpoint": "http://collector:4318/v1/traces", "headers_env": {"Bad Header": "X"}},
     "otel.headers_env"),
    ({"endpoint": "http://collector:4318/v1/traces", "headers_env": {"Authorization":
                                                                     "BOTHY_TEST_UNSET_VAR"}},
     "otel.headers_env"),
    ({"endpoint": "http://collector:4318/v1/traces", "sample": 1}, "otel.sample"),
])
async def test_a_bad_otel_section_stops_serve_with_78_naming_the_key(
    tmp_path: Path, otel: dict[str, Any], named: str,
) -> None:
    """Each bad `otel` value is refused before anything starts, naming the key."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1", listen={"tailnet_port": free_port()},
                otel=otel)
    done = await site.bothy("serve")
    assert done.code == 78, (done.stdout, done.stderr)
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.codex
async def test_a_chat_runs_trace_waits_for_its_worker_to_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chat run answers before its worker stops (`run finished`, then `worker stopped`): with
    a worker slow to stop (a member deaf to SIGTERM, a 2 s grace), the trace goes once the
    worker has stopped, so its worker span ends there and says how it ended."""
    slack_environment(monkeypatch)
    port = free_port()
    async with ModelServer() as server, FakeSlack(ack_timeout_s=5.0) as slack, \
            OtlpReceiver(port=port) as receiver:
        server.script(text("Nothing changed."))
        site = Site(tmp_path, server.base_url, listen={"tailnet_port": free_port()},
                    chat={"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR]}},
                    limits={"stop_grace_s": 2.0}, otel=_otel(port),
                    codex={"command": ["/bin/sh", "-c", DEAF_TO_TERM, str(codex_binary()),
                                       "app-server"]})
        async with Shell(site) as shell:
            serving = await start_serve(shell)
            slack.send_mention(OPERATOR, CHANNEL, "what changed this week?")
            await until(lambda: bool(receiver.received), "the trace received")
            assert await serving.stop() == 0

    [document] = receiver.received
    assert problems(document) == []
    [stopped] = records(site, "worker", "stopped")
    [worker] = [span for span in _spans(document) if span["name"] == "worker"]
    summary = [a["value"]["stringValue"] for a in worker["attributes"]
               if a["key"] == "bothy.summary"]
    assert summary == [stopped.details["how"]]
    ended = stopped.ts  # the worker span ends at `worker stopped`, not at `run finished`
    assert int(worker["endTimeUnixNano"]) == (int(ended.timestamp()) * 10**9
                                              + ended.microsecond * 1000)
