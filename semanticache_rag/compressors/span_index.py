"""SeKV's host copy of every multi-token span of a document cache, and its zoom-in over spans.

:class:`SpanIndex` keeps each span's tokens in host memory (int8 / int4 codes per token, or SeKV's
rank-``r`` SVD); a question rebuilds the spans it attends to most (:mod:`.zoom`).
:class:`SplicedSpans` is the same state for a long document's sections spliced into one cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from semanticache_rag.compressors.zoom import ZoomInfo, entry_scores, reconstruct_sections, select_spans, zoomed_kv
from semanticache_rag.kv import ConversationKV
from semanticache_rag.tensor_codes import QuantizedTensor

# one bucket's keys or values in host memory: (None, rows or their codes) or (left, right) factors
HostRows = tuple[torch.Tensor | None, torch.Tensor | QuantizedTensor]


@dataclass(eq=False)
class SpanIndex:
    """Host-side copy of every multi-token span of a SeKV document cache.

    Spans are grouped in buckets by length (widths 2, 4, 8, ...). Per bucket, ``entries``
    (S,) are the spans' summary-entry indices and ``factors`` holds, for keys and for values,
    ``(None, rows)`` with the rows of the bucket's tokens (L, H, T, D) (T = their total length, no
    padding) as :class:`~semanticache_rag.tensor_codes.QuantizedTensor` codes (``host_copy="int8"``/``"int4"``)
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
        rebuilt = reconstruct_sections(self.parts, selected, self.inv_freqs, engine.device, cache.layers[0].keys.dtype)
        return zoomed_kv(cache, selected, rebuilt, len(tail))


def factor(rows: torch.Tensor, rank: int, dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
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
        basis = top_eigenvectors(x.transpose(-1, -2) @ x, k)  # (..., D, k)
        return (x @ basis).to(dtype), basis.transpose(-1, -2).to(dtype)
    basis = top_eigenvectors(x @ x.transpose(-1, -2), k)  # (..., W, k)
    return basis.to(dtype), (basis.transpose(-1, -2) @ x).to(dtype)


def top_eigenvectors(gram: torch.Tensor, k: int) -> torch.Tensor:
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
