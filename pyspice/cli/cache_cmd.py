"""`pyspice cache`: what pyspice keeps on disk between runs (models, sidecars, the lossy
levels' slot copies, cost profiles), how large, and removing it. Everything listed is a
cache: removing it costs the next run time (a rebuild, a calibration, copies made again),
never a result.

    pyspice cache                          # list, with sizes; --json for one document
    pyspice cache clear --stale            # slot copies nothing will read again
    pyspice cache clear slot-copies        # every slot copy; also models, profiles, calibration, other, all
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pyspice.engine.cache_contents import KINDS, CacheEntry, cache_entries, remove, slot_copies_dir
from pyspice.paths import cache_dir
from pyspice.units import format_bytes


def register(sub: Any) -> None:
    p = sub.add_parser(
        "cache",
        help="list or clear what pyspice keeps on disk",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the list as one JSON document")
    p.set_defaults(func=run_list)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", help="what is kept, by kind, with sizes (the default)")
    listing.add_argument("--json", action="store_true", help="print the list as one JSON document")
    listing.set_defaults(func=run_list)
    clear = actions.add_parser(
        "clear",
        help="remove kinds of entries, or only the stale slot copies",
        description="Remove what pyspice keeps: every entry of the KINDs named, or with --stale "
        "only the slot copies nothing will read again (their model file moved, deleted or changed, "
        "or a save that was interrupted).",
    )
    clear.add_argument("kinds", nargs="*", metavar="KIND", help=f"{', '.join(KINDS)}, or all")
    clear.add_argument("--stale", action="store_true", help="only the stale slot copies")
    clear.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    clear.set_defaults(func=run_clear)


def _rows(entries: list[CacheEntry]) -> list[dict[str, Any]]:
    return [
        {"kind": e.kind, "path": str(e.path), "bytes": e.size, "note": e.note, "stale": e.stale}
        for e in entries
    ]


def run_list(args: argparse.Namespace) -> int:
    entries = cache_entries()
    if args.json:
        doc = {
            "folder": str(cache_dir()),
            "slot_copies_folder": str(slot_copies_dir()),
            "entries": _rows(entries),
        }
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    total = sum(e.size for e in entries)
    print(f"pyspice keeps {format_bytes(total)} in {cache_dir()}", end="")
    slots = slot_copies_dir()
    print("" if slots.parent == cache_dir() else f" and {slots} (slot copies)")
    if not entries:
        print("(nothing)")
        return 0
    width = max(len(e.kind) for e in entries)
    for e in entries:
        mark = " [stale]" if e.stale else ""
        print(f"  {e.kind:<{width}}  {format_bytes(e.size):>11}  {e.path.name}: {e.note}{mark}")
    by_kind = {k: sum(e.size for e in entries if e.kind == k) for k in KINDS}
    print("by kind: " + ", ".join(f"{k} {format_bytes(n)}" for k, n in by_kind.items() if n))
    stale = [e for e in entries if e.stale]
    if stale:
        print(
            f"{len(stale)} stale slot copies hold {format_bytes(sum(e.size for e in stale))}: "
            "`pyspice cache clear --stale` removes them"
        )
    print("remove a kind with `pyspice cache clear KIND` (the next run makes what it needs again)")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.kinds) - {*KINDS, "all"})
    if unknown:
        raise ValueError(
            f"pyspice cache clear: no kind {', '.join(unknown)}; the kinds are {', '.join(KINDS)}, all"
        )
    kinds = set(KINDS) if "all" in args.kinds else set(args.kinds)
    if not kinds and not args.stale:
        raise ValueError(
            f"pyspice cache clear: name what to remove ({', '.join(KINDS)}, all) or give --stale"
        )
    if args.stale and kinds - {"slot-copies"}:
        raise ValueError("pyspice cache clear: --stale is for slot copies only; name no other kind with it")
    chosen = [e for e in cache_entries() if (e.kind in kinds or not kinds) and (e.stale or not args.stale)]
    for e in chosen:
        print(f"{'would remove' if args.dry_run else 'removing'} {e.path} ({format_bytes(e.size)}, {e.note})")
    freed = sum(e.size for e in chosen) if args.dry_run else remove(chosen)
    what = "would free" if args.dry_run else "freed"
    print(f"{len(chosen)} entries, {what} {format_bytes(freed)}")
    return 0
