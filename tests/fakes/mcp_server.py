"""A real MCP server over stdio, built with the official ``mcp`` SDK, for Bothy's MCP tests.

Run as ``python tests/fakes/mcp_server.py [mode]``. Tools:

* ``search(query)`` — read-only (``readOnlyHint``): a few lines of results naming the query;
* ``send_message(to, body)`` — not read-only: appends ``{"to": ..., "body": ...}`` as one JSON
  line to the file named by ``$FAKE_MCP_OUTBOX``, so a test sees what was really sent;
* ``environment()`` — read-only: the server's whole environment, as JSON;
* ``snapshot()`` — read-only: a text item and a small PNG image;
* ``fail(reason)`` — an MCP error result (``isError``) carrying the reason;
* ``dump(chars)`` — read-only: ``chars`` characters of digits (a result too big to pass on).

Modes, each a fault Bothy must survive:

* ``normal`` — behaves;
* ``hang`` — never answers ``initialize`` (and leaves a child in its process group, so a test
  proves the whole group is ended, not just the leader);
* ``crash`` — ``send_message`` kills the process with ``os._exit(3)`` mid-call;
* ``garbage`` — ``search`` writes a line that is not JSON to the wire before answering;
* ``slow`` — ``search`` sleeps for ``$FAKE_MCP_SLOW_S`` seconds (default 30) before answering.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ContentBlock, ImageContent, TextContent, ToolAnnotations

MODES = ("normal", "hang", "crash", "garbage", "slow")
_READ_ONLY = ToolAnnotations(read_only_hint=True)
# A 1x1 transparent PNG.
_PIXEL_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)


def _build(mode: str, wire_fd: int) -> MCPServer:
    server: MCPServer = MCPServer(name="fake-mcp", version="1.0")

    @server.tool(description="Search the mailbox.", annotations=_READ_ONLY, structured_output=False)
    async def search(query: str) -> str:
        if mode == "garbage":
            # A server library "printing" to the wire: the SDK moved fd 1 aside, so use the
            # duplicate of the real stdout taken before it started.
            os.write(wire_fd, b"this is not json-rpc\n")
        if mode == "slow":
            await anyio.sleep(float(os.environ.get("FAKE_MCP_SLOW_S", "30")))
        return "\n".join(
            f"{n}. message about {query!r} from sender{n}@example.test" for n in (1, 2, 3)
        )

    @server.tool(description="Send a message to someone.", structured_output=False)
    def send_message(to: str, body: str) -> str:
        if mode == "crash":
            os._exit(3)
        outbox = Path(os.environ["FAKE_MCP_OUTBOX"])
        with outbox.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"to": to, "body": body}) + "\n")
        return f"sent to {to}"

    @server.tool(description="This server's environment.", annotations=_READ_ONLY)
    def environment() -> str:
        return json.dumps(dict(os.environ))

    @server.tool(description="A picture.", annotations=_READ_ONLY, structured_output=False)
    def snapshot() -> list[ContentBlock]:
        image = base64.b64encode(_PIXEL_PNG).decode()
        return [TextContent(text="the view"), ImageContent(data=image, mime_type="image/png")]

    @server.tool(description="Always fails.", structured_output=False)
    def fail(reason: str) -> str:
        raise ToolError(reason)

    @server.tool(description="A long read.", annotations=_READ_ONLY, structured_output=False)
    def dump(chars: int) -> str:
        return ("0123456789" * (chars // 10 + 1))[:chars]

    return server


def _hang() -> None:
    # A child in our process group, as a real server's helper would be.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    while True:
        time.sleep(60)


def main(argv: list[str]) -> None:
    mode = argv[1] if len(argv) > 1 else "normal"
    if mode not in MODES:
        sys.exit(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "hang":
        _hang()
    _build(mode, os.dup(1)).run("stdio")


if __name__ == "__main__":
    main(sys.argv)
