"""SemantiCache: semantic chunks -> Greedy Seed-based Clustering -> semantic cores.

Per layer and KV head, tokens of one delimiter-closed chunk whose post-RoPE keys are similar
(cosine >= tau) merge into a *semantic core*: the mean key and value of the cluster, kept with
its size ``s``; decoding adds ``log s`` to the core's attention logit (proportional attention,
:mod:`semanticache_rag.kernels.proportional_attention_ref`). ``tau`` is found per layer and head
by a search (:func:`~semanticache_rag.compressors.tau_search.search_tau`) so that every head keeps its budget to
within 0.1% (or one entry), which meets the budget with next to no padding. Layers that share a
plan are clustered together, their heads side by side: on CPUs by a C++ kernel over the similarity
grid (``kernels/gsc_cpu.cpp``, built on first use: 2K tokens compress in 0.16-0.21 s instead of
0.38-0.58 s), else on a bit-packed greedy loop in torch
(:func:`~semanticache_rag.kernels.gsc_ref.greedy_clusters`), which finds the same clusters.

Protected tokens stay whole: the chat-template tokens around the document, the first
``sink_tokens`` (attention sinks), the last ``window_tokens``, and *anchors*: tokens the model
found surprising at prefill (surprisal > mean + ``anchor_std`` std, as SeKV's span boundaries).
Rare tokens carry the facts; merged into their neighbours they are lost (measured: a planted
"purple-elephant-42" turned into "SHA-2" at ratio 0.5 without anchors).

When even whole-chunk merging cannot reach the budget, chunks are coarsened (a chunk closes
at a delimiter only once it has ``min_chunk_length`` tokens, doubled until the budget is
reachable with room left for the similarity search).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from semanticache_rag.chunking import delimiter_mask, semantic_chunks
from semanticache_rag.compressors.anchors import UNITS, anchor_priority, choose_anchors, context_words
from semanticache_rag.compressors.base import CompressionContext, Compressor
from semanticache_rag.compressors.tau_search import search_tau, seeds_at
from semanticache_rag.errors import ConfigError
from semanticache_rag.kernels import cpu_ops
from semanticache_rag.kernels.dispatch import check_backend, cluster_seeds, resolve_backend
from semanticache_rag.kernels.gsc_ref import (
    CHUNK_BLOCK,
    ChunkLayout,
    JoinTable,
    chunk_similarity,
    count_clusters,
    free_slots,
    greedy_clusters,
    merge_clusters,
    side_by_side,
    word_dtype,
)
from semanticache_rag.kv import LayerKV

logger = logging.getLogger(__name__)

_MAX_WIDTH = 512  # longest chunk coarsening may build
_GROUP_BYTES = 32 * 2**20  # similarity grids (and their thresholded copies) of the layers clustered together
# what clustering may take before any layer has been compressed: less than a read's own activations at the
# end of its prefill (e.g. 2 x 1,024 tokens x 1,536 float32 MLP activations, 12 MiB, for the default model)
_FLOOR_BYTES = 8 * 2**20


def _grid_bytes(keys: torch.Tensor, layout: ChunkLayout, masks: bool = True) -> tuple[int, int]:
    """Bytes one layer takes while clustered on the torch grid: (its table, the build's temporaries).

    The table is the (H, C, W, W) similarity (float32); for the torch loop it is sorted, beside the
    (H, C, W, W + 1) packed masks of its rows (int32 or int64 words, :class:`~.gsc_ref.JoinTable`), while
    the C++ kernel (``masks=False``) clusters the similarity as it is. The table is built one head at a
    time, a block of chunks at a time, so the temporaries (a head's unit keys and similarity, a block's
    grid and sort) do not add up over the heads and layers of a group."""
    heads, dim, width = keys.shape[1], keys.shape[3], layout.width
    cells = layout.num_chunks * width  # at least the tokens
    word = torch.iinfo(word_dtype(width)).bits // 8
    table = heads * cells * (4 * width + (word * (width + 1) if masks else 0))
    head = 8 * keys.shape[2] * dim + 4 * cells * width  # its keys as float32 and unit vectors, its similarity
    return table, head + min(CHUNK_BLOCK, layout.num_chunks) * width * (4 * dim + 16 * width)


@dataclass(frozen=True, eq=False)
class _Plan:
    layout: ChunkLayout
    protected: torch.Tensor  # (N,) bool
    target: int  # entries per KV head
    delimiters: torch.Tensor  # (N,) bool, to lay out chunks for another layer's target


def layer_targets(target: int, layers: int, slope: float, floor: int, ceiling: int) -> list[int]:
    """Entries per KV head for each layer: ``target`` on average, ``(1 + slope)`` times it in the first
    layer and ``(1 - slope)`` times it in the last, linear in between, each within [``floor``, ``ceiling``].

    The layers' sum never exceeds ``layers * target`` (what a uniform budget keeps): entries a
    floor adds are taken back from the layers with the most.
    """
    if layers == 1 or slope == 0:
        return [target] * layers
    shares = [1 + slope * (1 - 2 * index / (layers - 1)) for index in range(layers)]
    targets = [min(ceiling, max(floor, round(target * share))) for share in shares]
    excess = sum(targets) - layers * target
    while excess > 0:
        index = max(range(layers), key=lambda i: targets[i])
        if targets[index] <= floor:
            break
        step = min(excess, targets[index] - floor, max(1, excess // layers))
        targets[index] -= step
        excess -= step
    return targets


@dataclass(frozen=True)
class SemantiCacheCompressor(Compressor):
    """Merge similar tokens of each semantic chunk into cores, to a budget.

    Attributes
    ----------
    compression_ratio : float
        Fraction of KV entries to remove, in [0, 1).
    target_tokens : int or None
        Entries to keep per KV head instead of a ratio.
    tau : float or None
        Fixed cosine threshold in [-1, 1] instead of a budget search.
    max_chunk_length : int
        Longest semantic chunk before any coarsening.
    sink_tokens, window_tokens : int
        First and last tokens kept whole.
    anchor_std : float or None
        Protect tokens with surprisal above mean + ``anchor_std`` std; ``None`` disables anchors.
    anchor_share : float
        Most of the kept entries that anchors may take, in [0, 1].
    anchor_unit : str
        ``"word"`` (the default): an anchor keeps every token of its whitespace-delimited word (up
        to ``max_word_tokens``), so "Q7-TANGERINE-318" keeps its hyphens, at the cost of fewer
        anchors elsewhere in the same budget; ``"token"``: an anchor keeps its token only. Measured
        on RULER-style tasks (36 questions at 4K, numbers, uuids, names, cities, codes, QA;
        benchmarks/results/ruler_facts): word 50% / 42% / 19% at ratios 0.5 / 0.75 / 0.9, token 28%
        / 31% / 22%, the full cache 50%.
    max_word_tokens : int
        Longest word kept whole; a longer run without spaces (a URL, a line of code) keeps its
        anchor tokens only.
    protect_digits : bool
        Tokens holding a digit are anchors before any other.
    protect_names : bool
        Capitalised words inside a sentence (names, places, titles) are anchors after digits and
        before surprising tokens; off by default until measured (``benchmarks/ruler.py``'s
        ``niah_facts`` task asks for names, cities and codes).
    layer_budget_slope : float
        Budget per layer: the first layer keeps ``1 + slope`` times the mean budget and the last
        ``1 - slope`` times it, linear in between (positive: more entries where keys are least
        alike, the early layers; see :func:`layer_targets`); 0 keeps the same budget in every layer.
        In [-0.9, 0.9].
    search_steps : int
        Precision of the tau search, in halvings of [-1, 1] (it tries 4 taus per head and round and
        ends sooner once every head keeps its budget; at most twice the 9 rounds that an even split
        of the default 20 halvings takes).
    backend : str
        Clustering kernel: ``"auto"`` (Triton on CUDA tensors when installed), ``"torch"`` or
        ``"triton"``; ``value_similarity`` runs on torch only.
    """

    name: ClassVar[str] = "semanticache"
    compression_ratio: float = 0.5
    target_tokens: int | None = None
    tau: float | None = None
    max_chunk_length: int = 64
    sink_tokens: int = 4
    window_tokens: int = 32
    anchor_std: float | None = 0.5
    anchor_share: float = 0.5
    anchor_unit: str = "word"
    max_word_tokens: int = 16
    protect_digits: bool = True
    protect_names: bool = False
    layer_budget_slope: float = 0.0
    value_similarity: bool = False
    search_steps: int = 20
    backend: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.tau is not None and not -1 <= self.tau <= 1:
            raise ConfigError(f"tau must be in [-1, 1], got {self.tau!r}")
        if self.target_tokens is not None and self.target_tokens < 1:
            raise ConfigError(f"target_tokens must be >= 1, got {self.target_tokens!r}")
        if self.max_chunk_length < 1 or self.sink_tokens < 0 or self.window_tokens < 0 or self.search_steps < 1:
            raise ConfigError("max_chunk_length and search_steps must be >= 1, sink/window tokens >= 0")
        if not 0 <= self.anchor_share <= 1:
            raise ConfigError(f"anchor_share must be in [0, 1], got {self.anchor_share!r}")
        if self.anchor_unit not in UNITS:
            raise ConfigError(f"anchor_unit must be one of {UNITS}, got {self.anchor_unit!r}")
        if self.max_word_tokens < 1:
            raise ConfigError(f"max_word_tokens must be >= 1, got {self.max_word_tokens!r}")
        if not -0.9 <= self.layer_budget_slope <= 0.9:
            raise ConfigError(f"layer_budget_slope must be in [-0.9, 0.9], got {self.layer_budget_slope!r}")
        check_backend(self.backend)
        if self.value_similarity and self.backend == "triton":
            raise ConfigError('value_similarity runs on the torch backend only; use backend="auto" or "torch"')

    @property
    def needs_surprisal(self) -> bool:  # type: ignore[override]
        return self.anchor_std is not None

    def target_entries(self, num_tokens: int) -> int:
        if self.target_tokens is None:
            return super().target_entries(num_tokens)
        if self.target_tokens > num_tokens:
            raise ConfigError(f"target_tokens={self.target_tokens} exceeds the document's {num_tokens} tokens")
        return self.target_tokens

    def prepare(self, context: CompressionContext) -> _Plan:
        num_tokens = context.token_ids.numel()
        target = num_tokens if self.tau is not None else self.target_entries(num_tokens)
        protected = context.protected.clone()
        if target >= num_tokens and self.tau is None:  # nothing to remove (a fixed tau merges what it finds alike)
            return _Plan(
                ChunkLayout.from_chunk_ids(torch.arange(num_tokens)), protected, target, torch.zeros_like(protected)
            )
        protected[: self.sink_tokens] = True
        window = self.window_tokens
        if int(protected.sum()) + window >= target:  # a short text (a long document's last section): a shorter window
            window = max(0, (target - int(protected.sum())) // 2)
            logger.debug("%d entries per head: the protected window shrinks to %d tokens", target, window)
        protected[max(0, num_tokens - window) :] = True
        if int(protected.sum()) >= target:
            raise ConfigError(
                f"the budget of {target} entries per head does not cover the {int(protected.sum())} template, "
                "sink and window tokens; lower compression_ratio, sink_tokens or window_tokens"
            )
        protected |= self._anchors(context, protected, target)
        delimiters = delimiter_mask(context.token_ids, context.tokenizer)
        layout = self._layout(delimiters, protected, target)
        return _Plan(layout, protected, target, delimiters)

    def layer_plans(self, plan: _Plan, num_layers: int, context: CompressionContext) -> list[_Plan]:
        """One plan per layer, each with its own budget when :attr:`layer_budget_slope` is set."""
        num_tokens = context.token_ids.numel()
        if not self.layer_budget_slope or self.tau is not None or plan.target >= num_tokens:
            return [plan] * num_layers
        floor = min(plan.target, math.ceil(int(plan.protected.sum()) / 0.8))  # room to merge above the protected
        targets = layer_targets(plan.target, num_layers, self.layer_budget_slope, floor, num_tokens)
        plans = {plan.target: plan}  # the mean budget's layout is laid out already
        for target in targets:
            if target not in plans:
                layout = self._layout(plan.delimiters, plan.protected, target)
                plans[target] = _Plan(layout, plan.protected, target, plan.delimiters)
        return [plans[target] for target in targets]

    def _anchors(self, context: CompressionContext, protected: torch.Tensor, target: int) -> torch.Tensor:
        """Digit tokens, then the most surprising tokens (> mean + k std), within ``anchor_share`` of the budget
        (:mod:`.anchors`). Kept to that share so that the rest of the budget is left to merging."""
        priority = anchor_priority(context, protected, self.anchor_std, self.protect_digits, self.protect_names)
        room = max(0, int(self.anchor_share * target) - int(protected.sum()))
        return choose_anchors(priority, protected, room, context_words(context, self.anchor_unit), self.max_word_tokens)

    def _layout(self, delimiters: torch.Tensor, protected: torch.Tensor, target: int) -> ChunkLayout:
        """Finest chunks with which merging can still reach ``target`` (with 10% room to search)."""
        min_length, max_length = 1, self.max_chunk_length
        while True:
            chunk_ids = semantic_chunks(delimiters, min_length, max_length)
            fewest = int(protected.sum()) + int(torch.unique(chunk_ids[~protected]).numel())
            # Anchors take at most anchor_share of the budget, so this usually ends near min_length ~ N / target;
            # the width cap bounds the greedy loop when template/sink/window tokens crowd the budget.
            if fewest <= 0.9 * target or max_length >= _MAX_WIDTH:
                return ChunkLayout.from_chunk_ids(chunk_ids)
            min_length, max_length = 2 * min_length, min(_MAX_WIDTH, max(max_length, 4 * min_length))

    def compress(self, keys, values, context, plan: _Plan) -> LayerKV:
        return self._compress_layers([(keys, values)], plan)[0]

    def compress_document(
        self, keys_values, context: CompressionContext, plan: _Plan | None = None
    ) -> tuple[LayerKV, ...]:
        """Every layer, several at a time: consecutive layers with the same plan are clustered together
        (their heads side by side), so that each step of the greedy loop and each round of the tau
        search covers them all at once.

        A group's similarity tables (and the temporaries of building them) take at most
        :data:`_FLOOR_BYTES` plus what the layers compressed before it gave back (their full keys and
        values less their cores); a layer whose table alone takes more is clustered a few heads at a
        time. Several layers are grouped only within :data:`_GROUP_BYTES`. ``plan``: this context's
        :meth:`prepare`, when the caller has it already.
        Compression then adds little to the peak memory of a read, which holds every layer's full KV
        when it starts.
        """
        plans = self.layer_plans(self.prepare(context) if plan is None else plan, len(keys_values), context)
        layers: list[LayerKV] = []
        start, freed = 0, 0
        while start < len(keys_values):
            end, heads = start + 1, keys_values[start][0].shape[1]
            if self._on_grid(keys_values[start][0]):
                keys = keys_values[start][0]
                table, build = _grid_bytes(keys, plans[start].layout, masks=not self._on_cpu_kernel(keys))
                room = _FLOOR_BYTES + freed - build  # for tables, on top of the full KV of the layers left
                if table > room:  # not even one layer's: a few heads at a time
                    heads = max(1, room * heads // table)
                cap = min(_GROUP_BYTES, room)  # more layers only within the group cap
                while end < len(keys_values) and plans[end] is plans[start] and (end - start + 1) * table <= cap:
                    end += 1
            if (
                self._merges(plans[start], keys_values[start][0].shape[2])
                and end - start == 1
                and heads < keys_values[start][0].shape[1]
            ):
                keys, values = keys_values[start]
                group = [self._compress_heads(keys, values, plans[start], heads)]
            else:
                group = self._compress_layers(keys_values[start:end], plans[start])
            freed += sum(k.nbytes + v.nbytes for k, v in keys_values[start:end]) - sum(g.nbytes for g in group)
            layers.extend(group)
            if context.release_layers:  # the list's references were the last ones to these layers' full KV
                keys_values[start:end] = [None] * (end - start)
            start = end
        return tuple(layers)

    def _compress_heads(self, keys: torch.Tensor, values: torch.Tensor, plan: _Plan, at_once: int) -> LayerKV:
        """One layer clustered ``at_once`` heads at a time (the same clustering, less memory at once)."""
        parts = [
            self._compress_layers([(keys[:, h : h + at_once], values[:, h : h + at_once])], plan)[0]
            for h in range(0, keys.shape[1], at_once)
        ]
        entries = max(part.keys.shape[2] for part in parts)

        def padded(tensor: torch.Tensor) -> torch.Tensor:  # shorter heads end in size-0 padding, as merge pads
            return torch.nn.functional.pad(
                tensor, (0, 0, 0, entries - tensor.shape[2]) if tensor.dim() == 4 else (0, entries - tensor.shape[2])
            )

        return LayerKV(
            *(torch.cat([padded(getattr(part, name)) for part in parts], 1) for name in ("keys", "values", "sizes"))
        )

    def _compress_layers(self, keys_values, plan: _Plan) -> list[LayerKV]:
        """Layers (keys, values) (1, H_kv, N, D) sharing ``plan``, clustered together."""
        if not self._merges(plan, keys_values[0][0].shape[2]):  # ratio 0 (or a budget of the whole document)
            return [LayerKV(keys, values) for keys, values in keys_values]
        heads = keys_values[0][0].shape[1]
        cluster = self._clustering(keys_values, plan)
        if self.tau is None:
            seeds = self._search_tau(cluster, heads * len(keys_values), plan)
        else:
            seeds = seeds_at(cluster, torch.full((heads * len(keys_values),), self.tau))
        del cluster  # its similarity table, before the cores are built
        dtype = torch.int16 if plan.layout.width < 2**15 else torch.int32
        layers = []
        for index, (keys, values) in enumerate(keys_values):
            core_keys, core_values, sizes = merge_clusters(
                keys[0], values[0], seeds[index * heads : (index + 1) * heads]
            )
            layers.append(LayerKV(core_keys[None], core_values[None], sizes.to(dtype)[None]))
        return layers

    def _clustering(self, keys_values, plan: _Plan):
        """The clustering of layers sharing ``plan``, their H heads side by side, at K thresholds per head
        at once: ``tau (K, H) -> (counts (K, H), pick)``, where ``pick(index (H,))`` gives the seeds
        (H, N) of threshold ``index[h]`` for each head ``h``.

        The torch grid computes the similarity once for every tau, and runs the greedy loop once
        for all K (its steps cost about the same for K thresholds as for one); the Triton kernel
        recomputes the similarity from the keys in each call and keeps no (H, C, W, W) grid in memory
        (it clusters one layer at a time).
        """
        keys = keys_values[0][0]
        device = keys.device
        if self._on_grid(keys):
            layout, protected = plan.layout.to(device), plan.protected.to(device)
            grids = (  # one head at a time: a head's grid of unit keys is the largest temporary of the build
                self._similarity(layer_keys[:, h : h + 1], layer_values[:, h : h + 1], layout)
                for layer_keys, layer_values in keys_values
                for h in range(layer_keys.shape[1])
            )
            heads = keys.shape[1] * len(keys_values)
            if self._on_cpu_kernel(keys):
                return self._kernel_clustering(grids, heads, layout, protected)
            table = JoinTable.build(grids, heads, layout)
            rows = torch.arange(table.similarity.shape[0])

            def on_grid(tau):
                clusters = greedy_clusters(table, layout, tau.to(device), protected)
                return clusters.counts.cpu().view(tau.shape), lambda index: clusters.seeds(index * len(rows) + rows)

            return on_grid
        chunk_ids, protected = plan.layout.token_chunk[None].to(device), plan.protected[None].to(device)

        def on_triton(tau):
            seeds = torch.stack(
                [cluster_seeds(keys, chunk_ids, row.to(device), protected, backend="triton")[0] for row in tau]
            )
            counts = count_clusters(seeds.flatten(0, 1)).cpu().view(tau.shape)
            return counts, lambda index: seeds[index.to(device), torch.arange(tau.shape[1], device=device)]

        return on_triton

    @staticmethod
    def _kernel_clustering(grids, heads: int, layout: ChunkLayout, protected: torch.Tensor):
        """:meth:`_clustering` by the C++ clustering kernel (``kernels/gsc_cpu.cpp``): the similarity grids
        side by side, as they are (no sorted table), clustered at each round's thresholds in one call."""
        similarity = side_by_side(grids, heads, layout)
        lengths = torch.bincount(layout.token_chunk, minlength=layout.num_chunks)
        free = free_slots(layout, protected)
        start = layout.chunk_start[layout.token_chunk]
        kept = int(protected.sum())
        rows = torch.arange(heads)

        def on_kernel(tau):
            slots, counts = cpu_ops.op("greedy_seeds")(similarity, lengths, free, tau.float().contiguous())

            def pick(index: torch.Tensor) -> torch.Tensor:
                chosen = slots[index, rows]  # (H, C, W)
                return start + chosen[:, layout.token_chunk, layout.token_slot].long()

            return counts + kept, pick

        return on_kernel

    def _merges(self, plan: _Plan, num_tokens: int) -> bool:
        """Whether ``plan`` clusters anything: a budget below the tokens, or a fixed tau."""
        return self.tau is not None or plan.target < num_tokens

    def _on_cpu_kernel(self, keys: torch.Tensor) -> bool:
        """Whether the grid is clustered by the C++ kernel (CPU tensors, where it was built), else by the table."""
        return keys.device.type == "cpu" and cpu_ops.available()

    def _on_grid(self, keys: torch.Tensor) -> bool:
        """Whether these keys are clustered on the torch grid (else by the Triton kernel, one layer at a time)."""
        return self.value_similarity or resolve_backend(self.backend, keys) == "torch"

    def _similarity(self, keys: torch.Tensor, values: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        similarity = chunk_similarity(keys[0], layout)
        if self.value_similarity:
            similarity = torch.minimum(similarity, chunk_similarity(values[0], layout))
        return similarity

    def _search_tau(self, cluster, heads: int, plan: _Plan) -> torch.Tensor:
        """Per head, the seeds (H, N) at the largest tau keeping at most ``plan.target`` entries
        (:func:`~.tau_search.search_tau`, within this compressor's ``search_steps``)."""
        return search_tau(cluster, heads, plan, self.search_steps)
