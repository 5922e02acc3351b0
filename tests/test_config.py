"""Proofs of the configuration contract (SPEC §1): the minimal config works as is, and a bad
one stops every command with exit 78 and one message naming the file, the key and what is
expected.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from bothy.config import parse_config
from bothy.money import usd_to_micros

MINIMAL = {
    "site": "acme-mini",
    "workspace": "/srv/work",
    "pool": {"max_workers": 2},
    "budget": {"mode": "api", "per_run_usd": 0.50, "per_day_usd": 25.0},
}


@dataclass(frozen=True)
class Shown:
    code: int
    stdout: str
    stderr: str


async def bothy(home: Path, *args: str, **extra_env: str) -> Shown:
    """Run the real ``bothy`` CLI with ``BOTHY_HOME=home`` (and ``extra_env``)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("BOTHY_")}
    env["BOTHY_HOME"] = str(home)
    env.update(extra_env)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bothy", *args, env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return Shown(process.returncode, stdout.decode(), stderr.decode())


def with_budget(**budget: Any) -> dict[str, Any]:
    return {**MINIMAL, "budget": {**MINIMAL["budget"], **budget}}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


# --- the minimal config ---------------------------------------------------------------


def test_the_minimal_config_loads_as_is() -> None:
    """SPEC §1's minimal config validates, with defaults for everything it leaves out."""
    cfg = parse_config(json.loads(json.dumps(MINIMAL)), path=Path("config.json"))

    assert cfg.site == "acme-mini"
    assert cfg.workspace == Path("/srv/work")
    assert cfg.pool.max_workers == 2
    assert cfg.budget.mode == "api"
    assert usd_to_micros(cfg.budget.per_run_usd) == 500_000
    assert usd_to_micros(cfg.budget.per_day_usd) == 25_000_000
    assert cfg.budget.timezone == "UTC"
    assert cfg.codex.command == ["codex", "app-server"]


def test_amounts_written_as_json_floats_are_exact() -> None:
    """A JSON float such as 0.1 becomes exactly 100,000 micro-dollars, not 0.1000000000000000055."""
    cfg = parse_config(with_budget(per_run_usd=0.1, per_day_usd=0.3), path=Path("config.json"))

    assert cfg.budget.per_run_usd == Decimal("0.1")
    assert usd_to_micros(cfg.budget.per_run_usd) * 3 == usd_to_micros(cfg.budget.per_day_usd)


async def test_status_works_with_the_minimal_config(home: Path) -> None:
    """`bothy status` on a fresh home with the minimal config shows the site and its ceiling."""
    (home / "config.json").write_text(json.dumps(MINIMAL))

    shown = await bothy(home, "status")

    assert shown.code == 0, shown.stderr
    assert shown.stdout.splitlines()[0].startswith("site acme-mini · ")
    assert "spend today: 0.0000 usd used, 0.0000 usd reserved, ceiling 25.00 usd" in shown.stdout
    assert "running: 0 of 2 workers" in shown.stdout
    assert shown.stderr == ""


# --- a bad config stops every command -------------------------------------------------


_BAD_CONFIGS: dict[str, tuple[str | None, list[str]]] = {
    # case: (config.json text, or None for no file; what the message must say)
    "missing file": (None, ["does not exist"]),
    "invalid JSON": ('{"site": "acme-mini",\n  "workspace": }', ["is not valid JSON", "line 2"]),
    "not an object": ("[1, 2]", ["must hold a JSON object, not list"]),
    "unknown key": (
        json.dumps(with_budget(per_ran_usd=0.5)),
        ["1 problem:", "budget.per_ran_usd: unknown key",
         "allowed here: mode, per_day_usd, per_run_usd, plan_ceiling_percent,"
         " plan_reserve_percent, prices, reservation_expiry_s, timezone"],
    ),
    "misspelt key": (
        json.dumps({**MINIMAL, "budget": {"mode": "api", "per_ran_usd": 0.5, "per_day_usd": 25}}),
        ["2 problems:", "budget.per_run_usd: required key is missing",
         "budget.per_ran_usd: unknown key (allowed here: mode, per_day_usd, per_run_usd,"],
    ),
    "wrong type": (
        json.dumps({**MINIMAL, "pool": {"max_workers": "two"}}),
        ["1 problem:", "pool.max_workers: Input should be a valid integer", "(got 'two')"],
    ),
    "per run above per day": (
        json.dumps(with_budget(per_run_usd=50, per_day_usd=25)),
        ["1 problem:", "budget: per_run_usd (50) is larger than per_day_usd (25)"],
    ),
    "plan reserve not below ceiling": (
        json.dumps({**MINIMAL, "budget": {"mode": "plan", "plan_ceiling_percent": 10,
                                          "plan_reserve_percent": 10}}),
        ["1 problem:", "budget: plan_reserve_percent (10) must be smaller than"
         " plan_ceiling_percent (10)"],
    ),
    "plan ceiling above 100": (
        json.dumps({**MINIMAL, "budget": {"mode": "plan", "plan_ceiling_percent": 101}}),
        ["1 problem:", "budget.plan_ceiling_percent: Input should be less than or equal to 100"],
    ),
    "plan reserve of 0": (
        json.dumps({**MINIMAL, "budget": {"mode": "plan", "plan_reserve_percent": 0}}),
        ["1 problem:", "budget.plan_reserve_percent: Input should be greater than 0"],
    ),
    "unknown timezone": (
        json.dumps(with_budget(timezone="Mars/Olympus_Mons")),
        ["1 problem:", "budget.timezone: unknown time zone 'Mars/Olympus_Mons'"],
    ),
}


@pytest.mark.parametrize("command", [["status"], ["run", "hello", "--subject", "demo"]])
@pytest.mark.parametrize("case", list(_BAD_CONFIGS))
async def test_a_bad_config_stops_the_command_with_exit_78(
    home: Path, case: str, command: list[str]
) -> None:
    """A bad config.json: exit 78, one message on stderr naming the file and what is wrong."""
    text, expected = _BAD_CONFIGS[case]
    config = home / "config.json"
    if text is not None:
        config.write_text(text)

    shown = await bothy(home, *command)

    assert shown.code == 78, shown.stderr
    assert shown.stdout == ""
    assert shown.stderr.startswith(f"bothy: configuration error: config file {config} ")
    assert shown.stderr.count("configuration error") == 1
    for part in expected:
        assert part in shown.stderr, f"{part!r} not in {shown.stderr!r}"
    assert "Traceback" not in shown.stderr
    assert not (home / "state" / "audit.jsonl").exists()


async def test_doctor_reports_a_bad_config_and_exits_78(home: Path) -> None:
    """`bothy doctor` with a bad config fails its config line naming the key, and exits 78."""
    (home / "config.json").write_text(json.dumps(with_budget(per_ran_usd=0.5)))

    shown = await bothy(home, "doctor")

    assert shown.code == 78
    assert "\n[fail] config valid: config file " in shown.stdout
    assert "budget.per_ran_usd: unknown key" in shown.stdout
    assert shown.stdout.splitlines()[-1].endswith(" failed")


async def test_serve_under_launchd_records_a_config_error_and_exits_zero(home: Path) -> None:
    """launchd cannot filter 78: with BOTHY_SERVICE_MANAGER=launchd the error is kept, exit 0."""
    (home / "config.json").write_text('{"site": "x"}')
    launchd = await bothy(home, "serve", BOTHY_SERVICE_MANAGER="launchd")
    assert launchd.code == 0, launchd.stderr
    recorded = (home / "state" / "config-error.txt").read_text()
    assert "budget: required key is missing" in recorded
    systemd = await bothy(home, "serve")
    assert systemd.code == 78
