"""`bothy status`: fast, read-only, and never shows figures from a config that changed."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.fakes import github
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import Shell, until
from tests.fakes.site import Completed, Site
from tests.test_serve import SECRET, queued, records, serve_site, start_serve

SLOW_DISK = Path(__file__).parent / "fakes" / "slowdisk"
MINUTE_ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d[+-]\d\d:\d\d"


@pytest.mark.codex
async def test_status_revalidates_an_edited_config(tmp_path: Path) -> None:
    """Status reads kept figures only while config.json is unchanged; an edit is validated."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    (site.home / "state").mkdir(mode=0o700)
    first = await site.bothy("status")
    assert first.code == 0, first.stderr
    assert "ceiling 25.00 usd" in first.stdout
    assert (site.home / "state" / "config.validated").exists()

    site.config["budget"]["per_day_usd"] = "30.00"
    site.write_config(site.config)
    second = await site.bothy("status")
    assert "ceiling 30.00 usd" in second.stdout

    site.config["pool"]["max_workers"] = "two"
    site.write_config(site.config)
    broken = await site.bothy("status")
    assert broken.code == 78
    assert "pool.max_workers" in broken.stderr


@pytest.mark.codex
async def test_status_json_reports_the_day(tmp_path: Path) -> None:
    """`bothy status --json` gives the site, the day's figures, and says no daemon is running."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    done = await site.bothy("status", "--json")
    assert done.code == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["site"] == "test-site"
    assert report["used_usd"] == "0.0000"
    assert report["ceiling_usd"] == "25.00"
    assert report["running"] == [] and report["queued"] == {}
    assert report["chat"] == {} and report["serve"] == "not running"


@pytest.mark.codex
async def test_status_reads_alike_however_its_line_is_spelt(tmp_path: Path) -> None:
    """`bothy status --json` (read without argparse) and `--js` (which only the full grammar
    reads) print one report; a stray word gets status's own usage and exit 64."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    (site.home / "state").mkdir(mode=0o700)
    exact = await site.bothy("status", "--json")
    abbreviated = await site.bothy("status", "--js")
    stray = await site.bothy("status", "now")

    assert (exact.code, abbreviated.code) == (0, 0), exact.stderr + abbreviated.stderr
    assert json.loads(exact.stdout) == json.loads(abbreviated.stdout)
    assert stray.code == 64
    assert stray.stderr.startswith("usage: bothy status")
    assert "unrecognized arguments: now" in stray.stderr


@pytest.mark.codex
async def test_status_of_an_empty_state_file_says_nothing_ran(tmp_path: Path) -> None:
    """A zero-length state database (made, no tables yet) reads as a site where nothing ran,
    as a missing one does: no traceback."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    (site.home / "state").mkdir(mode=0o700)
    (site.home / "state" / "bothy.sqlite3").touch()
    done = await site.bothy("status", "--json")
    assert done.code == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["used_usd"] == "0.0000" and report["running"] == []
    assert "Traceback" not in done.stderr


async def test_status_of_a_state_file_its_maker_was_killed_making_says_nothing_ran(
    tmp_path: Path,
) -> None:
    """A state database a command was killed making (WAL set, its tables not yet made: what a
    `bothy run` SIGKILLed at its start leaves) reads as a site where nothing ran, in text and
    JSON: no traceback; the next run makes its tables and is counted."""
    import sqlite3

    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    (site.home / "state").mkdir(mode=0o700)
    made = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    made.execute("PRAGMA journal_mode = WAL")
    made.close()
    assert (site.home / "state" / "bothy.sqlite3").stat().st_size > 0

    text_done = await site.bothy("status")
    json_done = await site.bothy("status", "--json")

    assert (text_done.code, json_done.code) == (0, 0), text_done.stderr + json_done.stderr
    assert "running: 0 of 2 workers" in text_done.stdout
    assert json.loads(json_done.stdout)["running"] == []
    assert "Traceback" not in text_done.stderr + json_done.stderr


async def test_status_with_standard_output_closed_exits_cleanly(tmp_path: Path) -> None:
    """`bothy status >&-` (a cron line with its output closed): exit 0, nothing on stderr."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    process = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", 'exec "$0" -m bothy status >&-', sys.executable, env=site.env(),
        stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        _, stderr = await process.communicate()
    assert (process.returncode, stderr.decode()) == (0, "")


@pytest.mark.codex
async def test_status_shows_a_held_question(tmp_path: Path) -> None:
    """While a run holds a question, `bothy status` shows it, with how to answer it."""
    async with ModelServer() as server:
        site = Site(tmp_path, server.base_url, profiles={"selfcare": {
            "tools": ["bothy_checklist"], "approvals": {"bothy_checklist": "confirm"}}})
        server.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}), text("no"))
        async with Shell(site) as shell:
            run = await shell.start("run", "add x", "--profile", "selfcare", "--subject", "ops")
            run_id = await run.admitted()
            await run.line(r"^bothy: question: May I use bothy_checklist\?")
            shown = await shell.bothy("status")
            as_json = await shell.bothy("status", "--json")
            assert (await shell.bothy("answer", str(run_id), "no")).code == 0
            assert (await run.finish()).code == 0

    assert shown.code == 0, shown.stderr
    assert "held questions: 1\n" in shown.stdout
    [line] = [line for line in shown.stdout.splitlines() if " asks: " in line]
    assert re.fullmatch(rf"  {run_id} ops asks: May I use bothy_checklist\? .* held until"
                        rf" {MINUTE_ISO} \(bothy answer {run_id} TEXT\)", line), line
    [question] = json.loads(as_json.stdout)["held_questions"]
    assert (question["run_id"], question["kind"], question["tool"]) == (
        run_id, "approval", "bothy_checklist")


@pytest.mark.codex
async def test_status_shows_a_wake_waiting_to_be_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery refused at the budget gate waits for its retry, and `bothy status` says so."""
    monkeypatch.setenv("GH_SECRET", SECRET)
    async with ModelServer() as server:
        site = serve_site(tmp_path, server, budget={"per_run_usd": "0.50", "per_day_usd": "0.50"},
                          wakes={"retry_first_s": 600})
        server.script(text("Spent the day's money."))
        async with Shell(site) as shell:
            assert (await shell.bothy("run", "spend", "--max-usd", "0.05")).code == 0
            serving = await start_serve(shell)
            delivery = await queued(serving, github.pull_request_opened(42))
            await until(lambda: bool(records(site, "wake", "deferred")), "the wake deferred")
            shown = await shell.bothy("status")
            as_json = await shell.bothy("status", "--json")
            assert await serving.stop() == 0

    assert shown.code == 0, shown.stderr
    assert "wakes waiting to be retried: 1\n" in shown.stdout
    [line] = [line for line in shown.stdout.splitlines() if f" {delivery} " in line]
    assert re.fullmatch(rf"  webhook github {delivery} next try {MINUTE_ISO}: attempt 1"
                        r" refused: .*against a 0\.50 ceiling.*", line), line
    [waiting] = json.loads(as_json.stdout)["wakes_waiting"]
    assert (waiting["key"], waiting["attempts"]) == (delivery, 1)


_STATUS_AND_PSUTIL = (
    "import sys\n"
    "from bothy.cli import main\n"
    "code = main(['status', '--json'])\n"
    "print('psutil loaded' if 'psutil' in sys.modules else 'psutil not loaded', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


async def _python(site: Site, code: str) -> Completed:
    """``python -c code`` in the site's environment, as a `bothy` command would run."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=site.env(), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return Completed(process.returncode, stdout.decode(), stderr.decode())


async def _serve_line(site: Site) -> str:
    done = await site.bothy("status", "--json")
    assert done.code == 0, done.stderr
    return str(json.loads(done.stdout)["serve"])


@pytest.mark.codex
async def test_status_tells_a_running_serve_from_a_killed_one_whose_pid_was_taken(
    server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside a running `bothy serve`, status shows it ready, told by the serve's lock without
    loading the process table; once it is SIGKILLed, status says it is gone, and still does
    when its published pid belongs to another live process (a pid taken again)."""
    monkeypatch.setenv("GH_SECRET", SECRET)
    site = serve_site(tmp_path, server, codex={"spare": False})
    published = site.home / "state" / "serve.json"
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        pid = serving.command.pid
        live = await site.bothy("status")
        checked = await _python(site, _STATUS_AND_PSUTIL)
        await serving.command.kill()
        killed = await _serve_line(site)

        other = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; sys.stdin.read()", stdin=asyncio.subprocess.PIPE)
        try:
            state = json.loads(published.read_text())
            published.write_text(json.dumps({**state, "pid": other.pid}))
            taken = await _serve_line(site)
        finally:
            assert other.stdin is not None
            other.stdin.close()
            await other.wait()

    assert f"bothy serve: ready (pid {pid}, ports" in live.stdout, live.stdout
    assert checked.code == 0, checked.stderr
    assert json.loads(checked.stdout)["serve"].startswith(f"ready (pid {pid}, ports")
    assert "psutil not loaded" in checked.stderr
    assert killed == f"not running (pid {pid} is gone: it did not stop cleanly)"
    assert taken == f"not running (pid {other.pid} is gone: it did not stop cleanly)"


@pytest.mark.codex
async def test_a_serve_is_not_recorded_ready_before_status_can_see_it_ready(
    server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve ready` waits for the serve's published state: with the fsync of `serve.json`
    saying ready held (a slow disk), the register says no `serve ready`; once it is durable,
    the record follows and status, asked next, shows the serve ready."""
    monkeypatch.setenv("GH_SECRET", SECRET)
    site = serve_site(tmp_path, server, codex={"spare": False})
    hold = tmp_path / "hold"
    site.extra_env.update({"PYTHONPATH": str(SLOW_DISK),
                           "FAKE_SLOW_FSYNC_MARK": '"state": "ready"',  # serve.json's form
                           "FAKE_SLOW_FSYNC_WHILE": str(hold)})
    hold.touch()
    async with Shell(site) as shell:
        command = await shell.start("serve")
        await until(lambda: (tmp_path / "hold.holding").exists() or not command.running,
                    "serve.json's fsync held")
        ready_while_held = records(site, "serve", "ready")
        hold.unlink()
        await until(lambda: bool(records(site, "serve", "ready")) or not command.running,
                    "`serve ready`")
        shown = await _serve_line(site)
        command.signal(signal.SIGTERM)
        stopped = await command.finish()

    assert stopped.code == 0, stopped.stderr

    assert ready_while_held == []
    assert shown.startswith(f"ready (pid {command.pid}, ports"), shown


async def test_status_during_a_repair_still_says_a_killed_serve_is_gone(
    tmp_path: Path,
) -> None:
    """While a register repair holds the serve lock that a killed serve left its pid in, and
    that pid is a live process's again, status still says the serve is gone."""
    from bothy.servelock import serve_holding

    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    state = site.home / "state"
    state.mkdir(mode=0o700)
    other = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; sys.stdin.read()", stdin=asyncio.subprocess.PIPE)
    try:
        # What a serve SIGKILLed while ready leaves, its pid since given to ``other``.
        (state / "serve.lock").write_text(str(other.pid))
        (state / "serve.json").write_text(json.dumps(
            {"pid": other.pid, "pid_start": "1@1", "state": "ready", "ports": {}}))
        with serve_holding(state / "serve.lock", doing="repair the register"):
            during = await _serve_line(site)
    finally:
        assert other.stdin is not None
        other.stdin.close()
        await other.wait()

    assert during == f"not running (pid {other.pid} is gone: it did not stop cleanly)"


async def test_a_serve_starting_while_a_status_looks_at_its_lock_starts(tmp_path: Path) -> None:
    """A status's look at the lock (a killed serve's pid given to another process) holds it
    for an instant: a serve starting then waits for it instead of being refused as if another
    serve ran; a lock held for good (a serve that runs) is still refused, naming its pid."""
    import fcntl
    import os

    from bothy.errors import TemporaryFailure
    from bothy.servelock import single_instance

    lock = tmp_path / "serve.lock"
    lock.write_text("4242")
    looking = os.open(lock, os.O_RDONLY)
    fcntl.flock(looking, fcntl.LOCK_SH | fcntl.LOCK_NB)  # what serve_alive holds, briefly
    asyncio.get_running_loop().call_later(0.01, os.close, looking)
    async with single_instance(lock):
        started = lock.read_text()

    holding = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(holding, fcntl.LOCK_SH | fcntl.LOCK_NB)
        with pytest.raises(TemporaryFailure) as refused:
            async with single_instance(lock):
                pass
    finally:
        os.close(holding)

    assert started == str(os.getpid())
    assert f"another bothy serve (pid {os.getpid()}) holds {lock}" in str(refused.value)


async def test_a_serve_starting_during_a_register_repair_is_told_what_holds_the_lock(
    tmp_path: Path,
) -> None:
    """A repair holds the serve lock with no pid in it: a serve starting meanwhile says a
    repair holds it, not that another serve runs."""
    from bothy.errors import TemporaryFailure
    from bothy.servelock import serve_holding, single_instance

    lock = tmp_path / "serve.lock"
    lock.write_text("4242")  # a dead serve's pid, which the repair empties
    with serve_holding(lock, doing="repair the register"), \
            pytest.raises(TemporaryFailure) as refused:
        async with single_instance(lock):
            pass

    assert str(refused.value) == (f"{lock} is held by a bothy that is not a serve (a register "
                                  "repair); not starting until it is done")
