"""What every command needs first: the home and its validated configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bothy.config import Config
    from bothy.home import BothyHome


def load() -> tuple[BothyHome, Config]:
    from bothy.config import load_config
    from bothy.home import BothyHome

    home = BothyHome.from_env()
    return home, load_config(home.config_path)
