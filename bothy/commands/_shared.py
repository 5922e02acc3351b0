"""What every command needs first: the home and its validated configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bothy.config import Config
    from bothy.home import BothyHome


def load(home: BothyHome | None = None) -> tuple[BothyHome, Config]:
    """The home (``$BOTHY_HOME``, unless the caller has it already) and its configuration."""
    from bothy.config import load_config
    from bothy.home import BothyHome

    home = home or BothyHome.from_env()
    return home, load_config(home.config_path)
