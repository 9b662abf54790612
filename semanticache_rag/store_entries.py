"""The store's entries on disk as users see them: listing, ids and id prefixes, sizes and budgets."""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from semanticache_rag.errors import ConfigError, StoreError
from semanticache_rag.models import home_dir
from semanticache_rag.store_format import ENTRY_ID
from semanticache_rag.store_sections import folder_bytes, sections_folder

_ID_PREFIX = re.compile(r"[0-9a-f]{4,64}")


def default_directory() -> Path:
    """``$SEMANTICACHE_STORE_DIR``, else ``caches`` under :func:`~semanticache_rag.models.home_dir`."""
    override = os.environ.get("SEMANTICACHE_STORE_DIR")
    return Path(override).expanduser() if override else home_dir() / "caches"


def parse_bytes(text: str) -> int:
    """``"2G"``, ``"512MiB"``, ``"1.5GB"`` or ``"1000"`` as bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not match:
        raise ConfigError(f"cannot read {text!r} as a size; use bytes or a number with K, M, G or T (e.g. 2G)")
    return int(float(match[1]) * 1024 ** " kmgt".index(match[2] or " "))


def budget_bytes(value: int | str | None, variable: str, default: int) -> int:
    """A budget given as bytes or a size string, else ``$variable``, else ``default``."""
    if value is None:
        value = os.environ.get(variable) or default
    budget = parse_bytes(value) if isinstance(value, str) else int(value)
    if budget < 0:
        raise ConfigError(f"{variable.removeprefix('SEMANTICACHE_').lower()} must be >= 0 bytes, got {budget}")
    return budget


@dataclass(frozen=True)
class StoredEntry:
    """One entry on disk: its manifest (``None`` when unreadable), bytes on disk, last use (epoch s)."""

    id: str
    manifest: dict | None
    disk_bytes: int
    last_used: float


def entry_paths(directory: Path, entry_id: str) -> tuple[Path, Path]:
    """(manifest, tensor file) of an entry; the id is checked to be 64 hex digits before it names a path."""
    if not isinstance(entry_id, str) or not ENTRY_ID.fullmatch(entry_id):
        raise ConfigError(f"invalid cache id {entry_id!r}: expected 64 hex digits")
    return directory / f"{entry_id}.json", directory / f"{entry_id}.safetensors"


def list_entries(directory: Path) -> list[StoredEntry]:
    """Every entry in ``directory``, least recently used first."""
    found = []
    with contextlib.suppress(OSError):
        for path in directory.glob("*.json"):
            if ENTRY_ID.fullmatch(path.stem):
                with contextlib.suppress(OSError):
                    found.append(read_entry(directory, path.stem))
    return sorted(found, key=lambda e: e.last_used)


def read_entry(directory: Path, entry_id: str) -> StoredEntry:
    """One entry's manifest, bytes on disk and last use; OSError if its manifest cannot be read."""
    manifest_path, tensors_path = entry_paths(directory, entry_id)
    stat = manifest_path.stat()
    try:
        manifest = json.loads(manifest_path.read_bytes())
        manifest = manifest if isinstance(manifest, dict) else None
    except ValueError:
        manifest = None
    tensor_bytes = tensors_path.stat().st_size if tensors_path.exists() else 0
    tensor_bytes += folder_bytes(sections_folder(directory, entry_id))
    return StoredEntry(entry_id, manifest, stat.st_size + tensor_bytes, stat.st_mtime)


def resolve_id(directory: Path, id_or_prefix: str) -> str:
    """The full id of the one entry whose id starts with ``id_or_prefix`` (at least 4 hex digits).

    Raises
    ------
    ConfigError
        ``id_or_prefix`` is not hex (ids never name paths other than the store's own files).
    StoreError
        No entry, or more than one, has that prefix.
    """
    prefix = str(id_or_prefix).strip().lower()
    if not _ID_PREFIX.fullmatch(prefix):
        raise ConfigError(
            f"invalid cache id {id_or_prefix!r}: use 4 to 64 hex digits of an id that `semanticache-rag cache list`"
            " shows"
        )
    matches = [e.id for e in list_entries(directory) if e.id.startswith(prefix)]
    if len(matches) != 1:
        found = "no cache entry" if not matches else f"{len(matches)} cache entries"
        raise StoreError(f"{found} with id {prefix} in {directory}; see `semanticache-rag cache list`")
    return matches[0]
