"""`bothy trace RUN`: a run's whole story from the register, as a tree, as OTLP/JSON, and sent
to an OTLP/HTTP receiver — proven on a real run of the pinned codex against the scripted model
(a command Codex runs without asking, a question held and answered, a late answer)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bothy.engine.audit import AuditLog
from bothy.engine.rpc import RECORD_ENV
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.otlp import OtlpReceiver, problems
from tests.fakes.shell import Shell
from tests.fakes.site import Site


async def _story_run(tmp_path: Path) -> tuple[Site, str]:
    """A run with a command Codex runs without asking, a question held and answered with
    `bothy answer`, and a late answer after the run had finished."""
    async with ModelServer() as server:
        site = Site(tmp_path, server.base_url, profiles={"selfcare": {
            "tools": ["bothy_checklist", "shell"],
            "approvals": {"bothy_checklist": "confirm"}}})
        server.script(tool_call("exec_command", {"cmd": "echo traced"}),
                      tool_call("bothy_checklist", {"action": "add", "item": "x"}),
                      text("added x"))
        async with Shell(site) as shell:
            run = await shell.start("run", "add x", "--profile", "selfcare", "--subject", "ops")
            run_id = await run.admitted()
            await run.line(r"^bothy: question: May I use bothy_checklist\?")
            assert (await shell.bothy("answer", str(run_id), "yes")).code == 0
            assert (await run.finish()).code == 0
            late = await shell.bothy("answer", str(run_id), "yes again")
            assert late.code == 1, late.stderr
    return site, str(run_id)


def _sent(method: str) -> list[dict[str, Any]]:
    """Each ``method`` request Bothy sent codex, from the frames the harness records."""
    frames = [json.loads(line) for line in
              Path(os.environ[RECORD_ENV]).read_text().splitlines()]
    return [frame["message"] for frame in frames
            if frame["direction"] == "sent" and frame["method"] == method]


def _spans(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [span for rs in document["resourceSpans"] for ss in rs["scopeSpans"]
            for span in ss["spans"]]


def _attr(span: dict[str, Any], key: str) -> Any:
    [value] = [a["value"] for a in span["attributes"] if a["key"] == key]
    return next(iter(value.values()))


@pytest.mark.codex
async def test_trace_of_a_real_run_shows_each_step_as_a_tree_as_otlp_and_sent(
    tmp_path: Path,
) -> None:
    """The tree shows the wake, the gate, the worker, the turn, the command Codex ran without
    asking, the question and its answer, the tool's verdict, the settlement and the late answer;
    --json is valid OTLP/JSON with ids derived from the run; --otlp delivers it to a receiver
    that checks the same rules."""
    site, run_id = await _story_run(tmp_path)

    tree = await site.bothy("trace", run_id)
    assert tree.code == 0, tree.stderr
    lines = tree.stdout.splitlines()
    duration = r"\d+ ms|\d+\.\d s"
    assert re.fullmatch(rf"run {run_id} ok ({duration})  completed cost 0\.\d+ usd,"
                        r" 360 in, 24 out tokens", lines[0])  # three responses of 120 in, 8 out
    expected = [
        r"├─ wake cli ok 0 ms  wake_\S+ from cli",
        r"├─ gate budget admitted ok 0 ms  reserved 0\.500000 usd of 25\.000000",
        # codex exits on the end of its input, which the stop closes just before its TERM:
        # under load it is sometimes gone before the TERM (both are a clean stop).
        rf"├─ worker ok ({duration})  (terminated|already_gone) in .*",
        rf"│  └─ turn 1 ok ({duration})  model fake-model, 360 in, 24 out tokens",
        rf"│     ├─ command ran ok ({duration})  /bin/bash -lc 'echo traced' \(exit 0\)",
        rf"│     ├─ question approval bothy_checklist ok ({duration})  May I use bothy_checklist\?"
        r" .* → answered by \S+@shell",
        r"│     └─ tool bothy_checklist allowed ok 0 ms  approved by \S+@shell",
        r"├─ settlement ok 0 ms  cost 0\.\d+ usd, released 0\.\d+",
        r"└─ late answer ok 0 ms  from \S+@shell: nothing was waiting: the run had moved on",
    ]
    assert len(lines) == 1 + len(expected), tree.stdout
    for pattern, line in zip(expected, lines[1:], strict=True):
        assert re.fullmatch(pattern, line), (pattern, line)

    as_json = await site.bothy("trace", run_id, "--json")
    assert as_json.code == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert problems(document) == []
    spans = _spans(document)
    assert len({span["traceId"] for span in spans}) == 1
    again = json.loads((await site.bothy("trace", run_id, "--json")).stdout)
    assert again == document  # ids and times derived from the register alone
    [root] = [span for span in spans if "parentSpanId" not in span]
    assert (root["kind"], root["status"]["code"]) == (2, 1)
    assert _attr(root, "gen_ai.operation.name") == "invoke_agent"
    assert _attr(root, "gen_ai.request.model") == "fake-model"
    assert _attr(root, "bothy.run.id") == run_id
    assert int(_attr(root, "bothy.cost_micros")) > 0
    [turn] = [span for span in spans if span["name"] == "turn 1"]
    assert (turn["kind"], _attr(turn, "gen_ai.operation.name")) == (3, "chat")
    assert _attr(turn, "gen_ai.conversation.id")  # the Codex thread
    assert (_attr(turn, "gen_ai.usage.input_tokens"), _attr(turn, "gen_ai.usage.output_tokens")
            ) == ("360", "24")  # what Codex reported in thread/tokenUsage/updated
    assert _attr(root, "gen_ai.usage.input_tokens") == "360"
    # Codex was handed the run's trace context, naming the root span: its spans join the trace.
    [turn_start] = _sent("turn/start")
    assert turn_start["trace"] == {
        "traceparent": f"00-{root['traceId']}-{root['spanId']}-01"}
    [gate] = [span for span in spans if span["name"] == "gate budget admitted"]
    assert _attr(gate, "bothy.reserved_micros") == "500000"
    [question] = [span for span in spans if span["name"].startswith("question")]
    assert int(question["endTimeUnixNano"]) > int(question["startTimeUnixNano"])
    assert question["parentSpanId"] == turn["spanId"]

    async with OtlpReceiver() as receiver:
        sent = await site.bothy("trace", run_id, "--otlp", receiver.url)
    assert sent.code == 0, sent.stderr
    assert sent.stderr == (f"bothy: trace of {run_id} exported to {receiver.url}:"
                           f" {len(spans)} spans accepted\n")
    assert receiver.received == [document] and receiver.refused == []


def _register(tmp_path: Path) -> tuple[Site, str]:
    """A site whose register holds one short run, written by the register's own writer."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    run_id = "run_20261201T100000Z_0123abcd"
    log = AuditLog(site.home / "state" / "audit.jsonl")
    log.append("wake", "received", "ok", subject="ops", run_id=None,
               details={"wake_id": "wake_20261201T100000Z_0123abcd", "source": "cli"})
    log.append("run", "admitted", "ok", subject="ops", run_id=run_id,
               details={"reserved_usd": "0.500000", "ceiling_usd": "25.000000"})
    log.append("run", "finished", "failed", subject="ops", run_id=run_id,
               details={"outcome": "failed", "reason": "the app-server died", "cost_usd": "0"})
    return site, run_id


async def test_trace_exit_codes_and_a_receiver_that_refuses(tmp_path: Path) -> None:
    """A non-2xx answer or a partial success rejecting spans fails with the collector's message;
    an unknown run or a URL that is not http is a usage error; a failed run's root is ERROR."""
    site, run_id = _register(tmp_path)
    assert (site.home / "state" / "audit.jsonl").exists()

    document = json.loads((await site.bothy("trace", run_id, "--json")).stdout)
    assert problems(document) == []
    [root] = [span for span in _spans(document) if "parentSpanId" not in span]
    assert root["status"] == {"code": 2, "message": "failed cost 0 usd: the app-server died"}

    async with OtlpReceiver(answer=(503, {"code": 14, "message": "queue full"})) as receiver:
        down = await site.bothy("trace", run_id, "--otlp", receiver.url)
    assert down.code == 1
    assert down.stderr == (f"bothy: trace of {run_id} not exported: {receiver.url} answered"
                           " 503: queue full\n")
    rejecting = (200, {"partialSuccess": {"rejectedSpans": "2", "errorMessage": "too old"}})
    async with OtlpReceiver(answer=rejecting) as receiver:
        partial = await site.bothy("trace", run_id, "--otlp", receiver.url)
    assert partial.code == 1
    assert partial.stderr == (f"bothy: trace of {run_id} not exported: {receiver.url}"
                              " rejected 2 span(s): too old\n")
    async with OtlpReceiver() as receiver:
        url = receiver.url
    gone = await site.bothy("trace", run_id, "--otlp", url)
    assert gone.code == 1 and f"not exported: cannot reach {url}: " in gone.stderr

    unknown = await site.bothy("trace", "run_nope")
    assert unknown.code == 64
    assert "no record of run 'run_nope' in the register" in unknown.stderr
    bad_url = await site.bothy("trace", run_id, "--otlp", "collector:4318")
    assert bad_url.code == 64 and "is not an http(s) URL" in bad_url.stderr
    assert "Traceback" not in unknown.stderr + bad_url.stderr + gone.stderr


async def test_the_receiver_refuses_what_breaks_the_otlp_json_rules(tmp_path: Path) -> None:
    """The fake receiver's checks can fail: each broken copy of a good request is named."""
    site, run_id = _register(tmp_path)
    good = json.loads((await site.bothy("trace", run_id, "--json")).stdout)

    def broken(change: Any) -> dict[str, Any]:
        copied = copy.deepcopy(good)
        change(_spans(copied))
        return copied

    def base64_id(spans: list[dict[str, Any]]) -> None:
        spans[0]["traceId"] = "W47/95gDgQPSabYzgT/GDA=="

    def snake(spans: list[dict[str, Any]]) -> None:
        spans[0]["start_time_unix_nano"] = spans[0].pop("startTimeUnixNano")

    def number_time(spans: list[dict[str, Any]]) -> None:
        spans[1]["endTimeUnixNano"] = int(spans[1]["endTimeUnixNano"])

    def orphan(spans: list[dict[str, Any]]) -> None:
        spans[1]["parentSpanId"] = "00000000000000aa"

    def enum_name(spans: list[dict[str, Any]]) -> None:
        spans[0]["kind"] = "SPAN_KIND_SERVER"

    for change, words in ((base64_id, "traceId"), (snake, "lowerCamelCase"),
                          (number_time, "decimal string"), (orphan, "no span of this request"),
                          (enum_name, "not an integer 0-5")):
        found = problems(broken(change))
        assert any(words in problem for problem in found), (change.__name__, found)
    async with OtlpReceiver() as receiver:
        bad = json.dumps(broken(orphan)).encode()
        request = urllib.request.Request(receiver.url, data=bad,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
    refused.value.close()
    assert refused.value.code == 400
    assert receiver.received == [] and "no span of this request" in receiver.refused[0]
