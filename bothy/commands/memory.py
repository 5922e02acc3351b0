"""``bothy memory show|search|preimages|restore``: what the memory holds, and undoing a dream."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import TYPE_CHECKING, Any

from bothy.commands._shared import load
from bothy.errors import UsageError
from bothy.exitcodes import ExitCode

if TYPE_CHECKING:
    from bothy.memory import MemoryStore, SiteMemory


async def cmd_memory(args: argparse.Namespace) -> int:
    from bothy.memory import SiteMemory

    home, cfg = load()
    site = SiteMemory(home.root, cfg)
    if args.action == "restore":
        return await _restore(home.audit_path, site, args.preimage)
    stores = _stores(site, args.profile)
    report = await asyncio.to_thread(_report, args, stores)
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        print(_render(args.action, report))
    return ExitCode.OK


def _stores(site: SiteMemory, profile: str | None) -> list[MemoryStore]:
    names = site.profiles()
    if not names:
        raise UsageError('no profile has memory on: set "memory": true in a profile'
                         " (docs/CONFIGURATION.md)")
    if profile is not None and profile not in names:
        raise UsageError(f"profile {profile!r} has no memory (profiles with memory:"
                         f" {', '.join(names)})")
    stores = [site.store(name) for name in ([profile] if profile else names)]
    return [store for store in stores if store is not None]


def _report(args: argparse.Namespace, stores: list[MemoryStore]) -> dict[str, Any]:
    if args.action == "show":
        return {"profiles": [_show(store) for store in stores]}
    if args.action == "search":
        if not args.query.split():
            raise UsageError("the query needs at least one word")
        return {"query": args.query, "results": [
            {"profile": store.profile, "ref": note.ref, "text": note.text,
             "trusted": note.trusted, "run_id": note.run_id}
            for store in stores for note in store.search(args.query, args.limit)]}
    return {"preimages": [p.to_json() for store in stores for p in store.preimages.all()]}


def _show(store: MemoryStore) -> dict[str, Any]:
    from bothy.memory import SOUL, TARGETS, parse_entries

    files = []
    for name in (SOUL, *TARGETS.values()):
        path = store.path(name)
        entry: dict[str, Any] = {"name": name, "cap_chars": store.cap(name), "present": False}
        if path.exists():
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                entry.update(present=True, problem="not valid UTF-8")
            else:
                entry.update(present=True, chars=len(text.strip()), text=text.strip())
                if name != SOUL:
                    entry["entries"] = len(parse_entries(text))
        files.append(entry)
    days = store.days()
    return {"profile": store.profile, "directory": str(store.directory),
            "search": store.search_mode.why, "files": files, "days": len(days),
            "first_day": days[0] if days else None, "last_day": days[-1] if days else None,
            "retention_days": store.cfg.memory_retention_days}


def _render(action: str, report: dict[str, Any]) -> str:
    if action == "show":
        return "\n\n".join(_render_profile(p) for p in report["profiles"])
    if action == "search":
        lines = [f"{r['profile']}  {r['ref']}  {' '.join(r['text'].split())}"
                 for r in report["results"]]
        return "\n".join(lines) or f"no note matches {report['query']!r}"
    lines = [f"{p['id']}  {p['profile']}  {p['created_at']}  {p['reason']}  "
             + ", ".join(f"{name} {size} chars" for name, size in p["files"].items())
             for p in report["preimages"]]
    return "\n".join(lines) or "(no preimages)"


def _render_profile(p: dict[str, Any]) -> str:
    lines = [f"memory of profile {p['profile']}: {p['directory']}", f"  search: {p['search']}"]
    for f in p["files"]:
        if not f["present"]:
            lines.append(f"  {f['name']}: absent (cap {f['cap_chars']} chars)")
        elif "problem" in f:
            lines.append(f"  {f['name']}: {f['problem']} (left out of prompts)")
        else:
            entries = f" {f['entries']} entries," if "entries" in f else ""
            over = " OVER CAP, left out of prompts" if f["chars"] > f["cap_chars"] else ""
            lines.append(f"  {f['name']}:{entries} {f['chars']}/{f['cap_chars']} chars{over}")
    span = f" ({p['first_day']} to {p['last_day']})" if p["days"] else ""
    lines.append(f"  day notes: {p['days']} days{span}, kept {p['retention_days']} days")
    for f in p["files"]:
        if f.get("text"):
            lines += ["", f"--- {f['name']}", f["text"]]
    return "\n".join(lines)


async def _restore(audit_path: Any, site: SiteMemory, preimage_id: str) -> int:
    from bothy.engine.audit import AuditLog
    from bothy.memory import is_preimage_id

    if not is_preimage_id(preimage_id):
        raise UsageError(f"{preimage_id!r} is not a preimage id (see bothy memory preimages)")
    for name in site.profiles():
        store = site.store(name)
        preimage = store.preimages.load(preimage_id) if store else None
        if store is None or preimage is None:
            continue
        kept = await asyncio.to_thread(store.restore, preimage)
        await AuditLog(audit_path).record(
            "memory", "restored", "ok", subject=f"memory:{name}",
            details={"profile": name, "preimage": preimage.id, "kept": kept.id,
                     "files": {f: len(t) for f, t in sorted(preimage.files.items())}})
        files = ", ".join(sorted(preimage.files))
        print(f"restored {preimage.id} ({files}) in profile {name};"
              f" what it replaced is kept as {kept.id}")
        return ExitCode.OK
    raise UsageError(f"no preimage {preimage_id!r} (see bothy memory preimages)")
