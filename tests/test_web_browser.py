"""The status pages in a real browser (issue 19): headless Chromium, driven by Selenium
through the system's chromedriver, loads each page of a site made by real runs — `bothy run`
from the CLI and a webhook run through a real `bothy serve`, the real codex against the
scripted model — and what it shows is checked against what the CLI says.

One site and one browser for the whole module (a browser is heavy on a small machine): the
site is built once in a loop of its own (a thread), so the tests can drive `bothy` commands
while the browser looks. Screenshots are left in each test's temporary folder.

Skipped, saying why, where Chromium or its driver is missing (`.ci/run` installs Debian's
`chromium` and `chromium-driver`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bothy.engine.rpc import RECORD_ENV
from tests.codex_schema import CodexSchema
from tests.fakes import github
from tests.fakes.cairn import FakeCairn
from tests.fakes.model_server import ModelServer, http_error, text, tool_call
from tests.fakes.shell import Command, Shell, until
from tests.fakes.site import Site
from tests.test_serve import SECRET, Serving, free_port, queued, records, serve_site, start_serve

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("needs Debian's chromium and chromium-driver (`.ci/run` installs them):"
                f" chromium {CHROMIUM or 'missing'}, chromedriver {CHROMEDRIVER or 'missing'}",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402  (only once the browser is known to be there)
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.codex, pytest.mark.timeout(300)]

TOKEN = "a-page-token-for-the-browser"
TITLE = ("<script>document.title='pwned'</script>"
         "<img src=/bothy/pwned.png onerror=\"document.title='pwned'\"> Fix & <b>ship</b>")
BUILD_S = 240.0
T = TypeVar("T")


class _Loop:
    """An event loop in a thread of its own, for the site's async parts (the model server,
    `bothy` commands) while the tests, synchronous, drive the browser."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="site-loop",
                                        daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, T], *, timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Built:
    """The site, its running `bothy serve`, and the runs made on it."""

    site: Site
    shell: Shell
    serving: Serving
    public_port: int
    completed: str  # `bothy run`, lane ops, its task ACME-12 in Cairn
    failed: str  # `bothy run`, lane nightly: the provider answered 500
    reviewed: str  # the webhook run, lane pr:7, whose answer quotes the PR's title
    held: str  # `bothy run`, lane held, waiting on a question
    held_command: Command
    queued_command: Command  # `bothy run` in lane held, queued behind it
    loop: _Loop | None = None

    def bothy(self, *args: str) -> str:
        """What `bothy ARGS` printed (exit 0), run from a test while the browser waits."""
        assert self.loop is not None
        return self.loop.run(self.cli(*args))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.serving.port}"

    async def cli(self, *args: str) -> str:
        done = await self.shell.bothy(*args)
        assert done.code == 0, (args, done.stderr)
        return done.stdout


async def _build(root: Path, stack: contextlib.AsyncExitStack) -> Built:
    model = await stack.enter_async_context(ModelServer())
    cairn = FakeCairn(root / "cairn")
    cairn.add("ACME-12", brief="Keep an eye on the disks.")
    site = serve_site(root, model, listen={"public_port": free_port()},
                      web={"token_env": "PAGES_TOKEN"}, profiles={"selfcare": {
                          "tools": ["bothy_checklist"],
                          "approvals": {"bothy_checklist": "confirm"}}},
                      cairn={"command": cairn.command, "timeout_s": 5.0})
    shell = await stack.enter_async_context(Shell(site))
    model.script(text("The disks are fine."))
    completed = await shell.start("run", "Check the disks", "--subject", "ops",
                                  "--ref", "ACME-12")
    completed_id = await completed.admitted()
    assert (await completed.finish()).code == 0
    model.script(http_error(500, '{"error": {"message": "upstream on fire", "type": "x"}}'))
    failed = await shell.start("run", "This one fails", "--subject", "nightly")
    failed_id = await failed.admitted()
    assert (await failed.finish()).code == 1
    assert (await shell.bothy("schedule", "add", "backups", "--cron", "0 3 * * *",
                              "--prompt", "Check the backups.")).code == 0

    serving = await start_serve(shell)
    public = int(records(site, "serve", "ready")[-1].details["ports"]["public"])
    model.script(text(f"Reviewed: {TITLE}"))
    await queued(serving, github.pull_request_opened(7, title=TITLE))
    await until(lambda: bool(records(site, "run", "finished", "ok")
                             and [r for r in records(site, "run", "finished", "ok")
                                  if r.subject == "pr:7"]), "the webhook run finished")
    [reviewed] = [r for r in records(site, "run", "finished", "ok") if r.subject == "pr:7"]

    model.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}), text("No then."),
                 text("Done after the held one."))
    held = await shell.start("run", "Add x", "--profile", "selfcare", "--subject", "held")
    held_id = await held.admitted()
    await held.line(r"^bothy: question: May I use bothy_checklist\?")
    behind = await shell.start("run", "Queued behind", "--subject", "held")
    await behind.line(r"^bothy: waiting: ")
    assert completed_id and failed_id and held_id
    return Built(site, shell, serving, public, completed_id, failed_id, str(reviewed.run_id),
                 held_id, held, behind)


async def _finish(built: Built) -> None:
    await built.cli("answer", built.held, "no")
    assert (await built.held_command.finish()).code == 0
    assert (await built.queued_command.finish()).code == 0
    assert await built.serving.stop() == 0


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, codex_schema: CodexSchema) -> Iterator[Built]:
    """The site, built once: two CLI runs, a schedule, `bothy serve` with a webhook run, and
    a run holding a question with another queued behind it in its lane."""
    root = tmp_path_factory.mktemp("web-site")
    traffic = root / "traffic.jsonl"
    saved = {name: os.environ.get(name) for name in ("PAGES_TOKEN", "GH_SECRET", RECORD_ENV)}
    os.environ.update({"PAGES_TOKEN": TOKEN, "GH_SECRET": SECRET, RECORD_ENV: str(traffic)})
    loop = _Loop()
    stack = contextlib.AsyncExitStack()
    try:
        site = loop.run(_build(root, stack), timeout_s=BUILD_S)
        site.loop = loop
        yield site
        loop.run(_finish(site), timeout_s=BUILD_S)
    finally:
        loop.run(stack.aclose(), timeout_s=BUILD_S)
        loop.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    problems = codex_schema.traffic_problems(traffic) if traffic.exists() else []
    assert problems == [], "traffic breaks codex's schema"


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """One headless Chromium for the module, its console kept."""
    assert CHROMIUM is not None and CHROMEDRIVER is not None
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,1800", "--no-first-run", "--disable-extensions",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-default-apps"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    log = tmp_path_factory.mktemp("chromedriver") / "chromedriver.log"
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, log_output=str(log)),
                              options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(built: Built, browser: WebDriver) -> Iterator[WebDriver]:
    """The browser, signed in once with the ?token= link; its console read empty first and
    checked for errors after the test."""
    if not browser.get_cookies():
        browser.get(f"{built.base}/bothy/?token={TOKEN}")
        WebDriverWait(browser, 15).until(lambda d: d.current_url == f"{built.base}/bothy/")
    browser.get_log("browser")
    yield browser
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == [], "the browser's console has errors"


def _text(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def _usd4(usd: str) -> str:
    return str(Decimal(usd).quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP))


def test_the_token_link_becomes_a_cookie_and_leaves_the_address(
    built: Built, browser: WebDriver, tmp_path: Path
) -> None:
    """A ?token= link lands on the page without the token in the address bar, holding an
    HttpOnly, SameSite=Strict cookie; without the cookie the page is refused."""
    browser.delete_all_cookies()
    browser.get(f"{built.base}/bothy/runs?token={TOKEN}&lane=ops")
    WebDriverWait(browser, 15).until(lambda d: "token" not in d.current_url
                                     and d.current_url.endswith("/bothy/runs?lane=ops"))
    [cookie] = browser.get_cookies()
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (
        "bothy_web", True, "Strict", "/bothy/")
    assert browser.execute_script("return document.cookie") == ""  # HttpOnly: script sees none
    browser.save_screenshot(str(tmp_path / "signed-in.png"))
    browser.delete_all_cookies()
    browser.get(f"{built.base}/bothy/")
    assert "needs the site's link" in _text(browser, "#message")
    browser.get_log("browser")  # the 401 itself is logged as a failed load: expected here


def test_the_overview_shows_what_bothy_status_json_says(
    built: Built, page: WebDriver, tmp_path: Path
) -> None:
    """Every figure of the overview is `bothy status --json`'s: serve, chat, pool, lanes and
    their queues, held questions, spend against the ceiling (and its chart), schedules; the
    register's head is `bothy audit head`'s; the page reloads itself and holds no script."""
    page.get(f"{built.base}/bothy/")
    status = json.loads(built.bothy("status", "--json"))
    head = json.loads(built.bothy("audit", "head", "--json"))
    page.save_screenshot(str(tmp_path / "overview.png"))

    assert _text(page, "#site-name") == status["site"] == "test-site"
    assert _text(page, "#serve") == status["serve"]
    assert _text(page, "#chat") == "none" and status["chat"] == {}
    assert _text(page, "#running-count") == str(len(status["running"])) == "1"
    assert _text(page, "#max-workers") == str(status["max_workers"])
    assert _text(page, "#queued-count") == str(sum(map(len, status["queued"].values()))) == "1"
    lanes = {_text(row, ".lane-name"): row.find_element(By.CSS_SELECTOR, ".lane-queued")
             .get_attribute("data-count") for row in page.find_elements(By.CSS_SELECTOR,
                                                                        "#lanes tr.lane")}
    assert lanes == {"held": str(len(status["queued"]["held"]))}
    assert _text(page, "#held-count") == str(len(status["held_questions"])) == "1"
    assert built.held in _text(page, "#held-questions")
    assert status["held_questions"][0]["question"] in _text(page, "#held-questions")
    for name in ("used_usd", "reserved_usd", "ceiling_usd"):
        assert _text(page, f"#{name.replace('_', '-')}") == status[name], name
    assert page.find_element(By.CSS_SELECTOR, "#spend-chart polyline.spend")
    assert page.find_element(By.CSS_SELECTOR, "#spend-chart rect.reserved")
    [schedule] = status["schedules"]
    assert _text(page, "#schedules .next-fire") == schedule["next_fire"]
    assert _text(page, "#register-seq") == str(head["seq"])
    assert _text(page, "#register-hash") == head["hash"]
    refresh = page.find_element(By.CSS_SELECTOR, 'meta[http-equiv="refresh"]')
    assert refresh.get_attribute("content") == "15"  # it reloads itself, with no script
    assert page.execute_script("return document.scripts.length") == 0


def test_the_runs_page_lists_and_filters_the_runs(
    built: Built, page: WebDriver, tmp_path: Path
) -> None:
    """Each finished run with its register's outcome, lane and cost; the form's filters (a
    real GET from the browser) narrow it to an outcome or a lane."""
    page.get(f"{built.base}/bothy/runs")
    page.save_screenshot(str(tmp_path / "runs.png"))
    finished = {json.loads(line)["run_id"]: json.loads(line) for line in
                built.bothy("audit", "--json").splitlines()
                if '"event":"finished"' in line}
    rows = {row.get_attribute("data-run"): row
            for row in page.find_elements(By.CSS_SELECTOR, "#runs tr.run-row")}
    assert set(rows) >= {built.completed, built.failed, built.reviewed, built.held}
    for run_id in (built.completed, built.failed, built.reviewed):
        record = finished[run_id]
        assert _text(rows[run_id], ".outcome") == record["details"]["outcome"]
        assert _text(rows[run_id], ".lane") == record["subject"]
        assert _text(rows[run_id], ".cost") == _usd4(record["details"]["cost_usd"])
        assert _text(rows[run_id], ".duration").endswith(("ms", " s"))
    assert _text(rows[built.held], ".outcome") == "running"

    Select(page.find_element(By.NAME, "outcome")).select_by_value("failed")
    page.find_element(By.CSS_SELECTOR, "#filter button").click()
    WebDriverWait(page, 15).until(lambda d: "outcome=failed" in d.current_url)
    shown = [r.get_attribute("data-run") for r in page.find_elements(By.CSS_SELECTOR,
                                                                      "#runs tr.run-row")]
    assert shown == [built.failed]
    page.get(f"{built.base}/bothy/runs?lane=pr%3A7")
    shown = [r.get_attribute("data-run") for r in page.find_elements(By.CSS_SELECTOR,
                                                                      "#runs tr.run-row")]
    assert shown == [built.reviewed]
    page.save_screenshot(str(tmp_path / "runs-pr7.png"))


def test_a_run_page_draws_its_trace_and_shows_the_injected_title_as_text(
    built: Built, page: WebDriver, tmp_path: Path
) -> None:
    """The webhook run's page: one waterfall bar per span of `bothy trace`, its register lines
    as `bothy audit --run` prints them, and its answer quoting a PR titled `<script>…` shown
    as that text: nothing of it ran, no element of it exists."""
    page.get(f"{built.base}/bothy/runs/{built.reviewed}")
    page.save_screenshot(str(tmp_path / "run.png"))
    trace = built.bothy("trace", built.reviewed).splitlines()
    lines = built.bothy("audit", "--run", built.reviewed).splitlines()

    assert _text(page, "#run-id") == built.reviewed
    assert (_text(page, "#outcome"), _text(page, "#lane")) == ("completed", "pr:7")
    assert _text(page, "#final-text") == f"Reviewed: {TITLE}"
    assert page.title.startswith(built.reviewed) and "pwned" not in page.title
    assert page.execute_script("return document.scripts.length") == 0
    assert page.find_elements(By.CSS_SELECTOR, "main img, main b") == []
    bars = page.find_elements(By.CSS_SELECTOR, "#waterfall g.span rect")
    assert len(bars) == len(trace) and len(bars) >= 5
    shown = [element.text for element in page.find_elements(By.CSS_SELECTOR, "#records .record")]
    assert shown == lines
    assert _text(page, "#cairn-ref") == "none"


def test_a_run_page_shows_its_task_in_cairn(built: Built, page: WebDriver) -> None:
    """A run started with `--ref ACME-12` shows the task and what was done with it, as its
    register's cairn records say."""
    page.get(f"{built.base}/bothy/runs/{built.completed}")
    events = [" ".join(line.split()[3:5]) for line in
              built.bothy("audit", "--run", built.completed).splitlines() if " cairn " in line]
    assert events[0] == "claimed ok" and events[-1] == "released ok"
    assert _text(page, "#cairn-ref") == f"ACME-12 ({', '.join(events)})"
    assert _text(page, "#final-text") == "The disks are fine."


def test_the_failed_run_page_says_why(built: Built, page: WebDriver, tmp_path: Path) -> None:
    """A failed run's page shows its outcome and the reason its register gives."""
    page.get(f"{built.base}/bothy/runs/{built.failed}")
    page.save_screenshot(str(tmp_path / "failed.png"))
    [finished] = [json.loads(line) for line in
                  built.bothy("audit", "--run", built.failed, "--json").splitlines()
                  if '"event":"finished"' in line]
    assert _text(page, "#outcome") == "failed"
    assert _text(page, "#reason") == finished["details"]["reason"]
    assert _text(page, "#final-text") == "none"


def test_the_public_port_refuses_the_pages(built: Built, browser: WebDriver) -> None:
    """On the public (Funnel) port the browser gets the webhook listener's 404, no page."""
    for path in ("/bothy/", f"/bothy/runs/{built.reviewed}", "/bothy/api/status"):
        browser.get(f"http://127.0.0.1:{built.public_port}{path}")
        assert json.loads(browser.find_element(By.TAG_NAME, "body").text) == {
            "error": "no webhook route here"}, path
        assert "Overview" not in browser.page_source
    browser.get_log("browser")  # each 404 is logged as a failed load: expected here


def test_the_json_api_beside_the_pages_says_what_the_cli_says(built: Built) -> None:
    """With the bearer token: the runs list names every run, and a run's document carries its
    register lines and the trace `bothy trace RUN --json` prints; without it, 401."""
    import httpx

    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=built.base, timeout=30) as client:
        refused = client.get("/bothy/api/runs")
        runs = client.get("/bothy/api/runs", headers=bearer).json()
        run = client.get(f"/bothy/api/runs/{built.reviewed}", headers=bearer).json()
    trace = json.loads(built.bothy("trace", built.reviewed, "--json"))
    lines = built.bothy("audit", "--run", built.reviewed).splitlines()

    assert refused.status_code == 401
    assert {r["run_id"] for r in runs["runs"]} >= {built.completed, built.failed,
                                                    built.reviewed, built.held}
    assert run["trace"] == trace
    assert run["register"] == lines
    assert (run["run"]["outcome"], run["final_text"]) == ("completed", f"Reviewed: {TITLE}")
