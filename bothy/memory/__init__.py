"""Memory on request (SPEC §8): a profile's persona, curated notes, day notes and their index.

Off until a profile sets ``"memory"``. Plain files and a local SQLite index under
``$BOTHY_HOME/memory/<profile>/``, outside the workspace. The modules hold: ``store`` the
files, their caps and the per-profile lock; ``scan`` the secret scan; ``index`` the FTS5
index and its scan fallback; ``dream`` the guard on a consolidation's proposal;
``preimages`` what a dream or restore replaced; ``tools`` the tools hosted for Codex;
``prompt`` the prompt section; ``site`` which profiles have memory.
"""

from bothy.memory.index import Note, SearchMode, probe_fts5, search_mode
from bothy.memory.preimages import Preimage, is_preimage_id
from bothy.memory.prompt import memory_section
from bothy.memory.scan import SecretScan, held_secrets
from bothy.memory.site import SiteMemory, memory_root
from bothy.memory.store import (
    SOUL,
    TARGETS,
    DreamStart,
    MemoryStore,
    PromptFile,
    Refused,
    Saved,
    parse_entries,
)
from bothy.memory.tools import (
    ALL_TOOLS,
    PROPOSE,
    READ_TOOLS,
    WRITE_TOOLS,
    MemoryTools,
    ToolOutcome,
    tool_specs,
)

__all__ = [
    "ALL_TOOLS",
    "PROPOSE",
    "READ_TOOLS",
    "SOUL",
    "TARGETS",
    "WRITE_TOOLS",
    "DreamStart",
    "MemoryStore",
    "MemoryTools",
    "Note",
    "Preimage",
    "PromptFile",
    "Refused",
    "Saved",
    "SearchMode",
    "SecretScan",
    "SiteMemory",
    "ToolOutcome",
    "held_secrets",
    "is_preimage_id",
    "memory_root",
    "memory_section",
    "parse_entries",
    "probe_fts5",
    "search_mode",
    "tool_specs",
]
