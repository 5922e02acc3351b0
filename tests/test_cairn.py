"""Proofs of Bothy's Cairn client against the fake ``cairn``: every answer is a value.

The real client (:class:`bothy.engine.cairn.Cairn`) runs the fake command as a child process,
as it would run a real Cairn: claim, brief, note and release; a task held by someone else; a
command that is missing, slow, failing or answering garbage.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from bothy.config import CairnConfig
from bothy.engine.cairn import Brief, Cairn, Claimed, Done, Held, StepFailed, ref_problem
from bothy.engine.state import StateDB
from tests.fakes.cairn import FakeCairn
from tests.fakes.site import Site

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fake(tmp_path: Path) -> FakeCairn:
    fake = FakeCairn(tmp_path / "cairn")
    fake.add("ACME-12", brief="Summarise the week for the client.")
    return fake


def client(command: list[str], tmp_path: Path, timeout_s: float = 5.0) -> Cairn:
    return Cairn(CairnConfig(command=command, timeout_s=timeout_s), cwd=tmp_path)


def fake_processes(fake: FakeCairn) -> list[int]:
    """Pids of live processes serving this fake's ledger."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            raw = cmdline.read_bytes()
            state = (cmdline.parent / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if str(fake.ledger).encode() in raw and state not in ("Z", "X"):
            pids.append(int(cmdline.parent.name))
    return pids


async def test_a_task_is_claimed_briefed_noted_and_released(
    fake: FakeCairn, tmp_path: Path
) -> None:
    """Each verb of the contract does what docs/CAIRN.md says, and Cairn's ledger shows it."""
    cairn = client(fake.command, tmp_path)

    claimed = await cairn.claim("ACME-12", "run_1")
    held_by = fake.task("ACME-12")["holder"]
    brief = await cairn.brief("ACME-12")
    noted = await cairn.note("ACME-12", "run run_1: completed\nAll done.")
    released = await cairn.release("ACME-12", "run_1")

    assert claimed == Claimed("ACME-12")
    assert held_by == "run_1"
    assert brief == Brief("ACME-12", "Summarise the week for the client.")
    assert noted == Done("note", "ACME-12")
    assert released == Done("release", "ACME-12")
    task = fake.task("ACME-12")
    assert task["holder"] is None
    assert task["notes"] == [{"kind": "note", "text": "run run_1: completed\nAll done."}]
    assert fake.verbs() == ["claim", "show", "note", "release"]


async def test_a_task_held_by_someone_else_names_the_holder(
    fake: FakeCairn, tmp_path: Path
) -> None:
    """Claim exit 3: the answer is Held, with whoever Cairn says holds the task."""
    fake.hold("ACME-12", "run_20261130T101010Z_0badf00d on other-site")

    answer = await client(fake.command, tmp_path).claim("ACME-12", "run_1")

    assert answer == Held("ACME-12", "run_20261130T101010Z_0badf00d on other-site")
    assert fake.task("ACME-12")["holder"] == "run_20261130T101010Z_0badf00d on other-site"


async def test_a_missing_cairn_is_a_failed_step_that_never_ran(tmp_path: Path) -> None:
    """No such command: the step failed, saying so, and Cairn cannot have done anything."""
    answer = await client(["cairn-not-installed-here"], tmp_path).claim("ACME-12", "run_1")

    assert answer == StepFailed("claim", "ACME-12",
                                "cairn command 'cairn-not-installed-here' not found on PATH",
                                ran=False)


async def test_a_slow_cairn_is_cut_off_at_the_timeout_and_its_group_ended(
    fake: FakeCairn, tmp_path: Path
) -> None:
    """A step past cairn.timeout_s fails with the timeout named; none of its processes stay."""
    fake.slow("claim", 60)

    answer = await client(fake.command, tmp_path, timeout_s=0.5).claim("ACME-12", "run_1")

    assert answer == StepFailed("claim", "ACME-12", "cairn claim did not answer within 0.5 s")
    assert fake.verbs() == ["claim"]
    assert fake_processes(fake) == []
    assert fake.task("ACME-12")["holder"] is None


async def test_a_failing_cairn_gives_its_exit_code_and_stderr(
    fake: FakeCairn, tmp_path: Path
) -> None:
    """Any exit but 0 (and 3 for claim) is the step failing, its stderr the reason."""
    fake.fail("note", "the ledger's disk is full")

    answer = await client(fake.command, tmp_path).note("ACME-12", "hello")

    assert answer == StepFailed("note", "ACME-12",
                                "cairn note exited with code 1: cairn: the ledger's disk is full")


async def test_garbage_from_cairn_is_a_failed_step(fake: FakeCairn, tmp_path: Path) -> None:
    """Output that is not UTF-8 text is garbage, whatever the exit code says."""
    fake.garbage("show")

    answer = await client(fake.command, tmp_path).brief("ACME-12")

    assert isinstance(answer, StepFailed)
    assert answer.reason == ("cairn brief answered garbage: its output is not UTF-8 text"
                             " (byte 0) (exit code 0)")


async def test_an_unknown_task_is_a_failed_claim(fake: FakeCairn, tmp_path: Path) -> None:
    """Cairn's own refusal (here: no such task) reaches the caller as the reason."""
    answer = await client(fake.command, tmp_path).claim("ACME-99", "run_1")

    assert answer == StepFailed("claim", "ACME-99",
                                "cairn claim exited with code 2: cairn: no task ACME-99")


async def test_a_release_of_a_task_held_by_another_leaves_it_held(
    fake: FakeCairn, tmp_path: Path
) -> None:
    """Release is only ever by the run that holds the task: another holder keeps it."""
    fake.hold("ACME-12", "alice")

    answer = await client(fake.command, tmp_path).release("ACME-12", "run_1")

    assert answer == Done("release", "ACME-12")
    assert fake.task("ACME-12")["holder"] == "alice"


async def test_cairn_gets_a_scrubbed_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bothy's secrets never reach Cairn's command; names in cairn.env do."""
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-secret")
    monkeypatch.setenv("CAIRN_DIR", "/srv/ledger")
    printer = [sys.executable, "-c", "import os; print(' '.join(sorted(os.environ)))"]
    cairn = Cairn(CairnConfig(command=printer, env=["CAIRN_DIR"]), cwd=tmp_path)

    answer = await cairn.brief("ACME-12")

    assert isinstance(answer, Brief)
    names = answer.text.split()
    assert "CAIRN_DIR" in names
    assert "SLACK_BOT_TOKEN" not in names


async def test_the_probe_says_whether_cairn_answers(fake: FakeCairn, tmp_path: Path) -> None:
    """`cairn --version` within the timeout is reachable; anything else is the reason why not."""
    assert await client(fake.command, tmp_path).probe() is None
    missing = await client(["cairn-not-installed-here"], tmp_path).probe()
    assert missing == "cairn command 'cairn-not-installed-here' not found on PATH"


@pytest.mark.parametrize("ref", ["ACME-12", "a", "MP.1002", "x_y-z", "A" * 64])
def test_a_task_reference_of_the_contract_is_accepted(ref: str) -> None:
    """A ref is 1–64 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    assert ref_problem(ref) is None


@pytest.mark.parametrize(
    "ref", ["", "-rf", ".hidden", "ACME 12", "ACME-12;rm", "A" * 65, "ÅCME-1", "a\nb", "--by"]
)
def test_a_task_reference_outside_the_contract_is_refused(ref: str) -> None:
    """Anything else could reach Cairn's command line as an option or worse: refused."""
    problem = ref_problem(ref)
    assert problem is not None
    assert problem.endswith("is not a task reference: expected 1 to 64 letters, digits, '.',"
                            " '_' or '-', starting with a letter or digit (e.g. ACME-12)")


def test_a_cairn_step_waits_ten_seconds_at_most_by_default() -> None:
    """The default timeout is the seed's 10 s, and no configuration may lengthen it."""
    assert CairnConfig().timeout_s == 10.0
    assert CairnConfig().command == ["cairn"]
    with pytest.raises(ValidationError):
        CairnConfig(timeout_s=10.5)


# --- bothy doctor ---------------------------------------------------------------------


async def test_doctor_says_cairn_is_reachable(fake: FakeCairn, tmp_path: Path) -> None:
    """A Cairn that answers: the page's line, `[ok ] cairn reachable: memory and task ledger`."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1", cairn={"command": fake.command})

    done = await site.bothy("doctor")

    assert "[ok ] cairn reachable: memory and task ledger\n" in done.stdout, done.stdout


@pytest.mark.parametrize(("cairn", "problem"), [
    (["cairn-not-installed-here"], "cairn command 'cairn-not-installed-here' not found on PATH"),
    ([sys.executable, "-c", "import sys; sys.exit('no ledger here')"],
     "cairn probe exited with code 1: no ledger here"),
])
async def test_doctor_warns_naming_what_is_missing(
    tmp_path: Path, cairn: list[str], problem: str
) -> None:
    """Cairn missing or failing is a warning naming why, never a failure: it is optional."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1", cairn={"command": cairn})

    done = await site.bothy("doctor")

    assert (f"[warn] cairn reachable: {problem} — runs with --ref go on without a task"
            " ledger\n") in done.stdout, done.stdout


# --- the state database ---------------------------------------------------------------


async def test_a_state_database_from_before_refs_gains_the_schedules_ref_column(
    tmp_path: Path
) -> None:
    """A database made before schedules had a ref (schema 7) gets the column, rows kept."""
    path = tmp_path / "bothy.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE schedules (name TEXT PRIMARY KEY, cron TEXT NOT NULL, kind TEXT NOT NULL,"
        " prompt TEXT, sop TEXT, profile TEXT, verify_argv TEXT, verify_regex TEXT,"
        " max_usd_micros INTEGER, created_us INTEGER NOT NULL, last_fire_us INTEGER,"
        " next_fire_us INTEGER);"
        "INSERT INTO schedules (name, cron, kind, prompt, created_us)"
        " VALUES ('nightly', '0 3 * * *', 'prompt', 'tidy up', 1);"
        "PRAGMA user_version = 7;"
    )
    old.close()

    async with StateDB.open(path) as db:
        rows = await db.fetch_all("SELECT name, ref FROM schedules")

    assert [(row["name"], row["ref"]) for row in rows] == [("nightly", None)]
