"""Supervisor overhead: `bothy run` start → turn/start sent, minus codex's own initialize time.

The real CLI runs against the real pinned codex and the scripted model server. The `turn
started` audit record carries when turn/start was sent (unix time) and how long the
app-server took from spawn to its initialize answer; the difference from the moment this
benchmark launched `bothy run` is Bothy's own cost: interpreter start, imports, config, state,
the gates, spawning, and thread/start. (`bothy run` spawns codex as soon as the run is checked,
its head start: codex's initialize then runs beside Bothy's own set-up, so that what is left
of the figure is what of Bothy's start codex's initialize did not cover; the launch → spawn
figure says how soon codex was spawned.)

Beside it, in the same run and taking turns with it: a bare interpreter (`python -c pass`),
and codex's own initialize and thread/start measured without Bothy (the same argv, environment
and working directory, spawned here, each request sent at once), so that the parts of the
figure that are codex's and the part that is Python's are each on the page.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench._util import figure, median, run_against_fakes

RUNS = 7


async def _bare_python_s(env: dict[str, str]) -> float:
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass", env=env)
    await process.wait()
    return time.perf_counter() - started


async def _codex_alone_s(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Spawn codex app-server as Bothy would; time its answer to ``initialize`` (from spawn),
    then to the ``thread/start`` a run without a profile sends (from sending it)."""
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *argv, env=env, cwd=cwd, start_new_session=True, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    async def call(request_id: int, method: str, params: dict[str, Any]) -> None:
        stdin.write(json.dumps({"id": request_id, "method": method, "params": params}).encode()
                    + b"\n")
        while True:
            line = await stdout.readline()
            if not line:
                raise RuntimeError(f"codex app-server closed its output before answering {method}")
            if json.loads(line).get("id") == request_id:
                return

    try:
        async with asyncio.timeout(30):
            await call(1, "initialize", {
                "clientInfo": {"name": "bench", "title": "bench", "version": "0"},
                "capabilities": {"experimentalApi": True}})
            initialized = time.perf_counter()
            stdin.write(json.dumps({"method": "initialized"}).encode() + b"\n")
            asked = time.perf_counter()
            await call(2, "thread/start", {"cwd": str(cwd), "approvalPolicy": "on-request",
                                           "sandbox": "read-only", "ephemeral": True})
            return initialized - started, time.perf_counter() - asked
    finally:
        stdin.close()
        try:
            async with asyncio.timeout(5):
                await process.wait()
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


async def _run_once(site: Any, server: Any) -> dict[str, float]:
    """One `bothy run`: its figures from the register (ms)."""
    from tests.fakes.model_server import text

    server.script(text("BOTHY"))
    launched = time.time()
    done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "bench")
    if done.code != 0:
        raise RuntimeError(f"bench run failed: {done.stdout} {done.stderr[-500:]}")
    run_id = done.stdout.split()[1]
    listing = await site.bothy("audit", "--run", run_id, "--json")
    records = [json.loads(line) for line in listing.stdout.splitlines()]
    turn = next(r for r in records if r["kind"] == "turn" and r["event"] == "started")

    def at(kind: str, event: str) -> float:
        record = next(r for r in records if r["kind"] == kind and r["event"] == event)
        return datetime.fromisoformat(record["ts"]).timestamp()

    details = turn["details"]
    sent = details["turn_start_sent_unix"]
    woken, admitted = at("wake", "received"), at("run", "admitted")
    spawned = sent - details["to_turn_start_ms"] / 1000  # (a cold start: from the spawn)
    return {
        "overhead": (sent - launched) * 1000 - details["initialize_ms"],
        "to_turn_start": (sent - launched) * 1000,
        "before_wake": (woken - launched) * 1000,
        "inside": (sent - woken) * 1000 - details["initialize_ms"],
        "init": details["initialize_ms"],
        # The split of the run's own part: the gates (wake recorded → admitted), the slot and
        # the spawn (→ codex spawned), then codex's first steps and turn/start (→ turn/start
        # sent, minus codex's initialize).
        "gates": (admitted - woken) * 1000,
        "spawn": (spawned - admitted) * 1000,  # negative: spawned ahead (`bothy run`'s head start)
        "spawned_at": (spawned - launched) * 1000,
        "to_turn": (sent - spawned) * 1000 - details["initialize_ms"],
    }


async def _imports_alone_ms(env: dict[str, str]) -> float:
    """The wall time (ms) of what a run imports, in an interpreter of its own, as the CLI does
    (timed inside it, so the interpreter's own start is left out)."""
    code = ("import time; started = time.perf_counter()\n" + _IMPORTED_ALONE["engine"]
            + "; import bothy.cli, bothy.commandline;"
            " print(time.perf_counter() - started)")
    alone = await asyncio.create_subprocess_exec(sys.executable, "-c", code, env=env,
                                                 stdout=asyncio.subprocess.PIPE)
    out, _ = await alone.communicate()
    return float(out) * 1000


_IMPORT_KINDS = (  # (what, module name prefixes), the first that names a module or its importer
    ("pydantic", ("pydantic", "pydantic_core", "annotated_types", "typing_inspection")),
    ("the config's models", ("bothy.config",)),
    ("asyncio", ("asyncio",)),
    ("the engine (its modules, psutil, sqlite)", ("bothy.engine", "bothy.runtime")),
)


def _kind(chain: list[str]) -> str:
    """What an import is for: the first kind that the module, or one importing it, is."""
    for name in chain:
        for kind, prefixes in _IMPORT_KINDS:
            if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
                return kind
    return "the rest"


async def _import_shares(site: Any, server: Any) -> dict[str, float]:
    """One more `bothy run`, under ``-X importtime``: the time (ms) its imports take, by kind
    (each module's own time, counted for the first kind found from it up its importers)."""
    from tests.fakes.model_server import text

    server.script(text("BOTHY"))
    done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "bench",
                            PYTHONPROFILEIMPORTTIME="1")
    rows = []  # (own µs, depth, name), children before the module that imported them
    for line in done.stderr.splitlines():  # "import time: self | cumulative |   name"
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[0].strip().isdigit():
            name = fields[2][1:].rstrip()
            rows.append((int(fields[0]), (len(name) - len(name.lstrip())) // 2, name.strip()))
    # `python -m bothy` begins with runpy: whatever was imported before is the interpreter's.
    begins = next(i for i, (_, depth, name) in enumerate(rows) if depth == 0 and name == "runpy")
    shares = {"the interpreter's own": sum(own for own, _, _ in rows[:begins]) / 1000}
    importers: list[tuple[int, str]] = []
    for own_us, depth, name in reversed(rows[begins:]):
        while importers and importers[-1][0] >= depth:
            importers.pop()
        kind = _kind([name, *reversed([n for _, n in importers])])
        shares[kind] = shares.get(kind, 0.0) + own_us / 1000
        importers.append((depth, name))
    return shares


async def _instructions(site: Any, server: Any, env: dict[str, str]) -> dict[str, float]:
    """Where valgrind is installed: the instructions (M) of one whole `bothy run`, its own
    process only (codex is not traced), and of a bare interpreter; none without valgrind."""
    from tests.fakes.model_server import text

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return {}
    counting = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    server.script(text("BOTHY"))
    site.launch_prefix = counting
    try:
        done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "bench",
                                timeout_s=300)
    finally:
        site.launch_prefix = []
    counted = [done.stderr]
    for code in ("pass", *_IMPORTED_ALONE.values()):
        alone = await asyncio.create_subprocess_exec(*counting, sys.executable, "-c", code,
                                                     env=env, stderr=asyncio.subprocess.PIPE)
        _, err = await alone.communicate()
        counted.append(err.decode())
    found = [re.search(r"Collected : (\d+)", text) for text in counted]
    if done.code != 0 or not all(found):
        return {}
    run, interpreter, *layers = (int(match.group(1)) / 1e6 for match in found if match)
    return {"run": run, "bare": interpreter, **dict(zip(_IMPORTED_ALONE, layers, strict=True))}


# What a run imports, layer on layer, each counted in an interpreter of its own as the CLI
# starts a command (the collector off, pydantic's plugins off): the event loop, then the
# validated config (what codex could be spawned after at the earliest), then the engine.
# (Where the CLI also stands in for pydantic's plugin loader, bothy/pydanticplugins.py, so
# does this; a checkout without it is measured as its CLI runs.)
_AS_THE_CLI = ("import gc, os; gc.disable();"
               " os.environ.setdefault('PYDANTIC_DISABLE_PLUGINS', '__all__')\n"
               "try:\n from bothy.pydanticplugins import look_for_plugins_only_when_on\n"
               "except ImportError:\n pass\nelse:\n look_for_plugins_only_when_on()\n")
_IMPORTED_ALONE = {
    "asyncio": _AS_THE_CLI + "import asyncio",
    "config": _AS_THE_CLI + "import asyncio, bothy.config",
    "engine": _AS_THE_CLI + "import asyncio, bothy.config, bothy.runtime,"
              " bothy.commands.foreground, bothy.progress, bothy.waits",
}


async def _measure(root: Path) -> dict[str, list[float]]:
    from bothy.config import load_config
    from bothy.engine.launch import build_launch
    from tests.fakes.model_server import ModelServer, text
    from tests.fakes.site import Site

    figures: dict[str, list[float]] = {}
    async with ModelServer() as server:
        site = Site(root, server.base_url)
        # As a site meets it: an installed bothy has its bytecode compiled (pip does that); an
        # empty PYTHONDONTWRITEBYTECODE is unset for Python, so the first run writes the .pyc.
        site.extra_env["PYTHONDONTWRITEBYTECODE"] = ""
        env = site.env()
        launch = build_launch(load_config(site.home / "config.json").codex, environ=env)
        server.script(text("BOTHY"))
        await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "warm")
        for _ in range(RUNS):  # taking turns, so that the machine's load meets all three
            for name, value in (await _run_once(site, server)).items():
                figures.setdefault(name, []).append(value)
            figures.setdefault("bare", []).append(await _bare_python_s(env) * 1000)
            figures.setdefault("imports", []).append(await _imports_alone_ms(env))
            init_s, thread_s = await _codex_alone_s(launch.argv, launch.env, site.workspace)
            figures.setdefault("codex_init", []).append(init_s * 1000)
            figures.setdefault("codex_thread", []).append(thread_s * 1000)
        for name, value in (await _import_shares(site, server)).items():
            figures[f"imports_{name}"] = [value]
        for name, value in (await _instructions(site, server, env)).items():
            figures[f"instructions_{name}"] = [value]
    return figures


def main() -> None:
    figures: dict[str, list[float]] = {}

    async def bench(root: Path) -> None:
        figures.update(await _measure(root))

    run_against_fakes("supervisor-", bench)
    figure("bothy run → turn/start, minus codex init", median(figures["overhead"]), "ms", 80,
           higher_is_better=False)
    low, high = min(figures["overhead"]), max(figures["overhead"])
    print(f"   ({len(figures['overhead'])} runs, {low:.1f}–{high:.1f} ms; launch → turn/start"
          f" sent in all: median {median(figures['to_turn_start']):.1f} ms)")
    alone = [total - init for total, init in zip(figures["to_turn_start"], figures["codex_init"],
                                                 strict=True)]
    print(f"   minus codex's initialize measured alone (next to each run) instead of within it:"
          f" median {median(alone):.1f} ms")
    print(f"   bare python -c pass, same run: median {median(figures['bare']):.1f} ms")
    print(f"   launch → `wake received` recorded (interpreter, imports, config, state, recovery):"
          f" median {median(figures['before_wake']):.1f} ms")
    print(f"   of which the supervisor itself (wake recorded → turn/start, minus codex init):"
          f" median {median(figures['inside']):.1f} ms")
    set_up = [wake - bare - imports for wake, bare, imports in
              zip(figures["before_wake"], figures["bare"], figures["imports"], strict=True)]
    print(f"   the split, medians in ms: interpreter (bare) {median(figures['bare']):.1f},"
          f" imports (alone, next to each run) {median(figures['imports']):.1f}, set-up (the"
          f" rest before `wake received`: config, state, recovery) {median(set_up):.1f},"
          f" gates (→ `run admitted`) {median(figures['gates']):.1f}, slot and spawn"
          f" (→ codex spawned; negative when spawned ahead) {median(figures['spawn']):.1f},"
          f" codex's first steps and"
          f" turn/start (→ sent, minus codex init) {median(figures['to_turn']):.1f}")
    print(f"   launch → codex spawned: median {median(figures['spawned_at']):.1f} ms"
          f" ({min(figures['spawned_at']):.1f}–{max(figures['spawned_at']):.1f}); a head start"
          f" spawns it before `wake received`, so its initialize runs beside Bothy's set-up")
    print(f"   codex app-server's initialize within the run (spawn → answer):"
          f" median {median(figures['init']):.1f} ms; alone, spawned by this bench:"
          f" median {median(figures['codex_init']):.1f} ms")
    print(f"   codex's own thread/start alone (sent → answer, inside the figure above):"
          f" median {median(figures['codex_thread']):.1f} ms")
    floor = median(figures["spawned_at"]) + median(figures["codex_thread"])
    print(f"   so, with codex spawned when it is (once the config is checked: engine/headstart.py),"
          f" the figure cannot go below launch → spawned + codex's own thread/start:"
          f" {floor:.1f} ms (turn/start follows the thread, which follows the initialize the"
          " figure leaves out)")
    if "instructions_run" in figures:
        run, bare = figures["instructions_run"][0], figures["instructions_bare"][0]
        print(f"   instructions (callgrind) of one whole bothy run, its own process (codex not"
              f" counted): {run:,.0f} M; a bare interpreter {bare:,.0f} M ({run / bare:.1f}×)")
        asyncio_ir, config_ir, engine_ir = (figures[f"instructions_{name}"][0]
                                            for name in _IMPORTED_ALONE)
        print(f"   what it imports, counted alone in interpreters of their own (each with the"
              f" one before): asyncio {asyncio_ir:,.0f} M, with pydantic and the config's models"
              f" {config_ir:,.0f} M, with the engine and the CLI's run path {engine_ir:,.0f} M")
    imports = {name.removeprefix("imports_"): values[0] for name, values in figures.items()
               if name.startswith("imports_")}
    interpreter = imports.pop("the interpreter's own")
    shown = ", ".join(f"{kind} {ms:.0f}" for kind, ms in
                      sorted(imports.items(), key=lambda item: -item[1]))
    print(f"   its imports, in one more run under -X importtime (which slows them), in ms:"
          f" {shown}; the interpreter's own {interpreter:.0f}")
