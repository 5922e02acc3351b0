"""One profile's memory files under ``$BOTHY_HOME/memory/<profile>/`` and every change to them.

    SOUL.md            the persona, written by the operator (Bothy never writes it)
    MEMORY.md          short curated notes, entries separated by a line holding only "§"
    USER.md            the same, about the people Bothy works for
    days/YYYY-MM-DD.md day notes (kept out of prompts; searched through the index)
    index.sqlite3      the search index (see bothy.memory.index)
    preimages/         what a dream or a restore replaced (see bothy.memory.preimages)
    .lock              held (flock) across each change's check and its replace

Every write is scanned (bothy.memory.scan) and sized against its cap before anything
touches disk: a refused text is never written. Each change holds the profile's lock from the
moment it reads the file to the atomic replace, so two runs writing at once cannot lose either
one's entry. Blocking throughout: call it from a thread in a coroutine.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from bothy.atomicfile import write_atomically
from bothy.config import MemoryConfig
from bothy.memory.dream import FileChange, judge
from bothy.memory.index import Note, SearchIndex, SearchMode
from bothy.memory.preimages import Preimage, Preimages
from bothy.memory.scan import SecretScan

SEPARATOR = "\n§\n"
TARGETS = {"memory": "MEMORY.md", "user": "USER.md"}
SOUL = "SOUL.md"
_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_REF = re.compile(r"^(\d{4}-\d{2}-\d{2})#(\d+)$")
_DREAM_CURSOR = "dream_cursor"


@dataclass(frozen=True)
class Saved:
    """A write that was carried out. ``text`` is for the model; the rest for the register."""

    target: str
    length: int
    entries: int
    chars: int
    cap_chars: int
    text: str


@dataclass(frozen=True)
class Refused:
    """A write that was not: ``rule`` names why (for the register), ``text`` tells the model.

    ``full`` marks a refusal because the file is at its cap, which the operator hears of.
    """

    target: str
    rule: str
    length: int
    text: str
    full: bool = False


@dataclass(frozen=True)
class PromptFile:
    """A SOUL, MEMORY or USER file as the prompt would carry it, or why it is left out."""

    name: str
    text: str | None
    problem: str | None
    digest: str


@dataclass(frozen=True)
class DreamStart:
    """What the files held when a dream began: their entries and their hashes."""

    entries: dict[str, list[str]]
    digests: dict[str, str]
    cursor: int
    notes: list[Note]


def parse_entries(text: str) -> list[str]:
    """The entries of a MEMORY or USER file: blocks separated by a line holding only "§"."""
    blocks = re.split(r"(?m)^§[ \t]*$", text)
    return [block.strip() for block in blocks if block.strip()]


def render_entries(entries: list[str]) -> str:
    return SEPARATOR.join(entries) + "\n" if entries else ""


def size_of(entries: list[str]) -> int:
    """A file's size in characters, as its cap counts it."""
    return len(SEPARATOR.join(entries))


class MemoryStore:
    """The memory of one profile."""

    def __init__(self, directory: Path, profile: str, cfg: MemoryConfig, *,
                 scan: SecretScan, search: SearchMode) -> None:
        self.directory = directory
        self.profile = profile
        self.cfg = cfg
        self.search_mode = search
        self._scan = scan
        self.index = SearchIndex(directory / "index.sqlite3", fts5=search.fts5)
        self.preimages = Preimages(directory / "preimages", profile)

    # --- paths and reads ------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def days_dir(self) -> Path:
        return self.directory / "days"

    def cap(self, name: str) -> int:
        return {SOUL: self.cfg.soul_chars, "MEMORY.md": self.cfg.memory_chars,
                "USER.md": self.cfg.user_chars}[name]

    def entries(self, target: str) -> list[str]:
        """The entries of ``memory`` or ``user`` (UnicodeDecodeError if not UTF-8)."""
        return parse_entries(self._read(TARGETS[target]))

    def _read(self, name: str) -> str:
        try:
            return self.path(name).read_bytes().decode("utf-8")
        except FileNotFoundError:
            return ""

    def days(self) -> list[str]:
        if not self.days_dir.is_dir():
            return []
        return sorted(p.stem for p in self.days_dir.glob("*.md") if _DAY.match(p.stem))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The profile's lock, held across a check and its replace (other processes too)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    # --- the prompt -------------------------------------------------------------------

    def prompt_files(self) -> list[PromptFile]:
        """SOUL, MEMORY and USER as they may reach the prompt; a bad one carries its problem."""
        found = []
        for name in (SOUL, *TARGETS.values()):
            try:
                raw = self.path(name).read_bytes()
            except FileNotFoundError:
                continue
            digest = hashlib.sha256(raw).hexdigest()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                found.append(PromptFile(name, None, "not-utf8", digest))
                continue
            if len(text.strip()) > self.cap(name):
                found.append(PromptFile(name, None, "over-cap", digest))
                continue
            rule = self._scan.find(text)
            if rule is not None:
                found.append(PromptFile(name, None, f"scan:{rule}", digest))
                continue
            if text.strip():
                found.append(PromptFile(name, text.strip(), None, digest))
        return found

    # --- writes -----------------------------------------------------------------------

    def edit(self, target: str, operations: list[dict[str, Any]]) -> Saved | Refused:
        """Apply add / replace / remove operations to ``target`` at once, or none of them."""
        length = sum(len(str(op.get("content") or "")) for op in operations)
        if target not in TARGETS:
            return Refused(str(target), "invalid", length,
                           "target must be 'memory' or 'user'")
        name = TARGETS[target]
        for op in operations:
            content = op.get("content")
            rule = self._scan.find(content) if isinstance(content, str) else None
            if rule is not None:
                return Refused(target, f"scan:{rule}", length,
                               f"refused: the text looks like a secret ({rule}); nothing was"
                               " written. Never store credentials in memory.")
        with self.locked():
            try:
                entries = self.entries(target)
            except UnicodeDecodeError:
                return Refused(target, "unreadable", length,
                               f"{name} is not valid UTF-8; the operator must fix it by hand")
            for op in operations:
                problem = _apply(entries, op)
                if problem is not None:
                    return Refused(target, "invalid", length, f"{problem}; nothing was written")
            chars, cap = size_of(entries), self.cap(name)
            if chars > cap:
                return Refused(target, "cap", length,
                               f"refused: {name} would hold {chars} characters, over its cap of"
                               f" {cap}. Remove or shorten at least {chars - cap} characters"
                               " (replace or remove entries), then try again.", full=True)
            write_atomically(self.path(name), render_entries(entries).encode())
        return Saved(target, length, len(entries), chars, cap,
                     f"saved. {name}: {len(entries)} entries, {chars}/{cap} characters."
                     " This update is complete; do not repeat it.")

    def note(self, text: str, *, run_id: str | None, trusted: bool,
             now: datetime | None = None) -> Saved | Refused:
        """Append ``text`` to today's notes (UTC days) and index it."""
        text = text.strip()
        moment = now or datetime.now(UTC)
        day = moment.strftime("%Y-%m-%d")
        if not text:
            return Refused("note", "invalid", 0, "a note needs some text")
        rule = self._scan.find(text)
        if rule is not None:
            return Refused("note", f"scan:{rule}", len(text),
                           f"refused: the text looks like a secret ({rule}); nothing was"
                           " written. Never store credentials in memory.")
        if len(text) > self.cfg.note_chars:
            return Refused("note", "cap", len(text),
                           f"refused: a note is at most {self.cfg.note_chars} characters;"
                           f" shorten it by {len(text) - self.cfg.note_chars}.")
        path = self.days_dir / f"{day}.md"
        with self.locked():
            try:
                notes = parse_entries(path.read_text("utf-8")) if path.exists() else []
            except UnicodeDecodeError:
                return Refused("note", "unreadable", len(text),
                               f"days/{day}.md is not valid UTF-8; the operator must fix it")
            chars = size_of([*notes, text])
            if chars > self.cfg.day_chars:
                return Refused("note", "cap", len(text),
                               f"refused: today's notes would hold {chars} characters, over"
                               f" the day's cap of {self.cfg.day_chars}.", full=True)
            n = max(len(notes), self.index.last_n(day)) + 1
            write_atomically(path, render_entries([*notes, text]).encode())
            self.index.add(day, n, text, run_id=run_id, trusted=trusted)
        return Saved("note", len(text), len(notes) + 1, chars, self.cfg.day_chars,
                     f"noted as {day}#{n}.")

    # --- reads for tools and the CLI ----------------------------------------------------

    def search(self, query: str, limit: int = 10) -> list[Note]:
        return self.index.search(query, limit=limit)

    def get(self, ref: str) -> str | None:
        """A day's notes (``YYYY-MM-DD``), one note (``YYYY-MM-DD#N``), or None."""
        ref = ref.strip()
        if ref in TARGETS:
            return render_entries(self.entries(ref)) or "(empty)"
        one = _REF.match(ref)
        if one:
            found = [note for note in self.index.day(one[1]) if note.n == int(one[2])]
            return found[0].text if found else None
        if _DAY.match(ref):
            notes = self.index.day(ref)
            return "\n".join(f"[{note.ref}] {note.text}" for note in notes) if notes else None
        return None

    # --- retention --------------------------------------------------------------------

    def prune(self, today: date | None = None) -> list[str]:
        """Delete day notes older than ``memory_retention_days`` from disk and the index."""
        today = today or datetime.now(UTC).date()
        oldest = (today - timedelta(days=self.cfg.memory_retention_days)).isoformat()
        with self.locked():
            old = [day for day in self.days() if day < oldest]
            indexed_old = self.index.days_before(oldest) if self.index.path.exists() else []
            for day in old:
                (self.days_dir / f"{day}.md").unlink(missing_ok=True)
            self.index.forget_days(sorted({*old, *indexed_old}))
        return old

    # --- the dream and restores ---------------------------------------------------------

    def dream_start(self) -> DreamStart:
        """What a dream works from: the files, their hashes, the trusted notes it has not seen."""
        with self.locked():
            entries = {name: parse_entries(self._read(name)) for name in TARGETS.values()}
            digests = {name: self._digest(name) for name in TARGETS.values()}
            cursor = int(self.index.get_meta(_DREAM_CURSOR, "0"))
            notes = self.index.since(cursor, trusted_only=True)
        return DreamStart(entries, digests, cursor, notes)

    def apply_dream(self, start: DreamStart, proposal: dict[str, list[str]],
                    now: datetime | None = None) -> Preimage | Refused:
        """Apply a dream's proposal if the guard allows it; keep a preimage first."""
        length = sum(len(entry) for entries in proposal.values() for entry in entries)
        for entries in proposal.values():
            for entry in entries:
                rule = self._scan.find(entry)
                if rule is not None:
                    return Refused("dream", f"scan:{rule}", length,
                                   f"refused: an entry looks like a secret ({rule})")
        with self.locked():
            for name in proposal:
                if self._digest(name) != start.digests[name]:
                    return Refused("dream", "changed", length,
                                   f"refused: {name} changed since the dream began;"
                                   " nothing was applied")
            for name, after in proposal.items():
                change = FileChange(name, start.entries[name], after, self.cap(name))
                problem = judge(change, separator=SEPARATOR)
                if problem is not None:
                    return Refused("dream", "guard", length, f"refused: {problem}")
            preimage = self.preimages.keep(
                "dream", {name: self._read(name) for name in proposal}, now or datetime.now(UTC))
            for name, after in proposal.items():
                write_atomically(self.path(name), render_entries(after).encode())
            if start.notes:
                self.index.set_meta(_DREAM_CURSOR, str(start.notes[-1].id))
        return preimage

    def restore(self, preimage: Preimage, now: datetime | None = None) -> Preimage:
        """Put ``preimage`` back; return the preimage kept of what it replaced."""
        with self.locked():
            kept = self.preimages.keep(f"restore of {preimage.id}",
                                       {name: self._read(name) for name in preimage.files},
                                       now or datetime.now(UTC))
            for name, text in preimage.files.items():
                write_atomically(self.path(name), text.encode())
        return kept

    def first_alert(self, key: str, value: str) -> bool:
        """Whether the operator has not yet been alerted of ``key`` at ``value``; note it."""
        path = self.directory / "alerted.json"
        with self.locked():
            try:
                seen = json.loads(path.read_text("utf-8"))
            except (OSError, ValueError):
                seen = {}
            if not isinstance(seen, dict):
                seen = {}
            if seen.get(key) == value:
                return False
            seen[key] = value
            write_atomically(path, json.dumps(seen, sort_keys=True).encode())
        return True

    def clear_alert(self, key: str) -> None:
        """Forget that ``key`` was alerted (the condition cleared): a recurrence alerts again."""
        path = self.directory / "alerted.json"
        with self.locked():
            try:
                seen = json.loads(path.read_text("utf-8"))
            except (OSError, ValueError):
                return
            if isinstance(seen, dict) and key in seen:
                del seen[key]
                write_atomically(path, json.dumps(seen, sort_keys=True).encode())

    def _digest(self, name: str) -> str:
        try:
            return hashlib.sha256(self.path(name).read_bytes()).hexdigest()
        except FileNotFoundError:
            return "absent"


def _apply(entries: list[str], op: dict[str, Any]) -> str | None:
    """Apply one operation to ``entries`` in place; return why it cannot be, or None."""
    action, content, old = op.get("action"), op.get("content"), op.get("old_text")
    if action not in ("add", "replace", "remove"):
        return f"unknown action {action!r}: use add, replace or remove"
    if action in ("add", "replace") and (not isinstance(content, str) or not content.strip()):
        return f"{action} needs a non-empty 'content'"
    if isinstance(content, str) and re.search(r"(?m)^§[ \t]*$", content):
        return "'content' may not hold a line of only '§' (it separates entries)"
    if action == "add":
        assert isinstance(content, str)
        if content.strip() not in entries:
            entries.append(content.strip())
        return None
    if not isinstance(old, str) or not old.strip():
        return f"{action} needs 'old_text', a short unique part of the entry"
    matches = [i for i, entry in enumerate(entries) if old.strip() in entry]
    if len(matches) != 1:
        return (f"'old_text' matches {len(matches)} entries; it must match exactly one"
                if matches else "no entry contains 'old_text'")
    if action == "replace":
        assert isinstance(content, str)
        entries[matches[0]] = content.strip()
    else:
        del entries[matches[0]]
    return None
