"""How a worker is launched: the codex command, its config overrides and a scrubbed environment.

The default command is ``codex app-server`` from PATH. When that ``codex`` is the npm package's
Node shim, Bothy execs the native binary it would have started instead, so that the pid and
process group Bothy supervises are the real worker's (on Node 20 the shim stays as a parent).

The worker's environment is built from nothing: a short list of harmless variables, then the
names the operator lists in ``codex.env``. Bothy's own secrets (chat tokens, webhook secrets)
are never passed.

Codex itself needs the ``codex.env`` variables (the provider's API key), but the shell commands
it runs for the model must not see them: a model told to run ``env`` would read the key back.
So every worker is started with a ``shell_environment_policy`` that excludes each ``codex.env``
name and anything named like a credential (``*KEY*``, ``*TOKEN*``, ``*SECRET*``...), with
Codex's own default excludes switched on (codex 0.171.0 leaves them off unless told). An
operator's own ``shell_environment_policy`` keys are kept; their ``exclude`` list is added to.

That policy filters the environment codex hands the user's shell; what the shell's own startup
files then export (``~/.profile``, ``~/.bashrc``…) is beyond it: codex reads them for the
model's commands. :mod:`bothy.engine.workershell` names such variables (``bothy doctor``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bothy.config import CodexConfig
from bothy.errors import CodexNotFoundError

# Variables a shell tool needs to behave; nothing here carries a credential.
_BASELINE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
                 "SHELL", "TERM")

# Keys Bothy sets unless the operator's codex.config (or a profile's codex_config) says
# otherwise: no update check, no analytics or feedback upload from an unattended machine, and
# not codex's shadow skill-selection experiment. ``features.skill_search`` (on by default in
# 0.171.0, `codex features list`) only switches that experiment on: the app-server builds the
# skills extension (app-server/src/extensions.rs) with ``shadow_selection_enabled =
# features.enabled(SkillSearch)``, and on every turn, before the model request, it ranks the
# skill catalog with a dozen lexical selectors whose results go to metrics alone
# (ext/skills/src/shadow_selection_experiment/mod.rs: "temporary and should be removed after
# evaluation"; it never changes the prompt).
# The model's requests with it off were compared with it on, byte for byte: the same. Measured
# on the real app-server alone (noisy): turn/start to the model request ~4-10 ms sooner.
_BASELINE_OVERRIDES: dict[str, Any] = {
    "check_for_update_on_startup": False,
    "analytics": {"enabled": False},
    "feedback": {"enabled": False},
    "features": {"skill_search": False},
}

# Names of variables the model's shell commands never see (case-insensitive globs, as Codex
# matches them), on top of every ``codex.env`` name.
SHELL_EXCLUDES = ("*KEY*", "*TOKEN*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*")

_NPM_PLATFORM_PACKAGES = {
    ("Linux", "x86_64"): ("codex-linux-x64", "x86_64-unknown-linux-musl"),
    ("Linux", "aarch64"): ("codex-linux-arm64", "aarch64-unknown-linux-musl"),
    ("Darwin", "x86_64"): ("codex-darwin-x64", "x86_64-apple-darwin"),
    ("Darwin", "arm64"): ("codex-darwin-arm64", "aarch64-apple-darwin"),
}


@dataclass(frozen=True)
class Launch:
    """Everything needed to exec one worker."""

    argv: list[str]
    env: dict[str, str]
    codex_home: Path


def build_launch(cfg: CodexConfig, environ: Mapping[str, str] | None = None, *,
                 profile_config: Mapping[str, Any] | None = None) -> Launch:
    """Resolve the command and build the worker's argv and environment; ``profile_config``
    (a profile's ``codex_config``) is merged over ``codex.config``."""
    env_in = os.environ if environ is None else environ
    executable = resolve_executable(cfg.command[0], env_in.get("PATH", os.defpath), cfg.command)
    chosen = _merge(cfg.config, profile_config or {})
    overrides = config_overrides(_merge(_merge(_BASELINE_OVERRIDES, chosen),
                                        _shell_policy(cfg, chosen)))
    if cfg.model is not None:
        overrides += ["-c", f"model={_toml_value(cfg.model)}"]
    codex_home = cfg.home or Path(env_in.get("CODEX_HOME") or Path.home() / ".codex")
    env = {name: env_in[name] for name in _BASELINE_ENV if name in env_in}
    env.update({name: env_in[name] for name in cfg.env if name in env_in})
    env["CODEX_HOME"] = str(codex_home)
    env.setdefault("RUST_LOG", "warn")
    return Launch([str(executable), *cfg.command[1:], *overrides], env, codex_home)


def workspace_problem(workspace: Path) -> str | None:
    """Why the configured workspace cannot host a run (the worker's working directory), or
    None."""
    if not workspace.is_dir():
        return f"workspace {workspace} does not exist or is not a directory"
    return None


def shell_excludes(cfg: CodexConfig, chosen: Mapping[str, Any] | None = None) -> list[str]:
    """The names the model's shell commands must not see (case-insensitive globs, as Codex
    matches them): the operator's own ``shell_environment_policy.exclude`` in ``chosen`` (the
    merged codex config; the site's ``codex.config`` when None), every ``codex.env`` name,
    and :data:`SHELL_EXCLUDES`."""
    theirs = _own_policy(cfg.config if chosen is None else chosen).get("exclude")
    return list(dict.fromkeys([*(theirs if isinstance(theirs, list) else []), *cfg.env,
                               *SHELL_EXCLUDES]))


def shell_excluded(name: str, excludes: Sequence[str]) -> bool:
    """Whether variable ``name`` matches one of ``excludes`` (:func:`shell_excludes`)."""
    folded = name.upper()
    return any(fnmatch.fnmatchcase(folded, glob.upper()) for glob in excludes)


def _own_policy(chosen: Mapping[str, Any]) -> Mapping[str, Any]:
    policy = chosen.get("shell_environment_policy")
    return policy if isinstance(policy, Mapping) else {}


def _shell_policy(cfg: CodexConfig, chosen: Mapping[str, Any]) -> dict[str, Any]:
    """The ``shell_environment_policy`` keys Bothy insists on, merged over the operator's."""
    return {"shell_environment_policy": {
        "ignore_default_excludes": bool(_own_policy(chosen).get("ignore_default_excludes",
                                                                False)),
        "exclude": shell_excludes(cfg, chosen),
    }}


def resolve_executable(name: str, search_path: str, command: list[str]) -> Path:
    """Find the command; see through the npm shim to the native binary."""
    found = shutil.which(name, path=search_path) if os.sep not in name else name
    if found is None:
        raise CodexNotFoundError(
            f"codex command {name!r} not found on PATH: install @openai/codex or set "
            "codex.command in config.json",
            command=command,
        )
    path = Path(found)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise CodexNotFoundError(
            f"codex command {str(path)!r} is not an executable file", command=command
        )
    return _native_behind_npm_shim(path) or path


def _native_behind_npm_shim(path: Path) -> Path | None:
    real = path.resolve()
    if not (real.name == "codex.js" and real.parent.name == "bin"):
        return None
    package_root = real.parent.parent  # .../node_modules/@openai/codex
    target = _NPM_PLATFORM_PACKAGES.get((platform.system(), platform.machine()))
    if target is None:
        return None
    package, triple = target
    for vendor in (package_root.parent / package / "vendor",
                   package_root / "node_modules" / "@openai" / package / "vendor",
                   package_root / "vendor"):
        native = vendor / triple / "bin" / "codex"
        if native.is_file() and os.access(native, os.X_OK):
            return native
    return None


def codex_version(launch: Launch, *, timeout_s: float = 10.0) -> str:
    """``codex --version`` of the resolved binary (blocking: call from a thread or the CLI)."""
    result = subprocess.run(
        [launch.argv[0], "--version"],
        env=launch.env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0:
        raise CodexNotFoundError(
            f"{launch.argv[0]} --version exited with code {result.returncode}: "
            f"{result.stderr.strip()[:200]}",
            command=launch.argv,
        )
    return result.stdout.strip()


def config_overrides(config: Mapping[str, Any]) -> list[str]:
    """Flatten nested config into ``-c dotted.key=<TOML value>`` arguments."""
    args: list[str] = []
    for key, value in _flatten(config, ""):
        args += ["-c", f"{key}={_toml_value(value)}"]
    return args


def _flatten(config: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in config.items():
        dotted = f"{prefix}{_toml_key(key)}"
        if isinstance(value, Mapping):
            items += _flatten(value, dotted + ".")
        else:
            items.append((dotted, value))
    return items


def _toml_key(key: str) -> str:
    if key and all(ch.isalnum() or ch in "_-" for ch in key):
        return key
    return json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot pass {type(value).__name__} to codex as a config value")


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
