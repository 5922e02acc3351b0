"""Every exception Bothy raises, in one rooted tree.

    BothyError
    ├── ConfigError            config file missing, unreadable or invalid (exit 78)
    ├── UsageError             a command-line argument that cannot be honoured (exit 64)
    ├── TemporaryFailure       try again later: a lock held, a port taken (exit 75)
    │   └── ListenerError      a webhook listener cannot bind its host:port
    ├── StateError             the state directory or database cannot be used
    │   └── StateCorruptError  the state database is damaged or not one (exit 65)
    ├── InboxError             a wake cannot be made durable, or its payload cannot be read
    ├── AuditIntegrityError    the audit chain is broken (names the first bad record)
    ├── CodexNotFoundError     the configured codex command is missing or not executable
    ├── AppServerError         the codex app-server misbehaved or died
    │   └── RpcProtocolError   a frame that is not valid JSON-RPC
    ├── ProcessGroupError      a worker's process group could not be started or stopped
    └── ChatError              a chat platform refused or failed a call
        ├── ChatAuthError      a token the platform refuses (a configuration error: exit 78)
        └── ChatUnavailable    the platform cannot be reached now (exit 75)

A refusal (budget, pool, lane) is *not* an exception: gates return values (see
``bothy.engine.budget``). Exceptions are for what nobody can plan around.
"""

from __future__ import annotations

from pathlib import Path


class BothyError(Exception):
    """Root of Bothy's exceptions."""


class ConfigError(BothyError):
    """The configuration cannot be used. Carries the file, the key and what was expected."""

    def __init__(self, message: str, *, path: Path | None = None, key: str | None = None) -> None:
        self.path = path
        self.key = key
        super().__init__(message)


class UsageError(BothyError):
    """A command-line argument that cannot be honoured."""


class TemporaryFailure(BothyError):
    """Something that may clear by itself: the service manager should restart Bothy later."""


class StateError(BothyError):
    """The state directory or database cannot be used."""


class StateCorruptError(StateError):
    """The state database is damaged, or not a database: it has to be moved aside (exit 65)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        super().__init__(
            f"the state database {path} is corrupt ({reason}). Stop bothy serve, move it"
            f" aside (mv {path} {path}.corrupt, and likewise its -wal and -shm files if"
            " present), then run the command again: a new, empty one is made. Schedules"
            " must be added again and today's spend starts again from zero; the audit log"
            " keeps the history."
        )

    @classmethod
    def from_sqlite(cls, path: Path, exc: BaseException) -> StateCorruptError | None:
        """The translation of SQLite's own verdict, or None when ``exc`` is not corruption."""
        name = getattr(exc, "sqlite_errorname", None)
        if name in ("SQLITE_CORRUPT", "SQLITE_NOTADB"):
            return cls(path, str(exc))
        return None


class AuditIntegrityError(BothyError):
    """The audit chain does not verify. ``seq`` names the first bad record (or None)."""

    def __init__(self, message: str, *, seq: int | None = None, line_no: int | None = None) -> None:
        self.seq = seq
        self.line_no = line_no
        super().__init__(message)


class CodexNotFoundError(BothyError):
    """The configured codex command is missing or not executable."""

    def __init__(self, message: str, *, command: list[str]) -> None:
        self.command = command
        super().__init__(message)


class AppServerError(BothyError):
    """The codex app-server misbehaved: an error response, a death, a hang."""

    def __init__(
        self, message: str, *, method: str | None = None, exit_code: int | None = None
    ) -> None:
        self.method = method
        self.exit_code = exit_code
        super().__init__(message)


class RpcProtocolError(AppServerError):
    """A frame from the app-server that is not valid JSON-RPC."""


class ProcessGroupError(BothyError):
    """A worker's process group could not be started or stopped."""


class InboxError(BothyError):
    """A wake cannot be made durable (disk full, permission, not a directory) or read back.

    The webhook listener answers 503 to it, so the sender retries later.
    """


class ListenerError(TemporaryFailure):
    """A webhook listener cannot listen on ``host``:``port`` (taken, not permitted)."""

    def __init__(self, message: str, *, host: str, port: int) -> None:
        self.host = host
        self.port = port
        super().__init__(message)


class ChatError(BothyError):
    """A chat platform refused or failed a call. ``platform`` is "slack" or "discord"."""

    def __init__(self, message: str, *, platform: str) -> None:
        self.platform = platform
        super().__init__(message)


class ChatAuthError(ChatError):
    """The platform refuses the token: fix the configuration (exit 78)."""


class ChatUnavailable(ChatError):
    """The platform cannot be reached now: try again later (exit 75)."""
