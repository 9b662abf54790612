"""Document cache store: compressed document caches kept in memory and on disk, shared safely.

Reading a document is the expensive step; a :class:`DocumentStore` keeps what an engine read,
so that ``engine.read(path)`` on a document read before (by this process or another) loads the
compressed cache instead of reading the document again.

- **Keys.** An entry is found by its :class:`~semanticache_rag.store_key.CacheKey` (document
  content and page map, model identity, compressor configuration, format and package version);
  its id, the key's SHA-256, is the only thing that names files. Ids that users type are checked
  to be hex before they come near a path.
- **Tiers.** Memory: an LRU of caches within ``memory_budget_bytes``. Disk: every entry, least
  recently used evicted first once ``disk_budget_bytes`` is exceeded.
- **Safety.** Tensors in safetensors and a JSON manifest (never pickle); temporary file + rename
  for every write, manifest last; a SHA-256 of the tensor file in the manifest. A corrupt,
  truncated or mismatched entry is logged once, deleted (or, where it cannot be, ignored) and the
  document is read again. A per-entry file lock makes two processes that read the same new
  document compute it once: the second waits, then loads the first one's entry.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

from semanticache_rag.cache import DocumentCache, ModelSpec
from semanticache_rag.documents import Document
from semanticache_rag.errors import StoreError
from semanticache_rag.sections import SectionedCache
from semanticache_rag.store_documents import find_upload, forget_upload, keep_upload, load_document_text
from semanticache_rag.store_entries import (
    StoredEntry,
    budget_bytes,
    default_directory,
    entry_paths,
    list_entries,
    parse_bytes,
    read_entry,
    resolve_id,
)
from semanticache_rag.store_format import (
    EntryRejected,
    atomic_write,
    build_manifest,
    cache_record,
    cache_tensors,
    check_manifest,
    entry_lock,
    load_cache,
    lock_if_free,
    remove_leftovers,
    write_tensors,
)
from semanticache_rag.store_key import CacheKey
from semanticache_rag.store_sections import (
    SectionFiles,
    SectionRejected,
    load_sectioned,
    remove_folder,
    remove_unfinished,
    sectioned_records,
    sections_folder,
)

logger = logging.getLogger(__name__)

__all__ = ["CacheKey", "DocumentStore", "StoreStats", "StoredEntry", "default_directory", "parse_bytes"]

DEFAULT_MEMORY_BUDGET = 2 * 2**30  # ~7 full caches of a 6K-token document on the default model
DEFAULT_DISK_BUDGET = 10 * 2**30
LEFTOVER_AGE_S = 3600  # temporary and orphaned files older than this are left by a crash
LOCK_TIMEOUT_S = 1800.0  # then read the document without the lock rather than wait forever


AnyCache = DocumentCache | SectionedCache  # what the store keeps: a document read whole, or in sections


def _held_nbytes(cache: AnyCache) -> int:
    """Memory a cache holds: its tensors plus host-side zoom state (SeKV), where there is any."""
    return cache.nbytes + getattr(cache, "host_nbytes", 0)


@dataclass
class StoreStats:
    """What a store did in this process (for logs, the CLI and tests)."""

    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    rejected: int = 0
    writes: int = 0


class DocumentStore:
    """Compressed document caches in memory (LRU) and on disk, keyed by :class:`CacheKey`.

    Parameters
    ----------
    directory : path, optional
        Where entries live; :func:`default_directory` by default. Created on the first write.
    memory_budget_bytes, disk_budget_bytes : int or str, optional
        Byte budgets (``"2G"`` style strings accepted); default ``$SEMANTICACHE_MEMORY_BUDGET`` /
        ``$SEMANTICACHE_DISK_BUDGET``, else 2 GiB and 10 GiB. 0 keeps nothing in that tier.
    lock_timeout_s : float
        How long to wait for another process reading the same document.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        memory_budget_bytes: int | str | None = None,
        disk_budget_bytes: int | str | None = None,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
    ):
        self.directory = Path(directory).expanduser() if directory is not None else default_directory()
        self.memory_budget_bytes = budget_bytes(
            memory_budget_bytes, "SEMANTICACHE_MEMORY_BUDGET", DEFAULT_MEMORY_BUDGET
        )
        self.disk_budget_bytes = budget_bytes(disk_budget_bytes, "SEMANTICACHE_DISK_BUDGET", DEFAULT_DISK_BUDGET)
        self.lock_timeout_s = lock_timeout_s
        self.stats = StoreStats()
        self._memory: OrderedDict[str, AnyCache] = OrderedDict()
        self._memory_lock = threading.Lock()
        self._ignored: set[str] = set()  # rejected entries that could not be deleted
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"DocumentStore({str(self.directory)!r})"

    # -- reading through the store --------------------------------------------------------

    def load_document(self, source) -> Document:
        """:func:`~semanticache_rag.documents.load_document`, without extracting a file's text twice.

        The text and page map of every file read through the store are kept under ``documents/``,
        named by the SHA-256 of the file's bytes: re-opening a long PDF costs a hash, not pypdf
        (~0.1 s per page on a CPU).
        """
        return load_document_text(self.directory / "documents", source)

    def keep_upload(self, document: Document) -> None:
        """Keep a document that came as bytes or text (a server's upload) under ``documents/uploads/``,
        so that every process sharing this store finds it by id (:meth:`find_upload`)."""
        keep_upload(self.directory / "documents", document)

    def forget_upload(self, document: Document) -> None:
        """Delete the kept upload of ``document``: no process finds it by id any more (its cache stays)."""
        forget_upload(self.directory / "documents", document)

    def find_upload(self, doc_id: str) -> Document | None:
        """The kept upload with this id (the first 16 hex digits of its text's SHA-256), or ``None``."""
        return find_upload(self.directory / "documents", doc_id)

    def key(self, engine, document: Document, prompt: str = "") -> CacheKey:
        """The key under which ``engine.read(document)`` (or a prompt prefix, see :class:`CacheKey`) is stored."""
        return CacheKey.for_read(engine, document, memo=self.directory / "weights.json", prompt=prompt)

    def fetch(self, engine, document: Document, compute, prompt: str = "") -> AnyCache:
        """The cache of ``document`` for ``engine``: from memory, from disk, else ``compute(sections)`` and store it.

        ``sections`` is where a long document's read keeps the sections it finished
        (:class:`~semanticache_rag.store_sections.SectionFiles`), so that an interrupted read resumes.
        An entry that cannot be loaded for a reason other than proven damage (an I/O error, a bug,
        memory) is kept as it is: the document is read again and the new cache is not written over it.
        """
        key = self.key(engine, document, prompt)
        cache = self._from_memory(key.id)
        if cache is None:
            with entry_lock(
                self._lock_path(key.id), self.lock_timeout_s
            ):  # another process reading this document: wait for its entry
                cache, intact = self._from_disk(key, document, engine.spec)
                if cache is None:
                    self.stats.misses += 1
                    files = SectionFiles(sections_folder(self.directory, key.id), document, engine.spec)
                    if self.disk_budget_bytes == 0 or not intact:
                        files.complete = False  # nothing of this read goes to disk
                    cache = compute(files)
                    self._remember(key.id, cache)
                    if intact:
                        self._save(key, cache, files)
        return cache if cache.document == document else replace(cache, document=document)

    def check_fits(self, nbytes: int, name: str) -> None:
        """Refuse, before reading, a document whose cache alone would exceed the disk budget.

        Raises
        ------
        StoreError
            ``nbytes`` (an estimate of the entry) is larger than the disk budget.
        """
        if 0 < self.disk_budget_bytes < nbytes:
            raise StoreError(
                f"the cache of {name} would take about {nbytes / 2**20:,.0f} MiB, more than the document store's disk "
                f"budget of {self.disk_budget_bytes / 2**20:,.0f} MiB; raise the budget (e.g. "
                "SEMANTICACHE_DISK_BUDGET=20G), compress more (--ratio), or read without the store (--no-store)"
            )

    def put(self, key: CacheKey, cache: AnyCache) -> None:
        """Keep ``cache`` in memory and on disk (failures to write are logged, never raised)."""
        self._remember(key.id, cache)
        self._save(key, cache, SectionFiles(sections_folder(self.directory, key.id), cache.document, None))

    # -- memory tier ----------------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        """Bytes of the caches held in memory."""
        with self._memory_lock:
            return sum(_held_nbytes(cache) for cache in self._memory.values())

    def _remember(self, entry_id: str, cache: AnyCache) -> None:
        with self._memory_lock:
            self._memory.pop(entry_id, None)
            if _held_nbytes(cache) > self.memory_budget_bytes:
                return
            self._memory[entry_id] = cache
            total = sum(_held_nbytes(c) for c in self._memory.values())
            while total > self.memory_budget_bytes:  # least recently used first; disk copies stay
                total -= _held_nbytes(self._memory.popitem(last=False)[1])

    def _from_memory(self, entry_id: str) -> AnyCache | None:
        with self._memory_lock:
            cache = self._memory.get(entry_id)
            if cache is not None:
                self._memory.move_to_end(entry_id)
        if cache is not None:
            self.stats.memory_hits += 1
            self._touch(entry_id)
        return cache

    # -- disk tier ------------------------------------------------------------------------

    def _paths(self, entry_id: str) -> tuple[Path, Path]:
        return entry_paths(self.directory, entry_id)

    def _from_disk(self, key: CacheKey, document: Document, spec: ModelSpec):
        """(cache or ``None``, whether the entry may be written): a cache that failed to load for a
        reason other than proven damage is kept on disk, and not overwritten by this process."""
        entry_id = key.id
        manifest_path, tensors_path = self._paths(entry_id)
        if entry_id in self._ignored:
            return None, False
        try:
            raw = manifest_path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None, True
        except OSError as exc:
            self._warn_once("read", f"Cannot read document caches in {self.directory}: {exc}")
            return None, False
        started = time.perf_counter()
        try:
            manifest = json.loads(raw)
            check_manifest(manifest, key)
            cache: AnyCache
            if "sections" in manifest:
                folder = sections_folder(self.directory, entry_id)
                cache = load_sectioned(manifest, tensors_path, folder, document, spec)
            else:
                cache = load_cache(manifest, tensors_path, document, spec)
        except FileNotFoundError:
            if manifest_path.exists():
                self._reject(entry_id, "its tensor file is missing")
            return None, True  # else evicted by another process meanwhile: a plain miss
        except SectionRejected as exc:  # the other sections stay: the read that follows resumes from them
            self._reject(entry_id, str(exc), delete=False)
            self._ignored.discard(entry_id)
            with contextlib.suppress(OSError):
                manifest_path.unlink(missing_ok=True)
                SectionFiles(sections_folder(self.directory, entry_id), document, spec).remove(exc.section)
            return None, True
        except (EntryRejected, json.JSONDecodeError) as exc:  # proven unusable: a bad checksum, format, key or shape
            self._reject(entry_id, str(exc) or type(exc).__name__)
            return None, True
        except Exception as exc:  # noqa: BLE001 - I/O, memory or a bug of ours: keep the user's entry
            self._keep(entry_id, f"{type(exc).__name__}: {exc}")
            return None, False
        self.stats.disk_hits += 1
        self._touch(entry_id)
        self._remember(entry_id, cache)
        seconds = time.perf_counter() - started
        logger.info(
            "Loaded the cache of %s (%d tokens) from %s in %.2fs", document.name, cache.length, tensors_path, seconds
        )
        return cache, True

    def _save(self, key: CacheKey, cache, files: SectionFiles) -> None:
        manifest_path, tensors_path = self._paths(key.id)
        if self.disk_budget_bytes == 0:
            return
        head: DocumentCache = cache.head if isinstance(cache, SectionedCache) else cache
        try:
            tensors = cache_tensors(head)
        except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
            self._warn_once(f"save:{cache.compressor}", f"Cannot store caches of {cache.compressor}: {exc}")
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            digest, size = write_tensors(tensors_path, tensors)
            if isinstance(cache, SectionedCache):
                records = sectioned_records(cache, files, digest, size)
                if records is None:  # a section could not be written
                    tensors_path.unlink(missing_ok=True)
                    return
            else:
                records = cache_record(cache, digest, size)
            atomic_write(manifest_path, json.dumps(build_manifest(cache, key, records), indent=1).encode())
        except OSError as exc:
            with contextlib.suppress(OSError):
                tensors_path.unlink(missing_ok=True)
            self._warn_once("write", f"Cannot write document caches to {self.directory}: {exc}; not kept on disk")
            return
        self.stats.writes += 1
        self._ignored.discard(key.id)
        self._enforce_disk_budget(keep=key.id, name=cache.document.name)

    def _keep(self, entry_id: str, reason: str) -> None:
        """An entry that could not be loaded but is not proven damaged: left on disk, skipped by this process."""
        self.stats.rejected += 1
        self._ignored.add(entry_id)
        logger.warning(
            "Cannot load stored cache %s in %s (%s); it is kept, and the document is read again without storing it",
            entry_id[:12],
            self.directory,
            reason,
        )

    def _reject(self, entry_id: str, reason: str, delete: bool = True) -> None:
        self.stats.rejected += 1
        logger.warning(
            "Ignoring stored cache %s in %s (%s); reading the document again", entry_id[:12], self.directory, reason
        )
        if delete:
            try:  # a long document's sections are checked one by one as the read that follows resumes
                self._delete(entry_id, sections=False)
                return
            except OSError:
                pass
        self._ignored.add(entry_id)  # kept on disk: skipped, and not reported again, by this process

    def _delete(self, entry_id: str, memory: bool = True, sections: bool = True) -> None:
        manifest_path, tensors_path = self._paths(entry_id)
        manifest_path.unlink(missing_ok=True)  # first: the entry is gone before its tensors are
        tensors_path.unlink(missing_ok=True)
        if sections:
            remove_folder(sections_folder(self.directory, entry_id))
        if memory:
            with self._memory_lock:
                self._memory.pop(entry_id, None)

    def _touch(self, entry_id: str) -> None:
        with contextlib.suppress(OSError):  # last use is the manifest's mtime; read-only stores keep theirs
            os.utime(self._paths(entry_id)[0])

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message)

    def _lock_path(self, entry_id: str) -> Path:
        self._paths(entry_id)  # checks the id
        return self.directory / ".locks" / f"{entry_id}.lock"

    def _enforce_disk_budget(self, keep: str, name: str) -> None:
        self._remove_leftovers(LEFTOVER_AGE_S)
        entries = self.entries()
        total = sum(e.disk_bytes for e in entries)
        # Least recently used first, the entry just written last; entries being read are skipped.
        for entry in sorted(entries, key=lambda e: (e.id == keep, e.last_used)):
            if total <= self.disk_budget_bytes:
                break
            # the entry just written is this process's (its lock is ours); any other is claimed first
            claim = contextlib.nullcontext(True) if entry.id == keep else lock_if_free(self._lock_path(entry.id))
            with claim as free, contextlib.suppress(OSError):
                if not free:  # being read right now
                    continue
                self._delete(entry.id, memory=False)  # evicted from disk, not from this process's memory
                total -= entry.disk_bytes
                if entry.id == keep:
                    size, budget = entry.disk_bytes / 2**20, self.disk_budget_bytes / 2**20
                    logger.warning("The cache of %s (%.1f MiB) exceeds the disk budget (%.1f MiB)", name, size, budget)

    def _remove_leftovers(self, older_than_s: float) -> None:
        last_used = min([e.last_used for e in self.entries()] + [time.time()])
        remove_leftovers(self.directory, older_than_s, last_used)
        claim = lambda entry_id: lock_if_free(self._lock_path(entry_id))  # noqa: E731
        remove_unfinished(self.directory, time.time() - older_than_s, claim)

    # -- listing and removing -------------------------------------------------------------

    def entries(self) -> list[StoredEntry]:
        """Every entry on disk, least recently used first."""
        return list_entries(self.directory)

    @property
    def disk_bytes(self) -> int:
        """Bytes of all entries on disk."""
        return sum(e.disk_bytes for e in self.entries())

    def resolve(self, id_or_prefix: str) -> str:
        """The full id of the one entry whose id starts with ``id_or_prefix`` (see :func:`resolve_id`)."""
        return resolve_id(self.directory, id_or_prefix)

    def info(self, id_or_prefix: str) -> StoredEntry:
        """The entry with this id or unique id prefix (see :meth:`resolve`)."""
        entry_id = self.resolve(id_or_prefix)
        try:
            return read_entry(self.directory, entry_id)
        except OSError as exc:
            raise StoreError(f"cannot read cache entry {entry_id[:12]}: {exc}") from exc

    def remove(self, id_or_prefix: str) -> StoredEntry:
        """Delete the entry with this id or unique id prefix; returns what it was."""
        entry = self.info(id_or_prefix)
        try:
            self._delete(entry.id)
        except OSError as exc:
            raise StoreError(f"cannot remove cache entry {entry.id[:12]}: {exc}") from exc
        return entry

    def clear(self) -> tuple[int, int]:
        """Delete every entry (memory and disk) and crash leftovers; returns (entries, bytes) removed."""
        entries = self.entries()
        for entry in entries:
            with contextlib.suppress(OSError):
                self._delete(entry.id)
        self._remove_leftovers(0)
        self._ignored.clear()
        with self._memory_lock:
            self._memory.clear()
        return len(entries), sum(e.disk_bytes for e in entries)
