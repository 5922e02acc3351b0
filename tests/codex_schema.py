"""Bothy pinned to Codex's own contract: the JSON Schema the pinned binary generates.

``generate_schema`` runs ``codex app-server generate-json-schema --experimental`` (Bothy
enables the experimental API at ``initialize``); :class:`CodexSchema` reads the bundle and
answers two questions, each answer naming the method and the field:

* ``traffic_problems``: does each frame recorded by the JSON-RPC client's hook
  (``RECORD_CODEX_RPC``, see ``bothy/engine/rpc.py``) match the schema of its method? What
  Bothy sends is then known to be accepted, what it receives known to be what Codex says.
* ``field_problem``: does a field Bothy's parsing reads (``bothy/engine/contract.py``) exist
  in the schema of its method? A field Codex renamed or dropped fails here even when no test
  happened to receive it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator
from jsonschema.exceptions import best_match

_STEP = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(?P<array>\[\])?(\{type=(?P<tag>[A-Za-z0-9_]+)\})?$")


def generate_schema(binary: Path, out: Path, codex_home: Path) -> None:
    """Write the experimental schema bundle of ``binary`` into ``out``."""
    codex_home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", os.defpath), "CODEX_HOME": str(codex_home),
           "RUST_LOG": "error"}
    subprocess.run(
        [str(binary), "app-server", "generate-json-schema", "--experimental", "--out", str(out)],
        env=env, check=True, capture_output=True, timeout=60,
    )


@dataclass(frozen=True)
class _Entry:
    """The schema of one method's params (or result), with the definitions it refers to."""

    schema: dict[str, Any]
    definitions: dict[str, Any]

    def validator(self) -> Draft7Validator:
        return Draft7Validator({"definitions": self.definitions, "allOf": [self.schema]})


class CodexSchema:
    """The generated bundle, indexed by (kind, method)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self.client_requests = self._branches("ClientRequest.json")
        self.client_notifications = self._branches("ClientNotification.json")
        self.server_notifications = self._branches("ServerNotification.json")
        self.server_requests = self._branches("ServerRequest.json")

    # --- lookup ------------------------------------------------------------------------

    def _branches(self, name: str) -> dict[str, _Entry]:
        document = json.loads((self._dir / name).read_text())
        definitions = document.get("definitions", {})
        found = {}
        for branch in document["oneOf"]:
            method = branch["properties"]["method"]["enum"][0]
            params = branch["properties"].get("params", {"type": "null"})
            found[method] = _Entry(params, definitions)
        return found

    def _response_of(self, entry: _Entry) -> _Entry | None:
        """``FooParams`` answers with ``FooResponse``: the bundle's own naming."""
        ref = entry.schema.get("$ref", "")
        if not ref.endswith("Params"):
            return None
        name = ref.rsplit("/", 1)[-1].removesuffix("Params") + "Response.json"
        for where in (self._dir, self._dir / "v2", self._dir / "v1"):
            if (where / name).is_file():
                document = json.loads((where / name).read_text())
                body = {key: value for key, value in document.items()
                        if key not in ("definitions", "$schema")}
                return _Entry(body, document.get("definitions", {}))
        return None

    def entry(self, kind: str, method: str) -> _Entry | None:
        """The schema of a (kind, method) as :mod:`bothy.engine.contract` names them."""
        if kind == "notification":
            return self.server_notifications.get(method)
        if kind == "request":
            return self.server_requests.get(method)
        if kind == "response":
            request = self.client_requests.get(method)
            return self._response_of(request) if request else None
        if kind == "answer":  # what Bothy answers to a server request
            request = self.server_requests.get(method)
            return self._response_of(request) if request else None
        raise ValueError(f"unknown kind {kind!r}")

    # --- recorded traffic --------------------------------------------------------------

    def traffic_problems(self, record_file: Path) -> list[str]:
        """Every recorded frame that does not match its method's schema, as sentences."""
        problems: list[str] = []
        for record in _records(record_file):
            problem = self.frame_problem(record)
            if problem is not None and problem not in problems:
                problems.append(problem)
        return problems

    def frame_problem(self, record: dict[str, Any]) -> str | None:
        """Why one recorded frame breaks the schema, or None."""
        direction, kind, method = record["direction"], record["kind"], record["method"]
        message = record["message"]
        if kind == "error" or method is None:
            return None  # JSON-RPC errors carry no method schema; late answers no method
        where, field = _locate(direction, kind)
        entry = self._frame_entry(direction, kind, method)
        if entry is None:
            return f"{direction} {kind} '{method}': the method is not in codex's schema"
        instance = message.get(field)
        if instance is None and field == "params" and entry.schema.get("type") == "null":
            return None
        error = best_match(entry.validator().iter_errors(instance))
        if error is None:
            return None
        path = ".".join([field, *(str(part) for part in error.absolute_path)])
        return f"{direction} {kind} '{method}' ({where}): field '{path}': {error.message}"

    def _frame_entry(self, direction: str, kind: str, method: str) -> _Entry | None:
        if direction == "sent" and kind == "request":
            return self.client_requests.get(method)
        if direction == "sent" and kind == "notification":
            return self.client_notifications.get(method)
        if direction == "sent" and kind == "response":
            return self.entry("answer", method)
        if direction == "received" and kind == "response":
            return self.entry("response", method)
        return self.entry(kind, method)

    # --- fields Bothy reads ------------------------------------------------------------

    def field_problem(self, kind: str, method: str, path: str) -> str | None:
        """Why ``path`` is not a field of ``method``'s ``kind`` in the schema, or None."""
        entry = self.entry(kind, method)
        if entry is None:
            return f"{kind} '{method}': the method is not in codex's schema"
        nodes = [entry.schema]
        walked: list[str] = []
        for step in path.split("."):
            match = _STEP.match(step)
            if match is None:
                raise ValueError(f"{kind} '{method}': {path!r} is not a field path")
            name = match["name"]
            children = [child for node in nodes for alt in self._alternatives(node, entry)
                        if (child := alt.get("properties", {}).get(name)) is not None]
            walked.append(name)
            if not children:
                return (f"{kind} '{method}': field '{'.'.join(walked)}' is not in codex's"
                        " schema (renamed or dropped?)")
            if match["array"]:
                children = [alt["items"] for child in children
                            for alt in self._alternatives(child, entry) if "items" in alt]
                if not children:
                    return f"{kind} '{method}': field '{'.'.join(walked)}' is not an array"
            if match["tag"]:
                tag = match["tag"]
                children = [alt for child in children for alt in self._alternatives(child, entry)
                            if _has_tag(alt, tag)]
                if not children:
                    return (f"{kind} '{method}': field '{'.'.join(walked)}' has no variant"
                            f" of type '{tag}' in codex's schema")
            nodes = children
        return None

    def _alternatives(self, node: dict[str, Any], entry: _Entry) -> Iterator[dict[str, Any]]:
        """The concrete object schemas a node may be: refs followed, unions flattened."""
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = entry.definitions.get(ref.rsplit("/", 1)[-1])
            if target is not None:
                yield from self._alternatives(target, entry)
            return
        for union in ("anyOf", "oneOf", "allOf"):
            for alt in node.get(union, []):
                yield from self._alternatives(alt, entry)
        yield node


def _has_tag(node: dict[str, Any], tag: str) -> bool:
    kind = node.get("properties", {}).get("type", {})
    return tag in kind.get("enum", []) or kind.get("const") == tag


def _locate(direction: str, kind: str) -> tuple[str, str]:
    """A human 'where' and the member of the frame that carries the payload."""
    if kind == "response":
        return ("Bothy's answer" if direction == "sent" else "Codex's answer"), "result"
    return ("from Bothy" if direction == "sent" else "from Codex"), "params"


def _records(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)
