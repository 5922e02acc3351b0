"""Proofs of ``bothy run`` end to end: the real CLI, the real codex binary, a scripted model.

Every test runs ``python -m bothy`` as a subprocess against a throwaway ``$BOTHY_HOME``
(:class:`tests.fakes.site.Site`) whose codex talks to a :class:`ModelServer` on loopback, and
asserts what an operator sees: the printed line, the exit code, the audit register.
"""

from __future__ import annotations

import json
import re
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.codex import PROVIDER_ENV
from tests.fakes.model_server import ModelServer, failed, http_error, stall, text, tool_call
from tests.fakes.shell import Shell
from tests.fakes.site import Completed, Site, operator_home

RUN_ID = re.compile(r"run_\d{8}T\d{6}Z_[0-9a-f]{8}")
RUN_LINE = re.compile(r"^(?P<outcome>\S+) (?P<run_id>\S+) (?P<usd>\d+\.\d{4}) usd(?P<rest>.*)$")
AUDIT_LINE = re.compile(
    r"^(?P<seq>\d{4,}) (?P<ts>\S+) (?P<kind>\S+) (?P<event>\S+) (?P<outcome>\S+) "
    r"(?P<subject>\S+) (?P<run_id>\S+)$"
)


# --- fixtures and helpers -------------------------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


@pytest.fixture
def site(tmp_path: Path, server: ModelServer) -> Site:
    return Site(tmp_path, server.base_url)


def run_line(done: Completed) -> re.Match[str]:
    """The one line ``bothy run`` prints on stdout, parsed."""
    lines = done.stdout.splitlines()
    assert len(lines) == 1, f"expected one line on stdout, got {done.stdout!r} ({done.stderr})"
    match = RUN_LINE.match(lines[0])
    assert match, f"not a run line: {lines[0]!r}"
    assert RUN_ID.fullmatch(match["run_id"]), match["run_id"]
    return match


async def audit_events(site: Site, run_id: str) -> list[tuple[str, str, str]]:
    """(kind, event, outcome) of each of the run's records, as ``bothy audit --run`` prints."""
    done = await site.bothy("audit", "--run", run_id)
    assert done.code == 0, done.stderr
    events = []
    for line in done.stdout.splitlines():
        match = AUDIT_LINE.match(line)
        assert match, f"not an audit line: {line!r}"
        # The wake has no run yet (`-`): it is found through the wake id its run names.
        assert match["run_id"] == (run_id if match["kind"] != "wake" else "-"), line
        events.append((match["kind"], match["event"], match["outcome"]))
    return events


async def audit_records(site: Site, run_id: str) -> list[dict[str, Any]]:
    """The run's records as ``bothy audit --run ID --json`` prints them."""
    done = await site.bothy("audit", "--run", run_id, "--json")
    assert done.code == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def live_members(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
        fields = raw[raw.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


# --- a completed run ------------------------------------------------------------------


@pytest.mark.codex
async def test_completed_run_prints_outcome_id_cost_and_answer(
    site: Site, server: ModelServer
) -> None:
    """A completed run prints its outcome, id, settled cost and answer, and exits 0."""
    server.script(text("BOTHY"))

    done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "demo")

    assert done.code == 0, done.stderr
    match = run_line(done)
    assert done.stdout == f"completed {match['run_id']} 0.0152 usd BOTHY\n"


@pytest.mark.codex
async def test_completed_run_is_audited_from_wake_to_finish(
    site: Site, server: ModelServer
) -> None:
    """Every step of a completed run is an audit line carrying its run id, in order."""
    server.script(text("BOTHY"))
    done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "demo")
    run_id = run_line(done)["run_id"]

    events = await audit_events(site, run_id)

    expected = [
        ("wake", "received", "ok"),
        ("run", "admitted", "ok"),
        ("run", "started", "ok"),
        ("worker", "stopped", "ok"),
        ("budget", "settled", "ok"),
        ("run", "finished", "ok"),
    ]
    assert [event for event in events if event in expected] == expected
    listing = await site.bothy("audit")
    grepped = [line for line in listing.stdout.splitlines() if line.endswith(f" {run_id}")]
    filtered = await site.bothy("audit", "--run", run_id)
    assert filtered.stdout.splitlines()[1:] == grepped
    assert filtered.stdout.splitlines()[0].endswith(" wake received ok demo -")
    assert grepped[0].endswith(f" run admitted ok demo {run_id}")
    assert grepped[-1].endswith(f" run finished ok demo {run_id}")


@pytest.mark.codex
async def test_audit_json_and_verify_describe_the_run(site: Site, server: ModelServer) -> None:
    """`bothy audit --run ID --json` prints one JSON record per line; verify counts them all."""
    server.script(text("BOTHY"))
    done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "demo")
    run_id = run_line(done)["run_id"]

    records = await audit_records(site, run_id)
    verified = await site.bothy("audit", "verify")

    wake, *of_run = records
    assert (wake["kind"], wake["event"], wake["run_id"]) == ("wake", "received", None)
    assert of_run and all(record["run_id"] == run_id for record in of_run)
    assert of_run[0]["details"]["wake_id"] == wake["details"]["wake_id"]
    finished = records[-1]
    assert (finished["kind"], finished["event"], finished["outcome"]) == (
        "run", "finished", "ok"
    )
    assert finished["details"]["cost_usd"] == "0.015200"
    total = len(site.audit_lines())
    assert verified.code == 0
    assert verified.stdout == f"audit chain intact: {total} records verified\n"


@pytest.mark.codex
async def test_no_reply_is_never_shown(site: Site, server: ModelServer) -> None:
    """A final text of NO_REPLY completes the run but shows nothing after the cost."""
    server.script(text("NO_REPLY"))

    done = await site.bothy("run", "Anything to report?", "--subject", "heartbeat")

    assert done.code == 0, done.stderr
    match = run_line(done)
    assert done.stdout == f"completed {match['run_id']} 0.0152 usd\n"
    assert "NO_REPLY" not in done.stderr


# --- failures and refusals ------------------------------------------------------------


@pytest.mark.codex
async def test_provider_error_fails_the_run_and_settles_its_reservation(
    site: Site, server: ModelServer
) -> None:
    """HTTP 500 from the provider: the run fails with the reason, and nothing stays reserved."""
    server.script(http_error(500, '{"error": {"message": "upstream on fire", "type": "x"}}'))

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 1, done.stderr
    match = run_line(done)
    assert match["outcome"] == "failed"
    assert match["usd"] == "0.0000"
    # Codex does not relay the provider's body; its error code says the provider failed.
    assert match["rest"].endswith(" (codex error: internalServerError)"), match["rest"]
    status = await site.bothy("status")
    assert status.code == 0, status.stderr
    assert "0.0000 usd reserved" in status.stdout
    events = await audit_events(site, match["run_id"])
    assert events[-1] == ("run", "finished", "failed")


@pytest.mark.codex
async def test_a_provider_that_cannot_be_reached_fails_the_run(tmp_path: Path) -> None:
    """Nothing listening at the provider's address: the run fails saying so, nothing reserved."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    site = Site(tmp_path, f"http://127.0.0.1:{port}/v1")

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 1, done.stderr
    match = run_line(done)
    assert (match["outcome"], match["usd"]) == ("failed", "0.0000")
    assert "Connection failed" in match["rest"] and "httpConnectionFailed" in match["rest"]
    status = await site.bothy("status")
    assert "0.0000 usd reserved" in status.stdout


@pytest.mark.codex
async def test_a_failed_response_stream_fails_the_run_with_its_message(
    site: Site, server: ModelServer
) -> None:
    """A response.failed event: the run fails carrying the provider's own message."""
    server.script(failed("the bothy roof fell in"))

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 1, done.stderr
    match = run_line(done)
    assert match["outcome"] == "failed"
    assert "stream disconnected before completion: the bothy roof fell in" in match["rest"]


@pytest.mark.codex
async def test_a_model_without_a_price_is_refused_at_the_budget_gate(
    tmp_path: Path, server: ModelServer
) -> None:
    """No price for the model Codex runs: refused at gate 'budget', naming the model; exit 3."""
    site = Site(tmp_path, server.base_url)
    site.config["budget"]["prices"] = {}
    site.write_config(site.config)
    server.script(text("should not be asked"))

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 3, done.stderr
    match = run_line(done)
    assert match["outcome"] == "refused"
    assert match["usd"] == "0.0000"
    assert match["rest"].startswith(
        " refused at gate 'budget': no price for model 'fake-model' "
    ), match["rest"]
    events = await audit_events(site, match["run_id"])
    assert ("run", "refused", "refused") in events
    assert events[-1] == ("run", "finished", "refused")
    assert server.requests == []


@pytest.mark.codex
async def test_a_configured_unpriced_model_is_refused_before_the_run_has_a_worker(
    tmp_path: Path, server: ModelServer
) -> None:
    """codex.model without a price: refused at the gate; the run never has a worker (no `run
    started`; the codex spawned ahead of it is ended unused: tests/test_head_start.py)."""
    site = Site(tmp_path, server.base_url, codex={"model": "pricey-model"})

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 3, done.stderr
    match = run_line(done)
    assert match["outcome"] == "refused"
    assert match["rest"].startswith(
        " refused at gate 'budget': no price for model 'pricey-model' "
    ), match["rest"]
    events = await audit_events(site, match["run_id"])
    assert ("run", "refused", "refused") in events
    assert ("run", "started", "ok") not in events
    assert all(kind != "worker" for kind, _, _ in events)


# --- limits ---------------------------------------------------------------------------


@pytest.mark.codex
async def test_max_tokens_stops_the_run_with_token_limit(site: Site, server: ModelServer) -> None:
    """A reply of 128 tokens against --max-tokens 50 ends the run as token_limit, exit 4."""
    server.script(text("a long answer"))

    done = await site.bothy("run", "hello", "--subject", "demo", "--max-tokens", "50")

    assert done.code == 4, done.stderr
    match = run_line(done)
    assert done.stdout == f"token_limit {match['run_id']} 0.0152 usd used 128 tokens, limit 50\n"
    events = await audit_events(site, match["run_id"])
    assert events[-1] == ("run", "finished", "token_limit")


@pytest.mark.codex
async def test_wall_clock_stops_a_stalled_run_and_ends_its_process_group(
    site: Site, server: ModelServer
) -> None:
    """A stalled model past --wall-clock 2: timed_out, exit 4, and no live worker remains."""
    server.script(stall("thinking"))

    done = await site.bothy("run", "hello", "--subject", "demo", "--wall-clock", "2")

    assert done.code == 4, done.stderr
    match = run_line(done)
    assert done.stdout == f"timed_out {match['run_id']} 0.0000 usd wall clock of 2 s reached\n"
    records = await audit_records(site, match["run_id"])
    started = [r for r in records if (r["kind"], r["event"]) == ("run", "started")]
    assert len(started) == 1
    pgid = started[0]["details"]["pgid"]
    assert isinstance(pgid, int) and pgid > 1
    assert live_members(pgid) == []
    assert (records[-1]["event"], records[-1]["outcome"]) == ("finished", "timed_out")


@pytest.mark.codex
async def test_a_second_stop_signal_skips_the_waits_yet_the_run_is_settled(
    site: Site, server: ModelServer
) -> None:
    """SIGINT then SIGTERM while the model stalls: the second skips the graceful stop (exit 5,
    saying so), yet the run is still settled `cancelled` and its worker group is ended."""
    server.script(stall("thinking"))

    async with Shell(site) as shell:
        run = await shell.start("run", "hello", "--subject", "demo")
        run_id = await run.admitted()
        assert run_id is not None
        await run.line(r"^bothy: started ")
        run.signal(signal.SIGINT)
        run.signal(signal.SIGTERM)  # a different signal: the kernel cannot fold it into the first
        done = await run.finish()

    assert done.code == 5, (done.stdout, done.stderr)
    assert "bothy: stopped by a second signal before the run could settle" in done.stderr
    records = await audit_records(site, run_id)
    assert (records[-1]["kind"], records[-1]["event"], records[-1]["outcome"]) == (
        "run", "finished", "cancelled")
    [started] = [r for r in records if (r["kind"], r["event"]) == ("run", "started")]
    assert live_members(started["details"]["pgid"]) == []


# --- tools and secrets ----------------------------------------------------------------


@pytest.mark.codex
async def test_an_escalation_request_is_declined_and_audited(
    site: Site, server: ModelServer
) -> None:
    """A worker's request to run outside the sandbox is declined, audited, and never runs."""
    server.script(
        tool_call("exec_command", {"cmd": "touch escalated.txt",
                                   "sandbox_permissions": "require_escalated",
                                   "justification": "test"}),
        text("done"),
    )

    done = await site.bothy("run", "make a file", "--subject", "demo")

    assert done.code == 0, done.stderr
    match = run_line(done)
    assert done.stdout == f"completed {match['run_id']} {match['usd']} usd done\n"
    events = await audit_events(site, match["run_id"])
    assert ("tool", "refused", "refused") in events
    assert not (site.workspace / "escalated.txt").exists()
    told = [item["output"] for item in server.requests[1]["input"]
            if item.get("type") == "function_call_output"]
    assert len(told) == 1 and "rejected" in json.dumps(told[0])


@pytest.mark.codex
async def test_bothys_own_secrets_never_reach_the_worker(site: Site, server: ModelServer) -> None:
    """The worker's environment, printed by a shell tool, holds none of Bothy's secrets."""
    slack_token = "xoxb-secret-test"
    webhook_secret = "whsec-never-to-be-seen-4711"
    server.script(tool_call("exec_command", {"cmd": "env"}), text("done"))

    done = await site.bothy(
        "run", "print the environment", "--subject", "demo",
        SLACK_BOT_TOKEN=slack_token, BOTHY_WEBHOOK_SECRET=webhook_secret,
    )

    assert done.code == 0, done.stderr
    assert len(server.requests) == 2
    outputs = [item for item in server.requests[1]["input"]
               if item.get("type") == "function_call_output"]
    assert len(outputs) == 1
    printed = json.dumps(outputs[0]["output"])
    assert "CODEX_HOME=" in printed and "PATH=" in printed
    assert slack_token not in printed
    assert webhook_secret not in printed
    assert "SLACK_BOT_TOKEN" not in printed


@pytest.mark.codex
async def test_the_models_shell_commands_see_no_key_codex_was_given(
    tmp_path: Path, server: ModelServer
) -> None:
    """Every codex.env variable, and anything named like a key, token or secret, is kept from
    the shell commands codex runs for the model; codex itself still reaches its provider."""
    passed = {"DEPLOY_LOGIN": "deploy-login-5521", "ACME_ACCESS_TOKEN": "acme-token-8830"}
    site = Site(tmp_path, server.base_url,
                codex={"env": [*PROVIDER_ENV, *passed]})
    server.script(tool_call("exec_command", {"cmd": "env"}), text("done"))

    done = await site.bothy("run", "print the environment", "--subject", "demo", **passed)

    assert done.code == 0, done.stderr
    outputs = [item for item in server.requests[1]["input"]
               if item.get("type") == "function_call_output"]
    assert len(outputs) == 1
    printed = json.dumps(outputs[0]["output"])
    assert "PATH=" in printed and "CODEX_HOME=" in printed  # the command did print env
    for name, value in {**PROVIDER_ENV, **passed}.items():
        assert name not in printed
        assert value not in printed


@pytest.mark.codex
async def test_a_secret_the_workers_shell_startup_files_export_reaches_the_model(
    tmp_path: Path, server: ModelServer
) -> None:
    """Why `bothy doctor` checks the worker user's shell startup files: codex reads them for
    the model's commands, so a variable exported there reaches the model past every exclude
    Bothy sets (engine/workershell.py). Which files depends on timing: the shell snapshot, a
    login shell's, reads the profile once it is taken; a command run before it still gets
    ~/.bashrc (bash reads it when its input is a socket). So both hold the export here.
    Should a codex release stop reading them, this fails, and the doctor's check can go."""
    export = "export OPERATOR_API_TOKEN=leak-9931\n"
    home = operator_home(tmp_path / "operator", {".bash_profile": export, ".bashrc": export})
    site = Site(tmp_path / "site", server.base_url)
    server.script(tool_call("exec_command", {"cmd": "env"}), text("done"))

    done = await site.bothy("run", "print the environment", "--subject", "demo",
                            HOME=str(home))

    assert done.code == 0, done.stderr
    outputs = [item for item in server.requests[1]["input"]
               if item.get("type") == "function_call_output"]
    printed = json.dumps(outputs[0]["output"])
    assert "PATH=" in printed  # the command did print env
    assert "OPERATOR_API_TOKEN=leak-9931" in printed


@pytest.mark.parametrize(("inline", "key"), [
    ({"model_providers": {"fake": {"experimental_bearer_token": "hunter2-4471"}}},
     "codex.config.model_providers.fake.experimental_bearer_token"),
    ({"mcp_servers": {"gh": {"command": "gh-mcp", "env": {"GITHUB_TOKEN": "hunter2-4471"}}}},
     "codex.config.mcp_servers.gh.env.GITHUB_TOKEN"),
    ({"notify_note": "sk-proj-hunter2-4471"}, "codex.config.notify_note"),
])
async def test_a_secret_inline_in_codex_config_is_refused_naming_its_key(
    site: Site, inline: dict[str, Any], key: str
) -> None:
    """A secret-looking value in codex.config would show in `ps` on the worker's command line:
    `bothy run` exits 78 naming the key and the way to pass it, never echoing the value."""
    site.config["codex"]["config"] = {**site.config["codex"]["config"], **inline}
    site.write_config(site.config)

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 78
    assert f"{key} holds what looks like a secret" in done.stderr
    assert "codex.env" in done.stderr and "0600" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


# --- usage errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hello", "--max-usd", "9"], "--max-usd 9 is more than budget.per_run_usd (0.50)"),
        (["hello", "--max-usd", "abc"], "--max-usd 'abc' is not an amount in usd"),
        (["hello", "--max-usd", "0"], "--max-usd must be more than 0"),
        (["hello", "--max-usd", "nan"], "--max-usd 'nan' is not an amount in usd"),
        (["hello", "--max-usd", "Infinity"], "--max-usd 'Infinity' is not an amount in usd"),
        (["hello", "--subject", "a b"], "--subject 'a b' must be one word"),
        (["   "], "the prompt is empty"),
        (["hello", "--wall-clock", "0"], "--wall-clock must be a positive number, not 0"),
        (["hello", "--max-tokens", "-5"], "--max-tokens must be a positive number, not -5"),
        (["hello", "--wall-clock", "soon"], "--wall-clock: invalid int value: 'soon'"),
        (["hello", "--wall-clock", "61"],
         "--wall-clock 61 is above the configured limits.wall_clock_s (60): a flag may tighten"
         " a limit, not loosen it"),
    ],
)
@pytest.mark.codex
async def test_bad_run_arguments_are_usage_errors(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """An argument `bothy run` cannot honour exits 64 with a message naming it; nothing runs."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")

    done = await site.bothy("run", *args)

    assert done.code == 64
    assert message in done.stderr
    assert done.stdout == ""
    assert not site.audit_path.exists() or site.audit_lines() == []


@pytest.mark.codex
async def test_cancelling_an_unknown_run_is_a_usage_error(tmp_path: Path) -> None:
    """`bothy cancel` of a run this site never saw exits 64, naming the run."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")

    done = await site.bothy("cancel", "run_nope")

    assert done.code == 64
    assert "no run 'run_nope'" in done.stderr


# --- codex missing --------------------------------------------------------------------


@pytest.mark.codex
async def test_a_missing_codex_is_a_configuration_error(tmp_path: Path) -> None:
    """codex.command naming no file: `bothy run` exits 78 naming it; nothing is admitted."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1",
                codex={"command": ["/nonexistent/codex", "app-server"]})

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 78
    assert "/nonexistent/codex" in done.stderr
    assert done.stdout == ""
    assert not site.audit_path.exists() or site.audit_lines() == []


@pytest.mark.codex
async def test_doctor_fails_the_codex_check_when_codex_is_missing(tmp_path: Path) -> None:
    """`bothy doctor` with a missing codex fails its `codex present` line and exits 1."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1",
                codex={"command": ["/nonexistent/codex", "app-server"]})

    done = await site.bothy("doctor")

    assert done.code == 1, done.stdout
    failing = [line for line in done.stdout.splitlines()
               if line.startswith("[fail] codex present")]
    assert len(failing) == 1
    assert "/nonexistent/codex" in failing[0]
    assert re.search(r"^\d+ passed, \d+ warned, [1-9]\d* failed$", done.stdout, re.MULTILINE)


@pytest.mark.codex
async def test_a_codex_that_is_not_executable_is_a_configuration_error(tmp_path: Path) -> None:
    """A codex file without the execute bit: `bothy run` exits 78, doctor fails the check."""
    fake = tmp_path / "codex"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o644)
    site = Site(tmp_path, "http://127.0.0.1:9/v1", codex={"command": [str(fake), "app-server"]})

    done = await site.bothy("run", "hello", "--subject", "demo")
    doctor = await site.bothy("doctor")

    assert done.code == 78
    assert f"{str(fake)!r} is not an executable file" in done.stderr
    assert doctor.code == 1
    assert any(line.startswith("[fail] codex present") and str(fake) in line
               for line in doctor.stdout.splitlines())
