"""Preimages: what memory files held before a dream or a restore replaced them.

One JSON file per preimage under ``<profile>/preimages/``, kept (fsynced) *before* the files
it describes are replaced, so a crash between the two leaves a preimage too many, never one
too few. ``bothy memory preimages`` lists them; ``bothy memory restore ID`` puts one back.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bothy.atomicfile import write_atomically

_ID = re.compile(r"^pre_\d{8}T\d{6}Z_[0-9a-f]{6}$")


@dataclass(frozen=True)
class Preimage:
    """The content of some memory files at one moment, and why it was kept."""

    id: str
    profile: str
    created_at: str
    reason: str
    files: dict[str, str]

    def describe(self) -> str:
        sizes = ", ".join(f"{name} {len(text)} chars" for name, text in sorted(self.files.items()))
        return f"{self.id}  {self.profile}  {self.created_at}  {self.reason}  {sizes}"

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "profile": self.profile, "created_at": self.created_at,
                "reason": self.reason,
                "files": {name: len(text) for name, text in sorted(self.files.items())}}


def is_preimage_id(value: str) -> bool:
    return bool(_ID.match(value))


class Preimages:
    """The preimages of one profile."""

    def __init__(self, directory: Path, profile: str) -> None:
        self.directory = directory
        self.profile = profile

    def keep(self, reason: str, files: dict[str, str], now: datetime) -> Preimage:
        """Write a preimage durably and return it."""
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        preimage = Preimage(id=f"pre_{stamp}_{secrets.token_hex(3)}", profile=self.profile,
                            created_at=now.isoformat(timespec="seconds"), reason=reason,
                            files=dict(files))
        body = {"id": preimage.id, "profile": self.profile, "created_at": preimage.created_at,
                "reason": reason, "files": preimage.files}
        write_atomically(self.directory / f"{preimage.id}.json",
                         json.dumps(body, ensure_ascii=False, indent=1).encode())
        return preimage

    def all(self) -> list[Preimage]:
        """Every readable preimage, oldest first."""
        found = []
        for path in sorted(self.directory.glob("pre_*.json")):
            preimage = self.load(path.stem)
            if preimage is not None:
                found.append(preimage)
        return found

    def load(self, preimage_id: str) -> Preimage | None:
        if not is_preimage_id(preimage_id):
            return None
        try:
            body = json.loads((self.directory / f"{preimage_id}.json").read_text("utf-8"))
            files = {str(name): str(text) for name, text in dict(body["files"]).items()}
            return Preimage(id=str(body["id"]), profile=self.profile,
                            created_at=str(body["created_at"]), reason=str(body["reason"]),
                            files=files)
        except (OSError, ValueError, KeyError, TypeError):
            return None
