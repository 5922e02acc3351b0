"""Bothy as the MCP client of a profile's servers: tools listed, calls forwarded, faults survived.

Real MCP over stdio throughout: ``tests/fakes/mcp_server.py`` is built with the official SDK's
server API and run as a subprocess in each of its fault modes. Every test is bounded by
``asyncio.timeout``; the ``site`` fixture stops every host and ends every process group that
``on_group`` recorded, whatever the test's fate.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bothy.config import McpServerConfig
from bothy.engine.mcp import McpHost, McpProblem, ToolResult
from bothy.engine.procgroup import GroupRecord, end_orphan_group, live_members

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="checks results in /proc")

_BOUND_S = 20.0
_FAKE = Path(__file__).resolve().parent / "fakes" / "mcp_server.py"
_SECRET = "xoxb-not-for-mcp-servers"
_CHATTY = "print('hello', flush=True); import signal; signal.pause()"


def _fake(mode: str = "normal", **limits: float) -> McpServerConfig:
    """The fake server in ``mode``, with the two variables it reads passed through."""
    return McpServerConfig(
        command=sys.executable,
        args=[str(_FAKE), mode],
        env=["FAKE_MCP_OUTBOX", "FAKE_MCP_SLOW_S"],
        **limits,
    )


def _python(code: str, **limits: float) -> McpServerConfig:
    """A 'server' that is just a Python one-liner, for servers that are not MCP at all."""
    return McpServerConfig(command=sys.executable, args=["-c", code], **limits)


class _Site:
    """Hosts under test, the environment they are given, and every group they recorded."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.outbox = tmp_path / "outbox.jsonl"
        self.environ = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "LANG": "C.UTF-8",
            "FAKE_MCP_OUTBOX": str(self.outbox),
            "FAKE_MCP_SLOW_S": "30",
            "SLACK_BOT_TOKEN": _SECRET,
        }
        self.groups: dict[str, GroupRecord] = {}
        # For each server, the servers recorded before it whose groups were still live when
        # its own group was recorded: lifetimes that overlap, seen from real processes.
        self.alongside: dict[str, set[str]] = {}
        self.hosts: list[McpHost] = []
        self.recorded: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(
            asyncio.Event
        )

    def host(self, **servers: McpServerConfig) -> McpHost:
        host = McpHost(servers, cwd=self.tmp_path, environ=self.environ, on_group=self._record)
        self.hosts.append(host)
        return host

    async def _record(self, server: str, record: GroupRecord) -> None:
        recorded = list(self.groups.items())
        self.groups[server] = record
        self.alongside[server] = {
            earlier for earlier, seen in recorded
            if await asyncio.to_thread(live_members, seen.pgid)
        }
        self.recorded[server].set()

    async def live(self, server: str) -> list[int]:
        """The live members of the group recorded for ``server``."""
        return await asyncio.to_thread(live_members, self.groups[server].pgid)


@pytest.fixture
async def site(tmp_path: Path) -> AsyncIterator[_Site]:
    """A site whose hosts are stopped and whose recorded groups are ended after the test."""
    made = _Site(tmp_path)
    yield made
    async with asyncio.timeout(_BOUND_S):
        for host in made.hosts:
            await host.stop()
        for record in made.groups.values():
            await end_orphan_group(record, grace_s=0.5, kill_wait_s=1.0)


async def _started(site: _Site, **servers: McpServerConfig) -> McpHost:
    host = site.host(**servers)
    assert await host.start() == []
    return host


async def test_tools_are_listed_with_read_only_from_annotations(site: _Site) -> None:
    """Each tool is listed under its server, read-only only where the server says so."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        tools = {tool.qualified: tool for tool in host.tools()}
    assert {"mail.search", "mail.send_message"} <= set(tools)
    assert tools["mail.search"].read_only is True
    assert tools["mail.send_message"].read_only is False  # no annotation: fails closed
    assert tools["mail.search"].input_schema["required"] == ["query"]
    assert tools["mail.search"].description == "Search the mailbox."


async def test_search_returns_the_servers_text(site: _Site) -> None:
    """A successful call returns the text the server answered."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        result = await host.call("mail", "search", {"query": "audit chain"})
    assert result.success
    assert result.text.splitlines()[0] == "1. message about 'audit chain' from sender1@example.test"
    assert len(result.text.splitlines()) == 3


async def test_send_message_really_sends(site: _Site) -> None:
    """The arguments reach the server, which acts on them."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        result = await host.call("mail", "send_message", {"to": "ops@example.test", "body": "hi"})
    assert result == ToolResult(True, "sent to ops@example.test")
    lines = site.outbox.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"to": "ops@example.test", "body": "hi"}]


async def test_non_text_content_is_described_briefly(site: _Site) -> None:
    """Text items are concatenated; an image becomes a one-line description."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        result = await host.call("mail", "snapshot", {})
    assert result.success
    assert result.text.splitlines() == ["the view", "[image: image/png, 68 bytes, not shown]"]


async def test_an_error_result_is_a_failed_tool_result(site: _Site) -> None:
    """A tool that reports an error fails, and the model reads the server's reason."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        result = await host.call("mail", "fail", {"reason": "mailbox is locked"})
    assert not result.success
    assert result.text.startswith("MCP tool 'mail.fail' reported an error: ")
    assert "mailbox is locked" in result.text


async def test_malformed_arguments_are_an_error_for_the_model(site: _Site) -> None:
    """Arguments that do not fit the tool's schema fail the call; the server stays up."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        bad = await host.call("mail", "search", {"q": 42})
        not_an_object = await host.call("mail", "search", ["x"])  # type: ignore[arg-type]
        good = await host.call("mail", "search", {"query": "still up"})
    assert not bad.success
    assert bad.text.startswith("MCP tool 'mail.search' reported an error: ")
    assert "query" in bad.text
    assert not_an_object == ToolResult(
        False, "Arguments for MCP tool 'mail.search' must be a JSON object, not list."
    )
    assert good.success


async def test_an_unknown_server_or_tool_is_refused(site: _Site) -> None:
    """A call to a server or tool the host does not have fails with a message naming it."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        no_server = await host.call("gmail", "search", {"query": "x"})
        no_tool = await host.call("mail", "delete_everything", {})
    assert no_server == ToolResult(False, "No MCP server named 'gmail' is available in this run.")
    assert no_tool == ToolResult(False, "MCP server 'mail' has no tool 'delete_everything'.")


async def test_a_server_that_hangs_on_start_is_a_problem_and_its_group_is_ended(
    site: _Site,
) -> None:
    """No answer to initialize within start_timeout_s: a problem, and the whole group is gone."""
    async with asyncio.timeout(_BOUND_S):
        host = site.host(mail=_fake("hang", start_timeout_s=1.0))
        problems = await host.start()
        result = await host.call("mail", "search", {"query": "x"})
        assert await site.live("mail") == []  # the leader and the child it forked
    assert problems == [
        McpProblem("mail", "MCP server 'mail' did not answer 'initialize' within 1 s")
    ]
    assert host.tools() == []
    assert result == ToolResult(
        False,
        "MCP tool 'mail.search' is unavailable:"
        " server 'mail' did not answer 'initialize' within 1 s.",
    )


async def test_servers_start_concurrently(site: _Site) -> None:
    """Servers start side by side: a second hung server is started while the first still
    waits for its answer (not after its timeout), and the good one still starts."""
    async with asyncio.timeout(_BOUND_S):
        host = site.host(
            first=_fake("hang", start_timeout_s=4.0),
            second=_fake("hang", start_timeout_s=4.0),
            mail=_fake(),
        )
        problems = await host.start()
    assert [problem.server for problem in problems] == ["first", "second"]
    # Started one after the other, the first hung server's group would be ended (at its
    # timeout) before the second's was recorded.
    earlier, later = (server for server in site.groups if server in ("first", "second"))
    assert earlier in site.alongside[later]
    assert {tool.server for tool in host.tools()} == {"mail"}


async def test_a_crash_mid_call_fails_the_call_and_every_later_call_fast(site: _Site) -> None:
    """The server dies mid-call: that call and the next fail at once, and the group is ended."""
    async with asyncio.timeout(_BOUND_S):  # shorter than call_timeout_s: no call waits for it
        host = await _started(site, mail=_fake("crash", call_timeout_s=60.0))
        crashed = await host.call("mail", "send_message", {"to": "a@example.test", "body": "b"})
        later = await host.call("mail", "search", {"query": "x"})
        await host.stop()
        assert await site.live("mail") == []
    reason = "server 'mail' stopped unexpectedly (exit code 3)"
    assert crashed == ToolResult(False, f"MCP tool 'mail.send_message' is unavailable: {reason}.")
    assert later == ToolResult(False, f"MCP tool 'mail.search' is unavailable: {reason}.")
    assert host.problems() == [
        McpProblem("mail", "MCP server 'mail' stopped unexpectedly (exit code 3)")
    ]
    assert host.tools() == []
    assert not site.outbox.exists()


async def test_garbage_on_the_wire_fails_the_call_without_a_hang(site: _Site) -> None:
    """A non-JSON line from the server fails the call in flight at once, not at the timeout."""
    async with asyncio.timeout(_BOUND_S):  # shorter than call_timeout_s: the call cannot wait
        host = await _started(site, mail=_fake("garbage", call_timeout_s=60.0))
        result = await host.call("mail", "search", {"query": "x"})
        await host.stop()
        assert await site.live("mail") == []
    reason = "server 'mail' wrote a line that is not JSON-RPC: 'this is not json-rpc'"
    assert result == ToolResult(False, f"MCP tool 'mail.search' is unavailable: {reason}.")
    assert [problem.message for problem in host.problems()] == [
        "MCP server 'mail' wrote a line that is not JSON-RPC: 'this is not json-rpc'"
    ]


async def test_garbage_during_start_is_a_problem_without_waiting_for_the_timeout(
    site: _Site,
) -> None:
    """A 'server' that prints text instead of speaking MCP is a problem as soon as it does."""
    async with asyncio.timeout(_BOUND_S):  # shorter than start_timeout_s: start cannot wait
        host = site.host(chatty=_python(_CHATTY, start_timeout_s=60.0))
        problems = await host.start()
        assert await site.live("chatty") == []
    assert problems == [
        McpProblem("chatty", "MCP server 'chatty' wrote a line that is not JSON-RPC: 'hello'")
    ]


async def test_a_slow_call_times_out_and_the_server_stays_up(site: _Site) -> None:
    """A call past call_timeout_s fails saying so; the server still answers the next call."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake("slow", call_timeout_s=0.5))
        slow = await host.call("mail", "search", {"query": "x"})
        quick = await host.call("mail", "send_message", {"to": "a@example.test", "body": "b"})
    assert slow == ToolResult(False, "MCP tool 'mail.search' timed out after 0.5 s.")
    assert quick == ToolResult(True, "sent to a@example.test")
    assert host.problems() == []


async def test_a_missing_command_is_a_problem_naming_it(site: _Site) -> None:
    """A command that does not exist is a problem that names it; nothing is recorded."""
    async with asyncio.timeout(_BOUND_S):
        host = site.host(mail=McpServerConfig(command="no-such-bothy-mcp-server"))
        problems = await host.start()
    assert len(problems) == 1
    assert problems[0].server == "mail"
    assert "could not be started" in problems[0].message
    assert "'no-such-bothy-mcp-server'" in problems[0].message
    assert site.groups == {}


async def test_a_server_that_exits_at_start_reports_its_last_words(site: _Site) -> None:
    """A server that dies while starting is a problem quoting its exit code and stderr."""
    async with asyncio.timeout(_BOUND_S):
        host = site.host(mail=_python("import sys; sys.exit('missing GMAIL_TOKEN')"))
        problems = await host.start()
    assert problems == [
        McpProblem(
            "mail",
            "MCP server 'mail' stopped unexpectedly (exit code 1);"
            " its last output on stderr: missing GMAIL_TOKEN",
        )
    ]


async def test_a_group_that_cannot_be_recorded_is_not_left_running(site: _Site) -> None:
    """If Bothy cannot record a server's group, the server is stopped and is a problem."""
    records: list[GroupRecord] = []

    async def refuse(server: str, record: GroupRecord) -> None:
        records.append(record)
        raise OSError("state database is read-only")

    async with asyncio.timeout(_BOUND_S):
        host = McpHost({"mail": _fake()}, cwd=site.tmp_path, environ=site.environ, on_group=refuse)
        try:
            problems = await host.start()
        finally:
            await host.stop()
        assert await asyncio.to_thread(live_members, records[0].pgid) == []
    assert problems == [
        McpProblem(
            "mail",
            "MCP server 'mail' was stopped: its process group could not be recorded"
            " (OSError: state database is read-only)",
        )
    ]


async def test_stop_is_idempotent_and_leaves_no_live_process(site: _Site) -> None:
    """After every kind of server, stop() twice ends every recorded group; calls then fail."""
    async with asyncio.timeout(_BOUND_S):
        host = site.host(
            mail=_fake(),
            crashy=_fake("crash"),
            hung=_fake("hang", start_timeout_s=1.0),
            missing=McpServerConfig(command="no-such-bothy-mcp-server"),
        )
        problems = await host.start()
        await host.call("crashy", "send_message", {"to": "a", "body": "b"})
        await host.stop()
        await host.stop()
        after = await host.call("mail", "search", {"query": "x"})
        live = {server: await site.live(server) for server in site.groups}
    assert [problem.server for problem in problems] == ["hung", "missing"]
    assert set(site.groups) == {"mail", "crashy", "hung"}
    assert live == {"mail": [], "crashy": [], "hung": []}
    assert after == ToolResult(
        False, "MCP tool 'mail.search' is unavailable: server 'mail' was stopped."
    )
    assert host.tools() == []


async def test_a_server_sees_only_listed_variables(site: _Site) -> None:
    """A server gets the baseline and the names its config lists, never another secret."""
    async with asyncio.timeout(_BOUND_S):
        host = await _started(site, mail=_fake())
        result = await host.call("mail", "environment", {})
    environment: dict[str, Any] = json.loads(result.text)
    assert environment["FAKE_MCP_OUTBOX"] == str(site.outbox)
    assert environment["PATH"] == site.environ["PATH"]
    assert "SLACK_BOT_TOKEN" not in environment
    assert _SECRET not in result.text


async def test_a_cancelled_start_leaves_no_live_process(site: _Site) -> None:
    """Cancelling start() stops what it started before the cancellation propagates."""
    async with asyncio.timeout(_BOUND_S):
        host = site.host(hung=_fake("hang", start_timeout_s=15.0))
        starting = asyncio.create_task(host.start())
        await site.recorded["hung"].wait()
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert await site.live("hung") == []
    assert host.problems() == []
