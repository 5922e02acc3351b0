"""The status pages' rules over real HTTP against a real ``bothy serve`` (issue 19): where
they are served (the tailnet door only), that nothing they answer changes state, the token,
the JSON status being ``bothy status --json``'s document, and the config errors.

What a browser shows is ``tests/test_web_browser.py``'s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.fakes.model_server import ModelServer
from tests.fakes.shell import DEADLINE_S, Shell, audit_records
from tests.fakes.site import Site
from tests.fakes.slack import slack_environment
from tests.test_serve import free_port, records, serve_site, start_serve

TOKEN = "s3cret-page-token"
CSP = ("default-src 'self'; script-src 'none'; object-src 'none'; base-uri 'none';"
       " form-action 'self'; frame-ancestors 'none'")


@pytest.fixture
async def server() -> ModelServer:  # type: ignore[misc]
    async with ModelServer() as model:
        yield model


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_serve import SECRET

    monkeypatch.setenv("GH_SECRET", SECRET)


def _client(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S,
                             follow_redirects=False)


@pytest.mark.codex
async def test_the_pages_are_on_the_tailnet_door_and_never_on_the_public_one(
    server: ModelServer, tmp_path: Path
) -> None:
    """/bothy/ answers on the tailnet door with a page and its CSP, / redirects there; the
    public (Funnel) port has no such route: every page path is its webhook 404."""
    site = serve_site(tmp_path, server, listen={"public_port": free_port()})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        public = int(records(site, "serve", "ready")[-1].details["ports"]["public"])
        async with _client(serving.port) as tailnet, _client(public) as funnel:
            page = await tailnet.get("/bothy/")
            root = await tailnet.get("/")
            bare = await tailnet.get("/bothy")
            refused = [await funnel.get(path) for path in
                       ("/bothy/", "/bothy/runs", "/bothy/api/status", "/bothy/static/site.css",
                        "/")]
        assert await serving.stop() == 0

    assert page.status_code == 200, page.text
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == CSP
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<h1>Overview</h1>" in page.text and "<script" not in page.text
    assert (root.status_code, root.headers["location"]) == (302, "/bothy/")
    assert (bare.status_code, bare.headers["location"]) == (302, "/bothy/")
    assert [(r.status_code, r.json()) for r in refused] == \
        [(404, {"error": "no webhook route here"})] * 5
    assert "content-security-policy" not in refused[0].headers


@pytest.mark.codex
async def test_no_page_changes_state_and_other_methods_are_refused(
    server: ModelServer, tmp_path: Path
) -> None:
    """Only GET and HEAD: POST, PUT, DELETE and PATCH on any page or API path get 405 with
    `Allow: GET, HEAD`, and the register gains nothing from any of it."""
    # No spare app-server: its `spare started`, a moment after ready, would land in the count.
    site = serve_site(tmp_path, server, codex={"spare": False})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        before = len(audit_records(site))
        async with _client(serving.port) as client:
            refused = [await client.request(method, path)
                       for method in ("POST", "PUT", "DELETE", "PATCH")
                       for path in ("/", "/bothy/", "/bothy/runs", "/bothy/api/status",
                                    "/bothy/runs/run_20260101T000000Z_00000000")]
            head = await client.head("/bothy/")
            shown = await client.get("/bothy/runs")
        after = len(audit_records(site))
        assert await serving.stop() == 0

    assert {(r.status_code, r.headers["allow"]) for r in refused} == {(405, "GET, HEAD")}
    assert all("GET, HEAD" in r.text for r in refused if r.request.url.path != "/bothy/api/status")
    assert (head.status_code, head.content) == (200, b"")
    assert shown.status_code == 200
    assert after == before


@pytest.mark.codex
async def test_the_token_guards_the_api_by_header_and_the_pages_by_a_cookie(
    server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the token's variable set (`web.token_env`): the API wants the bearer header; a page
    wants the cookie that a ?token= link is exchanged for (HttpOnly, SameSite=Strict), and goes
    on without the token in its address; a wrong token or none is 401."""
    monkeypatch.setenv("PAGES_TOKEN", TOKEN)
    site = serve_site(tmp_path, server, web={"token_env": "PAGES_TOKEN"})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        async with _client(serving.port) as client:
            api_bare = await client.get("/bothy/api/status")
            api_wrong = await client.get("/bothy/api/status",
                                         headers={"Authorization": "Bearer nope"})
            api = await client.get("/bothy/api/status",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
            page_bare = await client.get("/bothy/")
            page_wrong = await client.get("/bothy/runs", params={"token": "nope"})
            exchange = await client.get("/bothy/runs",
                                        params={"token": TOKEN, "outcome": "failed"})
            cookie = exchange.cookies["bothy_web"]
            client.cookies.clear()  # each request below says which cookie it carries
            with_cookie = await client.get("/bothy/runs",
                                           headers={"Cookie": f"bothy_web={cookie}"})
            forged = await client.get("/bothy/", headers={"Cookie": f"bothy_web={'0' * 64}"})
        assert await serving.stop() == 0

    assert [r.status_code for r in (api_bare, api_wrong)] == [401, 401]
    assert "Authorization: Bearer" in api_bare.json()["error"]
    assert api.status_code == 200 and api.json()["site"] == "test-site"
    assert [r.status_code for r in (page_bare, page_wrong, forged)] == [401, 401, 401]
    assert "?token=" in page_bare.text and TOKEN not in page_bare.text
    assert exchange.status_code == 200
    set_cookie = exchange.headers["set-cookie"]
    assert re.search(r"\bHttpOnly\b", set_cookie) and "SameSite=Strict" in set_cookie
    assert "Path=/bothy/" in set_cookie and TOKEN not in set_cookie
    assert '<meta http-equiv="refresh" content="0; url=/bothy/runs?outcome=failed">' \
        in exchange.text
    assert TOKEN not in exchange.text
    assert with_cookie.status_code == 200 and "<h1>Runs</h1>" in with_cookie.text


@pytest.mark.codex
async def test_the_api_status_is_bothy_status_json(server: ModelServer, tmp_path: Path) -> None:
    """/bothy/api/status is the document `bothy status --json` prints, byte for byte, while
    nothing runs (running runs carry their elapsed seconds)."""
    site = serve_site(tmp_path, server)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        async with _client(serving.port) as client:
            api = await client.get("/bothy/api/status")
        printed = await shell.bothy("status", "--json")
        assert await serving.stop() == 0

    assert printed.code == 0, printed.stderr
    assert api.status_code == 200
    assert api.headers["content-type"] == "application/json; charset=utf-8"
    assert api.text == printed.stdout
    assert json.loads(api.text)["serve"].startswith("ready (pid ")


@pytest.mark.codex
async def test_a_bad_filter_is_answered_400_naming_it(server: ModelServer, tmp_path: Path) -> None:
    """An unknown outcome or a before= that is not a number: 400 saying what was wrong and
    which values would do, on the page and the API."""
    site = serve_site(tmp_path, server)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        async with _client(serving.port) as client:
            page = await client.get("/bothy/runs", params={"outcome": "<b>exploded</b>"})
            api = await client.get("/bothy/api/runs", params={"before": "yesterday"})
            unknown = await client.get("/bothy/runs/run_nope")
        assert await serving.stop() == 0

    assert page.status_code == 400
    assert "outcome &#39;&lt;b&gt;exploded&lt;/b&gt;&#39; is not one of: queued, running," \
        " completed," in page.text
    assert (api.status_code, api.json()) == (
        400, {"error": "before 'yesterday' is not a run's number"})
    assert unknown.status_code == 404 and "no run run_nope" in unknown.text


@pytest.mark.codex
@pytest.mark.parametrize("path", ["/bothy/hooks/github", "/bothy"])
async def test_a_webhook_route_under_bothy_is_a_configuration_error(
    server: ModelServer, tmp_path: Path, path: str
) -> None:
    """A webhook route at /bothy or under /bothy/ would be hidden by the pages: `bothy serve`
    exits 78 naming the key."""
    site = serve_site(tmp_path, server)
    site.config["webhooks"]["github"]["path"] = path
    site.write_config(site.config)
    done = await site.bothy("serve")

    assert done.code == 78, done.stderr
    assert "webhooks.github.path" in done.stderr
    assert f"'{path}' is under /bothy/, where bothy serve's status pages live" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.codex
async def test_a_webhook_route_at_the_root_keeps_the_root(
    server: ModelServer, tmp_path: Path
) -> None:
    """With a route at /, a GET there is that route's (405: use POST), not the redirect."""
    site = serve_site(tmp_path, server)
    site.config["webhooks"]["github"]["path"] = "/"
    site.write_config(site.config)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        async with _client(serving.port) as client:
            root = await client.get("/")
            page = await client.get("/bothy/")
        assert await serving.stop() == 0

    assert (root.status_code, root.json()) == (405, {"error": "use POST"})
    assert page.status_code == 200


@pytest.mark.codex
async def test_the_pages_can_be_turned_off(server: ModelServer, tmp_path: Path) -> None:
    """`web.enabled: false`: /bothy/ is the webhook listener's 404, like any unknown path."""
    site = serve_site(tmp_path, server, web={"enabled": False})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        async with _client(serving.port) as client:
            page = await client.get("/bothy/")
        assert await serving.stop() == 0

    assert (page.status_code, page.json()) == (404, {"error": "no webhook route here"})


def test_a_site_without_state_still_has_its_config_checked(tmp_path: Path) -> None:
    """The web section is validated like any other: a refresh below 2 s is exit 78 material."""
    from bothy.config import parse_config
    from bothy.errors import ConfigError

    site = Site(tmp_path, "http://127.0.0.1:9/v1", web={"refresh_s": 1})
    with pytest.raises(ConfigError, match=r"web\.refresh_s"):
        parse_config(site.config, path=site.home / "config.json")


@pytest.mark.codex
async def test_an_alert_and_a_broken_state_are_shown_as_text(
    server: ModelServer, tmp_path: Path
) -> None:
    """The alert `bothy audit repair` raised is in the overview's recent alerts, its reason as
    text; a state database that cannot be read is a 503 naming it, not a traceback."""
    site = serve_site(tmp_path, server)
    sop = tmp_path / "sop.md"
    sop.write_text("Check the backups.\n")
    async with Shell(site) as shell:
        assert (await shell.bothy("sop", "set", "backups", "--file", str(sop))).code == 0
        site.audit_path.write_bytes(site.audit_path.read_bytes().replace(b'"ok"', b'"OK"', 1))
        assert (await shell.bothy("audit", "repair")).code == 0
        serving = await start_serve(shell)
        async with _client(serving.port) as client:
            page = await client.get("/bothy/")
            # The database (and its WAL) set aside while serve, idle, keeps its open copy;
            # the pages open what is at the path now.
            files = [site.home / "state" / f"bothy.sqlite3{end}" for end in ("", "-wal", "-shm")]
            for path in files:
                path.rename(path.with_name(path.name + ".kept"))
            files[0].write_bytes(b"not a database " * 100)
            try:
                broken = await client.get("/bothy/runs")
            finally:
                for path in files:
                    path.with_name(path.name + ".kept").replace(path)
        assert await serving.stop() == 0

    assert page.status_code == 200
    [alert] = re.findall(r'<li class="alert alert-critical">(.*?)</li>', page.text, re.S)
    assert "<strong>critical</strong> the register: repaired at seq 1: record 0001 was" \
        " altered: its hash does not match its content" in alert
    assert alert.endswith("— undelivered")
    assert broken.status_code == 503
    assert "cannot read the site&#39;s state:" in broken.text and "Traceback" not in broken.text


@pytest.mark.codex
async def test_in_plan_mode_the_overview_draws_the_windows_status_reports(
    server: ModelServer, tmp_path: Path
) -> None:
    """A plan-mode site after a run that learnt the windows from real rate-limit headers: the
    overview's ceiling and each window's use are `bothy status --json`'s, drawn as bars."""
    import time

    from tests.fakes.model_server import RateLimits, RateLimitWindow, text

    site = serve_site(tmp_path, server)
    site.config["budget"] = {"mode": "plan", "plan_ceiling_percent": 85,
                             "plan_reserve_percent": 2}
    site.write_config(site.config)
    reset_at = int(time.time()) + 3600
    server.script(text("Learnt the windows.", rate_limits=RateLimits(
        primary=RateLimitWindow(40, 300, reset_at),
        secondary=RateLimitWindow(12, 10080, reset_at + 86_400))))
    async with Shell(site) as shell:
        assert (await shell.bothy("run", "learn", "--subject", "ops")).code == 0
        serving = await start_serve(shell)
        async with _client(serving.port) as client:
            page = await client.get("/bothy/")
            status = (await client.get("/bothy/api/status")).json()
        assert await serving.stop() == 0

    assert page.status_code == 200
    plan = status["plan"]
    assert [(w["name"], w["used_percent"]) for w in plan["windows"]] == [
        ("primary", 40), ("secondary", 12)]
    assert f'<span id="plan-ceiling">{plan["ceiling_percent"]}</span>%' in page.text
    assert re.findall(r'<td class="window-used">(\d+)%</td>', page.text) == ["40", "12"]
    bars = re.findall(r'<rect class="used" [^>]*><title>(.*?)</title>', page.text)
    assert bars == ["primary: 40% used", "secondary: 12% used"]
    assert 'id="spend-chart"' not in page.text


@pytest.mark.codex
async def test_the_overview_shows_the_chat_connection_as_status_does(
    server: ModelServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Slack connected (the real slack-bolt against the fake), the overview names the
    connection and its liveness line in `bothy status`'s own words."""

    from tests.fakes.slack import FakeSlack

    slack_environment(monkeypatch)
    async with FakeSlack(ack_timeout_s=5.0) as slack:
        site = serve_site(tmp_path, server, chat={"slack": {"api_url": slack.api_url,
                                                           "allowed_users": ["U1"]}})
        async with Shell(site) as shell:
            serving = await start_serve(shell)
            async with _client(serving.port) as client:
                page = await client.get("/bothy/")
            status = json.loads((await shell.bothy("status", "--json")).stdout)
            assert await serving.stop() == 0

    assert status["chat"] == {"slack": "connected"}
    assert '<span class="chat" data-platform="slack">slack connected</span>' in page.text
    [line] = re.findall(r'<ul id="chat-connections">\n<li>(.*?)</li>', page.text)
    assert line.startswith("slack: last event ") and ", last ping " in line
