"""SeKV's zoom-in over SemantiCache's cores (``SeKVCompressor(summary="cores")``).

The device summary is SemantiCache's cache; a core never crosses a semantic chunk, so the chunks are
the spans a question rebuilds (their host copy is a :class:`~.span_index.SpanIndex` whose entries are
chunks), each scored by its best core. :class:`SplicedCores` is the same state for a long document's
sections spliced into one cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from semanticache_rag.compressors.span_index import SpanIndex
from semanticache_rag.compressors.zoom import (
    ZoomInfo,
    question_attention,
    reconstruct_sections,
    select_spans,
    zoomed_kv,
)
from semanticache_rag.kv import ConversationKV


@dataclass(eq=False)
class CoreIndex:
    """Zoom state of SeKV over SemantiCache's cores (``SeKVCompressor(summary="cores")``).

    The device summary is SemantiCache's cache; a core never crosses a semantic chunk, so the
    chunks are the spans: ``chunks`` is the host copy of every chunk (a :class:`SpanIndex` whose
    entries are chunks) and ``entry_chunk`` gives, per layer, the chunk of each core (H, E), -1 for
    padding. A question scores each chunk by its best core (the most attention any of its cores
    gets, max over heads and question tokens, summed over layers); the best chunks with a merged
    core (``merged``) within ``zoom_tokens`` get their cores masked in every layer and head and
    their tokens rebuilt.
    """

    chunks: SpanIndex
    entry_chunk: list[torch.Tensor]
    merged: torch.Tensor  # (C,) bool: chunks with a core of more than one token somewhere

    @property
    def nbytes(self) -> int:
        return self.chunks.nbytes + sum(t.numel() * t.element_size() for t in [*self.entry_chunk, self.merged])

    @property
    def zoom_tokens(self) -> int:
        return self.chunks.zoom_tokens

    @property
    def length(self) -> torch.Tensor:
        """Tokens per chunk (C,)."""
        return self.chunks.length

    def working_kv(self, engine, cache, tail: list[int]) -> tuple[ConversationKV, ZoomInfo]:
        """A working cache for ``tail`` with the chunks it needs rebuilt at token level."""
        return _zoom_cores(self, engine, cache, tail)

    def reconstruct(self, selected: torch.Tensor, device, dtype):
        """Token-level keys and values of the ``selected`` chunks (:meth:`SpanIndex.reconstruct`)."""
        return self.chunks.reconstruct(selected, device, dtype)

    @classmethod
    def join(cls, parts, inv_freqs) -> SplicedCores:
        """The zoom state of sections spliced into one cache (``parts``: (entries per layer before the
        section, its index or None, key delta))."""
        return SplicedCores.build(parts, inv_freqs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"chunks.{name}": tensor for name, tensor in self.chunks.state_dict().items()}
        state["merged"] = self.merged
        state.update({f"entry_chunk.{i}": entries for i, entries in enumerate(self.entry_chunk)})
        return state

    def check(self, layers) -> None:
        """Raise ValueError unless this index gives a chunk for every core of ``layers``."""
        if len(layers) != len(self.entry_chunk) or any(
            entries.shape != layer.keys.shape[1:3] for entries, layer in zip(self.entry_chunk, layers)
        ):
            raise ValueError("the zoom state's chunks do not match the layers' cores")

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> CoreIndex:
        chunks = SpanIndex.from_state_dict(
            {name.removeprefix("chunks."): tensor for name, tensor in state.items() if name.startswith("chunks.")}
        )
        layers = sum(1 for name in state if name.startswith("entry_chunk."))
        index = cls(chunks, [state[f"entry_chunk.{i}"] for i in range(layers)], state["merged"])
        chunk_count = chunks.length.numel()
        if index.merged.shape != (chunk_count,) or any(
            e.dim() != 2 or e.numel() and int(e.max()) >= chunk_count for e in index.entry_chunk
        ):
            raise ValueError("the zoom state's chunks do not match its cores")
        return index


@dataclass(eq=False)
class SplicedCores:
    """The zoom state of a long document's SeKV-over-cores sections spliced into one working cache:
    chunks numbered across sections, each layer's ``entry_chunk`` laid out as the spliced layer is
    (the head's entries first, -1), rebuilt keys moved with their section
    (:func:`~semanticache_rag.rotation.rotate_keys`)."""

    parts: list[tuple[int, CoreIndex, int]]  # (first chunk, section index, key delta)
    entry_chunk: list[torch.Tensor]
    merged: torch.Tensor
    length: torch.Tensor
    inv_freqs: list[torch.Tensor]

    @classmethod
    def build(cls, parts, inv_freqs) -> SplicedCores:
        kept = [(offsets, index, delta) for offsets, index, delta in parts if index is not None]
        heads = kept[0][1].entry_chunk[0].shape[0]
        entry_chunk: list[list[torch.Tensor]] = [[] for _ in inv_freqs]
        filled, first, joined = [0] * len(inv_freqs), 0, []
        for offsets, index, delta in kept:
            for i, local in enumerate(index.entry_chunk):
                entry_chunk[i].append(torch.full((heads, offsets[i] - filled[i]), -1, dtype=torch.int32))
                entry_chunk[i].append(torch.where(local >= 0, local + first, -1).to(torch.int32))
                filled[i] = offsets[i] + local.shape[1]
            joined.append((first, index, delta))
            first += index.merged.numel()
        indexes = [index for _, index, _ in joined]
        return cls(
            joined,
            [torch.cat(e, 1) for e in entry_chunk],  # entries after the last zooming section are padded when used
            torch.cat([index.merged for index in indexes]),
            torch.cat([index.length for index in indexes]),
            inv_freqs,
        )

    @property
    def nbytes(self) -> int:
        return sum(index.nbytes for _, index, _ in self.parts)

    @property
    def zoom_tokens(self) -> int:
        return sum(index.zoom_tokens for _, index, _ in self.parts)

    def working_kv(self, engine, cache, tail: list[int]) -> tuple[ConversationKV, ZoomInfo]:
        return _zoom_cores(self, engine, cache, tail)

    def reconstruct(self, selected: torch.Tensor, device, dtype):
        return reconstruct_sections(self.parts, selected, self.inv_freqs, device, dtype)


def _zoom_cores(index, engine, cache, tail: list[int]):
    """:meth:`CoreIndex.working_kv` for one document or spliced sections (``index.entry_chunk``, ``merged``,
    ``length``, ``zoom_tokens``, ``reconstruct``)."""
    chunks = index.merged.numel()
    scores = torch.zeros(chunks + 1)  # the last column collects padding and the spliced head (-1)

    def best_core(layer_idx, attention):  # attention (H, E) -> its chunks' best core, max over heads
        column = _columns(index.entry_chunk[layer_idx], attention.shape[1], chunks)
        best = torch.zeros(attention.shape[0], chunks + 1).scatter_reduce_(1, column, attention, "amax")
        scores.add_(best.amax(0))

    question_attention(engine, cache.layers, cache.positions, tail, best_core)
    candidates = torch.where(index.merged, index.length, 1)  # chunks kept whole are no candidates
    selected = select_spans(scores[:chunks], candidates, index.zoom_tokens)
    if selected.numel() == 0:
        return ConversationKV(cache.layers), ZoomInfo(0, 0, cache.nbytes)
    rebuilt = index.reconstruct(selected, engine.device, cache.layers[0].keys.dtype)
    chosen = torch.zeros(chunks + 1, dtype=torch.bool)
    chosen[selected] = True
    keep = [
        ~chosen[_columns(entries, layer.keys.shape[2], chunks)][None]
        for entries, layer in zip(index.entry_chunk, cache.layers)
    ]
    return zoomed_kv(cache, selected, rebuilt, len(tail), keep)


def _columns(entry_chunk: torch.Tensor, entries: int, chunks: int) -> torch.Tensor:
    """A layer's chunk per entry (H, ``entries``), with -1 (padding, a spliced head, sections that do not
    zoom) and entries past the end mapped to column ``chunks``."""
    column = entry_chunk.long().remainder(chunks + 1)
    return torch.nn.functional.pad(column, (0, entries - column.shape[1]), value=chunks)
