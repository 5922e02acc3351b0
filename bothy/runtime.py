"""The parts a command needs, opened in order and closed in reverse: home, state, audit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from bothy.clock import Clock, utc_now
from bothy.config import Config
from bothy.engine.audit import AuditLog
from bothy.engine.launch import Launch, build_launch
from bothy.engine.recovery import Recovery
from bothy.engine.state import StateDB
from bothy.engine.supervisor import Supervisor
from bothy.home import BothyHome


@dataclass
class Runtime:
    """An open Bothy site: its config, state database and audit log."""

    home: BothyHome
    cfg: Config
    db: StateDB
    audit: AuditLog
    clock: Clock

    @classmethod
    @asynccontextmanager
    async def open(
        cls, home: BothyHome, cfg: Config, *, clock: Clock = utc_now
    ) -> AsyncIterator[Runtime]:
        home.ensure()
        async with StateDB.open(home.db_path) as db:
            yield cls(home, cfg, db, AuditLog(home.audit_path, clock=clock), clock)

    def launch(self) -> Launch:
        return build_launch(self.cfg.codex)

    def supervisor(self, launch: Launch | None = None) -> Supervisor:
        return Supervisor(
            self.cfg, db=self.db, audit=self.audit, launch=launch or self.launch(),
            clock=self.clock, checklist_path=self.home.checklist_path,
        )

    def recovery(self) -> Recovery:
        return Recovery(self.db, self.audit, clock=self.clock, grace_s=self.cfg.limits.stop_grace_s)
