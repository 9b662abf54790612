"""The document cache: a document read once, its (compressed) per-layer KV and its token -> page map.

Data only: this module imports neither the engine nor the store. A document longer than the
model's context is a :class:`~semanticache_rag.sections.SectionedCache` of such caches; both
answer the same two calls, which a conversation makes once per turn to get the cache it answers
that turn from (:meth:`DocumentCache.select`, :meth:`DocumentCache.assemble`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from semanticache_rag.documents import Document
from semanticache_rag.kv import LayerKV


@dataclass(frozen=True)
class ModelSpec:
    """The shapes a model's caches have: what a stored cache is checked against when it is loaded.

    Attributes
    ----------
    num_layers, kv_heads, head_dim : int
    dtype : torch.dtype
    device : torch.device
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def empty_layers(self) -> tuple[LayerKV, ...]:
        """One layer of no entries, (1, H_kv, 0, D), per decoder layer."""
        empty = torch.zeros(1, self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        return tuple(LayerKV(empty, empty) for _ in range(self.num_layers))


@dataclass(frozen=True)
class Selection:
    """Which parts of a document one turn is answered from.

    Attributes
    ----------
    sections : tuple of int
        Indices of the sections used, in document order (``(0,)`` for a document read whole).
    total_sections : int
        Sections the document has.
    pages : tuple of str
        Labels of the pages those sections cover, in order.
    routing : str
        How they were chosen: ``"whole document"``, or the router's name (e.g. ``"bm25"``).
    matched : bool
        False when no section matched the question and the nearest ones were used instead.
    """

    sections: tuple[int, ...]
    total_sections: int
    pages: tuple[str, ...]
    routing: str
    matched: bool = True


def page_labels(document: Document, token_pages: torch.Tensor) -> tuple[str, ...]:
    """Labels of the pages that ``token_pages`` (page index per token, -1: template) touch, in order."""
    indices = torch.unique(token_pages[token_pages >= 0]).tolist()
    return tuple(document.pages[i].label for i in indices)


@dataclass(frozen=True, eq=False)
class DocumentCache:
    """A document read once: its (compressed) KV cache and what maps tokens back to pages.

    Immutable: questions and conversations append to caches of their own.

    Attributes
    ----------
    document : Document
        The text and pages that were read.
    layers : tuple of LayerKV
        Per decoder layer, the cache after compression.
    prefix_ids : Tensor (N,)
        Template head + document tokens the cache stands for.
    token_pages : Tensor (N,) int32
        0-based index into ``document.pages`` per token, -1 for template tokens.
    model_name, compressor : str
        What produced the cache.
    prefill_s, compress_s : float
        Seconds spent reading and compressing.
    zoom : object or None
        Host-side state of compressors that re-expand parts of the document per question
        (:class:`~semanticache_rag.compressors.span_index.SpanIndex`); ``None`` for the others.
    next_position : int or None
        Position of the first appended token; ``None``: ``N``. Sections spliced at compact
        positions (:mod:`semanticache_rag.sections`) end before ``N``.
    selection : Selection or None
        For a cache spliced from a long document's sections: which ones.
    """

    document: Document
    layers: tuple[LayerKV, ...]
    prefix_ids: torch.Tensor
    token_pages: torch.Tensor
    model_name: str
    compressor: str
    prefill_s: float
    compress_s: float
    zoom: Any = None
    next_position: int | None = None
    selection: Selection | None = None

    @property
    def length(self) -> int:
        """Original tokens (template head + document) the cache stands for."""
        return int(self.prefix_ids.numel())

    @property
    def positions(self) -> int:
        """Where appended tokens start: the positions the cache takes in the model's context."""
        return self.length if self.next_position is None else self.next_position

    @property
    def nbytes(self) -> int:
        """Bytes of all cache tensors, padding and size bookkeeping included."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def full_nbytes(self) -> int:
        """Bytes the uncompressed cache of the same tokens takes."""
        return sum(2 * layer.keys[:, :, :1].nbytes * self.length for layer in self.layers)

    @property
    def host_nbytes(self) -> int:
        """Bytes kept beside the cache in host memory (SeKV's span copies), 0 for most compressors."""
        return 0 if self.zoom is None else self.zoom.nbytes

    @property
    def num_entries(self) -> int:
        """KV entries kept, summed over layers and KV heads."""
        return sum(layer.num_entries for layer in self.layers)

    @property
    def layer_entries_removed(self) -> list[float]:
        """Fraction of KV entries removed, per layer."""
        return [1 - layer.num_entries / (layer.keys.shape[1] * self.length) for layer in self.layers]

    @property
    def entries_removed(self) -> float:
        """Fraction of KV entries removed, over all layers and heads (the ``compression_ratio`` of
        entry-removing compressors; 0 for KV-Kaizen alone, which stores every entry smaller)."""
        full = sum(layer.keys.shape[1] * self.length for layer in self.layers)
        return 1 - self.num_entries / full if full else 0.0

    @property
    def bytes_removed(self) -> float:
        """Fraction of the uncompressed cache's bytes saved (what memory and disk see)."""
        full = self.full_nbytes
        return 1 - self.nbytes / full if full else 0.0

    @property
    def total_pages(self) -> int:
        return self.document.total_pages

    def prefix(self, tokens: int) -> DocumentCache:
        """The cache of the first ``tokens`` tokens (views, no copy); only for uncompressed caches.

        Raises
        ------
        ValueError
            The cache is compressed (its entries are not tokens) or shorter than ``tokens``.
        """
        plain = all(type(layer) is LayerKV and layer.sizes is None for layer in self.layers)
        if not plain or not 0 <= tokens <= self.length:
            raise ValueError(f"only an uncompressed cache of at least {tokens} tokens has a prefix of that length")
        layers = tuple(LayerKV(layer.keys[:, :, :tokens], layer.values[:, :, :tokens]) for layer in self.layers)
        return replace(
            self, layers=layers, prefix_ids=self.prefix_ids[:tokens], token_pages=self.token_pages[:tokens], zoom=None
        )

    def select(self, engine, question: str, room: int, previous: Selection | None = None) -> Selection:
        """Which parts of the document answer ``question``: all of it, for a document read whole.

        ``room`` (positions left for the document after the question, earlier turns and the
        answer) and ``previous`` (the last turn's selection) matter to a
        :class:`~semanticache_rag.sections.SectionedCache`, which routes per turn.
        """
        return self._whole_document

    def assemble(self, engine, selection: Selection) -> DocumentCache:
        """The cache a turn with ``selection`` is answered from: this one."""
        return self

    @cached_property
    def _whole_document(self) -> Selection:
        return self.selection or Selection((0,), 1, page_labels(self.document, self.token_pages), "whole document")
