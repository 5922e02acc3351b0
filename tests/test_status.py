"""`bothy status`: fast, read-only, and never shows figures from a config that changed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.fakes.site import Site


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
