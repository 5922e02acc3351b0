"""What a command's start imports (issue 18): pydantic's plugin loader, with importlib.metadata
behind it, only when the operator turns pydantic's plugins on.

Each check runs the real CLI in a fresh interpreter under ``PYTHONPROFILEIMPORTTIME``, whose
lines on standard error name every module the process imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.site import Site


def _imported(stderr: str) -> set[str]:
    """The modules named by ``-X importtime`` lines ("import time: self | cumulative | name")."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


@pytest.mark.codex
async def test_a_command_validates_its_config_without_importlib_metadata(tmp_path: Path) -> None:
    """With pydantic's plugins off (Bothy's default), `bothy profile list` validates the config
    and answers without importing pydantic's plugin loader or importlib.metadata."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    done = await site.bothy("profile", "list", PYTHONPROFILEIMPORTTIME="1")

    assert done.code == 0, done.stderr[-2000:]
    imported = _imported(done.stderr)
    assert "bothy.config" in imported and "pydantic" in imported
    assert "importlib.metadata" not in imported
    assert "pydantic.plugin._loader" not in imported


@pytest.mark.codex
async def test_plugins_turned_on_by_the_operator_get_pydantics_own_loader(tmp_path: Path) -> None:
    """An operator who names a pydantic plugin gets pydantic's loader (and its entry-point
    scan); the command works as before."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    done = await site.bothy("profile", "list", PYTHONPROFILEIMPORTTIME="1",
                            PYDANTIC_DISABLE_PLUGINS="some-plugin")

    assert done.code == 0, done.stderr[-2000:]
    assert {"pydantic.plugin._loader", "importlib.metadata"} <= _imported(done.stderr)


_ASKS_THE_LOADER_FOR_MORE = """
import contextlib, sys
from pathlib import Path
from bothy.cli import main

with contextlib.suppress(SystemExit):  # (--version exits, as argparse does)
    main(["--version"])
assert type(sys.modules["pydantic.plugin._loader"]).__name__ == "module"
assert not hasattr(sys.modules["pydantic.plugin._loader"], "__file__")
from bothy.config import parse_config  # the models' validators ask the stand-in

parse_config({"site": "s", "workspace": "/srv/work",
              "budget": {"mode": "api", "per_run_usd": 0.5, "per_day_usd": 25.0}},
             path=Path("config.json"))
assert "importlib.metadata" not in sys.modules
from pydantic.plugin._loader import PYDANTIC_ENTRY_POINT_GROUP, get_plugins
print(PYDANTIC_ENTRY_POINT_GROUP, list(get_plugins()),
      sys.modules["pydantic.plugin._loader"].__file__.endswith("_loader.py"))
"""


def test_a_name_the_stand_in_lacks_comes_from_pydantics_loader() -> None:
    """A pydantic asking its plugin loader for more than ``get_plugins`` gets pydantic's own
    module (loaded then), which answers from there on: no plugin while they are off."""
    done = subprocess.run([sys.executable, "-c", _ASKS_THE_LOADER_FOR_MORE], capture_output=True,
                          text=True, timeout=60, env={"PYDANTIC_DISABLE_PLUGINS": "__all__",
                                                      "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["pydantic", "[]", "True"]
