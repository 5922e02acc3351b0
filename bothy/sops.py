"""Written procedures (SOPs) that a schedule can carry into its run (SPEC §5, "Cron").

Each SOP is a Markdown file ``$BOTHY_HOME/sops/NAME.md`` (0600, in a 0700 directory), set by
the operator with ``bothy sop set NAME --file F`` (or ``-`` for standard input) and read whole
into the prompt of a run woken by a schedule added with ``--sop NAME``. A write replaces the
file atomically (temporary file, fsync, rename, fsync of the directory): a run never reads
half a procedure, and a crash never leaves one.

Every method here blocks on the file system; coroutines call them through
``asyncio.to_thread``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from bothy.atomicfile import write_atomically
from bothy.errors import StateError, UsageError

MAX_SOP_BYTES = 64 * 1024  # a procedure is read whole into every prompt that carries it
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$")
_SUFFIX = ".md"


@dataclass(frozen=True)
class SopSummary:
    """One line of ``bothy sop list``: the name, its size and its first line."""

    name: str
    size_bytes: int
    title: str


def sop_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an SOP, or None. Names are file names: no dots, no slashes."""
    if _NAME.match(name):
        return None
    return (f"{name!r} is not an SOP name: use up to 48 letters, digits, '-' or '_',"
            " starting with a letter or digit (e.g. nightly-backup)")


class SopLibrary:
    """The SOP files under ``root`` (``BothyHome.sops_dir``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        """Where SOP ``name`` lives; UsageError if ``name`` is not an SOP name."""
        if problem := sop_name_problem(name):
            raise UsageError(problem)
        return self.root / f"{name}{_SUFFIX}"

    def summaries(self) -> list[SopSummary]:
        """Every SOP, by name."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in sorted(self.root.iterdir()):
            name = entry.name.removesuffix(_SUFFIX)
            if entry.suffix != _SUFFIX or sop_name_problem(name) or not entry.is_file():
                continue
            text = self.read(name) or ""
            found.append(SopSummary(name, entry.stat().st_size, _title(text)))
        return found

    def read(self, name: str) -> str | None:
        """The text of SOP ``name``; None if there is no such SOP."""
        try:
            return self.path(name).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"Cannot read SOP {name!r}: {exc.strerror or exc}") from exc

    def missing(self, name: str) -> str | None:
        """Why ``--sop NAME`` cannot be attached (bad name, no such SOP), or None."""
        if problem := sop_name_problem(name):
            return problem
        if not self.path(name).is_file():
            return (f"there is no SOP {name!r} in {self.root}: write it first with"
                    f" `bothy sop set {name} --file FILE` (see `bothy sop list`)")
        return None

    def write(self, name: str, data: bytes) -> int:
        """Replace SOP ``name`` with ``data`` (UTF-8 text) atomically; return its size.

        UsageError when the name, the size or the encoding is wrong; nothing is written then.
        """
        path = self.path(name)
        if len(data) > MAX_SOP_BYTES:
            raise UsageError(
                f"SOP {name!r} is {len(data):,} bytes; the limit is {MAX_SOP_BYTES:,} (it is read"
                " whole into every prompt that carries it): shorten it, or split it into"
                " several SOPs"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"SOP {name!r} is not UTF-8 text ({exc.reason} at byte"
                             f" {exc.start}): save it as UTF-8 and set it again") from None
        if not text.strip():
            raise UsageError(f"SOP {name!r} is empty: give the procedure's text")
        try:
            write_atomically(path, data)
        except OSError as exc:
            raise StateError(f"Cannot write SOP {name!r} to {path}: {exc.strerror or exc}"
                             ) from exc
        return len(data)


def _title(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip().lstrip("#").strip()[:80]
    return ""
