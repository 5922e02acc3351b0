"""Proofs that the scripted model server speaks the Responses API the way the real Codex needs.

Each Codex test spawns the pinned ``codex app-server`` binary (its own process group, a
private ``CODEX_HOME``, no OpenAI credentials), points it at a ``ModelServer`` on loopback
through ``-c`` overrides, and speaks newline-delimited JSON-RPC to it with the small driver
below (Bothy's own client lives elsewhere; this one only has to be obviously right).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes.codex import (
    PROVIDER_ENV,
    REPO_ROOT,
    codex_binary,
    config_overrides,
    provider_config,
)
from tests.fakes.model_server import (
    ModelServer,
    RateLimits,
    RateLimitWindow,
    Usage,
    failed,
    http_error,
    stall,
    text,
    tool_call,
)

JSON = dict[str, Any]

TEST_TIMEOUT_S = 30.0
_CLOSE_GRACE_S = 5.0
_STDERR_TAIL_LINES = 40
_SCRUBBED_ENV = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY")


# --- a minimal app-server driver ------------------------------------------------------


class _AppServerExited(RuntimeError):
    """The app-server closed stdout while the test still expected messages."""


class _AppServer:
    """Newline-delimited JSON-RPC to a ``codex app-server`` child in its own process group."""

    def __init__(self, proc: asyncio.subprocess.Process, workspace: Path) -> None:
        self._proc = proc
        self.workspace = workspace
        self._next_id = 1
        self._pending: dict[int, asyncio.Future[JSON]] = {}
        self._notifications: asyncio.Queue[JSON | None] = asyncio.Queue()
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self.server_requests: list[JSON] = []
        self._tasks = [asyncio.create_task(self._read_stdout()),
                       asyncio.create_task(self._read_stderr())]

    @classmethod
    async def spawn(cls, base_url: str, tmp_path: Path) -> _AppServer:
        """Start ``codex app-server`` against ``base_url`` with a private CODEX_HOME."""
        home, workspace = tmp_path / "codex-home", tmp_path / "workspace"
        home.mkdir(exist_ok=True)
        workspace.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if k not in _SCRUBBED_ENV and not k.startswith("OPENAI_")}
        env |= PROVIDER_ENV | {"CODEX_HOME": str(home), "RUST_LOG": "warn"}
        proc = await asyncio.create_subprocess_exec(
            codex_binary(), "app-server", *config_overrides(provider_config(base_url)),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=workspace,
            start_new_session=True, limit=16 * 1024 * 1024,
        )
        return cls(proc, workspace)

    @property
    def stderr_tail(self) -> str:
        """The last lines codex wrote to stderr, for failure messages."""
        return "\n".join(self._stderr_tail)

    async def initialize(self) -> JSON:
        """The ``initialize`` handshake, then the ``initialized`` notification."""
        result = await self.request("initialize", {
            "clientInfo": {"name": "bothy_tests", "title": "Bothy tests", "version": "0.1"},
            "capabilities": {"experimentalApi": True},
        })
        await self._send({"method": "initialized"})
        return result

    async def request(self, method: str, params: JSON) -> JSON:
        """Send a request and return its ``result``; an ``error`` reply raises."""
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[JSON] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        await self._send({"id": request_id, "method": method, "params": params})
        reply = await future
        if "error" in reply:
            raise AssertionError(f"{method} failed: {reply['error']}")
        return reply["result"]  # type: ignore[no-any-return]  # JSON from the wire

    async def until(self, method: str) -> list[JSON]:
        """Notifications received up to and including the next one named ``method``."""
        seen: list[JSON] = []
        while True:
            message = await self._notifications.get()
            if message is None:
                raise _AppServerExited(
                    f"app-server exited waiting for {method!r}; stderr:\n{self.stderr_tail}"
                )
            seen.append(message)
            if message["method"] == method:
                return seen

    async def start_thread(self, approval_policy: str = "never") -> str:
        """``thread/start`` (read-only sandbox, ephemeral); returns the thread id."""
        result = await self.request("thread/start", {
            "cwd": str(self.workspace),
            "approvalPolicy": approval_policy, "sandbox": "read-only", "ephemeral": True,
        })
        return result["thread"]["id"]  # type: ignore[no-any-return]  # JSON from the wire

    async def start_turn(self, thread_id: str, prompt: str) -> str:
        """``turn/start`` with one text input; returns the turn id."""
        result = await self.request("turn/start", {
            "threadId": thread_id, "input": [{"type": "text", "text": prompt}],
        })
        return result["turn"]["id"]  # type: ignore[no-any-return]  # JSON from the wire

    async def close(self) -> None:
        """EOF on stdin, a bounded wait, then SIGKILL whatever is left of the process group."""
        if self._proc.stdin is not None and not self._proc.stdin.is_closing():
            self._proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_GRACE_S):
                await self._proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        await self._proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send(self, message: JSON) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self._proc.stdin.drain()

    async def _read_stdout(self) -> None:
        assert self._proc.stdout is not None
        try:
            async for line in self._proc.stdout:
                self._route(json.loads(line))
        finally:
            self._notifications.put_nowait(None)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(_AppServerExited(
                        f"app-server exited before replying; stderr:\n{self.stderr_tail}"))

    def _route(self, message: JSON) -> None:
        if "id" in message and "method" not in message:
            self._pending.pop(message["id"]).set_result(message)
        elif "id" in message:
            # A server request (approval, user input, ...): these tests expect none.
            self.server_requests.append(message)
            reply = {"id": message["id"],
                     "error": {"code": -32601, "message": "not handled by the test driver"}}
            self._proc.stdin.write(json.dumps(reply).encode() + b"\n")  # type: ignore[union-attr]
        else:
            self._notifications.put_nowait(message)

    async def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        async for line in self._proc.stderr:
            self._stderr_tail.append(line.decode(errors="replace").rstrip())


def _named(notifications: list[JSON], method: str) -> list[JSON]:
    return [n["params"] for n in notifications if n["method"] == method]


def _completed_items(notifications: list[JSON], item_type: str) -> list[JSON]:
    return [p["item"] for p in _named(notifications, "item/completed")
            if p["item"]["type"] == item_type]


# --- fixtures -------------------------------------------------------------------------


@pytest.fixture
async def model_server() -> AsyncIterator[ModelServer]:
    """A scripted model server on loopback."""
    async with ModelServer() as server:
        yield server


@pytest.fixture
async def codex(model_server: ModelServer, tmp_path: Path) -> AsyncIterator[_AppServer]:
    """The real ``codex app-server``, initialized, talking to ``model_server``."""
    app = await _AppServer.spawn(model_server.base_url, tmp_path)
    try:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await app.initialize()
        yield app
    finally:
        await app.close()


# --- proofs against the real codex ----------------------------------------------------


@pytest.mark.codex
async def test_text_reply_becomes_agent_message_and_token_usage(
    model_server: ModelServer, codex: _AppServer
) -> None:
    """A scripted text reply reaches the client as an agentMessage with the scripted usage."""
    usage = Usage(input_tokens=1200, cached_tokens=200, output_tokens=34, reasoning_tokens=5)
    model_server.script(text("BOTHY", usage=usage, chunks=3))
    async with asyncio.timeout(TEST_TIMEOUT_S):
        thread_id = await codex.start_thread()
        turn_id = await codex.start_turn(thread_id, "Reply with exactly: BOTHY")
        seen = await codex.until("turn/completed")

    assert [item["text"] for item in _completed_items(seen, "agentMessage")] == ["BOTHY"]
    assert "".join(p["delta"] for p in _named(seen, "item/agentMessage/delta")) == "BOTHY"
    (token_usage,) = _named(seen, "thread/tokenUsage/updated")
    assert token_usage["turnId"] == turn_id
    expected = {"totalTokens": 1234, "inputTokens": 1200, "cachedInputTokens": 200,
                "outputTokens": 34, "reasoningOutputTokens": 5}
    assert token_usage["tokenUsage"]["last"].items() >= expected.items()
    assert token_usage["tokenUsage"]["total"].items() >= expected.items()
    assert seen[-1]["params"]["turn"]["status"] == "completed"
    (body,) = model_server.requests
    assert body["model"] == "fake-model" and body["stream"] is True
    assert "Reply with exactly: BOTHY" in json.dumps(body["input"])
    assert model_server.unscripted == 0 and codex.server_requests == []


@pytest.mark.codex
async def test_rate_limit_headers_reach_account_rate_limits(
    model_server: ModelServer, codex: _AppServer
) -> None:
    """Rate-limit headers on a reply become the windows of account/rateLimits/updated."""
    limits = RateLimits(primary=RateLimitWindow(12.5, 300, 1795944077),
                        secondary=RateLimitWindow(40, 10080, 1796026877))
    model_server.script(text("ok", rate_limits=limits))
    async with asyncio.timeout(TEST_TIMEOUT_S):
        thread_id = await codex.start_thread()
        await codex.start_turn(thread_id, "hello")
        seen = await codex.until("turn/completed")

    rate_limits = _named(seen, "account/rateLimits/updated")[-1]["rateLimits"]
    assert rate_limits["primary"] == {"usedPercent": 13, "windowDurationMins": 300,
                                      "resetsAt": 1795944077}
    assert rate_limits["secondary"] == {"usedPercent": 40, "windowDurationMins": 10080,
                                        "resetsAt": 1796026877}


@pytest.mark.codex
async def test_http_500_fails_the_turn_without_retry(
    model_server: ModelServer, codex: _AppServer
) -> None:
    """An HTTP 500 from the model ends the turn as failed, after exactly one request."""
    model_server.script(http_error(500))
    async with asyncio.timeout(TEST_TIMEOUT_S):
        thread_id = await codex.start_thread()
        await codex.start_turn(thread_id, "hello")
        seen = await codex.until("turn/completed")

    turn = seen[-1]["params"]["turn"]
    assert turn["status"] == "failed" and turn["error"] is not None
    errors = _named(seen, "error")
    assert errors and errors[-1]["error"]["codexErrorInfo"] == "internalServerError"
    assert len(model_server.requests) == 1 and model_server.unscripted == 0


@pytest.mark.codex
async def test_response_failed_fails_the_turn_with_its_message(
    model_server: ModelServer, codex: _AppServer
) -> None:
    """A response.failed event ends the turn as failed, carrying the scripted message."""
    model_server.script(failed("the bothy roof fell in"))
    async with asyncio.timeout(TEST_TIMEOUT_S):
        thread_id = await codex.start_thread()
        await codex.start_turn(thread_id, "hello")
        seen = await codex.until("turn/completed")

    turn = seen[-1]["params"]["turn"]
    assert turn["status"] == "failed"
    assert "the bothy roof fell in" in json.dumps(turn["error"])
    assert len(model_server.requests) == 1


@pytest.mark.codex
async def test_stalled_stream_is_interrupted(
    model_server: ModelServer, codex: _AppServer
) -> None:
    """turn/interrupt mid-stream ends the turn as interrupted and Codex drops the stream."""
    model_server.script(stall("BOT"))
    async with asyncio.timeout(TEST_TIMEOUT_S):
        thread_id = await codex.start_thread()
        turn_id = await codex.start_turn(thread_id, "hello")
        await model_server.stalled.wait()
        seen = await codex.until("item/agentMessage/delta")
        assert await codex.request(
            "turn/interrupt", {"threadId": thread_id, "turnId": turn_id}) == {}
        seen += await codex.until("turn/completed")
        await model_server.hung_up.wait()

    assert seen[-1]["params"]["turn"]["status"] == "interrupted"
    assert _named(seen, "item/agentMessage/delta")[0]["delta"] == "BOT"
    assert _completed_items(seen, "agentMessage") == []
    assert len(model_server.requests) == 1


@pytest.mark.codex
async def test_tool_call_output_returns_in_next_request(
    model_server: ModelServer, codex: _AppServer
) -> None:
    """After an exec_command call, Codex's next request carries its function_call_output."""
    call = tool_call("exec_command", {"cmd": "echo hi"})
    model_server.script(call, text("done"))
    async with asyncio.timeout(TEST_TIMEOUT_S):
        thread_id = await codex.start_thread(approval_policy="never")
        await codex.start_turn(thread_id, "say hi in the shell")
        seen = await codex.until("turn/completed")

    assert seen[-1]["params"]["turn"]["status"] == "completed"
    assert len(model_server.requests) == 2 and model_server.unscripted == 0
    outputs = [item for item in model_server.requests[1]["input"]
               if item.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [call.call_id]
    assert "hi" in json.dumps(outputs[0]["output"])
    (command,) = _completed_items(seen, "commandExecution")
    assert command["id"] == call.call_id and command["exitCode"] == 0
    assert [item["text"] for item in _completed_items(seen, "agentMessage")] == ["done"]
    assert codex.server_requests == []


@pytest.mark.codex
async def test_malformed_tool_arguments_reach_the_model_as_an_error(
    model_server: ModelServer, codex: _AppServer
) -> None:
    """Unparseable tool arguments are not run; Codex tells the model so in the next request."""
    call = tool_call("exec_command", '{"cmd": "echo hi"', call_id="call_malformed")
    model_server.script(call, text("sorry"))
    async with asyncio.timeout(TEST_TIMEOUT_S):
        thread_id = await codex.start_thread()
        await codex.start_turn(thread_id, "say hi in the shell")
        seen = await codex.until("turn/completed")

    assert seen[-1]["params"]["turn"]["status"] == "completed"
    (output,) = [item for item in model_server.requests[1]["input"]
                 if item.get("type") == "function_call_output"]
    assert output["call_id"] == "call_malformed"
    assert "failed to parse function arguments" in output["output"]
    assert _completed_items(seen, "commandExecution") == []


# --- the server on its own ------------------------------------------------------------


async def test_unscripted_request_gets_500_and_is_counted(model_server: ModelServer) -> None:
    """A request beyond the script is answered 500 "script exhausted" and counted."""
    async with asyncio.timeout(TEST_TIMEOUT_S), aiohttp.ClientSession() as session:
        async with session.post(f"{model_server.base_url}/responses",
                                json={"stream": True}) as response:
            assert response.status == 500
            assert "script exhausted" in await response.text()
        assert await model_server.wait_for_requests(1, timeout_s=5) == [{"stream": True}]
    assert model_server.unscripted == 1


async def test_server_close_releases_a_stalled_stream() -> None:
    """Closing the server ends a stalled stream instead of waiting for the client."""
    async with asyncio.timeout(TEST_TIMEOUT_S), aiohttp.ClientSession() as session:
        server = ModelServer()
        await server.start()
        server.script(stall("partial"))
        async with session.post(f"{server.base_url}/responses", json={}) as response:
            first = await response.content.readuntil(b"\n\n")
            assert b"response.created" in first
            await server.stalled.wait()
            await server.close()
            rest = await response.content.read()
    assert b"partial" in rest and b"response.completed" not in rest


@pytest.mark.codex
async def test_standalone_serves_script_to_codex_and_exits_on_sigterm(tmp_path: Path) -> None:
    """The standalone server prints its URL, serves codex one reply, and exits 0 on SIGTERM."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps([
        {"kind": "text", "text": "BOTHY",
         "usage": {"input_tokens": 50, "cached_tokens": 10, "output_tokens": 3}},
    ]))
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.fakes.model_server", "--script", str(script),
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    app: _AppServer | None = None
    try:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            assert server.stdout is not None
            line = (await server.stdout.readline()).decode()
            match = re.fullmatch(r"listening (http://127\.0\.0\.1:\d+/v1)\n", line)
            assert match, f"unexpected first line {line!r}"
            app = await _AppServer.spawn(match.group(1), tmp_path)
            await app.initialize()
            thread_id = await app.start_thread()
            await app.start_turn(thread_id, "hello")
            seen = await app.until("turn/completed")
            assert [i["text"] for i in _completed_items(seen, "agentMessage")] == ["BOTHY"]
            assert seen[-1]["params"]["turn"]["status"] == "completed"

            server.send_signal(signal.SIGTERM)
            stdout, stderr = await server.communicate()
        assert server.returncode == 0, stderr.decode()
        assert stdout == b""
        assert b"1 requests, 0 replies unused, 0 unscripted" in stderr
    finally:
        if app is not None:
            await app.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        await server.wait()


async def test_standalone_refuses_a_non_loopback_host(tmp_path: Path) -> None:
    """--host 0.0.0.0 is refused with a clear error before anything is bound."""
    script = tmp_path / "script.json"
    script.write_text("[]")
    async with asyncio.timeout(TEST_TIMEOUT_S):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.fakes.model_server", "--script", str(script),
            "--host", "0.0.0.0", cwd=REPO_ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await proc.communicate()
    assert proc.returncode == 2 and stdout == b""
    assert b"refusing to listen on '0.0.0.0'" in stderr


# --- config helpers -------------------------------------------------------------------


def _parse_overrides(flags: list[str]) -> JSON:
    """Rebuild the nested config from ``-c dotted.key=<TOML>`` flags, parsing values as TOML."""
    assert flags[::2] == ["-c"] * (len(flags) // 2)
    config: JSON = {}
    for flag in flags[1::2]:
        dotted, value = flag.split("=", 1)
        *parents, leaf = dotted.split(".")
        table = config
        for key in parents:
            table = table.setdefault(key, {})
        table[leaf] = tomllib.loads(f"v = {value}")["v"]
    return config


def test_config_overrides_flatten_to_dotted_toml_flags() -> None:
    """Nested config becomes one -c dotted.key=<TOML value> flag per leaf, in order."""
    config = {"model": "fake-model", "features": {"plugins": False, "retries": 0},
              "ratio": 0.5, "list": ["a", 1, True]}
    assert config_overrides(config) == [
        "-c", 'model="fake-model"',
        "-c", "features.plugins=false",
        "-c", "features.retries=0",
        "-c", "ratio=0.5",
        "-c", 'list=["a", 1, true]',
    ]


def test_config_overrides_values_parse_back_as_toml() -> None:
    """Awkward strings (quotes, backslashes, control characters) survive the TOML round trip."""
    config = {"s": 'say "hi"\n\n\t\x7f\x01 ünï', "deep": {"er": {"x": -3, "y": 1e20}}}
    assert _parse_overrides(config_overrides(config)) == config


def test_config_overrides_refuse_what_toml_flags_cannot_say() -> None:
    """None, nested lists and dotted keys are refused rather than mangled."""
    for config in ({"a": None}, {"a": [[1]]}, {"a.b": 1}):
        with pytest.raises(ValueError):
            config_overrides(config)


def test_provider_config_flattens_completely() -> None:
    """The provider config survives the flag round trip and targets the given URL."""
    config = provider_config("http://127.0.0.1:9/v1")
    assert _parse_overrides(config_overrides(config)) == config
    assert config["model_providers"]["fake"]["base_url"] == "http://127.0.0.1:9/v1"
    assert config["model_provider"] == "fake" and config["features"]["plugins"] is False


@pytest.mark.codex
def test_codex_binary_is_the_pinned_native_binary() -> None:
    """codex_binary() finds the native executable under node_modules."""
    path = codex_binary()
    assert path.is_file() and os.access(path, os.X_OK)
    assert REPO_ROOT / "node_modules" in path.parents
