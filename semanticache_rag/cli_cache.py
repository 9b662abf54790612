"""Command line: ``semanticache-rag cache list | info | rm | clear``, the stored document caches."""

from __future__ import annotations

import argparse
import json
import time


def store_of(args):
    """The document store that ``--store`` names (default: the user's)."""
    from semanticache_rag.store import DocumentStore

    return DocumentStore(args.store)


def _when(seconds: float | None) -> str:
    return "-" if seconds is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:,.1f} MiB ({size:,} bytes)"


def _tail(text, width: int) -> str:
    text = str(text or "-")
    return text if len(text) <= width else "…" + text[1 - width :]


def _entry_row(entry) -> dict:
    """What ``cache list`` / ``cache info`` show of one entry (``--json`` prints this too)."""
    m = entry.manifest or {}
    return {
        "id": entry.id,
        "document": (m.get("document") or {}).get("name", "(unreadable manifest)"),
        "pages": m.get("pages"),
        "tokens": m.get("tokens"),
        "compressed_bytes": m.get("nbytes"),
        "entries_removed": m.get("entries_removed"),
        "bytes_removed": m.get("bytes_removed"),
        "model": m.get("model_name"),
        "compressor": m.get("compressor"),
        "created": m.get("created"),
        "last_used": entry.last_used,
        "disk_bytes": entry.disk_bytes,
    }


def cmd_cache_list(args) -> None:
    store = store_of(args)
    rows = [_entry_row(e) for e in reversed(store.entries())]  # most recently used first
    if args.json:
        print(json.dumps(rows, ensure_ascii=False))
        return
    table = [("ID", "DOCUMENT", "PAGES", "TOKENS", "MiB", "ENTRIES-", "BYTES-", "MODEL", "CREATED", "LAST USED")]
    for r in rows:
        entries, saved = (_percent(r[key]) for key in ("entries_removed", "bytes_removed"))
        size = "-" if r["compressed_bytes"] is None else f"{r['compressed_bytes'] / 2**20:.1f}"
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
        cells = (_tail(r["document"], 32), str(r["pages"] or "-"), tokens, size, entries, saved, _tail(r["model"], 28))
        table.append((r["id"][:12], *cells, _when(r["created"]), _when(r["last_used"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        padded = (c.rjust(w) if i in (2, 3, 4, 5, 6) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        print("  ".join(padded).rstrip())
    total = sum(r["disk_bytes"] for r in rows)
    count = f"{len(rows)} {'entry' if len(rows) == 1 else 'entries'}"
    print(f"{count}, {total / 2**20:,.1f} MiB of {store.disk_budget_bytes / 2**20:,.0f} MiB in {store.directory}")


def cmd_cache_info(args) -> None:
    entry = store_of(args).info(args.id)
    row = _entry_row(entry) | {"manifest": entry.manifest}
    if args.json:
        print(json.dumps(row, ensure_ascii=False))
        return
    m = entry.manifest or {}
    document = m.get("document") or {}
    lines = {
        "id": entry.id,
        "document": row["document"],
        "source": document.get("source"),
        "document sha256": document.get("sha256"),
        "pages": row["pages"],
        "tokens": None if row["tokens"] is None else f"{row['tokens']:,}",
        "compressed": _mib(row["compressed_bytes"]),
        "uncompressed": _mib(m.get("full_nbytes")),
        "entries removed": None if row["entries_removed"] is None else f"{row['entries_removed']:.1%}",
        "bytes removed": None if row["bytes_removed"] is None else f"{row['bytes_removed']:.1%}",
        "model": row["model"],
        "compressor": row["compressor"],
        "read in (s)": None if m.get("prefill_s") is None else round(m["prefill_s"] + m["compress_s"], 2),
        "created": _when(row["created"]),
        "last used": _when(row["last_used"]),
        "on disk": _mib(entry.disk_bytes),
        "package version": m.get("package_version"),
    }
    for name, value in lines.items():
        print(f"{name + ':':19}{'-' if value is None else value}")


def cmd_cache_rm(args) -> None:
    entry = store_of(args).remove(args.id)
    print(f"Removed {entry.id[:12]} ({_entry_row(entry)['document']}, {entry.disk_bytes / 2**20:.1f} MiB)")


def cmd_cache_clear(args) -> None:
    store = store_of(args)
    count, size = store.clear()
    print(f"Removed {count} entries ({size / 2**20:.1f} MiB) from {store.directory}")


def add_cache_commands(sub) -> None:
    cache = sub.add_parser("cache", help="list, inspect or remove stored document caches")
    commands = cache.add_subparsers(dest="cache_command", required=True)
    listing = commands.add_parser("list", help="stored caches, most recently used first")
    listing.set_defaults(func=cmd_cache_list)
    info = commands.add_parser("info", help="everything stored about one cache")
    info.set_defaults(func=cmd_cache_info)
    rm = commands.add_parser("rm", help="remove one cache")
    rm.set_defaults(func=cmd_cache_rm, json=False)
    clear = commands.add_parser("clear", help="remove every cache")
    clear.set_defaults(func=cmd_cache_clear, json=False)
    for p in (info, rm):
        p.add_argument("id", help="cache id or a unique prefix of it (at least 4 hex digits)")
    for p in (listing, info):
        p.add_argument("--json", action="store_true")
    for p in (listing, info, rm, clear):
        add_store_option(p)
        p.add_argument("-v", "--verbose", action="store_true")


def add_store_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help="document cache store (default: $SEMANTICACHE_STORE_DIR, else caches/ in $SEMANTICACHE_HOME)",
    )
