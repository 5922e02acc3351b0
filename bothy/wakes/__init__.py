"""Wakes: what makes Bothy start a run without being asked in chat (SPEC §5).

The flow: a listener (``webhook``) checks a delivery, or a ``poller`` finds something new, and
makes it durable in the ``inbox``; the dispatcher takes durable wakes from there and turns them
into runs.
"""

from bothy.wakes.inbox import Accepted, Delivery, Duplicate, Inbox, WakeRow
from bothy.wakes.poller import Poller, PollReport
from bothy.wakes.webhook import WebhookListener

__all__ = ["Accepted", "Delivery", "Duplicate", "Inbox", "PollReport", "Poller", "WakeRow",
           "WebhookListener"]
