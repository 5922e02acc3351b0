"""A fault-injecting stand-in for ``codex app-server``: a peer that breaks the protocol.

The real binary cannot be made to send a bad frame or to ignore the end of its input, so the
tests that prove how Bothy survives a broken peer run this small program instead
(``codex.command = [sys.executable, "tests/fakes/broken_app_server.py", MODE]``). It speaks
just enough of the protocol (newline-delimited JSON-RPC on stdio, as observed in
``codex-app-server.md``) to get a run mid-turn: it answers ``initialize``, ``thread/start``
and ``turn/start``, announces ``turn/started``, and then misbehaves as MODE says:

``not-json``
    writes a line that is not JSON, then carries on as if nothing happened;
``truncated``
    writes the start of a frame with no newline and exits;
``unknown-id``
    answers a request Bothy never sent (id 4242), then carries on;
``hang``
    says nothing more and outlives the end of its input (a wedged worker): it only ends when
    signalled;
``exit-leaving-child``
    exits (code 3) with a well-formed stream, while its child, which inherited its stdout,
    keeps that pipe open: the end of the output does not come with the leader's death.

Every mode first starts a child (``sleep``) in its own process group, so a test can prove that
the whole group, not only the leader, was ended. With ``--log FILE`` it appends one line per
milestone to FILE (``child <pid>``, ``turn started``, ``fault written``, ``stdin closed``),
which a test waits on. Arguments it does not know (Bothy appends ``-c key=value`` config
overrides meant for Codex) are ignored.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

MODES = ("not-json", "truncated", "unknown-id", "hang", "exit-leaving-child")
LEADER_EXIT_CODE = 3
UNKNOWN_ID = 4242
THREAD_ID = "thr_broken"
TURN_ID = "turn_broken"
MODEL = "fake-model"
TRUNCATED_FRAME = b'{"method":"item/agentMessage/delta","params":{"threadId":"thr_bro'


class _Peer:
    def __init__(self, mode: str, log: Path | None) -> None:
        self.mode = mode
        self._log = log
        self._out = sys.stdout.buffer

    def note(self, milestone: str) -> None:
        if self._log is not None:
            with self._log.open("a", encoding="utf-8") as log:
                log.write(milestone + "\n")

    def send(self, message: dict[str, Any]) -> None:
        self.write(json.dumps(message).encode() + b"\n")

    def write(self, raw: bytes) -> None:
        self._out.write(raw)
        self._out.flush()

    def answer(self, message: dict[str, Any]) -> bool:
        """Answer one request; True once the turn is under way."""
        method, request_id = message.get("method"), message.get("id")
        if request_id is None:
            return False  # a notification (``initialized``): nothing to answer
        if method == "initialize":
            self.send({"id": request_id, "result": {
                "userAgent": f"broken_app_server/{self.mode}", "platformFamily": "unix"}})
        elif method == "thread/start":
            self.send({"id": request_id, "result": {
                "thread": {"id": THREAD_ID, "model": MODEL, "status": {"type": "idle"}}}})
        elif method == "turn/start":
            turn = {"id": TURN_ID, "items": [], "status": "inProgress", "error": None}
            self.send({"id": request_id, "result": {"turn": turn}})
            self.send({"method": "turn/started", "params": {"threadId": THREAD_ID, "turn": turn}})
            self.note("turn started")
            return True
        else:
            self.send({"id": request_id, "result": {}})
        return False

    def misbehave(self) -> None:
        if self.mode == "not-json":
            self.write(b"this is not json at all\n")
        elif self.mode == "truncated":
            self.write(TRUNCATED_FRAME)
            self.note("fault written")
            sys.exit(0)
        elif self.mode == "unknown-id":
            self.send({"id": UNKNOWN_ID, "result": {}})
        elif self.mode == "exit-leaving-child":
            self.note("fault written")
            sys.exit(LEADER_EXIT_CODE)
        self.note("fault written")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="broken_app_server")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--log", type=Path)
    args, _codex_flags = parser.parse_known_args(argv)
    peer = _Peer(args.mode, args.log)
    holds_output = args.mode == "exit-leaving-child"
    child = subprocess.Popen(
        ["sleep", "300"],
        stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        stdout=None if holds_output else subprocess.DEVNULL,
    )
    peer.note(f"child {child.pid}")
    for line in sys.stdin.buffer:
        if line.strip() and peer.answer(json.loads(line)):
            peer.misbehave()
    peer.note("stdin closed")
    if args.mode == "hang":
        while True:  # outlive the owner: only a signal ends this process
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
