"""``python -m bothy.install.envexec FILE -- ARGV…``: load an environment file, then exec ARGV.

launchd has no ``EnvironmentFile=``: a plist's ``EnvironmentVariables`` would put secrets
inline in a world-readable file. So the LaunchAgent starts this, which reads the 0600 file
written by ``bothy install`` (same format systemd reads) and execs ``bothy serve`` with it.
A file that cannot be read is a configuration error; under launchd it exits 0 after saying
so, since launchd would relaunch any non-zero exit forever (docs/RUNBOOK.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bothy.install.envfile import parse_env_text


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m bothy.install.envexec FILE -- ARGV...", file=sys.stderr)
        return 64
    path, command = Path(argv[0]), argv[2:]
    try:
        pairs = parse_env_text(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        print(f"bothy: configuration error: cannot read the service environment file {path}:"
              f" {exc}; rerun `bothy install --serve`", file=sys.stderr)
        return 0 if os.environ.get("BOTHY_SERVICE_MANAGER") == "launchd" else 78
    environment = {**os.environ, **pairs}
    try:
        os.execve(command[0], command, environment)
    except OSError as exc:
        print(f"bothy: cannot start {command[0]}: {exc.strerror}", file=sys.stderr)
        return 0 if os.environ.get("BOTHY_SERVICE_MANAGER") == "launchd" else 78


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
