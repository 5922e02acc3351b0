"""A fake ``cairn`` speaking Bothy's Cairn contract (docs/CAIRN.md), with a ledger in a file.

Run as a command (``python tests/fakes/cairn.py --ledger FILE VERB ...``): it reads and writes
a JSON ledger under a lock, as a real task ledger would keep its tasks::

    {"tasks": {"ACME-12": {"brief": "...", "holder": null, "notes": [...]}},
     "behaviour": {"slow": {"claim": 30}, "fail": {"note": "disk full"}, "garbage": ["brief"]},
     "calls": [{"verb": "claim", "ref": "ACME-12", "by": "run_..."}, ...]}

``behaviour`` makes a verb slow (sleeps that many seconds first), fail (exit 1, the message on
stderr), or answer garbage (bytes that are not text, exit 0, nothing done). Every call is
appended to ``calls`` before anything else, so a test sees what Bothy asked even of a call it
then killed. Tests drive it through :class:`FakeCairn`. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HELD_EXIT_CODE = 3
GARBAGE = b"\xff\xfe\x00\x9c not a brief \xc3\x28\n"


class FakeCairn:
    """The ledger file of a fake Cairn, and the command that serves it."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.ledger = root / "cairn-ledger.json"
        if not self.ledger.exists():
            _save(self.ledger, {"tasks": {}, "behaviour": {}, "calls": []})

    @property
    def command(self) -> list[str]:
        """``cairn.command`` for a site's config."""
        return [sys.executable, str(Path(__file__).resolve()), "--ledger", str(self.ledger)]

    def add(self, ref: str, brief: str = "") -> None:
        with _ledger(self.ledger) as data:
            data["tasks"][ref] = {"brief": brief, "holder": None, "notes": []}

    def hold(self, ref: str, holder: str) -> None:
        """Someone else claims the task."""
        with _ledger(self.ledger) as data:
            data["tasks"][ref]["holder"] = holder

    def slow(self, verb: str, seconds: float) -> None:
        with _ledger(self.ledger) as data:
            data["behaviour"].setdefault("slow", {})[verb] = seconds

    def fail(self, verb: str, message: str) -> None:
        with _ledger(self.ledger) as data:
            data["behaviour"].setdefault("fail", {})[verb] = message

    def garbage(self, verb: str) -> None:
        with _ledger(self.ledger) as data:
            data["behaviour"].setdefault("garbage", []).append(verb)

    def task(self, ref: str) -> dict[str, Any]:
        task: dict[str, Any] = _load(self.ledger)["tasks"][ref]
        return task

    def calls(self) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = _load(self.ledger)["calls"]
        return calls

    def verbs(self) -> list[str]:
        """The verbs asked of Cairn, in order (``show`` is the brief)."""
        return [call["verb"] for call in self.calls()]


# --- the ledger file ------------------------------------------------------------------


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _save(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, path)


@contextlib.contextmanager
def _ledger(path: Path) -> Iterator[dict[str, Any]]:
    """The ledger, read and written back under an exclusive lock."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _load(path)
        yield data
        _save(path, data)


# --- the command ----------------------------------------------------------------------


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def _serve(path: Path, args: list[str]) -> int:
    if args == ["--version"]:
        print("cairn (fake) 1.0")
        return 0
    if len(args) < 2:
        print("usage: cairn VERB REF ...", file=sys.stderr)
        return 64
    verb, ref = args[0], args[1]
    stdin = sys.stdin.read() if verb == "note" and "-" in args[2:] else None
    with _ledger(path) as data:
        data["calls"].append({"verb": verb, "ref": ref, "by": _option(args, "--by"),
                              "kind": _option(args, "--kind"), "stdin": stdin})
        behaviour = data["behaviour"]
    time.sleep(float(behaviour.get("slow", {}).get(verb, 0)))
    if verb in behaviour.get("fail", {}):
        print(f"cairn: {behaviour['fail'][verb]}", file=sys.stderr)
        return 1
    if verb in behaviour.get("garbage", []):
        sys.stdout.buffer.write(GARBAGE)
        return 0
    with _ledger(path) as data:
        task = data["tasks"].get(ref)
        if task is None:
            print(f"cairn: no task {ref}", file=sys.stderr)
            return 2
        return _act(task, verb, args, stdin)


def _act(task: dict[str, Any], verb: str, args: list[str], stdin: str | None) -> int:
    by = _option(args, "--by")
    if verb == "claim":
        if task["holder"] not in (None, by):
            print(task["holder"])
            return HELD_EXIT_CODE
        task["holder"] = by
        print(f"claimed by {by}")
        return 0
    if verb == "show" and "--brief" in args:
        sys.stdout.write(task["brief"])
        return 0
    if verb == "note" and stdin is not None:
        task["notes"].append({"kind": _option(args, "--kind"), "text": stdin})
        return 0
    if verb == "release":
        if task["holder"] == by:
            task["holder"] = None
        return 0
    print(f"cairn: cannot {' '.join(args)}", file=sys.stderr)
    return 64


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if len(arguments) < 2 or arguments[0] != "--ledger":
        print("usage: cairn.py --ledger FILE VERB ...", file=sys.stderr)
        sys.exit(64)
    sys.exit(_serve(Path(arguments[1]), arguments[2:]))
