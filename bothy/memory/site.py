"""The memory of a whole site: which profiles turn it on, and each one's store."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from bothy.config import Config
from bothy.memory.index import search_mode
from bothy.memory.scan import SecretScan, held_secrets
from bothy.memory.store import MemoryStore


def memory_root(home_root: Path) -> Path:
    """``$BOTHY_HOME/memory``: outside the workspace, one directory per profile."""
    return home_root / "memory"


class SiteMemory:
    """Opens the stores of the profiles whose config turns memory on."""

    def __init__(self, home_root: Path, cfg: Config,
                 environ: Mapping[str, str] | None = None) -> None:
        self._root = memory_root(home_root)
        self._cfg = cfg
        self._scan = SecretScan(held_secrets(cfg, os.environ if environ is None else environ))

    def profiles(self) -> list[str]:
        """The names of the profiles with memory on, sorted."""
        return sorted(name for name, p in self._cfg.profiles.items() if p.memory is not None)

    def store(self, profile: str) -> MemoryStore | None:
        """The store of ``profile``, or None when it has no memory (or is not defined)."""
        defined = self._cfg.profiles.get(profile)
        if defined is None or defined.memory is None:
            return None
        return MemoryStore(self._root / profile, profile, defined.memory, scan=self._scan,
                           search=search_mode(defined.memory.search))
