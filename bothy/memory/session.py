"""What memory does for one run of a profile that has it (SPEC §8).

Before the run: old day notes are pruned, the persona and curated notes are read for the
prompt (a file the operator left over its cap, not UTF-8 or failing the scan is left out and
reported, to be alerted once per version of the file), and for a dream the files' state is
captured. During it: the tools offered — writing ones only for trusted runs unless the profile
sets ``allow_from_untrusted``; a dream gets only the read tools and the proposal tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bothy.memory.prompt import memory_section
from bothy.memory.store import TARGETS, DreamStart, MemoryStore
from bothy.memory.tools import PROPOSE, READ_TOOLS, WRITE_TOOLS, MemoryTools

DREAM_INSTRUCTION = (
    "Fold the new day notes below into MEMORY.md and USER.md. Keep every entry that still"
    " holds, merge duplicates, and add what the notes teach that later runs will need; leave"
    " out passing details and anything that looks like a credential. Then call"
    " bothy_memory_propose once with the complete new list of entries of each file you change."
    " Bothy refuses a proposal that would cost a file more than 25 % of its entries or"
    " characters, empty it, or break its cap. Reply with one line saying what you changed, or"
    " NO_REPLY when there was nothing to fold."
)


@dataclass(frozen=True)
class LeftOut:
    """A file kept out of the prompt: which, why, and whether the operator hears of it now."""

    name: str
    problem: str
    first_time: bool


@dataclass(frozen=True)
class Begun:
    """What preparing the run found, for the register."""

    pruned_days: list[str] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    in_prompt: list[str] = field(default_factory=list)
    section: str = ""
    dream: DreamStart | None = None


class MemorySession:
    """The memory side of one run."""

    def __init__(self, store: MemoryStore, *, run_id: str, trusted: bool,
                 allow_from_untrusted: bool, dream: bool) -> None:
        self.store = store
        self._run_id = run_id
        self._trusted = trusted
        self._dream = dream
        self._writes = trusted or allow_from_untrusted
        self.begun = Begun()
        self.tools: MemoryTools | None = None

    @property
    def offered(self) -> frozenset[str]:
        if self._dream:
            return READ_TOOLS | {PROPOSE}
        return READ_TOOLS | WRITE_TOOLS if self._writes else READ_TOOLS

    @property
    def withheld(self) -> frozenset[str]:
        """Writing tools kept from this run because it was woken by untrusted input."""
        return frozenset() if self._dream or self._writes else WRITE_TOOLS

    def begin(self) -> Begun:
        """Prune, read the prompt's files, capture a dream's start. Blocking."""
        pruned = self.store.prune()
        left_out, in_prompt, good = [], [], []
        for found in self.store.prompt_files():
            if found.problem is None:
                in_prompt.append(found.name)
                good.append(found)
                continue
            first = self.store.first_alert(f"prompt:{found.name}", found.digest)
            left_out.append(LeftOut(found.name, found.problem, first))
        for name in {"SOUL.md", *TARGETS.values()} - {f.name for f in left_out}:
            self.store.clear_alert(f"prompt:{name}")
        start = self.store.dream_start() if self._dream else None
        self.begun = Begun(pruned, left_out, in_prompt, memory_section(self.store.profile, good),
                           start)
        self.tools = MemoryTools(self.store, run_id=self._run_id, trusted=self._trusted,
                                 offered=self.offered, dream=start)
        return self.begun

    def prompt(self, asked: str) -> str:
        """The prompt the model gets: the memory section first, then what was asked (or, for a
        dream, what to fold)."""
        parts = [self.begun.section] if self.begun.section else []
        if self.begun.dream is not None:
            parts.append(_dream_prompt(self.store.profile, self.begun.dream))
        else:
            parts.append(asked)
        return "\n\n".join(parts)


def _dream_prompt(profile: str, start: DreamStart) -> str:
    lines = [f"Memory consolidation (a dream) for profile {profile}. {DREAM_INSTRUCTION}", ""]
    for name, entries in start.entries.items():
        lines.append(f"Current entries of {name} ({len(entries)}):")
        lines += [f"[{i}] {entry}" for i, entry in enumerate(entries, 1)] or ["(none)"]
        lines.append("")
    lines.append(f"New day notes from trusted runs ({len(start.notes)}):")
    lines += [f"[{note.ref}] {note.text}" for note in start.notes] or ["(none)"]
    return "\n".join(lines)
