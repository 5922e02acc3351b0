"""Where everything lives: ``$BOTHY_HOME`` (default ``~/.bothy``) and its layout.

Directories are created 0700 and files holding secrets or payloads 0600 (SPEC §1). A home
made by hand (``mkdir -p`` gives 0755) is tightened to 0700 when a command that writes state
starts; ``bothy doctor`` warns about a config file others can read (:func:`loose_mode`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from bothy.errors import StateError


class BothyHome:
    """The paths under one ``$BOTHY_HOME``. (A plain class, neither a dataclass nor a
    NamedTuple: every command starts here, and importing ``dataclasses`` or ``typing`` is a
    good part of a cold ``bothy status``.)"""

    __slots__ = ("root",)

    def __init__(self, root: Path) -> None:
        self.root = root

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BothyHome) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def __repr__(self) -> str:
        return f"BothyHome({str(self.root)!r})"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> BothyHome:
        env = os.environ if environ is None else environ
        configured = env.get("BOTHY_HOME")
        root = Path(configured).expanduser() if configured else Path.home() / ".bothy"
        return cls(root.absolute())

    @property
    def config_path(self) -> Path:
        return self.root / "config.json"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def db_path(self) -> Path:
        return self.state_dir / "bothy.sqlite3"

    @property
    def audit_path(self) -> Path:
        return self.state_dir / "audit.jsonl"

    @property
    def otel_queue_path(self) -> Path:
        """The trace exporter's cursor and queue (bothy/traceexport.py)."""
        return self.state_dir / "otel-queue.json"

    @property
    def checklist_path(self) -> Path:
        return self.root / "checklist.md"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def inbox_dir(self) -> Path:
        """Durable wake payloads, one fsynced file per delivery (see ``bothy.wakes.inbox``)."""
        return self.root / "inbox"

    @property
    def sops_dir(self) -> Path:
        """Written procedures, one ``NAME.md`` each (``bothy sop``; ``schedule add --sop``)."""
        return self.root / "sops"

    def ensure(self) -> None:
        """Create the state layout (0700 directories) and tighten the home to 0700 if group or
        others may enter it. Raise StateError if either cannot be done."""
        for directory in (self.root, self.state_dir, self.runs_dir):
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise StateError(f"cannot create {directory}: {exc.strerror}") from exc
            if not os.access(directory, os.W_OK | os.X_OK):
                raise StateError(f"{directory} is not writable by this user")
        self._tighten()

    def _tighten(self) -> None:
        mode = loose_mode(self.root)
        if mode is None:
            return
        try:
            self.root.chmod(0o700)
        except OSError as exc:
            raise StateError(
                f"{self.root} is mode {mode:04o} (group or others may read it) and cannot be"
                f" tightened to 0700: {exc.strerror}; run chmod 700 {self.root}") from exc


def loose_mode(path: os.PathLike[str] | str) -> int | None:
    """The permission bits of ``path`` if group or others have any; None if they have none
    or it does not exist."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    return mode if mode & 0o077 else None
