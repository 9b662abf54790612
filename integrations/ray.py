"""Ray: read many documents into a shared store with Ray Data, serve them from replicas with Ray Serve.

Both run this package's own engine in Ray's workers and meet in one store directory that every
node sees (a shared file system): what one worker reads, every replica answers from.

Bulk reading, one engine per actor, each document read once and kept compressed::

    import ray
    from semanticache_rag.integrations.ray import ReadDocuments

    rows = (
        ray.data.from_items([{"path": p} for p in pdf_paths])
        .map_batches(ReadDocuments, fn_constructor_kwargs={"store": "/shared/caches", "ratio": 0.75},
                     batch_size=1, concurrency=2, num_cpus=1)
        .take_all()
    )  # per document: its id, tokens, cache size, seconds, or the error that stopped it

Serving, several replicas of the OpenAI-compatible server (:mod:`semanticache_rag.server`) behind
Ray Serve's proxy::

    from ray import serve
    from semanticache_rag.integrations.ray import DocumentServer

    serve.run(DocumentServer.options(num_replicas=4).bind(store="/shared/caches", ratio=0.75))

Any replica answers about any document read into the store (by this job or uploaded to another
replica): it loads the stored cache. Document affinity: a request that carries the document's id in
the ``serve_multiplexed_model_id`` header is routed by Ray Serve's model multiplexing to a replica
that has already loaded that document, so each document is loaded by few replicas and stays warm
there (LangChain: ``ChatOpenAI(..., default_headers={"serve_multiplexed_model_id": doc_id},
extra_body={"document_id": doc_id})``).

Needs ``pip install "semanticache-rag[ray]"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

try:
    from ray import serve
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        'semanticache_rag.integrations.ray needs Ray Data and Ray Serve: pip install "semanticache-rag[ray]"'
    ) from exc

from semanticache_rag.documents import document_from_text
from semanticache_rag.errors import SemantiCacheError

AFFINITY_HEADER = "serve_multiplexed_model_id"  # Ray Serve's model multiplexing routes on it
DOCUMENTS_PER_REPLICA = 8


def _engine(
    store: str, model: str | None = None, compression: str | None = None, ratio: float | None = None, **options: Any
):
    """An engine over the store in ``store``; ``compression=None`` with a ratio: the best measured one."""
    from semanticache_rag import DocumentStore, Engine, make_compressor

    name = compression or ("auto" if ratio is not None else "none")
    return Engine.from_pretrained(model, compressor=make_compressor(name, ratio), store=DocumentStore(store), **options)


class ReadDocuments:
    """A Ray Data ``map_batches`` callable (an actor): reads each document of a batch into the store.

    A batch holds a ``path`` column (files every worker can open) and/or ``text`` and ``name``
    columns (a row whose path is empty or ``None`` is its text).
    Each document is read once per store: a document already stored is loaded, not read again. One
    that cannot be read (an unreadable PDF, a document too long for the store's budget) gets its
    error in its row; the others go on. The texts are kept in the store too, so servers sharing it
    find each document by its id (:meth:`~semanticache_rag.DocumentStore.find_upload`).

    Parameters
    ----------
    store : str
        The store directory, shared by every node.
    model, compression, ratio : optional, keyword
        As :meth:`~semanticache_rag.Engine.from_pretrained` and
        :func:`~semanticache_rag.make_compressor` (a ratio alone: the best measured compressor).
    **engine_options :
        Further :meth:`~semanticache_rag.Engine.from_pretrained` options (``weights``, ``section_tokens``).
    """

    def __init__(self, store: str, **engine_options: Any):
        self.engine = _engine(store, **engine_options)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        count = len(batch["path"] if "path" in batch else batch["text"])
        paths = batch["path"] if "path" in batch else [None] * count
        sources = [p if isinstance(p, str) and p else None for p in paths]  # Arrow gives a missing path as NaN
        rows = [self._read(i, source, batch) for i, source in enumerate(sources)]
        return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}

    def _read(self, index: int, source, batch: dict[str, Any]) -> dict[str, Any]:
        store = self.engine.store
        label = str(source) if source is not None else str(batch["name"][index])
        row: dict[str, Any] = {"source": label, "document_id": "", "tokens": 0, "cache_bytes": 0, "full_bytes": 0}
        row |= {"bytes_removed": 0.0, "seconds": 0.0, "loaded": False, "error": ""}
        started, hits = time.perf_counter(), store.stats.disk_hits
        try:
            document = store.load_document(str(source)) if source is not None else None
            if document is None:
                document = document_from_text(str(batch["text"][index]), name=label)
            cache = self.engine.read(document, progress=False)
            store.keep_upload(cache.document)
        except (SemantiCacheError, OSError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            return row
        row |= {"document_id": cache.document.sha256[:16], "tokens": cache.length, "cache_bytes": cache.nbytes}
        row |= {"full_bytes": cache.full_nbytes, "bytes_removed": round(cache.bytes_removed, 4)}
        row |= {"seconds": round(time.perf_counter() - started, 3), "loaded": store.stats.disk_hits > hits}
        return row


@serve.deployment(num_replicas=2)
@serve.ingress()
class DocumentServer:
    """A Ray Serve deployment of the OpenAI-compatible server over a shared store.

    Parameters are :class:`ReadDocuments`'s, and ``api_key`` (required by every request when set).
    Each replica keeps up to :data:`DOCUMENTS_PER_REPLICA` documents registered for affinity routing
    (its server keeps up to 32 loaded).
    """

    def __init__(self, store: str, api_key: str | None = None, **engine_options: Any):
        from semanticache_rag.server import create_app

        self.engine = _engine(store, **engine_options)
        self._server_app = create_app(self.engine, api_key=api_key)
        self._library = self._server_app.state.library
        self.replica = serve.get_replica_context().replica_id.unique_id  # in a response header, for operators

        @self._server_app.middleware("http")
        async def affinity(request, call_next):
            doc_id = serve.get_multiplexed_model_id()
            if doc_id:  # registers the document with this replica, so the proxy routes its next requests here
                with contextlib.suppress(LookupError):  # unknown here too: the request itself says so (404)
                    await self.document(doc_id)
            response = await call_next(request)
            response.headers["x-semanticache-replica"] = self.replica
            return response

    def __serve_build_asgi_app__(self):
        return self._server_app

    @serve.multiplexed(max_num_models_per_replica=DOCUMENTS_PER_REPLICA)
    async def document(self, doc_id: str):
        """The served document ``doc_id`` (loaded from the store if this replica has not got it).

        Raises
        ------
        LookupError
            Neither this replica nor the store knows the id.
        """
        served = await asyncio.to_thread(self._library.get, doc_id, 30.0)
        if served is None:
            raise LookupError(doc_id)
        return served
