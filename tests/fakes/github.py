"""GitHub as a webhook sender: realistic payloads, signed exactly as GitHub signs them.

Payload shapes follow https://docs.github.com/en/webhooks/webhook-events-and-payloads
(trimmed to the fields Bothy or an operator would look at). The signature is
``sha256=<hex HMAC-SHA256(secret, raw body)>`` (contracts.md §1.2).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from typing import Any

HOOK_ID = "487111493"
REPO = "acme/widgets"


def sign(secret: str | bytes, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value GitHub sends for ``body`` under ``secret``."""
    key = secret.encode() if isinstance(secret, str) else secret
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


def encode(payload: dict[str, Any]) -> bytes:
    """The body as GitHub sends it with content type application/json."""
    return json.dumps(payload, indent=2).encode()


def headers(
    event: str,
    body: bytes,
    secret: str | bytes | None,
    *,
    delivery: str | None = None,
    hook_id: str = HOOK_ID,
) -> dict[str, str]:
    """The delivery headers of one request (no signature header when ``secret`` is None)."""
    sent = {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/a1b2c3d",
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-GitHub-Hook-ID": hook_id,
        "X-GitHub-Hook-Installation-Target-Type": "repository",
        "X-GitHub-Hook-Installation-Target-ID": "35129377",
    }
    if secret is not None:
        sent["X-Hub-Signature-256"] = sign(secret, body)
    return sent


def _user(login: str, user_id: int = 583231) -> dict[str, Any]:
    return {"login": login, "id": user_id, "type": "User",
            "html_url": f"https://github.com/{login}"}


def _repository(full_name: str = REPO) -> dict[str, Any]:
    owner, name = full_name.split("/", 1)
    return {"id": 35129377, "name": name, "full_name": full_name, "private": True,
            "owner": _user(owner, 9919), "html_url": f"https://github.com/{full_name}",
            "default_branch": "main"}


def pull_request_opened(
    number: int = 42,
    *,
    title: str = "Fix the flaky retry in the sync job",
    user: str = "octocat",
    author_association: str = "MEMBER",
    body: str = "Retries now back off instead of hammering the API.",
) -> dict[str, Any]:
    """``pull_request`` with ``action: opened``."""
    return {
        "action": "opened",
        "number": number,
        "pull_request": {
            "url": f"https://api.github.com/repos/{REPO}/pulls/{number}",
            "html_url": f"https://github.com/{REPO}/pull/{number}",
            "number": number,
            "state": "open",
            "title": title,
            "user": _user(user),
            "body": body,
            "author_association": author_association,
            "draft": False,
            "head": {"ref": "fix-retry", "sha": "6dcb09b5b57875f334f61aebed695e2e4193db5e"},
            "base": {"ref": "main", "sha": "9049f1265b7d61be4a8904a9a27120d2064dab3b"},
            "created_at": "2026-09-24T10:14:02Z",
        },
        "repository": _repository(),
        "sender": _user(user),
    }


def issue_comment_created(
    issue_number: int = 42,
    *,
    comment: str = "@bothy can you take a look?",
    user: str = "hubot",
    author_association: str = "CONTRIBUTOR",
) -> dict[str, Any]:
    """``issue_comment`` with ``action: created`` (on an issue or a pull request)."""
    return {
        "action": "created",
        "issue": {
            "number": issue_number,
            "title": "Sync job retries too fast",
            "state": "open",
            "user": _user("octocat"),
            "html_url": f"https://github.com/{REPO}/issues/{issue_number}",
        },
        "comment": {
            "id": 1362463823,
            "body": comment,
            "user": _user(user, 7777),
            "author_association": author_association,
            "html_url": f"https://github.com/{REPO}/issues/{issue_number}#issuecomment-1362463823",
            "created_at": "2026-09-24T10:15:40Z",
        },
        "repository": _repository(),
        "sender": _user(user, 7777),
    }


def push(
    ref: str = "refs/heads/main", *, messages: tuple[str, ...] = ("Bump the version",)
) -> dict[str, Any]:
    """``push`` (no ``action``)."""
    commits = [{"id": f"{n:040x}", "message": message, "author": {"name": "Octo Cat",
                "username": "octocat"}, "url": f"https://github.com/{REPO}/commit/{n:040x}"}
               for n, message in enumerate(messages, start=1)]
    return {
        "ref": ref,
        "before": "0" * 40,
        "after": commits[-1]["id"] if commits else "0" * 40,
        "commits": commits,
        "head_commit": commits[-1] if commits else None,
        "pusher": {"name": "octocat", "email": "octocat@example.com"},
        "repository": _repository(),
        "sender": _user("octocat"),
    }


def ping(hook_id: str = HOOK_ID, *, zen: str = "Keep it logically awesome.") -> dict[str, Any]:
    """``ping``, sent when a webhook is created (no ``action``)."""
    return {
        "zen": zen,
        "hook_id": int(hook_id),
        "hook": {"type": "Repository", "id": int(hook_id), "name": "web", "active": True,
                 "events": ["pull_request", "issue_comment", "push"],
                 "config": {"content_type": "json", "insecure_ssl": "0",
                            "url": "https://mini.example.ts.net/hooks/github"}},
        "repository": _repository(),
        "sender": _user("octocat"),
    }
