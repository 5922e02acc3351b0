"""How a profile's persona and curated notes reach the model: a section of its prompt.

Day notes never do (they are searched). A file the operator edited into a state Bothy would
not write (over its cap, not UTF-8, failing the scan) is left out, and the caller audits it.
"""

from __future__ import annotations

from bothy.memory.store import SOUL, PromptFile

_HEADINGS = {
    SOUL: "Your persona (SOUL.md, written by the operator)",
    "MEMORY.md": "Your memory (MEMORY.md; change it with bothy_memory, target=memory)",
    "USER.md": "About the people you work for (USER.md; bothy_memory, target=user)",
}


def memory_section(profile: str, files: list[PromptFile]) -> str:
    """The prompt section for ``files`` (the good ones), or "" when there is none."""
    parts = [f"### {_HEADINGS[f.name]}\n{f.text}" for f in files if f.text is not None]
    if not parts:
        return ""
    return (f"## Memory of profile {profile} (kept by Bothy; entries are separated by §)\n\n"
            + "\n\n".join(parts))
