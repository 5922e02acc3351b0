"""The docs stay in step with the code they describe."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from bothy.config import (
    Config,
    McpServerConfig,
    PollerConfig,
    Price,
    ProfileConfig,
    WebhookRoute,
)
from bothy.engine.auditevents import EVENTS
from bothy.exitcodes import ExitCode

DOCS = Path(__file__).resolve().parents[1] / "docs"
README = Path(__file__).resolve().parents[1] / "README.md"


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _field_paths(annotation, path + ".")
        elif typing.get_origin(annotation) is dict:
            value = typing.get_args(annotation)[1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                placeholder = {Price: "<model>", ProfileConfig: "<name>",
                               McpServerConfig: "<server>", WebhookRoute: "<route>",
                               PollerConfig: "<poller>"}[value]
                paths += _field_paths(value, f"{path}.{placeholder}.")
        elif typing.get_origin(annotation) is list:
            item = typing.get_args(annotation)[0]
            if isinstance(item, type) and issubclass(item, BaseModel):
                paths += _field_paths(item, f"{path}[].")
    return paths


def test_every_config_field_is_documented() -> None:
    """docs/CONFIGURATION.md has a row for every field of the config model."""
    text = (DOCS / "CONFIGURATION.md").read_text()
    missing = [path for path in _field_paths(Config) if f"`{path}`" not in text]
    assert missing == []


def test_every_exit_code_is_documented() -> None:
    """The README and the runbook list every exit code the CLI can return."""
    for doc in (README, DOCS / "RUNBOOK.md"):
        text = doc.read_text()
        missing = [code.value for code in ExitCode if f"| {code.value} |" not in text]
        assert missing == [], doc.name


def test_readme_opens_with_the_two_commands() -> None:
    """A newcomer finds the demo and the test command in the README's first lines."""
    head = "\n".join(README.read_text().splitlines()[:15])
    assert "make demo" in head
    assert "make test" in head


def test_the_audit_events_table_and_docs_audit_md_agree() -> None:
    """Every event the register accepts is explained in docs/AUDIT.md, and nothing else is."""
    rows = [line for line in (DOCS / "AUDIT.md").read_text().splitlines()
            if line.startswith("| `")]
    documented = {pair for row in rows
                  for pair in re.findall(r"`([a-z_-]+) ([a-z_-]+)`", row.split("|")[1])}
    declared = set(EVENTS)
    assert sorted(declared - documented) == [], "declared but not in docs/AUDIT.md"
    assert sorted(documented - declared) == [], "in docs/AUDIT.md but not declared"
