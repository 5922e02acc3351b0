"""pydantic's plugins through the real CLI: off by default without the scan's imports, and an
operator's installed plugin still used when they turn plugins on (bothy/pydanticplugins.py).

The plugin is a real installed distribution (a ``.dist-info`` with a ``pydantic`` entry point
on ``PYTHONPATH``) whose validators note each model they are built for in a file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.site import Site

pytestmark = pytest.mark.codex  # (the site's config names the pinned codex; it is not run)

_PLUGIN = '''
import os

class _Seen:
    def new_schema_validator(self, schema, schema_type, schema_type_path, schema_kind, config,
                             plugin_settings):
        with open(os.environ["SEEN_BY_PLUGIN"], "a") as seen:
            seen.write(schema_type_path.name + "\\n")
        return None, None, None

plugin = _Seen()
'''

# `bothy profile list` validates the config; the last line says whether the entry-point scan's
# machinery was imported at all.
_CLI = ("import sys; from bothy.cli import main; code = main(['profile', 'list']);"
        " print('importlib.metadata' in sys.modules); sys.exit(code)")


def _installed_plugin(root: Path) -> Path:
    """A directory holding the distribution ``seenplugin``, with its pydantic entry point."""
    packages = root / "packages"
    info = packages / "seenplugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: seenplugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pydantic]\nseen = seenplugin:plugin\n")
    (packages / "seenplugin.py").write_text(_PLUGIN)
    return packages


def _profile_list(site: Site, tmp_path: Path, **plugins: str) -> tuple[str, list[str]]:
    """The CLI's last line of output, and the models the plugin saw built."""
    seen = tmp_path / "seen.txt"
    env = site.env(PYTHONPATH=str(_installed_plugin(tmp_path)), SEEN_BY_PLUGIN=str(seen),
                   **plugins)
    env.pop("PYDANTIC_DISABLE_PLUGINS", None)
    env.update(plugins)
    done = subprocess.run([sys.executable, "-c", _CLI], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1], seen.read_text().split() if seen.exists() else []


def test_plugins_are_off_by_default_and_never_looked_for(tmp_path: Path) -> None:
    """With nothing set, the installed plugin is not used, and the scan's machinery
    (importlib.metadata) is never imported."""
    site = Site(tmp_path / "site", "http://127.0.0.1:9")
    assert _profile_list(site, tmp_path) == ("False", [])


def test_a_plugin_the_operator_turns_on_is_found_and_used(tmp_path: Path) -> None:
    """PYDANTIC_DISABLE_PLUGINS set to something other than "all off" lets pydantic find the
    installed plugin, which sees the config's model built."""
    site = Site(tmp_path / "site", "http://127.0.0.1:9")
    loaded, seen = _profile_list(site, tmp_path, PYDANTIC_DISABLE_PLUGINS="some-other-plugin")
    assert loaded == "True"
    assert "Config" in seen


def test_a_name_a_later_pydantic_asks_of_its_loader_comes_from_the_real_one() -> None:
    """A pydantic that imports more than ``get_plugins`` from its loader still starts: the
    stand-in hands any other name to the real loader (here the ``entry_points`` it imports),
    which takes its place."""
    code = ("import sys; from bothy.pydanticplugins import look_for_plugins_only_when_on;"
            " look_for_plugins_only_when_on();"
            " from pydantic.plugin._loader import entry_points;"
            " loader = sys.modules['pydantic.plugin._loader'];"
            " print(entry_points.__module__, loader.get_plugins.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["importlib.metadata", "pydantic.plugin._loader"]
