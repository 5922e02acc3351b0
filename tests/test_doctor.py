"""`bothy doctor`: the product page's eight checks first, in its order with its labels, always.

Every test runs the real CLI against a throwaway site with the pinned codex binary.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import shutil
import sys
import time
from pathlib import Path

import certifi
import psutil
import pytest

from bothy.engine.launch import SHELL_EXCLUDES, Launch
from bothy.engine.workershell import exported_by_startup_files, worker_shell
from tests.fakes.codex import REPO_ROOT, codex_binary
from tests.fakes.shell import until
from tests.fakes.site import Completed, Site, operator_home

SEED_LABELS = [
    "state directory writable",
    "audit chain intact",
    "codex present",
    "cairn reachable",
    "memory FTS5",
    "no orphaned workers",
    "sandbox can start",
    "alert route configured",
]
LINE = re.compile(r"^\[(?P<status>ok |warn|fail)\] (?P<label>[^:]+): (?P<detail>.+)$")
SUMMARY = re.compile(r"^(?P<ok>\d+) passed, (?P<warn>\d+) warned, (?P<fail>\d+) failed$")
SHELL_WARNING = " — runs needing a shell will fail"


def checks(done: Completed) -> dict[str, tuple[str, str]]:
    """label -> (status, detail) of the doctor's check lines; asserts the page's shape."""
    lines = done.stdout.splitlines()
    parsed = [LINE.match(line) for line in lines[:-1] if not line.startswith("  ")]
    assert all(parsed), done.stdout
    found = [match for match in parsed if match is not None]
    assert [match["label"] for match in found[:8]] == SEED_LABELS, done.stdout
    summary = SUMMARY.match(lines[-1])
    assert summary, lines[-1]
    statuses = [match["status"].strip() for match in found]
    assert [int(summary[s]) for s in ("ok", "warn", "fail")] == [
        statuses.count(s) for s in ("ok", "warn", "fail")]
    return {match["label"]: (match["status"].strip(), match["detail"]) for match in found}


@pytest.mark.codex
async def test_doctor_on_a_healthy_site_prints_the_pages_eight_lines(tmp_path: Path) -> None:
    """A healthy site: the eight lines in the page's forms, the count, and exit 0."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")

    done = await site.bothy("doctor")

    assert done.code == 0, done.stdout + done.stderr
    found = checks(done)
    assert found["state directory writable"] == ("ok", str(site.home / "state"))
    assert found["audit chain intact"] == ("ok", "0 records verified")
    status, version = found["codex present"]
    assert status == "ok" and re.fullmatch(r"codex-cli \d+\.\d+\.\d+", version), version
    assert found["cairn reachable"] == (
        "warn", "cairn command 'cairn' not found on PATH — runs with --ref go on without a task"
                " ledger")
    assert found["memory FTS5"] == (
        "ok", "FTS5 search; missing FTS5 uses a case-insensitive scan")
    assert found["no orphaned workers"] == (
        "ok", "0 process group(s) left by a previous instance")
    # Whether this machine's sandbox starts is the machine's business; a failure is a warning.
    sandbox = found["sandbox can start"]
    assert sandbox == ("ok", "codex sandbox runs a command") or (
        sandbox[0] == "warn" and sandbox[1].endswith(SHELL_WARNING)), sandbox
    assert found["alert route configured"][0] == "warn"
    assert found["alert route configured"][1].startswith(
        "a failure nobody hears about is not handled")
    assert "Traceback" not in done.stderr


@pytest.mark.codex
async def test_doctor_json_gives_the_same_checks(tmp_path: Path) -> None:
    """`bothy doctor --json` gives each check's status, label and detail, and the counts."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")

    done = await site.bothy("doctor", "--json")

    assert done.code == 0, done.stderr
    report = json.loads(done.stdout)
    assert [check["name"] for check in report["checks"][:8]] == SEED_LABELS
    statuses = [check["status"] for check in report["checks"]]
    assert (report["passed"], report["warned"], report["failed"]) == (
        statuses.count("ok"), statuses.count("warn"), statuses.count("fail"))
    assert report["checks"][1] == {"status": "ok", "name": "audit chain intact",
                                   "detail": "0 records verified"}


@pytest.mark.codex
async def test_doctor_with_an_invalid_config_still_prints_the_eight(tmp_path: Path) -> None:
    """An invalid config: the eight still print, those needing the config fail naming it; 78."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    site.config["budget"]["per_ran_usd"] = "0.50"
    site.write_config(site.config)

    done = await site.bothy("doctor")

    assert done.code == 78, done.stdout + done.stderr
    found = checks(done)
    config = site.home / "config.json"
    needs = f"needs a valid config: {config} is not (see 'config valid' below)"
    for label in ("codex present", "no orphaned workers", "sandbox can start",
                  "alert route configured"):
        assert found[label] == ("fail", needs), label
    assert found["state directory writable"][0] == "ok"
    assert found["audit chain intact"][0] == "ok"
    assert found["config valid"][0] == "fail"
    assert "budget.per_ran_usd: unknown key" in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.codex
async def test_doctor_with_an_unwritable_state_directory_still_prints_the_eight(
    tmp_path: Path,
) -> None:
    """The state directory cannot be made (a file is in its way): the eight print, and fail."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    state = site.home / "state"
    state.write_text("not a directory")

    done = await site.bothy("doctor")

    assert done.code == 1, done.stdout + done.stderr
    found = checks(done)
    status, detail = found["state directory writable"]
    assert status == "fail" and str(state) in detail, detail
    assert found["audit chain intact"][0] == "fail"
    assert found["no orphaned workers"][0] == "fail"
    assert str(state) in found["no orphaned workers"][1]
    assert found["codex present"][0] == "ok"
    assert "Traceback" not in done.stderr


@pytest.mark.codex
async def test_a_sandbox_that_cannot_start_is_a_warning(tmp_path: Path) -> None:
    """Codex's sandbox failing as bwrap does in a container is `[warn]`, in the page's words."""
    # A codex that is the real one except that its sandbox fails, as on a machine that
    # forbids user namespaces (this one allows them, so the failure is staged).
    wrapper = tmp_path / "codex"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = sandbox ]; then\n'
        '  echo "bwrap: loopback: Operation not permitted" >&2; exit 1\n'
        "fi\n"
        f'exec {codex_binary()} "$@"\n')
    wrapper.chmod(0o755)
    site = Site(tmp_path, "http://127.0.0.1:9/v1",
                codex={"command": [str(wrapper), "app-server"]})

    done = await site.bothy("doctor")

    assert done.code == 0, done.stdout + done.stderr
    assert ("[warn] sandbox can start: bwrap: loopback: Operation not permitted"
            f"{SHELL_WARNING}\n") in done.stdout


@pytest.mark.codex
async def test_doctor_names_the_profiles_that_force_the_memory_scan(tmp_path: Path) -> None:
    """The FTS5 probe really ran ([ok ]), and profiles set to "search": "scan" are named."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1",
                profiles={"ops": {"memory": {"search": "scan"}}, "chat": {"memory": True}})

    found = checks(await site.bothy("doctor"))

    assert found["memory FTS5"] == ("ok", "FTS5 search; missing FTS5 uses a case-insensitive"
                                          " scan (profiles forcing the scan: ops)")


@pytest.mark.codex
async def test_doctor_says_when_no_ca_certificate_is_trusted(tmp_path: Path) -> None:
    """OpenSSL skips an `SSL_CERT_FILE` that holds no certificate without a word, and a FIFO
    there would hold every TLS start: doctor warns of both, naming the variable and what to
    do, and counts a real bundle's certificates (certifi's: httpx brings it)."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    garbage = tmp_path / "not-a-bundle.pem"
    garbage.write_text("this is not a certificate\n")
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)

    found = {name: checks(await site.bothy("doctor", timeout_s=60.0, SSL_CERT_FILE=str(path)))
             for name, path in (("garbage", garbage), ("fifo", fifo),
                                ("bundle", Path(certifi.where())))}

    assert found["garbage"]["trusted certificates"] == (
        "warn", f"no CA certificate is trusted (SSL_CERT_FILE={garbage}): connections to Slack,"
                " Discord or an https collector will be refused; point SSL_CERT_FILE at a PEM"
                " bundle, or install the system's (Debian: ca-certificates)")
    assert found["fifo"]["trusted certificates"] == (
        "warn", f"SSL_CERT_FILE={fifo} is not a regular file: point it at a PEM bundle, or"
                " unset it")
    status, detail = found["bundle"]["trusted certificates"]
    assert status == "ok" and re.fullmatch(
        rf"\d{{2,}} CA certificates \(SSL_CERT_FILE={re.escape(certifi.where())}\)", detail), detail


BASH = worker_shell({"PATH": os.defpath})  # the shell codex runs the model's commands in here
needs_bash = pytest.mark.skipif(
    not BASH.endswith("/bash"),
    reason=f"this account's commands run in {BASH}, not bash: the startup files here are bash's")
# What a stock Debian ~/.bashrc begins with: the rest is for interactive shells only.
INTERACTIVE_ONLY = "case $- in\n    *i*) ;;\n      *) return;;\nesac\n"


@needs_bash
@pytest.mark.codex
async def test_doctor_names_the_secrets_the_workers_shell_startup_files_export(
    tmp_path: Path,
) -> None:
    """Codex reads the worker account's shell startup files for the model's commands, past
    Bothy's excludes (tests/test_run_cli.py shows it): doctor names every variable named like
    a secret, or listed in codex.env, that they export as codex starts the shell (a login
    shell; a plain one reading a socket), never a value. Not named: a variable named
    otherwise, a codex.env key Bothy itself hands codex (the model's shell never gets that
    one from Bothy), and what ~/.bashrc exports past its interactive-only guard. SHELL is
    not what codex goes by (cron sets /bin/sh): neither does doctor."""
    home = operator_home(tmp_path / "operator", {
        ".bash_profile": "echo 'welcome to the mini'\nexport OPERATOR_API_TOKEN=leak-9931\n"
                         "export PLAIN_SETTING=plain-5512\n",
        ".bashrc": "export DEPLOY_SECRET=leak-2207\nexport DEPLOY_LOGIN=leak-6620\n"
                   + INTERACTIVE_ONLY + "export INTERACTIVE_TOKEN=leak-4410\n",
    })
    site = Site(tmp_path / "site", "http://127.0.0.1:9/v1",
                codex={"env": ["DEPLOY_LOGIN", "ACME_ACCESS"]})

    done = await site.bothy("doctor", HOME=str(home), SHELL="/bin/sh",
                            ACME_ACCESS="handed-by-bothy-3318")

    assert done.code == 0, done.stdout + done.stderr
    assert checks(done)["model's shell"] == (
        "warn", f"{BASH}'s startup files (~/.profile, ~/.bashrc, ~/.zshrc…) export"
                " DEPLOY_LOGIN, DEPLOY_SECRET, OPERATOR_API_TOKEN: codex reads them for every"
                " command the model runs, so the model would see those, whatever Bothy keeps"
                " out of its environment; take them out of those files (serve reads its own"
                " secrets from its service's environment or the config's secrets_file)")
    said = done.stdout + done.stderr
    for value in ("leak-9931", "leak-2207", "leak-6620", "leak-4410", "plain-5512",
                  "handed-by-bothy-3318"):
        assert value not in said
    assert not {"PLAIN_SETTING", "ACME_ACCESS", "INTERACTIVE_TOKEN"} & set(re.findall(r"\w+",
                                                                                      said))


@needs_bash
@pytest.mark.codex
async def test_doctor_passes_startup_files_that_export_no_secret(tmp_path: Path) -> None:
    """Startup files that print, and export only what a shell needs: the check passes."""
    home = operator_home(tmp_path / "operator", {
        ".bash_profile": "echo 'welcome'\nexport EDITOR=vi\n",
        ".bashrc": "export HISTSIZE=5000\n",
    })
    site = Site(tmp_path / "site", "http://127.0.0.1:9/v1")

    done = await site.bothy("doctor", HOME=str(home))

    assert checks(done)["model's shell"] == (
        "ok", f"{BASH}'s startup files export no variable named like a secret")


@needs_bash
@pytest.mark.codex
async def test_a_shell_that_fails_is_a_warning_that_repeats_nothing_it_said(
    tmp_path: Path,
) -> None:
    """A startup file that fails (an export of a value with a space in it, then an exit):
    doctor warns with the exit code and what to run to see why, never what the shell said on
    stderr, which may hold a value."""
    home = operator_home(tmp_path / "operator", {
        ".bash_profile": "export DB_PASSWORD=hunter2 s3cr3t-tail\nexit 3\n"})
    site = Site(tmp_path / "site", "http://127.0.0.1:9/v1")

    done = await site.bothy("doctor", HOME=str(home))

    assert checks(done)["model's shell"] == (
        "warn", f"what {BASH}'s startup files export is unknown: {BASH} -lc did not run the"
                f" command it was given (exit 3); run `{BASH} -lc true` as the worker's account"
                " to see why")
    assert "s3cr3t" not in done.stdout + done.stderr and "hunter2" not in done.stdout


@needs_bash
@pytest.mark.codex
async def test_doctor_says_when_the_shell_does_not_start_in_time(tmp_path: Path) -> None:
    """A login file that never returns: after the check's ten seconds, a warning that says
    what is unknown and why, and doctor goes on to its count."""
    home = operator_home(tmp_path / "operator", {".bash_profile": "sleep 60\n"})
    site = Site(tmp_path / "site", "http://127.0.0.1:9/v1")

    done = await site.bothy("doctor", HOME=str(home))

    assert checks(done)["model's shell"] == (
        "warn", f"{BASH} did not start within 10 s, so what its startup files export is"
                " unknown (codex reads them for every command the model runs)")


async def test_a_startup_file_that_hangs_is_ended_with_its_children(tmp_path: Path) -> None:
    """A startup file that never returns (and started a child holding the output open) is
    ended, its whole process group, at the probe's patience: doctor then says what it could
    not learn instead of hanging."""
    marker = tmp_path / "sleeper.pid"
    home = operator_home(tmp_path / "operator", {
        ".bash_profile": f"sleep 30 & echo $! > {marker}\nwait\n",
        ".profile": f"sleep 30 & echo $! > {marker}\nwait\n"})
    launch = Launch(["codex"], {"HOME": str(home), "PATH": os.defpath}, tmp_path)
    started = time.monotonic()

    with pytest.raises(TimeoutError):
        await exported_by_startup_files(launch, SHELL_EXCLUDES, cwd=tmp_path, timeout_s=2.0)

    assert time.monotonic() - started < 10
    await until(marker.exists, "the startup file's child started", timeout_s=5)
    sleeper = int(marker.read_text())
    await until(lambda: _ended(sleeper), "the startup file's child ended", timeout_s=5)


async def test_what_a_startup_file_leaves_running_is_ended(tmp_path: Path) -> None:
    """A startup file that leaves a child running (its output elsewhere) and returns: the
    probe answers, and the child does not outlive it."""
    marker = tmp_path / "agent.pid"
    script = f"sleep 30 >/dev/null 2>&1 &\necho $! >> {marker}\n"
    home = operator_home(tmp_path / "operator", {".bash_profile": script, ".profile": script,
                                                 ".bashrc": script})
    launch = Launch(["codex"], {"HOME": str(home), "PATH": os.defpath}, tmp_path)

    found = await exported_by_startup_files(launch, SHELL_EXCLUDES, cwd=tmp_path,
                                            timeout_s=10.0)

    assert found.names == ()
    left = [int(pid) for pid in marker.read_text().split()]
    assert left
    await until(lambda: all(_ended(pid) for pid in left), "the startup files' children ended",
                timeout_s=5)


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming a uid with no passwd entry needs root")
async def test_an_account_the_system_does_not_know_still_gets_codexs_shell() -> None:
    """No passwd entry for the account (a container's arbitrary uid): no traceback, and the
    shell codex falls back to (bash, then zsh, on the worker's PATH; else /bin/sh). Run by a
    real process under such a uid."""
    uid = next(n for n in range(54321, 54400) if n not in {e.pw_uid for e in pwd.getpwall()})
    asks = ("import os, sys; from bothy.engine.workershell import worker_shell;"  # then:
            f" os.setgid({uid}); os.setuid({uid});"
            " print(worker_shell({'PATH': sys.argv[1]}))")
    answers = []
    for path in (os.defpath, "/nonexistent"):
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", asks, path, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        answers.append(out.decode().strip())

    assert answers == [shutil.which("bash", path=os.defpath) or "/bin/sh", "/bin/sh"]


def _ended(pid: int) -> bool:
    """Whether ``pid`` is gone, or ended and waiting for its reaper."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
