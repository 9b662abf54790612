"""Extracted document texts kept beside a store's entries, so that re-opening a long PDF skips pypdf.

``documents/<digest>.json`` keeps the text and page map extracted from a file, named by the
SHA-256 of the file's bytes (and the format and package version, since extraction depends on them).
A record that fails its checksum is ignored, deleted and extracted again.

``documents/uploads/<sha256 of the text>.json`` keeps documents that came as bytes or text (a
server's uploads), so that any process sharing the store finds one by its id (the first 16 hex
digits of that SHA-256) and loads its cache instead of asking for the upload again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import replace
from pathlib import Path

from semanticache_rag.documents import Document, Page, load_document
from semanticache_rag.store_format import FORMAT_VERSION, LOAD_ERRORS, EntryRejected, atomic_write, package_version

logger = logging.getLogger("semanticache_rag.store")


def load_document_text(folder: Path, source) -> Document:
    """:func:`~semanticache_rag.documents.load_document`, keeping what was extracted from a file in
    ``folder`` and reusing it when a file with the same bytes is opened again."""
    path = _existing_file(source)
    try:
        data = path.read_bytes() if path is not None else None
    except OSError:
        data = None
    if path is None or data is None:
        return load_document(source)
    record = folder / f"{source_digest(data)}.json"
    try:
        stored = record.read_bytes()
    except OSError:  # never extracted, or an unreadable store
        stored = None
    try:
        if stored is not None:
            document = document_from_record(stored, path)
            with contextlib.suppress(OSError):
                os.utime(record)  # last use, for clean-up
            return document
    except (EntryRejected, *LOAD_ERRORS) as exc:
        logger.warning("Ignoring the stored text of %s (%s); extracting it again", path.name, exc)
        with contextlib.suppress(OSError):
            record.unlink()
    document = load_document(path)
    with contextlib.suppress(OSError):  # a read-only store extracts every time
        if path.read_bytes() == data:  # unchanged while it was extracted
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(record, document_record(document))
    return document


def _existing_file(source) -> Path | None:
    """``source`` as a path when :func:`load_document` would read it as a file."""
    if isinstance(source, str) and ("\n" in source or len(source) >= 4096):
        return None
    if not isinstance(source, (str, os.PathLike)):
        return None
    try:
        path = Path(source).expanduser()
        return path if path.is_file() else None
    except (OSError, ValueError):
        return None


def source_digest(data: bytes) -> str:
    """Name of the extracted-text record of a file with these bytes (extraction depends on the version)."""
    return hashlib.sha256(data + f"\0{FORMAT_VERSION}\0{package_version()}".encode()).hexdigest()


def document_record(document: Document) -> bytes:
    """What re-opening the same file needs instead of extracting its text again."""
    pages = [[p.number, p.label, p.start, p.end] for p in document.pages]
    record = {"sha256": document.sha256, "extractor": document.extractor, "pages": pages, "text": document.text}
    record["name"] = document.name  # a kept upload's label; a file's record is named after the file
    return json.dumps(record, ensure_ascii=False).encode()


def document_from_record(data: bytes, path: Path) -> Document:
    """The :class:`Document` of a record, named after ``path``; :class:`EntryRejected` unless intact."""
    record = json.loads(data)
    text, pages = record["text"], tuple(Page(int(n), str(label), int(a), int(b)) for n, label, a, b in record["pages"])
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != record["sha256"]:
        raise EntryRejected("extracted text does not match its checksum")
    if not pages or any(not 0 <= p.start <= p.end <= len(text) for p in pages):
        raise EntryRejected("page map outside the text")
    return Document(text, pages, path.name, str(path.resolve()), record["sha256"], str(record["extractor"]))


DOCUMENT_ID = re.compile(r"[0-9a-f]{16}")


def keep_upload(folder: Path, document: Document) -> None:
    """Keep ``document``'s text and name in ``folder/uploads`` (best effort: a read-only store keeps nothing)."""
    with contextlib.suppress(OSError):
        (folder / "uploads").mkdir(parents=True, exist_ok=True)
        target = folder / "uploads" / f"{document.sha256}.json"
        if not target.exists():
            atomic_write(target, document_record(document))


def find_upload(folder: Path, doc_id: str) -> Document | None:
    """The kept upload whose text's SHA-256 starts with ``doc_id`` (16 hex digits), or ``None``.

    A record that fails its checksum is logged and left in place (it is the user's text).
    """
    if not isinstance(doc_id, str) or not DOCUMENT_ID.fullmatch(doc_id):
        return None  # nothing from a request names a path unless it is 16 hex digits
    for path in sorted((folder / "uploads").glob(f"{doc_id}*.json")):
        try:
            data = path.read_bytes()
            document = document_from_record(data, path)
            name = json.loads(data).get("name")
        except (OSError, EntryRejected, *LOAD_ERRORS) as exc:
            logger.warning("Cannot use the kept upload %s: %s", path.name, exc)
            continue
        return replace(document, name=str(name or path.stem), source=None)
    return None


def forget_upload(folder: Path, document: Document) -> None:
    """Delete the kept upload of ``document`` (the user removed it); its cache entries stay."""
    with contextlib.suppress(OSError):
        (folder / "uploads" / f"{document.sha256}.json").unlink(missing_ok=True)
