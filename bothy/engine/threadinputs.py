"""What codex reads into a thread when it starts it, not at its turns: a thread made ahead is
stale once any of it changed.

codex reads the workspace's project instructions at ``thread/start`` and keeps them for the
thread's life (seen with the pinned codex: a project ``AGENTS.md`` rewritten between
``thread/start`` and the first turn reaches the model as it was; ``CODEX_HOME/AGENTS.md`` is
read again at the turn). Its discovery (``codex-rs/core/src/agents_md.rs``): from the cwd up
to the project root (the nearest ancestor holding one of ``project_root_markers``, by default
``.git``; without one, the cwd alone), the first of ``AGENTS.override.md``, ``AGENTS.md`` and
the ``project_doc_fallback_filenames`` that is a file, in each directory; symlinks followed.

What is recorded here is wider than what codex reads, so that no change it would see is
missed: every candidate name in every directory from the cwd up to the filesystem root, each
as (inode, size, mtime) or absent, and whether each marker is there; the fallback names and
markers that Bothy's own ``-c`` overrides give are added to the defaults (those of
``CODEX_HOME/config.toml`` are not read: a change to that file already makes the spare
stale, engine/spare.py). And the local and UTC dates: codex puts ``<current_date>`` in the
thread's first context (its source computes it per turn, but a thread made before midnight
is not worth the doubt).
"""

from __future__ import annotations

import datetime
import itertools
import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_NAMES = ("AGENTS.override.md", "AGENTS.md")
_MARKERS = (".git",)

_Identity = tuple[int, int, int] | None


def _identity(path: str, *, marker: bool) -> _Identity:
    """A file's (inode, size, mtime); a marker's only that it exists (``.git``'s own mtime
    moves with every git command, and codex asks only whether it is there)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (0, 0, 0) if marker else (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _configured(argv: Sequence[str], key: str) -> tuple[str, ...]:
    """The strings a ``-c key=[...]`` override in ``argv`` gives (the last one wins, as in
    codex); none if there is none or it does not parse as a TOML list of strings."""
    found: tuple[str, ...] = ()
    for flag, value in itertools.pairwise(argv):
        if flag != "-c" or not value.startswith(f"{key}="):
            continue
        try:
            parsed = tomllib.loads(value).get(key)
        except tomllib.TOMLDecodeError:
            continue
        if isinstance(parsed, list):
            found = tuple(item for item in parsed if isinstance(item, str) and item)
    return found


def _upwards(directory: str) -> list[str]:
    """``directory`` and each of its parents up to the filesystem root."""
    found = [directory]
    while (parent := os.path.dirname(found[-1])) != found[-1]:
        found.append(parent)
    return found


@dataclass(frozen=True)
class ThreadInputs:
    """The identity of what codex reads into a new thread for one cwd, at one moment."""

    files: tuple[tuple[str, _Identity], ...]
    dates: tuple[str, str]  # local, UTC (codex falls back to UTC without a time zone)

    @classmethod
    def read(cls, cwd: Path, argv: Sequence[str]) -> ThreadInputs:
        """What codex started with ``argv`` would read into a thread started in ``cwd``, now."""
        names = (*_NAMES, *_configured(argv, "project_doc_fallback_filenames"))
        markers = (*_MARKERS, *_configured(argv, "project_root_markers"))
        kinds = {**dict.fromkeys(markers, True), **dict.fromkeys(names, False)}
        files = tuple((path, _identity(path, marker=marker))
                      for directory in _upwards(os.path.abspath(cwd))
                      for name, marker in kinds.items()
                      for path in (os.path.join(directory, name),))
        now = datetime.datetime.now(datetime.UTC)
        return cls(files, (now.astimezone().date().isoformat(), now.date().isoformat()))

    def changed_since(self, earlier: ThreadInputs) -> str | None:
        """Why a thread started when ``earlier`` was read is not one started now; None if it
        is."""
        changed = [path for (path, now), (_, was) in zip(self.files, earlier.files, strict=False)
                   if now != was]
        if changed or len(self.files) != len(earlier.files):
            listed = ", ".join(changed) or "the files codex reads"
            return f"{listed} changed after the thread was started ahead"
        if self.dates != earlier.dates:
            return "the date changed after the thread was started ahead"
        return None
