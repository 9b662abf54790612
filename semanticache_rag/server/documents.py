"""The server's documents: uploaded once, read in the background (progress for the web page), kept.

A document is named by its content (the first 16 hex digits of the SHA-256 of its text), so the
same file uploaded twice is one document. Reading runs in one background thread per document and
shares the engine with the answers being streamed (the engine interleaves them a forward pass at
a time). With a document store (the engine's), the caches and the uploaded texts live there, so a
restarted server, or any server sharing the store directory (replicas), answers about a document
uploaded to another one by its id: it loads the stored cache instead of reading the text again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from semanticache_rag.documents import Document
from semanticache_rag.errors import SemantiCacheError


@dataclass
class ServedDocument:
    """One uploaded document and how far reading it has got."""

    id: str
    document: Document
    status: str = "reading"  # "reading", "ready" or "failed"
    tokens_read: int = 0
    tokens: int = 0
    error: str | None = None
    cache: Any = None  # DocumentCache or SectionedCache once read
    created: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event, repr=False)  # set when read or failed

    def to_dict(self) -> dict:
        """What the API and the web page show of it."""
        cache = self.cache
        info = {
            "id": self.id,
            "object": "document",
            "name": self.document.name,
            "pages": self.document.total_pages,
            "status": self.status,
            "tokens": self.tokens,
            "tokens_read": self.tokens_read,
            "created": int(self.created),
            "error": self.error,
        }
        if cache is not None:
            info |= {
                "tokens": cache.length,
                "sections": len(getattr(cache, "sections", ())) or 1,
                "cache_bytes": cache.nbytes,
                "full_bytes": cache.full_nbytes,
                "entries_removed": round(cache.entries_removed, 4),
                "bytes_removed": round(cache.bytes_removed, 4),
                "compressor": cache.compressor,
            }
        return info


class DocumentLibrary:
    """Uploaded documents by id, read in the background by ``engine``.

    Parameters
    ----------
    engine : Engine
    max_documents : int
        Most documents kept; the oldest one that is not being read goes first.
    """

    def __init__(self, engine, max_documents: int = 32):
        self.engine, self.max_documents = engine, max_documents
        self._documents: dict[str, ServedDocument] = {}
        self._lock = threading.Lock()

    def add(self, document: Document) -> ServedDocument:
        """Start reading ``document`` (or return it when it is there already)."""
        doc_id = document.sha256[:16]
        if self._store is not None:
            self._store.keep_upload(document)
        with self._lock:
            served = self._documents.get(doc_id)
            if served is not None and served.status != "failed":
                return served
            served = ServedDocument(doc_id, document)
            self._documents[doc_id] = served
            self._evict()
        threading.Thread(target=self._read, args=(served,), daemon=True, name=f"read-{doc_id}").start()
        return served

    @property
    def _store(self):
        """The engine's document store, where uploads are kept for other servers; ``None`` without one."""
        return getattr(self.engine, "store", None)

    def _read(self, served: ServedDocument) -> None:
        def progress(done: int, total: int) -> None:
            served.tokens_read, served.tokens = done, total

        try:
            served.cache = self.engine.read(served.document, progress=progress)
            served.status = "ready"
        except SemantiCacheError as exc:
            served.status, served.error = "failed", str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client that uploaded it, not raised in a thread
            served.status, served.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            served.done.set()

    def _evict(self) -> None:
        while len(self._documents) > self.max_documents:
            oldest = min(
                (d for d in self._documents.values() if d.status != "reading"), key=lambda d: d.created, default=None
            )
            if oldest is None:
                return
            del self._documents[oldest.id]

    def get(self, doc_id: str, wait_s: float = 0.0) -> ServedDocument | None:
        """The document with this id; one kept in the engine's store (uploaded here before, or to
        another server sharing the store) is added and read from the stored cache. ``wait_s``: how
        long to wait for a document still being read."""
        with self._lock:
            served = self._documents.get(doc_id)
        if served is None:
            document = self._store.find_upload(doc_id) if self._store is not None else None
            if document is None:
                return None
            served = self.add(document)
        if wait_s > 0:
            served.done.wait(wait_s)
        return served

    def all(self) -> list[ServedDocument]:
        with self._lock:
            return sorted(self._documents.values(), key=lambda d: d.created)

    def remove(self, doc_id: str) -> ServedDocument | None:
        """Forget a document, here and in the store's kept uploads (its cache entry stays, so uploading
        it again is fast)."""
        with self._lock:
            served = self._documents.pop(doc_id, None)
        if self._store is None:
            return served
        if served is None:  # kept in the store only (uploaded to another server, or before a restart)
            found = self._store.find_upload(doc_id)
            served = ServedDocument(doc_id, found) if found is not None else None
        if served is not None:
            self._store.forget_upload(served.document)
        return served
