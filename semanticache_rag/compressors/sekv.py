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
from dataclasses import dataclass
from typing import ClassVar

import torch

from semanticache_rag.compressors.anchors import UNITS, anchor_priority, choose_anchors, context_words
from semanticache_rag.compressors.base import CompressionContext, Compressor
from semanticache_rag.compressors.core_index import CoreIndex
from semanticache_rag.compressors.semanticache import SemantiCacheCompressor
from semanticache_rag.compressors.span_index import HostRows, SpanIndex, factor
from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import LayerKV
from semanticache_rag.tensor_codes import QuantizedTensor

SUMMARIES = ("spans", "cores")
HOST_COPIES = {"int8": 8, "int4": 4, "rank": None}  # code bits of each host copy (rank: SVD factors)


@dataclass(frozen=True, eq=False)
class _Spans:
    start: torch.Tensor  # (E,) first token of each entry (whole tokens are spans of one)
    length: torch.Tensor  # (E,)
    entry_of_token: torch.Tensor  # (N,)
    zoom_tokens: int = 0  # per-question expansion budget


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
                if width <= self.rank:  # kept as they are (what factor gives back): one gather of their tokens
                    parts[name] = (None, x[:, :, rows[valid]])
                    continue
                left, right = factor(x[:, :, rows] * valid[None, None, :, :, None], self.rank, x.dtype)
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


def zoom_from_state_dict(state: dict[str, torch.Tensor]):
    """The zoom state a cache stored (:meth:`SpanIndex.state_dict` or :meth:`CoreIndex.state_dict`)."""
    return CoreIndex.from_state_dict(state) if "merged" in state else SpanIndex.from_state_dict(state)
