"""The parts a command needs, opened in order and closed in reverse: home, state, audit;
and the site's alerts, which every part that must be heard raises through (posted to the chat
alert channel by a one-shot Web API call, ``chat/oneshot.py``, when one is configured)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from bothy.clock import Clock, utc_now
from bothy.config import Config
from bothy.engine.alerts import Alert, Alerts
from bothy.engine.audit import AuditLog
from bothy.engine.launch import Launch, build_launch
from bothy.engine.recovery import Recovery
from bothy.engine.state import StateDB
from bothy.engine.supervisor import Supervisor
from bothy.home import BothyHome


@dataclass
class Runtime:
    """An open Bothy site: its config, state database, audit log and alerts."""

    home: BothyHome
    cfg: Config
    db: StateDB
    audit: AuditLog
    clock: Clock
    alerts: Alerts  # one per site: repeats are folded, and the daemon routes them to chat

    @classmethod
    @asynccontextmanager
    async def open(
        cls, home: BothyHome, cfg: Config, *, clock: Clock = utc_now
    ) -> AsyncIterator[Runtime]:
        home.ensure()
        async with StateDB.open(home.db_path) as db:
            audit = AuditLog(home.audit_path, clock=clock)
            yield cls(home, cfg, db, audit, clock, site_alerts(cfg, audit, clock=clock))

    def launch(self) -> Launch:
        return build_launch(self.cfg.codex)

    def supervisor(self, launch: Launch | None = None) -> Supervisor:
        memory = None
        if any(profile.memory is not None for profile in self.cfg.profiles.values()):
            from bothy.memory import SiteMemory

            memory = SiteMemory(self.home.root, self.cfg)
        return Supervisor(
            self.cfg, db=self.db, audit=self.audit, alerts=self.alerts,
            launch=launch or self.launch(),
            clock=self.clock, checklist_path=self.home.checklist_path, memory=memory,
        )

    def recovery(self) -> Recovery:
        return Recovery(self.db, self.audit, clock=self.clock, grace_s=self.cfg.limits.stop_grace_s)


def site_alerts(cfg: Config, audit: AuditLog, *, clock: Clock) -> Alerts:
    """The site's alerts, posted to the chat alert channel with one Web API call each (a
    command has no gateway; ``bothy serve`` routes them to its adapters once connected)."""
    alerts = Alerts(audit, site=cfg.site, clock=clock)
    chat = cfg.chat
    if not any(section is not None and section.alert_channel
               for section in (chat.slack, chat.discord)):
        return alerts
    poster = None

    async def post(alert: Alert) -> str:
        nonlocal poster
        if poster is None:  # only a command that alerts pays for the chat imports
            from bothy.chat.oneshot import OneShotPoster, Tokens

            poster = OneShotPoster(chat, Tokens(cfg.secrets_file))
        return await poster.post_alert(alert)

    alerts.route_to(post)
    return alerts
