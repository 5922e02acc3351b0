"""Every finished run's trace, sent by ``bothy serve`` to an OTLP/HTTP receiver (config ``otel``).

The register says what to send: :class:`TraceExporter` follows it from a cursor and queues the
run of each ``run finished`` record, whichever process wrote it (a run of the daemon's, or a
``bothy run`` beside it). The cursor and the queue are one small file, ``state/otel-queue.json``,
replaced atomically (and fsynced) after each change, so a restart loses no finished run and
does not send again one it had delivered — unless it died between the receiver's 2xx and that
file's replacement, when the run is sent a second time (at least once, never zero). On the
first start the cursor is the register's end: a site's history is not sent.

A queued run is sent when due: its trace built from the register at that moment
(:mod:`bothy.trace`; what people and the model wrote held back unless ``include_content``), one
POST of OTLP/JSON under ``timeout_s``. A failure (no answer, a non-2xx status, spans rejected)
is retried after ``retry_first_s``, doubling up to ``retry_max_s``; after ``max_attempts`` the
run is given up with a ``trace abandoned`` record. Nothing here touches a run: the exporter
reads the register and writes its own file, and its own trouble is waited out, never raised
into the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bothy import __version__
from bothy.atomicfile import write_atomically
from bothy.clock import Clock
from bothy.config import OtelConfig
from bothy.engine.audit import AuditLog
from bothy.engine.auditindex import RunIndex
from bothy.engine.auditrecord import parse_line
from bothy.errors import BothyError
from bothy.trace import OtlpRefused, build_spans, otlp_answer, otlp_request

__all__ = ["TraceExporter"]

_FOLLOW_EVERY_S = 0.5  # how often the register is looked at for runs that finished
_TROUBLE_WAIT_S = 30.0  # after an error of the exporter's own (its file, the register)
_FOLLOW_MAX_BYTES = 8 << 20  # read of the register per look (a long downtime, in steps)
# A chat run answers before its worker stops (`run finished`, then `worker stopped`): its trace
# waits for the worker's end, so the worker span is whole; at most this long (a stop that
# never gets recorded, a serve that died with no later one), then it goes as it is.
_WORKER_WAIT_S = 120.0


@dataclass
class _Queued:
    run_id: str
    attempts: int = 0
    due_at: float = 0.0  # unix seconds
    problem: str = ""
    awaits_worker: bool = False  # finished, its worker still stopping: due at `worker stopped`


@dataclass
class _Cursor:
    """How far the register has been followed: the file, the offset, the last seq seen."""

    dev: int = 0
    ino: int = 0
    offset: int = 0
    seq: int = 0


@dataclass
class _Queue:
    cursor: _Cursor
    runs: list[_Queued] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps({"cursor": asdict(self.cursor),
                           "runs": [asdict(run) for run in self.runs]}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> _Queue:
        data = json.loads(raw)
        return cls(_Cursor(**data["cursor"]), [_Queued(**run) for run in data["runs"]])


class TraceExporter:
    """Follows the register at ``audit.path`` and sends each finished run's trace (see above).

    ``http`` is the daemon's client; ``environ`` holds the values ``headers_env`` names.
    """

    def __init__(
        self,
        cfg: OtelConfig,
        *,
        audit: AuditLog,
        queue_path: Path,
        site: str,
        clock: Clock,
        http: httpx.AsyncClient,
        environ: Mapping[str, str],
    ) -> None:
        self._cfg = cfg
        self._audit = audit
        self._index = RunIndex(audit.path)
        self._queue_path = queue_path
        self._site = site
        self._clock = clock
        self._http = http
        self._environ = environ
        self._queue: _Queue | None = None
        self._stalled = False  # said once per streak of the exporter's own trouble

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the register and send what is due, until ``stop`` is set."""
        while not stop.is_set():
            wait_s = _FOLLOW_EVERY_S
            try:
                if self._queue is None:
                    self._queue = await asyncio.to_thread(self._load)
                if await asyncio.to_thread(self._follow, self._queue):
                    await asyncio.to_thread(self._save, self._queue)
                await self._send_due(self._queue, stop)
                self._stalled = False
            except (BothyError, OSError, ValueError) as exc:
                # The exporter's own trouble (its file, the register): never the daemon's.
                if not self._stalled:
                    self._stalled = True
                    with contextlib.suppress(BothyError):
                        await self._audit.record("trace", "stalled", "failed", details={
                            "reason": str(exc), "retry_in_s": _TROUBLE_WAIT_S})
                self._queue, wait_s = None, _TROUBLE_WAIT_S
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await stop.wait()

    # -- the queue's file ------------------------------------------------------------------

    def _load(self) -> _Queue:
        try:
            raw = self._queue_path.read_bytes()
        except FileNotFoundError:
            queue = _Queue(self._register_end())  # the first start: from now on
            self._save(queue)
            return queue
        try:
            return _Queue.from_json(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self._queue_path} is not the exporter's queue ({exc}); move"
                             " it aside to start again from the register's end") from None

    def _save(self, queue: _Queue) -> None:
        write_atomically(self._queue_path, queue.to_json())

    def _register_end(self) -> _Cursor:
        try:
            st = os.stat(self._audit.path)
        except FileNotFoundError:
            return _Cursor()
        return _Cursor(st.st_dev, st.st_ino, st.st_size, _last_seq(self._audit.path, st.st_size))

    # -- following the register ------------------------------------------------------------

    def _follow(self, queue: _Queue) -> bool:
        """Queue the runs that finished since the cursor; whether anything changed."""
        try:
            st = os.stat(self._audit.path)
        except FileNotFoundError:
            return False
        cursor = queue.cursor
        same_file = (cursor.dev, cursor.ino) == (st.st_dev, st.st_ino)
        if same_file and st.st_size == cursor.offset:
            return False
        # Another file (a repair started a segment) or a shorter one: read it all again, and
        # take only the records after the last seq followed.
        start = cursor.offset if same_file and st.st_size > cursor.offset else 0
        with self._audit.path.open("rb") as f:
            f.seek(start)
            data = f.read(min(st.st_size - start, _FOLLOW_MAX_BYTES))
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        queued = {run.run_id for run in queue.runs}
        seq = cursor.seq
        for line in complete.splitlines():
            record = parse_line(line)
            if isinstance(record, str) or record.seq <= seq:
                continue
            seq = record.seq
            pair, run_id = (record.kind, record.event), record.run_id
            if pair == ("run", "finished") and run_id and run_id not in queued:
                stopping = self._worker_stopping(run_id)
                queue.runs.append(_Queued(
                    run_id, due_at=self._now() + (_WORKER_WAIT_S if stopping else 0.0),
                    awaits_worker=stopping))
                queued.add(run_id)
            elif pair == ("worker", "stopped") and run_id in queued:
                for run in queue.runs:
                    if run.run_id == run_id and run.awaits_worker:
                        run.awaits_worker, run.due_at = False, self._now()
        queue.cursor = _Cursor(st.st_dev, st.st_ino, start + len(complete), seq)
        return True

    def _worker_stopping(self, run_id: str) -> bool:
        """Whether ``run_id``'s worker started and its `worker stopped` is not recorded yet."""
        pairs = {(r.kind, r.event) for r in self._index.records(run_id)}
        return ("run", "started") in pairs and ("worker", "stopped") not in pairs

    # -- sending ---------------------------------------------------------------------------

    async def _send_due(self, queue: _Queue, stop: asyncio.Event) -> None:
        for run in sorted(queue.runs, key=lambda queued: queued.due_at):
            if stop.is_set() or run.due_at > self._now():
                return
            try:
                await self._send(run.run_id)
            except OtlpRefused as exc:
                await self._failed(queue, run, str(exc))
            else:
                queue.runs.remove(run)
            await asyncio.to_thread(self._save, queue)

    async def _send(self, run_id: str) -> None:
        records = await asyncio.to_thread(self._index.records, run_id)
        request = otlp_request(run_id, build_spans(run_id, records), site=self._site,
                               version=__version__, include_content=self._cfg.include_content)
        headers = {"Content-Type": "application/json"}
        for header, env in self._cfg.headers_env.items():
            value = self._environ.get(env)
            if not value:
                raise OtlpRefused(f"otel.headers_env: {env} (for {header}) is not set")
            headers[header] = value
        endpoint = self._cfg.endpoint
        try:
            answer = await self._http.post(endpoint, content=json.dumps(request).encode(),
                                           headers=headers, timeout=self._cfg.timeout_s)
        except httpx.HTTPError as exc:
            raise OtlpRefused(f"cannot reach {_shown(endpoint)}: {exc or type(exc).__name__}"
                              ) from None
        otlp_answer(_shown(endpoint), answer.status_code, answer.content)

    async def _failed(self, queue: _Queue, run: _Queued, problem: str) -> None:
        run.attempts += 1
        run.problem = problem
        if run.attempts < self._cfg.max_attempts:
            delay_s = min(self._cfg.retry_first_s * 2 ** (run.attempts - 1),
                          self._cfg.retry_max_s)
            run.due_at = self._now() + delay_s
            return
        queue.runs.remove(run)
        await self._audit.record("trace", "abandoned", "failed", run_id=run.run_id, details={
            "endpoint": _shown(self._cfg.endpoint), "attempts": run.attempts,
            "problem": problem})

    def _now(self) -> float:
        return self._clock().timestamp()


def _shown(endpoint: str) -> str:
    """The endpoint without what may be a secret in it (a user, a password, a query)."""
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _last_seq(path: Path, size: int) -> int:
    """The seq of the register's last whole record (0 for none)."""
    if size == 0:
        return 0
    with path.open("rb") as f:
        f.seek(max(0, size - 65536))
        tail = f.read(size)
    for line in reversed(tail[: tail.rfind(b"\n") + 1].splitlines()):
        record = parse_line(line)
        if not isinstance(record, str):
            return record.seq
    return 0

