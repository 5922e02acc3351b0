"""What a newcomer trips on, through the real CLI: closed pipes, a corrupt state database, a
misspelt flag, an empty register, `--json` on every read, one time format, a fresh machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.fakes.codex import codex_binary
from tests.fakes.site import Completed, Site

pytestmark = pytest.mark.codex  # every test here runs or names the pinned codex binary

NO_MODEL = "http://127.0.0.1:9/v1"
MINUTE_ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d[+-]\d\d:\d\d"


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, NO_MODEL, profiles={
        "selfcare": {"tools": ["bothy_checklist"], "approvals": {"bothy_checklist": "confirm"}}})


async def into_closed_pipe(site: Site, *args: str) -> Completed:
    """Run ``bothy ARGS`` with stdout a pipe whose reader has gone, as `| head` leaves it."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bothy", *args, env=site.env(),
            stdin=asyncio.subprocess.DEVNULL, stdout=write_end, stderr=asyncio.subprocess.PIPE)
    finally:
        os.close(write_end)
    async with asyncio.timeout(60):
        _, stderr = await process.communicate()
    assert process.returncode is not None
    return Completed(process.returncode, "", stderr.decode())


async def with_sops(site: Site, *names: str) -> None:
    """Write an SOP per name (each leaves a `sop saved` record in the register)."""
    text = site.root / "sop.md"
    text.write_text("# Rotate the logs\n\nCompress last week's logs.\n")
    for name in names:
        done = await site.bothy("sop", "set", name, "--file", str(text))
        assert done.code == 0, done.stderr


# --- closed pipes and broken state --------------------------------------------------------


@pytest.mark.parametrize("command", [
    ("audit",), ("audit", "--json"), ("status",), ("sop", "list"), ("schedule", "list"),
    ("profile", "list"), ("checklist",), ("audit", "verify"),
])
async def test_a_closed_pipe_ends_quietly(site: Site, command: tuple[str, ...]) -> None:
    """`bothy audit | head` and the like: no traceback when the reader stops reading."""
    await with_sops(site, "rotate", "backup", "prune")

    done = await into_closed_pipe(site, *command)

    assert done.stderr == ""
    assert done.code == 0


async def test_a_pipe_closed_by_head_ends_quietly(site: Site) -> None:
    """The shell's own `bothy audit | head -n 1`: one line, and nothing on stderr."""
    await with_sops(site, "rotate", "backup", "prune")
    process = await asyncio.create_subprocess_shell(
        f"{sys.executable} -m bothy audit --json | head -n 1", env=site.env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        stdout, stderr = await process.communicate()

    assert stderr == b""
    assert json.loads(stdout)["seq"] == 1


@pytest.mark.parametrize("command", [("status",), ("schedule", "list")])
async def test_a_corrupt_state_database_is_named_with_what_to_do(
    site: Site, command: tuple[str, ...]
) -> None:
    """A state database that is not one: the file, what to do, exit 65, no traceback."""
    database = site.home / "state" / "bothy.sqlite3"
    database.parent.mkdir(mode=0o700)
    database.write_bytes(b"this is not a database, it is a shopping list\n" * 100)

    done = await site.bothy(*command)

    assert done.code == 65, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith(f"bothy: the state database {database} is corrupt")
    assert f"mv {database} {database}.corrupt" in done.stderr
    assert "Traceback" not in done.stderr


# --- usage and empty answers ----------------------------------------------------------------


@pytest.mark.parametrize(("command", "usage"), [
    (("status", "--jsn"), "usage: bothy status [-h] [--json]"),
    (("schedule", "list", "--jsn"), "usage: bothy schedule list [-h] [--json]"),
    (("audit", "--jsno"), "usage: bothy audit [-h]"),
])
async def test_a_misspelt_flag_prints_the_subcommands_usage(
    site: Site, command: tuple[str, ...], usage: str
) -> None:
    """`bothy status --jsn` shows how `bothy status` is used, not the top-level usage; 64."""
    done = await site.bothy(*command)

    assert done.code == 64
    assert done.stderr.startswith(usage), done.stderr
    assert f"bothy: error: unrecognized arguments: {command[-1]}\n" in done.stderr


async def test_an_empty_register_says_so(site: Site) -> None:
    """`bothy audit` on a new site says the register is empty; --json prints no lines."""
    text = await site.bothy("audit")
    as_json = await site.bothy("audit", "--json")

    assert (text.code, text.stdout) == (0, "")
    assert text.stderr == f"bothy: the register is empty ({site.audit_path})\n"
    assert (as_json.code, as_json.stdout) == (0, "")


async def test_audit_of_an_unknown_run_says_so(site: Site) -> None:
    """`bothy audit --run run_bogus` says no record names that run."""
    await with_sops(site, "rotate")

    done = await site.bothy("audit", "--run", "run_bogus")

    assert (done.code, done.stdout) == (0, "")
    assert done.stderr == (
        f"bothy: no record of run run_bogus in the register ({site.audit_path})\n")


# --- every read in JSON, one time format --------------------------------------------------


async def test_every_read_command_speaks_json(site: Site) -> None:
    """`--json` on schedule list, sop list, profile list|show, checklist, audit verify, status."""
    await with_sops(site, "rotate")
    (site.home / "checklist.md").write_text("- Disk on / should stay under 85%.\n")
    added = await site.bothy("schedule", "add", "nightly", "--cron", "0 3 * * *", "--sop",
                             "rotate")
    assert added.code == 0, added.stderr

    def read(done: Completed) -> object:
        assert done.code == 0, done.stderr
        return json.loads(done.stdout)

    schedules = read(await site.bothy("schedule", "list", "--json"))
    sops = read(await site.bothy("sop", "list", "--json"))
    profiles = read(await site.bothy("profile", "list", "--json"))
    profile = read(await site.bothy("profile", "show", "selfcare", "--json"))
    checklist = read(await site.bothy("checklist", "--json"))
    verified = read(await site.bothy("audit", "verify", "--json"))
    status = read(await site.bothy("status", "--json"))

    assert isinstance(schedules, list) and [s["name"] for s in schedules] == ["nightly"]
    assert schedules[0]["what"] == "sop:rotate"
    assert re.fullmatch(MINUTE_ISO, schedules[0]["next_fire"])
    assert sops == [{"name": "rotate", "size_bytes": 46, "title": "Rotate the logs"}]
    assert profiles == [{"name": "selfcare", "sandbox": "read-only",
                         "tools": ["bothy_checklist"], "mcp_servers": []}]
    assert isinstance(profile, dict)
    assert (profile["name"], profile["approvals"]) == ("selfcare", {"bothy_checklist": "confirm"})
    assert checklist == ["Disk on / should stay under 85%."]
    assert isinstance(verified, dict)
    assert verified | {"last_hash": None} == {
        "ok": True, "count": 2, "problem": "", "first_bad_seq": None, "line_no": None,
        "fault": None, "last_seq": 2, "last_hash": None, "repaired_at": []}
    assert isinstance(status, dict) and status["schedules"][0]["name"] == "nightly"


async def test_schedule_list_and_status_show_times_alike(site: Site) -> None:
    """A schedule's next fire reads the same in `schedule add`, `schedule list` and `status`."""
    site.config["budget"]["timezone"] = "Europe/Paris"
    site.write_config(site.config)
    added = await site.bothy("schedule", "add", "nightly", "--cron", "0 3 * * *", "--heartbeat")
    listing = await site.bothy("schedule", "list")
    status = await site.bothy("status")

    [when] = re.findall(rf"next fire ({MINUTE_ISO})", added.stdout)
    assert when.startswith(tuple(f"20{n}" for n in range(26, 40)))
    assert re.search(r"T03:00\+0[12]:00$", when)
    assert f"next {when}" in listing.stdout, listing.stdout
    assert f"next {when}" in status.stdout, status.stdout


# --- the page's minimal config on a fresh machine ----------------------------------------


async def test_the_pages_minimal_config_names_the_key_to_set(tmp_path: Path) -> None:
    """The seed's six lines on a fresh machine: no workspace, then no ~/.codex, each an error
    naming the key to set (exit 78), from `bothy run` and from `bothy serve`."""
    site = Site(tmp_path, NO_MODEL)
    fresh_home = tmp_path / "fresh-user"
    fresh_home.mkdir()
    workspace = tmp_path / "srv-work"
    site.write_config({"site": "acme-mini", "workspace": str(workspace),
                       "pool": {"max_workers": 2},
                       "budget": {"mode": "api", "per_run_usd": 0.50, "per_day_usd": 25.0}})
    env = {"HOME": str(fresh_home), "CODEX_HOME": "",
           "PATH": f"{codex_binary().parent}{os.pathsep}{os.environ['PATH']}"}

    no_workspace = await site.bothy("run", "Reply with exactly: BOTHY", **env)
    serve_no_workspace = await site.bothy("serve", **env)
    workspace.mkdir()
    no_codex_home = await site.bothy("run", "Reply with exactly: BOTHY", **env)
    serve_no_codex_home = await site.bothy("serve", **env)

    assert no_workspace.code == 78, no_workspace.stderr
    assert f"workspace {workspace} does not exist" in no_workspace.stderr
    assert "config key 'workspace'" in no_workspace.stderr
    assert no_codex_home.code == 78, no_codex_home.stderr
    assert f"{fresh_home / '.codex'} does not exist" in no_codex_home.stderr
    assert "config key 'codex.home'" in no_codex_home.stderr
    assert "Traceback" not in no_workspace.stderr + no_codex_home.stderr
    assert (serve_no_workspace.code, serve_no_codex_home.code) == (78, 78)
    assert "config key 'workspace'" in serve_no_workspace.stderr
    assert "config key 'codex.home'" in serve_no_codex_home.stderr
