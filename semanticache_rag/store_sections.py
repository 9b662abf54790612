"""Store entries of long documents: each section in a file of its own, written as it is read.

A :class:`~semanticache_rag.sections.SectionedCache` entry is the usual manifest ``<id>.json``
and tensor file ``<id>.safetensors`` (the prompt head), plus a folder ``<id>.sections/`` with
``<k>.safetensors`` and its record ``<k>.json`` per section. Sections are written as soon as
they are read (temporary file + rename), so no file holds more than one section and an
interrupted read resumes from the sections it finished: they are found by the entry's id, which
names the document, model, compressor and section length. The manifest is written last; until
then the entry does not exist for readers, and a folder left without a manifest by a crash is
removed after a while (:func:`~semanticache_rag.store_format.remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

from semanticache_rag.cache import ModelSpec
from semanticache_rag.documents import Document
from semanticache_rag.sections import SectionedCache
from semanticache_rag.store_format import (
    ENTRY_ID,
    LOAD_ERRORS,
    EntryRejected,
    atomic_write,
    cache_record,
    cache_tensors,
    load_cache,
    write_tensors,
)

logger = logging.getLogger("semanticache_rag.store")

SECTIONS_SUFFIX = ".sections"


def sections_folder(directory: Path, entry_id: str) -> Path:
    return directory / f"{entry_id}{SECTIONS_SUFFIX}"


def folder_bytes(folder: Path) -> int:
    """Bytes of the files in ``folder`` (0 when it does not exist)."""
    try:
        return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    except OSError:
        return 0


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


class SectionFiles:
    """The section files of one entry: the read's checkpoint, then part of the entry.

    ``load(k)`` returns section ``k`` when an earlier read finished it (else ``None``),
    ``save(k, section)`` writes it. Writing failures are logged once and make :attr:`complete`
    False, so no manifest will name files that are not there.
    """

    def __init__(self, folder: Path, document: Document, spec: ModelSpec | None):
        self.folder, self.document, self.spec = folder, document, spec
        self.records: dict[int, dict] = {}
        self.complete = True

    def _paths(self, k: int) -> tuple[Path, Path]:
        return self.folder / f"{k}.json", self.folder / f"{k}.safetensors"

    def remove(self, k: int) -> None:
        """Delete section ``k`` (proven damaged)."""
        for path in self._paths(k):
            path.unlink(missing_ok=True)

    def load(self, k: int):
        record_path, tensors_path = self._paths(k)
        try:
            record = json.loads(record_path.read_bytes())
        except (OSError, ValueError):  # not written yet (or unreadable): read the section
            return None
        try:
            if self.spec is None:
                return None
            section = load_cache(record, tensors_path, self.document, self.spec)
        except (EntryRejected, *LOAD_ERRORS) as exc:
            logger.warning(
                "Reading section %d of %s again: its stored copy is unusable (%s)", k, self.document.name, exc
            )
            if isinstance(exc, EntryRejected):  # proven damaged (checksum, shapes): never useful again
                self.remove(k)
            return None
        self.records[k] = record
        return section

    def save(self, k: int, section) -> None:
        if not self.complete:
            return
        record_path, tensors_path = self._paths(k)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            record = cache_record(section, *write_tensors(tensors_path, cache_tensors(section)))
            atomic_write(record_path, json.dumps(record).encode())
        except OSError as exc:
            self.complete = False
            logger.warning(
                "Cannot write the sections of %s to %s (%s); not kept on disk", self.document.name, self.folder, exc
            )
            return
        self.records[k] = record


def remove_unfinished(directory: Path, cutoff: float, claim) -> None:
    """Delete section folders without a manifest (reads that crashed or were interrupted) last
    written before ``cutoff`` (epoch s). ``claim(entry_id)`` is a context manager that yields
    whether the entry's lock was free (and holds it for the block): a read still under way keeps
    its folder, and none can start while the folder goes."""
    with contextlib.suppress(OSError):
        for folder in directory.glob(f"*{SECTIONS_SUFFIX}"):
            entry_id = folder.name.removesuffix(SECTIONS_SUFFIX)
            if not ENTRY_ID.fullmatch(entry_id) or (directory / f"{entry_id}.json").exists():
                continue
            if folder.stat().st_mtime < cutoff:
                with claim(entry_id) as free:
                    if free and not (directory / f"{entry_id}.json").exists():  # finished meanwhile: keep it
                        remove_folder(folder)


def sectioned_records(cache: SectionedCache, files: SectionFiles, head_sha256: str, head_bytes: int) -> dict | None:
    """The manifest part of a sectioned entry (writing sections ``files`` lacks), or ``None`` if incomplete."""
    for k, section in enumerate(cache.sections):
        if k not in files.records:
            files.save(k, section)
    if not files.complete:
        return None
    sections = [dict(files.records[k], span=list(span)) for k, span in enumerate(cache.spans)]
    return {"head": cache_record(cache.head, head_sha256, head_bytes), "sections": sections}


class SectionRejected(EntryRejected):
    """One section of an entry is damaged or missing; the other sections may still serve a new read."""

    def __init__(self, section: int, reason: str):
        super().__init__(f"section {section}: {reason}")
        self.section = section


def load_sectioned(
    manifest: dict, head_path: Path, folder: Path, document: Document, spec: ModelSpec
) -> SectionedCache:
    """Rebuild a :class:`SectionedCache` from its checked manifest.

    Raises
    ------
    SectionRejected
        A section file is missing or damaged.
    EntryRejected
        The head or the manifest is.
    """
    head = load_cache(manifest["head"], head_path, document, spec)
    sections, spans = [], []
    for k, record in enumerate(manifest["sections"]):
        try:
            sections.append(load_cache(record, folder / f"{k}.safetensors", document, spec))
        except FileNotFoundError as exc:
            raise SectionRejected(k, "missing") from exc
        except EntryRejected as exc:
            raise SectionRejected(k, str(exc)) from exc
        start, end = record["span"]
        if not 0 <= int(start) <= int(end) <= len(document.text):
            raise EntryRejected(f"section {k} lies outside the document")
        spans.append((int(start), int(end)))
    if not sections:
        raise EntryRejected("a sectioned entry without sections")
    return SectionedCache(document, head, tuple(sections), tuple(spans))
