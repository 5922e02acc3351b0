"""Commands an operator runs at a terminal: a run, its answer, its cancellation.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from bothy.commands._shared import load
from bothy.errors import ConfigError, UsageError
from bothy.exitcodes import ExitCode

if TYPE_CHECKING:
    from bothy.config import Config
    from bothy.engine.headstart import HeadStart
    from bothy.engine.launch import Launch
    from bothy.engine.questions import QuestionBoard
    from bothy.engine.run import RunRequest, RunResult
    from bothy.engine.toolbox import Asker
    from bothy.home import BothyHome
    from bothy.runtime import Runtime


async def cmd_run(args: argparse.Namespace) -> int:
    home, cfg = load()
    prompt = _read_prompt(args.prompt)
    subject = _subject(args.subject)
    max_usd_micros = reservation_micros(args.max_usd, cfg)
    wall_clock_s = _tighter(args.wall_clock, "--wall-clock", cfg.limits.wall_clock_s,
                            "limits.wall_clock_s")
    max_tokens = _tighter(args.max_tokens, "--max-tokens", cfg.limits.max_tokens,
                          "limits.max_tokens")
    profile = check_profile(args.profile, cfg)
    ref = check_ref(args.ref)
    launch = check_workspace(home, cfg)
    # Checked: codex starts now, beside the rest of the run's set-up (engine/headstart.py).
    head = await _head_start(launch, cfg, profile)
    try:
        from bothy.engine.run import RunRequest
        from bothy.runtime import Runtime

        request = RunRequest(
            prompt=prompt, subject=subject, source="cli", max_usd_micros=max_usd_micros,
            wall_clock_s=wall_clock_s, max_tokens=max_tokens, profile=profile, ref=ref,
            # A foreground run may hold a question: answered at the terminal or by `bothy
            # answer`.
            can_hold=True,
        )
        async with Runtime.open(home, cfg) as rt:
            result = await run_in_foreground(rt, request, head_start=head)
    finally:
        await head.close()
    return report_result(result)


async def _head_start(launch: Launch, cfg: Config, profile: str | None) -> HeadStart:
    """The run's app-server, spawned ahead of the run's set-up with the site's ``launch``; its
    thread started ahead too when the run has no profile (a profile's thread is its own:
    sandbox, skills, tools)."""
    from bothy.engine.headstart import HeadStart
    from bothy.engine.worker import ThreadParams

    thread = ThreadParams.plain(cfg.codex.model, keep=False) if profile is None else None
    return await HeadStart.begin(launch, cwd=cfg.workspace,
                                 grace_s=cfg.limits.stop_grace_s, thread=thread)


def check_workspace(home: BothyHome, cfg: Config) -> Launch:
    """The site's launch of codex, once its workspace and codex home are known to be there."""
    from bothy.engine.launch import build_launch, workspace_problem

    if problem := workspace_problem(cfg.workspace):
        raise ConfigError(f"{problem} (config key 'workspace' in {home.config_path})",
                          path=home.config_path, key="workspace")
    launch = build_launch(cfg.codex)
    codex_home = launch.codex_home
    if not codex_home.is_dir():  # codex refuses to start without it
        raise ConfigError(f"codex home {codex_home} does not exist: run `codex login` once, or"
                          f" set config key 'codex.home' in {home.config_path}",
                          path=home.config_path, key="codex.home")
    return launch


async def run_in_foreground(rt: Runtime, request: RunRequest, *,
                            head_start: HeadStart | None = None) -> RunResult:
    """Run ``request`` here, showing progress on stderr; a first signal stops it gracefully.
    ``head_start``: its app-server, spawned ahead (the caller closes it)."""
    from bothy.progress import PlainProgress, TerminalProgress

    supervisor = rt.supervisor()
    if head_start is not None:
        supervisor.use_head_start(head_start)
    await supervisor.recover()
    progress = TerminalProgress() if sys.stderr.isatty() else PlainProgress()
    answers = _TerminalAnswers(progress, rt)
    try:
        result: RunResult = await _until_signal(
            lambda: supervisor.execute(request, progress, asker=answers), supervisor.stopping
        )
    finally:
        answers.close()
    progress.finish()
    return result


def report_result(result: RunResult) -> int:
    """Print a run's one line (outcome, id, cost, answer or reason); return its exit code."""
    from bothy.money import format_usd

    shown = result.answer if result.outcome.answers else (result.reason or "")
    cost = format_usd(result.cost_micros, 4)
    print(f"{result.outcome} {result.run_id} {cost} usd {shown}".rstrip())
    return result.outcome.exit_code


class _TerminalAnswers:
    """Shows a question through the run's display; when stdin is a terminal, the next line
    typed answers it (as ``bothy answer`` would from another shell). The question board it
    answers on is made at the first line typed: a run that asks nothing never loads it."""

    def __init__(self, shown: Asker, rt: Runtime) -> None:
        self._shown = shown
        self._rt = rt
        self._board: QuestionBoard | None = None
        self._run_id: str | None = None
        self._reading = False
        self._pending: set[asyncio.Task[Any]] = set()

    def question(self, run_id: str, text: str) -> None:
        self._shown.question(run_id, text)
        self._run_id = run_id
        if sys.stdin.isatty() and not self._reading:
            asyncio.get_running_loop().add_reader(sys.stdin.fileno(), self._line)
            self._reading = True

    def declined(self, run_id: str, text: str) -> None:
        self._shown.declined(run_id, text)

    def _line(self, *_: Any) -> None:
        line = sys.stdin.readline().strip()
        if line and self._run_id is not None:
            if self._board is None:
                from bothy.engine.questions import QuestionBoard

                self._board = QuestionBoard(self._rt.db, clock=self._rt.clock)
            by = f"{os.environ.get('USER', 'operator')}@terminal"
            task = asyncio.ensure_future(self._board.answer(self._run_id, line, by))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def close(self) -> None:
        if self._reading:
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            self._reading = False


async def _until_signal(work: Callable[[], Awaitable[Any]], stopping: asyncio.Event) -> Any:
    """Run ``work``. A first SIGINT/SIGTERM only records the wish (``stopping``): the run
    stops itself, settles and reaps its group. A second one skips the waits."""
    from bothy.waits import first_of, recording_stop_signals

    task = asyncio.ensure_future(work())
    hurry = asyncio.Event()
    with recording_stop_signals(stopping, hurry):
        if await first_of(task, hurry.wait()) == 1:
            task.cancel("a second stop signal")
        return await task


def check_profile(name: str | None, cfg: Config) -> str | None:
    if name is not None and name not in cfg.profiles:
        known = ", ".join(sorted(cfg.profiles)) or "none are configured"
        raise UsageError(f"--profile {name!r} is not a configured profile ({known})")
    return name


def check_ref(ref: str | None, flag: str = "--ref") -> str | None:
    """A task reference given by a person: one outside the contract is a usage error."""
    if ref is None:
        return None
    from bothy.engine.cairn import ref_problem

    if problem := ref_problem(ref):
        raise UsageError(f"{flag} {problem}")
    return ref


def _read_prompt(prompt: str) -> str:
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise UsageError("the prompt is empty: give the text to run, or '-' to read stdin")
    return text


def _subject(subject: str) -> str:
    if not subject or any(ch.isspace() for ch in subject) or len(subject) > 200:
        raise UsageError(f"--subject {subject!r} must be one word (no spaces), e.g. pr:42")
    return subject


def _tighter(value: int | None, flag: str, configured: int | None, key: str) -> Any:
    """A flag may tighten a configured limit, never loosen it."""
    if value is None:
        return configured
    if value <= 0:
        raise UsageError(f"{flag} must be a positive number, not {value}")
    if configured is not None and value > configured:
        raise UsageError(
            f"{flag} {value} is above the configured {key} ({configured}): a flag may tighten"
            " a limit, not loosen it"
        )
    return value


def reservation_micros(value: str | None, cfg: Config) -> int:
    from bothy.money import usd_to_micros

    per_run = usd_to_micros(cfg.budget.per_run_usd)
    if value is None:
        return per_run
    try:
        amount = usd_to_micros(Decimal(value))
    except (InvalidOperation, ValueError, OverflowError):
        raise UsageError(f"--max-usd {value!r} is not an amount in usd, e.g. 0.25") from None
    if amount <= 0:
        raise UsageError(f"--max-usd must be more than 0, not {value}")
    if amount > per_run:
        raise UsageError(
            f"--max-usd {value} is more than budget.per_run_usd ({cfg.budget.per_run_usd}):"
            " a run may reserve less than the per-run limit, never more"
        )
    return amount


async def cmd_cancel(args: argparse.Namespace) -> int:
    from bothy.runtime import Runtime

    home, cfg = load()
    async with Runtime.open(home, cfg) as rt:
        return await _cancel(rt, args.run_id)


async def _cancel(rt: Runtime, run_id: str) -> int:
    from bothy.engine.pool import WorkerPool

    row = await rt.db.run(run_id)
    if row is None:
        raise UsageError(f"no run {run_id!r} in this site's state (see `bothy status`)")
    if row.status == "finished":
        print(f"{run_id} already finished: {row.outcome}")
        return ExitCode.FAILED
    await WorkerPool(rt.db, rt.cfg.pool, clock=rt.clock).request_cancel(run_id)
    await rt.audit.record("run", "cancel-requested", "ok", subject=row.subject, run_id=run_id)
    await rt.recovery().sweep()  # an orphan has nobody to hear the request: end it here
    deadline = asyncio.get_running_loop().time() + rt.cfg.limits.stop_grace_s + 15
    while asyncio.get_running_loop().time() < deadline:
        current = await rt.db.run(run_id)
        if current is not None and current.status == "finished":
            print(f"{current.outcome} {run_id}")
            return ExitCode.OK
        await asyncio.sleep(0.1)
    print(f"cancel requested for {run_id}; it has not finished yet (see `bothy status`)")
    return ExitCode.TEMPFAIL


async def cmd_answer(args: argparse.Namespace) -> int:
    from bothy.engine.questions import Delivered, QuestionBoard
    from bothy.runtime import Runtime

    home, cfg = load()
    text = args.text.strip()
    if not text:
        raise UsageError("the answer is empty: give yes, no, or the text to send")
    by = f"{os.environ.get('USER', 'operator')}@shell"
    async with Runtime.open(home, cfg) as rt:
        row = await rt.db.run(args.run_id)
        if row is None:
            raise UsageError(f"no run {args.run_id!r} in this site's state (see `bothy status`)")
        result = await QuestionBoard(rt.db, clock=rt.clock).answer(args.run_id, text, by)
        if isinstance(result, Delivered):
            await rt.audit.record("answer", "received", "ok", subject=row.subject,
                                  run_id=args.run_id, details={"by": by, "answer": text,
                                                               "question": result.question})
            print(f"answered {args.run_id}: {result.question}")
            return ExitCode.OK
        await rt.audit.record("answer", "late", "ok", subject=row.subject, run_id=args.run_id,
                              details={"by": by, "answer": text,
                                       "note": "nothing was waiting: the run had moved on"})
        print(f"{args.run_id} has no pending question: the run had moved on (recorded as late)")
        return ExitCode.FAILED
