"""SeKV-style zoom-in: a span summary on the device, every span recoverable from host memory.

SemantiCache decides what to merge before any question is known; a later question about a
detail inside a merged span cannot get it back. SeKV (Abaskohi et al., 2026) keeps one
summary entry per span on the accelerator and a low-rank copy of each span in host memory,
and re-expands, per question, the spans that question needs. This is the training-free
version:

- **Spans** come from prefill surprisal (``-log p``): a span starts where the model was
  surprised (SeKV's boundary rule, surprisal > mean + ``anchor_std`` std, taken highest first
  until the budget is met); *anchors* (tokens holding a digit, then the most surprising ones,
  each with its whole word: :mod:`.anchors`, as SemantiCache keeps them), template tokens, the
  first ``sink_tokens`` and the last ``window_tokens`` stay whole. Spans are shared by all
  layers and heads, so one decision expands a span everywhere.
- **Summary** (device): one entry per span, the mean key and value with the proportional-
  attention bias ``log |span|`` (exact when a span's tokens are identical).
- **Host copy**: each span's keys and values per layer and head, every token as 8-bit codes with an
  fp16 scale and minimum per 32 channels (``host_copy="int8"``, the default; ``"int4"`` for 4-bit
  codes), or as SeKV's own rank-``rank`` SVD (``host_copy="rank"``; spans no longer than ``rank``
  are kept as they are: their SVD would be larger than the tokens). On the default model's keys and
  values the codes are the better copy by every measure: spans rebuilt from int8 codes are within
  0.5-0.6% of the tokens (relative Frobenius error), from int4 8-10%, from rank-16 factors 15-43%
  (2K tokens of real text, spans of 17-128 tokens); the int8 copy takes 1.7-3.6x fewer bytes than the
  factors (which save nothing on spans of 17-32 tokens) and costs no eigendecomposition at
  compression (the factors cost ~60% of SeKV's compression time).
- **Zoom-in** (:meth:`SpanIndex.working_kv`): the question's tokens are run once over the
  summary; each span's score is the attention its summary entry gets (max over heads and
  question tokens, summed over layers); the best spans within ``zoom_tokens`` are rebuilt at
  token level *for this question only*: their summary entries are masked (size 0) in a copy
  of the ``sizes`` tensor (2 bytes per entry), and the rebuilt tokens go in front of the
  question in the working cache. The document cache never changes.

With ``summary="cores"`` the device summary is SemantiCache's cache at the summary budget
instead (cores merge only tokens whose keys are alike, inside one semantic chunk); the chunks
are the spans, a chunk is scored by its best core, and a rebuilt chunk masks its cores in every
layer and head (:class:`CoreIndex`).

``compression_ratio`` sets the device budget as for the other compressors: by default the
summary and the per-question expansion together keep at most ``(1 - compression_ratio) * N``
entries per head, ``zoom_share`` of them left for the expansion. An explicit ``zoom_tokens``
is added on top of a summary of ``(1 - compression_ratio) * N`` entries instead.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from semanticache_rag.compressors.anchors import UNITS, anchor_priority, choose_anchors, context_words
from semanticache_rag.compressors.base import CompressionContext, Compressor
from semanticache_rag.compressors.semanticache import SemantiCacheCompressor
from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import ConversationKV, LayerKV, QuantizedTensor
from semanticache_rag.rotation import rotate_keys

SUMMARIES = ("spans", "cores")
HOST_COPIES = {"int8": 8, "int4": 4, "rank": None}  # code bits of each host copy (rank: SVD factors)
# one bucket's keys or values in host memory: (None, rows or their codes) or (left, right) factors
HostRows = tuple[torch.Tensor | None, torch.Tensor | QuantizedTensor]


@dataclass(frozen=True, eq=False)
class _Spans:
    start: torch.Tensor  # (E,) first token of each entry (whole tokens are spans of one)
    length: torch.Tensor  # (E,)
    entry_of_token: torch.Tensor  # (N,)
    zoom_tokens: int = 0  # per-question expansion budget


@dataclass(frozen=True, eq=False)
class ZoomInfo:
    """What zooming did for one question (reported on the :class:`~semanticache_rag.Answer`)."""

    spans_expanded: int
    tokens_reconstructed: int
    device_bytes: int


@dataclass(eq=False)
class SpanIndex:
    """Host-side copy of every multi-token span of a SeKV document cache.

    Spans are grouped in buckets by length (widths 2, 4, 8, ...). Per bucket, ``entries``
    (S,) are the spans' summary-entry indices and ``factors`` holds, for keys and for values,
    ``(None, rows)`` with the rows of the bucket's tokens (L, H, T, D) (T = their total length, no
    padding) as :class:`~semanticache_rag.kv.QuantizedTensor` codes (``host_copy="int8"``/``"int4"``)
    or as they are (spans no longer than the rank); or low-rank factors ``(left, right)``: ``left``
    (L, H, T, r) per token and ``right`` (L, H, S, r, D) per span, so a span's rows are
    ``left[span tokens] @ right[span]``.
    """

    start: torch.Tensor  # (E,) per summary entry
    length: torch.Tensor  # (E,)
    widths: list[int]
    entries: list[torch.Tensor]
    factors: list[dict[str, HostRows]]
    zoom_tokens: int
    rank: int
    _nbytes: int = field(default=-1, repr=False)

    @property
    def nbytes(self) -> int:
        """Host bytes of the span copies and their bookkeeping."""
        if self._nbytes < 0:
            tensors = [self.start, self.length, *self.entries]
            coded = 0
            for parts in self.factors:
                for left, right in parts.values():
                    if isinstance(right, QuantizedTensor):
                        coded += right.nbytes
                    else:
                        tensors += [t for t in (left, right) if t is not None]
            self._nbytes = coded + sum(t.numel() * t.element_size() for t in tensors)
        return self._nbytes

    def reconstruct(self, selected: torch.Tensor, device, dtype):
        """Token-level keys and values of the ``selected`` entries, per layer: (L, H, T, D) each."""
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for width, entries, parts in zip(self.widths, self.entries, self.factors):
            chosen = torch.isin(entries, selected)
            if not chosen.any():
                continue
            valid = torch.arange(width)[None, :] < self.length[entries][:, None]  # (S, W)
            tokens = chosen[:, None].expand(-1, width)[valid]  # (T,) tokens of chosen spans
            for out, name in ((keys, "keys"), (values, "values")):
                left, right = parts[name]
                if isinstance(right, QuantizedTensor):
                    out.append(right.take(tokens.nonzero()[:, 0]).decode())
                    continue
                if left is None:
                    out.append(right[:, :, tokens])
                    continue
                padded = left.new_zeros(*left.shape[:2], int(chosen.sum()), width, left.shape[3])
                padded[:, :, valid[chosen]] = left[:, :, tokens]
                rows = padded.float() @ right[:, :, chosen].float()  # (L, H, S', W, D)
                out.append(rows[:, :, valid[chosen]])
        if not keys:
            return None
        return torch.cat(keys, 2).to(device, dtype), torch.cat(values, 2).to(device, dtype)

    def scores(self, engine, cache, tail: list[int]) -> torch.Tensor:
        """Attention each summary entry gets from the question's tokens (E,) (see :func:`entry_scores`)."""
        return entry_scores(engine, cache, tail)

    def select(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Multi-token spans by score, highest first, each taken if its tokens still fit ``budget``."""
        return select_spans(scores, self.length, budget)

    def working_kv(self, engine, cache, tail: list[int]) -> tuple[ConversationKV, ZoomInfo]:
        """A working cache for ``tail`` with the spans it needs rebuilt at token level."""
        selected = self.select(self.scores(engine, cache, tail), self.zoom_tokens)
        rebuilt = self.reconstruct(selected, engine.device, cache.layers[0].keys.dtype)
        return zoomed_kv(cache, selected, rebuilt, len(tail))

    @classmethod
    def join(cls, parts, inv_freqs) -> SplicedSpans:
        """The zoom state of sections spliced into one cache (``parts``: (entries per layer before the
        section, its index or None, key delta))."""
        return SplicedSpans(
            [(offsets[0], index, delta) for offsets, index, delta in parts if index is not None], inv_freqs
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (for safetensors); :meth:`from_state_dict` restores the index."""
        state = {"start": self.start, "length": self.length}
        state["config"] = torch.tensor([self.zoom_tokens, self.rank, *self.widths])
        for b, (entries, parts) in enumerate(zip(self.entries, self.factors)):
            state[f"{b}.entries"] = entries
            for name, (left, right) in parts.items():
                if isinstance(right, QuantizedTensor):
                    state["host_bits"] = torch.tensor([right.bits])
                    state.update({f"{b}.{name}.{part}": getattr(right, part) for part in _CODE_PARTS})
                    continue
                state[f"{b}.{name}.right"] = right
                if left is not None:
                    state[f"{b}.{name}.left"] = left
        return state

    def check(self, layers) -> None:
        """Raise ValueError unless this index describes ``layers`` (one summary entry per span)."""
        if any(layer.keys.shape[2] != self.start.numel() for layer in layers):
            raise ValueError("the zoom state's spans do not match the layers' entries")

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> SpanIndex:
        try:
            zoom_tokens, rank, *widths = state["config"].tolist()
            bits = int(state["host_bits"]) if "host_bits" in state else None
            entries = [state[f"{b}.entries"] for b in range(len(widths))]
            factors = [
                {name: _stored_rows(state, f"{b}.{name}", bits) for name in ("keys", "values")}
                for b in range(len(widths))
            ]
            start, length = state["start"], state["length"]
        except KeyError as exc:
            raise ValueError(f"the zoom state lacks {exc}") from exc
        return cls(start, length, widths, entries, factors, zoom_tokens, rank)


_CODE_PARTS = ("codes", "scales", "minimums")


def _stored_rows(state: dict[str, torch.Tensor], prefix: str, bits: int | None):
    """One bucket's keys or values as :meth:`SpanIndex.state_dict` stored them: ``(left, right)``."""
    if bits is not None and f"{prefix}.codes" in state:
        codes, scales, minimums = (state[f"{prefix}.{part}"] for part in _CODE_PARTS)
        return None, QuantizedTensor(codes, scales, minimums, bits, torch.float32)
    return state.get(f"{prefix}.left"), state[f"{prefix}.right"]


def question_attention(engine, layers, start: int, tail: list[int], each) -> None:
    """Run ``tail`` once over document ``layers`` from position ``start``; call ``each(layer_idx, attention)``
    with the attention (H_kv, E) each document entry gets in that layer, max over the question's tokens and
    the query heads of a KV head."""

    def observe(layer_idx, query, document, scaling):
        batch, heads, num_queries, dim = query.shape
        kv_heads = document.keys.shape[1]
        q = query.reshape(batch, kv_heads, -1, dim)
        logits = (q @ document.keys.transpose(-1, -2)).float() * scaling
        if document.log_sizes is not None:
            logits = logits + document.log_sizes[:, :, None, :]
        each(layer_idx, torch.softmax(logits, -1).amax(dim=(0, 2)).cpu())

    kv = ConversationKV(layers)
    kv.observe = observe
    engine.forward(kv, tail, start)


def entry_scores(engine, cache, tail: list[int]) -> torch.Tensor:
    """Attention each document entry of ``cache`` gets from ``tail`` (E,): max over heads and tokens,
    summed over layers (the question runs once over the summary)."""
    total = torch.zeros(cache.layers[0].keys.shape[2])
    question_attention(
        engine, cache.layers, cache.positions, tail, lambda layer_idx, attention: total.add_(attention.amax(0))
    )
    return total


def select_spans(scores: torch.Tensor, length: torch.Tensor, budget: int) -> torch.Tensor:
    """Entries of multi-token spans (``length`` > 1) by score, highest first, while their tokens fit ``budget``."""
    candidates = (length > 1).nonzero()[:, 0]
    order = candidates[scores[candidates].argsort(descending=True)].tolist()
    lengths, chosen, used = length.tolist(), [], 0
    for entry in order:
        if used + lengths[entry] <= budget:
            chosen.append(entry)
            used += lengths[entry]
    return torch.tensor(chosen, dtype=torch.long)


def zoomed_kv(cache, selected: torch.Tensor, rebuilt, tail_len: int, keep=None):
    """The working cache with ``selected`` summary entries masked and their ``rebuilt`` tokens in front of the tail.

    ``keep`` (one (H, E) bool mask per layer) masks per layer and head instead, for summaries whose
    entries differ between heads (:class:`CoreIndex`).
    """
    count = 0 if rebuilt is None else rebuilt[0].shape[2]
    if keep is None:
        masked = torch.ones(cache.layers[0].keys.shape[2], dtype=torch.bool)
        masked[selected] = False
        keep = [masked] * len(cache.layers)
    layers = []
    for layer, mask in zip(cache.layers, keep):
        sizes = layer.sizes if layer.sizes is not None else layer.keys.new_ones(layer.keys.shape[:3], dtype=torch.int16)
        layers.append(LayerKV(layer.keys, layer.values, sizes * mask.to(sizes)))
    kv = ConversationKV(layers, capacity=count + tail_len + 256)
    if rebuilt is not None:
        for index, layer in enumerate(kv.layers):
            layer.update(rebuilt[0][index][None], rebuilt[1][index][None])
        kv.prefix_length = count
    extra = sum(layer.nbytes - layer.keys.nbytes - layer.values.nbytes for layer in layers)  # the masked sizes
    extra += 0 if rebuilt is None else rebuilt[0].nbytes * 2
    return kv, ZoomInfo(int(selected.numel()), count, cache.nbytes + extra)


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
        return _reconstruct_sections(self.parts, selected, self.inv_freqs, device, dtype)


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


def _reconstruct_sections(parts, selected: torch.Tensor, inv_freqs: list[torch.Tensor], device, dtype):
    """Token-level keys and values of the ``selected`` entries of spliced sections, per layer: (L, H, T, D)
    each, or None. ``parts``: (first entry of the section, its index (``length``, ``reconstruct``), how far
    its keys moved); rebuilt keys move the same way, per layer's RoPE."""
    keys, values = [], []
    for first, index, delta in parts:
        local = selected[(selected >= first) & (selected < first + index.length.numel())] - first
        rebuilt = index.reconstruct(local, device, dtype) if local.numel() else None
        if rebuilt is not None:
            keys.append(torch.stack([rotate_keys(k[None], delta, f)[0] for k, f in zip(rebuilt[0], inv_freqs)]))
            values.append(rebuilt[1])
    return (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None


def _columns(entry_chunk: torch.Tensor, entries: int, chunks: int) -> torch.Tensor:
    """A layer's chunk per entry (H, ``entries``), with -1 (padding, a spliced head, sections that do not
    zoom) and entries past the end mapped to column ``chunks``."""
    column = entry_chunk.long().remainder(chunks + 1)
    return torch.nn.functional.pad(column, (0, entries - column.shape[1]), value=chunks)


def zoom_from_state_dict(state: dict[str, torch.Tensor]):
    """The zoom state a cache stored (:meth:`SpanIndex.state_dict` or :meth:`CoreIndex.state_dict`)."""
    return CoreIndex.from_state_dict(state) if "merged" in state else SpanIndex.from_state_dict(state)


@dataclass(eq=False)
class SplicedSpans:
    """The zoom state of a long document's sections spliced into one working cache.

    ``parts`` are (first entry in the spliced cache, the section's :class:`SpanIndex`, how far its
    keys moved); rebuilt keys are moved the same way (:func:`~semanticache_rag.rotation.rotate_keys`).
    """

    parts: list[tuple[int, SpanIndex, int]]
    inv_freqs: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(index.nbytes for _, index, _ in self.parts)

    def working_kv(self, engine, cache, tail: list[int]) -> tuple[ConversationKV, ZoomInfo]:
        length = torch.ones(cache.layers[0].keys.shape[2], dtype=torch.long)
        for offset, index, _ in self.parts:
            length[offset : offset + index.length.numel()] = index.length
        budget = sum(index.zoom_tokens for _, index, _ in self.parts)
        selected = select_spans(entry_scores(engine, cache, tail), length, budget)
        rebuilt = _reconstruct_sections(self.parts, selected, self.inv_freqs, engine.device, cache.layers[0].keys.dtype)
        return zoomed_kv(cache, selected, rebuilt, len(tail))


def _factor(rows: torch.Tensor, rank: int, dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """rows (..., W, D) -> (left (..., W, r), right (..., r, D)), the best rank-r approximation.

    Spans no longer than ``rank`` come back as ``(None, rows)``: their factors would be larger.
    Computed from the eigenvectors of the smaller Gram matrix (D x D or W x W), much faster than
    a batched SVD and the same subspace; exact once ``rank >= min(W, D)``.
    """
    width, dim = rows.shape[-2:]
    if width <= rank:
        return None, rows.to(dtype)
    x = rows.float()
    k = min(rank, width, dim)
    if width >= dim:
        basis = _top_eigenvectors(x.transpose(-1, -2) @ x, k)  # (..., D, k)
        return (x @ basis).to(dtype), basis.transpose(-1, -2).to(dtype)
    basis = _top_eigenvectors(x @ x.transpose(-1, -2), k)  # (..., W, k)
    return basis.to(dtype), (basis.transpose(-1, -2) @ x).to(dtype)


def _top_eigenvectors(gram: torch.Tensor, k: int) -> torch.Tensor:
    """The eigenvectors of the ``k`` largest eigenvalues of each symmetric (..., n, n) matrix: (..., n, k).

    LAPACK solves the batch one small matrix at a time, and torch's threads inside each make it slower,
    not faster. On a CPU the batch is shared out instead, one share per thread torch has, each solved
    with one thread: the same vectors bit for bit, 1.5-1.7x faster on 2 cores (32x32 and 64x64 Gram
    matrices). Torch's thread count is 1 meanwhile, for the whole process.
    """
    threads = torch.get_num_threads()
    flat = gram.reshape(-1, *gram.shape[-2:])
    if gram.device.type != "cpu" or threads < 2 or flat.shape[0] < 2 * threads:
        return torch.linalg.eigh(gram).eigenvectors[..., -k:]

    def solve(part: torch.Tensor) -> torch.Tensor:
        return torch.linalg.eigh(part).eigenvectors[..., -k:]

    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(solve, flat.chunk(threads)))
    finally:
        torch.set_num_threads(threads)
    return torch.cat(parts).reshape(*gram.shape[:-1], k)


@dataclass(frozen=True)
class SeKVCompressor(Compressor):
    """Surprisal-guided spans: summary on the device, rank-``rank`` span copies on the host, zoom-in.

    Attributes
    ----------
    compression_ratio : float
        Device budget: summary and per-question expansion keep at most this fraction of entries
        removed, in [0, 1).
    zoom_tokens : int or None
        Tokens rebuilt per question, on top of the summary; ``None``: ``zoom_share`` of the
        device budget.
    zoom_share : float
        Share of the device budget left for the expansion when ``zoom_tokens`` is None, in [0, 1).
    host_copy : str
        How host memory keeps every span's tokens: ``"int8"`` (the default) or ``"int4"`` codes per
        token (an fp16 scale and minimum per 32 channels), or ``"rank"``: SeKV's rank-``rank`` SVD
        per span (see the module's notes for what each costs and keeps).
    rank : int
        Rank of each span's SVD with ``host_copy="rank"`` (spans of at most ``rank`` tokens are kept
        exactly); a rank of at least the head dimension makes every reconstruction exact.
    anchor_std : float
        Span boundaries and anchors: tokens with surprisal above mean + ``anchor_std`` std.
    anchor_share : float
        Most of the summary that anchors (tokens kept whole) may take, in [0, 1].
    anchor_unit : str
        ``"word"``: an anchor keeps every token of its whitespace-delimited word (up to
        ``max_word_tokens``); ``"token"``: its token only.
    max_word_tokens : int
        Longest word kept whole.
    protect_digits : bool
        Tokens holding a digit are anchors before any other.
    sink_tokens, window_tokens : int
        First and last tokens kept whole.
    summary : str
        ``"cores"`` (the default): SemantiCache's cache at the summary budget (with SemantiCache's
        own anchor settings), its semantic chunks the spans that a question rebuilds, each scored by
        its best core (:class:`CoreIndex`); ``"spans"``: one mean entry per surprisal-bounded span
        (the anchor options above apply to it only). Measured on RULER-style tasks (36 questions at
        4K; benchmarks/results/ruler_facts), with the rank-16 host copy: cores 50 / 44 / 17 at ratios
        0.5 / 0.75 / 0.9, KL 0.074 / 0.193 / 0.690; spans 47 / 39 / 17, KL 0.090 / 0.278 / 0.727;
        SemantiCache alone 50 / 42 / 19, KL 0.134 / 0.242 / 0.570. Cores with the int8 host copy
        (benchmarks/results/sekv_host_copy): 50 / 50 / 17, KL 0.069 / 0.187 / 0.665.
    """

    name: ClassVar[str] = "sekv"
    needs_surprisal: ClassVar[bool] = True
    compression_ratio: float = 0.75
    zoom_tokens: int | None = None
    zoom_share: float = 0.3
    host_copy: str = "int8"
    rank: int = 16
    anchor_std: float = 1.0
    anchor_share: float = 0.25
    anchor_unit: str = "word"
    max_word_tokens: int = 16
    protect_digits: bool = True
    sink_tokens: int = 4
    window_tokens: int = 32
    summary: str = "cores"

    def __post_init__(self):
        super().__post_init__()
        if self.zoom_tokens is not None and self.zoom_tokens < 0:
            raise ConfigError(f"zoom_tokens must be >= 0, got {self.zoom_tokens!r}")
        if not 0 <= self.zoom_share < 1 or not 0 <= self.anchor_share <= 1:
            raise ConfigError(
                f"zoom_share must be in [0, 1) and anchor_share in [0, 1], "
                f"got {self.zoom_share!r}, {self.anchor_share!r}"
            )
        if self.rank < 1 or self.sink_tokens < 0 or self.window_tokens < 0:
            raise ConfigError(f"rank must be >= 1 and sink/window tokens >= 0, got rank={self.rank!r}")
        if self.anchor_unit not in UNITS:
            raise ConfigError(f"anchor_unit must be one of {UNITS}, got {self.anchor_unit!r}")
        if self.max_word_tokens < 1:
            raise ConfigError(f"max_word_tokens must be >= 1, got {self.max_word_tokens!r}")
        if self.host_copy not in HOST_COPIES:
            raise ConfigError(f"host_copy must be one of {tuple(HOST_COPIES)}, got {self.host_copy!r}")
        if self.summary not in SUMMARIES:
            raise ConfigError(f"summary must be one of {SUMMARIES}, got {self.summary!r}")

    def budgets(self, num_tokens: int) -> tuple[int, int]:
        """(summary entries, zoom tokens) per head for a prefix of ``num_tokens`` tokens."""
        kept = self.target_entries(num_tokens)
        if self.zoom_tokens is not None:
            return kept, self.zoom_tokens
        zoom = round(self.zoom_share * kept)
        return max(1, kept - zoom), zoom

    def prepare(self, context: CompressionContext) -> _Spans:
        num_tokens = context.token_ids.numel()
        summary, zoom = self.budgets(num_tokens)
        whole = context.protected.clone()
        whole[: self.sink_tokens] = True
        whole[max(0, num_tokens - self.window_tokens) :] = True
        if self.zoom_tokens is None and int(whole.sum()) >= summary:  # short documents: the summary comes first
            summary, zoom = min(summary + zoom, int(whole.sum()) + 1), max(0, summary + zoom - int(whole.sum()) - 1)
        if summary >= num_tokens:
            return _spans(torch.ones(num_tokens, dtype=torch.bool))
        if int(whole.sum()) >= summary:
            raise ConfigError(
                f"the summary budget of {summary} entries per head does not cover the {int(whole.sum())} "
                "template, sink and window tokens; lower compression_ratio, zoom_tokens or window_tokens"
            )
        if context.surprisal is None:
            raise ConfigError("SeKV needs token surprisal: prefill with surprisal=True")
        surprisal = context.surprisal.float()
        priority = anchor_priority(context, whole, self.anchor_std, self.protect_digits)
        words = context_words(context, self.anchor_unit)
        room = max(0, int(self.anchor_share * summary) - int(whole.sum()))
        while True:  # fewer anchors when the runs between them alone exceed the budget
            anchors = choose_anchors(priority, whole, room, words, self.max_word_tokens)
            kept = whole | anchors
            starts = kept.clone()
            starts[1:] |= kept[:-1]  # a token after a whole token starts a run
            starts[0] = True
            if int(starts.sum()) <= summary or room == 0:
                break
            room = int(anchors.sum()) // 2
        # -- the most surprising remaining tokens start new spans until the budget is used
        room = max(0, summary - int(starts.sum()))
        boundaries = surprisal.masked_fill(starts, float("-inf")).topk(min(room, int((~starts).sum()))).indices
        starts[boundaries] = True
        return _spans(starts, zoom)

    def compress(self, keys, values, context, plan: _Spans) -> LayerKV:
        """The summary of one layer: mean key and value per span, sizes = span lengths."""
        if plan.start.numel() == keys.shape[2]:
            return LayerKV(keys, values)
        entries = plan.start.numel()
        start, end = plan.start.to(keys.device), (plan.start + plan.length).to(keys.device)
        denom = plan.length.to(keys.device, torch.float64)[None, None, :, None]
        summary = []
        for x in (keys, values):  # span sums as differences of a float64 prefix sum (exact enough for one token)
            prefix = torch.nn.functional.pad(x.double().cumsum(2), (0, 0, 1, 0))
            summary.append(((prefix[:, :, end] - prefix[:, :, start]) / denom).to(x.dtype))
        dtype = torch.int16 if int(plan.length.max()) < 2**15 else torch.int32
        sizes = plan.length.to(keys.device, dtype).expand(1, keys.shape[1], entries).contiguous()
        return LayerKV(summary[0], summary[1], sizes)

    def compress_cache(self, keys_values, context: CompressionContext):
        if self.summary == "cores":
            return self._compress_cores(keys_values, context)
        plan = self.prepare(context)
        layers = tuple(self.compress(keys, values, context, plan) for keys, values in keys_values)
        return layers, self.span_index(keys_values, plan)

    def _compress_cores(self, keys_values, context: CompressionContext):
        """SemantiCache's cores at the summary budget, and the host copy of every chunk they merged."""
        num_tokens = context.token_ids.numel()
        summary, zoom = self.budgets(num_tokens)
        whole = int(context.protected[self.sink_tokens :].sum()) + min(self.sink_tokens, num_tokens)
        if self.zoom_tokens is None and whole >= summary:  # short documents: the summary comes first
            summary, zoom = summary + zoom, 0
        if summary >= num_tokens:
            return tuple(LayerKV(k, v) for k, v in keys_values), None
        inner = SemantiCacheCompressor(
            target_tokens=summary, sink_tokens=self.sink_tokens, window_tokens=self.window_tokens
        )
        plan = inner.prepare(context)
        layout = plan.layout
        chunks = self.span_index(keys_values, _spans(layout.token_slot == 0, zoom))
        layers = inner.compress_document(keys_values, context, plan)
        token_chunk = layout.token_chunk.cpu()
        entry_chunk, merged = [], torch.zeros(layout.num_chunks + 1, dtype=torch.bool)
        for layer in layers:
            sizes = torch.ones(layer.keys.shape[1:3], dtype=torch.long) if layer.sizes is None else layer.sizes[0]
            sizes = sizes.long().cpu()  # (H, E); cores follow their seeds, so chunks come in order
            first = (sizes.cumsum(1) - sizes).clamp(max=num_tokens - 1)  # first token counted by each core
            entries = torch.where(sizes > 0, token_chunk[first], -1)
            merged[entries[sizes > 1]] = True
            entry_chunk.append(entries.to(torch.int32))
        if chunks is None or not merged.any():
            return layers, None
        return layers, CoreIndex(chunks, entry_chunk, merged[:-1].clone())

    def span_index(self, keys_values, plan: _Spans) -> SpanIndex | None:
        """The host copy of every multi-token span (``None`` when nothing was merged)."""
        if plan.start.numel() == plan.entry_of_token.numel():
            return None
        widths, entries, factors = [], [], []
        multi = (plan.length > 1).nonzero()[:, 0]
        bucket = torch.ceil(torch.log2(plan.length[multi].float())).long()  # width 2**bucket
        stacked = [torch.stack([kv[i][0].cpu() for kv in keys_values]) for i in (0, 1)]  # (L, H, N, D)
        bits = HOST_COPIES[self.host_copy]
        for b in bucket.unique().tolist():
            members = multi[bucket == b]
            width = 2**b
            offsets = torch.arange(width)
            rows = (plan.start[members, None] + offsets).clamp(max=plan.entry_of_token.numel() - 1)  # (S, W)
            valid = offsets[None, :] < plan.length[members, None]
            parts: dict[str, HostRows] = {}
            for name, x in zip(("keys", "values"), stacked):
                if bits is not None:  # one fp16 scale and minimum per 32 channels (or fewer)
                    parts[name] = (
                        None,
                        QuantizedTensor.encode(x[:, :, rows[valid]].float(), bits, math.gcd(32, x.shape[-1])),
                    )
                    continue
                if width <= self.rank:  # kept as they are (what _factor gives back): one gather of their tokens
                    parts[name] = (None, x[:, :, rows[valid]])
                    continue
                left, right = _factor(x[:, :, rows] * valid[None, None, :, :, None], self.rank, x.dtype)
                assert left is not None  # spans wider than the rank are factored
                # keep only real tokens of the per-token factor (the padding rows are zeros)
                parts[name] = (left[:, :, valid], right)
            widths.append(width)
            entries.append(members)
            factors.append(parts)
        return SpanIndex(plan.start, plan.length, widths, entries, factors, plan.zoom_tokens, self.rank)


def _spans(starts: torch.Tensor, zoom_tokens: int = 0) -> _Spans:
    """Entries from a (N,) bool mask of span starts."""
    start = starts.nonzero()[:, 0]
    length = torch.diff(start, append=torch.tensor([starts.numel()]))
    return _Spans(start, length, starts.long().cumsum(0) - 1, zoom_tokens)
