"""What a run costs is what it used, not what its Codex thread has used.

Codex reports a thread's running totals (``thread/tokenUsage/updated``); a chat conversation
continued in its kept thread starts from the earlier runs' totals. The run's cost, its token
limit and its reservation count only the tokens of this run's own turns.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from bothy.engine.auditrecord import AuditRecord
from bothy.engine.prices import TokenUsage
from bothy.engine.tokenmeter import TokenMeter
from tests.fakes.model_server import ModelServer, Usage, text, tool_call
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_serve import free_port, start_serve

OPERATOR = "UOPERATOR"
CHANNEL = "CWORK"


def _finished(site: Site) -> list[AuditRecord]:
    return audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished"))


def _settled(site: Site, run_id: str) -> dict[str, Any]:
    [record] = audit_records(site, lambda r: (r.kind, r.event, r.run_id)
                             == ("budget", "settled", run_id))
    return dict(record.details)


@pytest.mark.codex
async def test_a_continued_conversation_pays_and_counts_only_its_own_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Slack reply continuing the kept Codex thread (two responses: a tool call, then the
    answer) finishes at its own cost and tokens, not the thread's; the token limit and the
    reservation that the two runs together pass but the second alone does not stop nothing;
    `bothy status` spend is the sum of the runs' costs."""
    slack_environment(monkeypatch)
    async with ModelServer() as server, FakeSlack(ack_timeout_s=5.0) as slack:
        # Prices (tests/fakes/site.py): 100 usd/Mtok input, 10 cached, 400 output.
        # First run: 800 uncached + 200 cached in, 50 out = 0.080 + 0.002 + 0.020 = 0.102 usd.
        # Second run: 400 (100 cached) + 500 (300 cached) in, 10 + 20 out
        #   = 500 × 100 + 400 × 10 + 30 × 400 micro-usd = 0.066 usd, 930 tokens.
        server.script(
            text("First answer.", usage=Usage(input_tokens=1000, cached_tokens=200,
                                              output_tokens=50)),
            tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."},
                      usage=Usage(input_tokens=400, cached_tokens=100, output_tokens=10)),
            text("Added it.", usage=Usage(input_tokens=500, cached_tokens=300,
                                          output_tokens=20)),
        )
        # Together the runs use 1,980 tokens and 0.168 usd: over both limits; each alone is not.
        site = Site(tmp_path, server.base_url, listen={"tailnet_port": free_port()},
                    budget={"per_run_usd": "0.15"},
                    limits={"max_tokens": 1500},
                    chat={"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR],
                                    "profile": "chat"}},
                    profiles={"chat": {"tools": ["bothy_checklist"],
                                       "approvals": {"bothy_checklist": "proceed"}}})
        async with Shell(site) as shell:
            serving = await start_serve(shell)
            ts = slack.send_mention(OPERATOR, CHANNEL, "what should we watch?")
            await until(lambda: len(_finished(site)) == 1, "the first run finished")
            slack.send_message(OPERATOR, CHANNEL, "add the disk to the checklist", thread_ts=ts)
            await until(lambda: len(_finished(site)) == 2, "the continued run finished")
            status = await site.bothy("status")
            assert await serving.stop() == 0

    first, second = _finished(site)
    threads = [r.details["thread_id"] for r in audit_records(
        site, lambda r: (r.kind, r.event) == ("turn", "started"))]
    assert len(threads) == 2 and threads[0] == threads[1]  # one Codex thread, continued
    assert (first.details["outcome"], first.details["cost_usd"],
            first.details["input_tokens"], first.details["output_tokens"]) == (
        "completed", "0.102000", 1000, 50)
    assert (second.details["outcome"], second.details["reason"], second.details["cost_usd"],
            second.details["input_tokens"], second.details["output_tokens"]) == (
        "completed", None, "0.066000", 900, 30)
    assert [(t["input_tokens"], t["output_tokens"]) for t in second.details["turns"]] == [
        (900, 30)]
    for run, cost in ((first, "0.102000"), (second, "0.066000")):
        settled = _settled(site, str(run.run_id))
        assert (settled["cost_usd"], settled["reserved_usd"]) == (cost, "0.150000")
    assert status.code == 0, status.stderr
    assert re.search(r"^spend today: 0\.1680 usd used, 0\.0000 usd reserved", status.stdout,
                     re.MULTILINE), status.stdout


def _usage(input_tokens: int, cached: int, output_tokens: int) -> TokenUsage:
    return TokenUsage(input_tokens=input_tokens, cached_input_tokens=cached,
                      output_tokens=output_tokens)


def test_a_repeated_report_is_counted_once_and_a_resumed_total_is_not_the_runs() -> None:
    """Reports as Codex sends them: a resumed thread's totals repeated before the output
    begins count nothing; several responses in a turn count once each; a report repeated
    with unchanged totals adds nothing; a verification turn starts where the last ended."""
    meter = TokenMeter()
    meter.report("t1", _usage(1000, 200, 50), _usage(1000, 200, 50), answering=False)
    assert meter.used == TokenUsage()
    meter.report("t1", _usage(1400, 300, 60), _usage(400, 100, 10), answering=True)
    meter.report("t1", _usage(1900, 600, 80), _usage(500, 300, 20), answering=True)
    meter.report("t1", _usage(1900, 600, 80), _usage(500, 300, 20), answering=True)
    meter.report("t2", _usage(2000, 600, 81), _usage(100, 0, 1), answering=True)
    assert meter.turns == {"t1": _usage(900, 400, 30), "t2": _usage(100, 0, 1)}
    assert meter.used == _usage(1000, 400, 31)


def test_a_resumed_thread_reported_only_once_its_output_began_counts_from_total_less_last(
) -> None:
    """Without the snapshot first, the run's first report says where the thread stood
    before it: its totals less the response it reports."""
    meter = TokenMeter()
    meter.report("t1", _usage(1400, 300, 60), _usage(400, 100, 10), answering=True)
    assert meter.used == _usage(400, 100, 10)
