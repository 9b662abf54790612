"""Greedy Seed-based Clustering (GSC) of keys inside semantic chunks, and core merging, in torch.

GSC, per KV head and chunk: the first unassigned token is a seed; every later unassigned token
of the chunk whose key has cosine similarity >= tau with the seed's joins it; repeat. Each
cluster becomes one *semantic core*: size-weighted mean key and value, and its size ``s``.

Tokens are laid out as a padded (chunks, slots) grid so that one step of the greedy loop runs
for every head and chunk at once; the loop has as many steps as the longest chunk.

:func:`cluster_seeds` and :func:`semantic_cores` are the batched entry points, over one layer's
keys (B, H_kv, N, D): the torch twins of :mod:`.gsc_triton`, chosen by :mod:`.dispatch`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Where each token sits in the padded (chunks, slots) grid.

    Attributes
    ----------
    token_chunk, token_slot : Tensor (N,) long
        Chunk index and position inside the chunk of each token.
    chunk_start : Tensor (C,) long
        First token of each chunk.
    width : int
        Longest chunk (slots per chunk).
    """

    token_chunk: torch.Tensor
    token_slot: torch.Tensor
    chunk_start: torch.Tensor
    width: int

    @classmethod
    def from_chunk_ids(cls, chunk_ids: torch.Tensor) -> ChunkLayout:
        """``chunk_ids`` (N,): non-decreasing chunk index per token (contiguous chunks)."""
        starts = torch.ones_like(chunk_ids, dtype=torch.bool)
        starts[1:] = chunk_ids[1:] != chunk_ids[:-1]
        chunk_start = starts.nonzero()[:, 0]
        token_chunk = starts.long().cumsum(0) - 1
        token_slot = torch.arange(chunk_ids.numel(), device=chunk_ids.device) - chunk_start[token_chunk]
        return cls(token_chunk, token_slot, chunk_start, int(token_slot.max()) + 1)

    def to(self, device: torch.device | str) -> ChunkLayout:
        return ChunkLayout(
            self.token_chunk.to(device), self.token_slot.to(device), self.chunk_start.to(device), self.width
        )

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_start.numel())


CHUNK_BLOCK = 256  # chunks whose padded grid of unit keys (and sort indices) exist at once


def chunk_similarity(keys: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Cosine similarity of keys inside each chunk: keys (H, N, D) -> (H, C, W, W).

    The padded (H, chunks, W, D) grid of unit keys is built :data:`CHUNK_BLOCK` chunks at a time
    (it is larger than the similarity itself when chunks are wider than the head dimension is long).
    """
    heads, num_tokens, dim = keys.shape
    unit = F.normalize(keys.float(), dim=-1).to(keys.dtype)
    similarity = keys.new_empty(heads, layout.num_chunks, layout.width, layout.width)
    bounds = torch.cat([layout.chunk_start, layout.chunk_start.new_tensor([num_tokens])]).tolist()
    for first in range(0, layout.num_chunks, CHUNK_BLOCK):
        last = min(first + CHUNK_BLOCK, layout.num_chunks)
        tokens = slice(bounds[first], bounds[last])  # chunks are contiguous runs of tokens
        grid = keys.new_zeros(heads, last - first, layout.width, dim)
        grid[:, layout.token_chunk[tokens] - first, layout.token_slot[tokens]] = unit[:, tokens]
        torch.matmul(grid, grid.transpose(-1, -2), out=similarity[:, first:last])
    return similarity


def side_by_side(
    grids: Iterable[torch.Tensor], heads: int, layout: ChunkLayout, order: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`chunk_similarity` grids (H_i, C, W, W) of ``heads`` heads in all as one (H, C, W, W) float32
    tensor, chunks in ``order`` where given. ``grids`` may be a generator: each grid is copied in as it
    comes, so this takes the result's memory and one grid at a time."""
    similarity: torch.Tensor | None = None
    at = 0
    for grid in grids:
        if similarity is None:
            similarity = torch.empty(heads, layout.num_chunks, layout.width, layout.width, device=grid.device)
        if at + grid.shape[0] > heads:
            raise ValueError(f"grids for {heads} heads expected, got more")
        similarity[at : at + grid.shape[0]] = grid if order is None else grid[:, order.to(grid.device)]
        at += grid.shape[0]
        del grid  # before the next grid is computed
    if similarity is None or at != heads:
        raise ValueError(f"grids for {heads} heads expected, got {at}")
    return similarity


def free_slots(layout: ChunkLayout, protected: torch.Tensor) -> torch.Tensor:
    """(C, W) bool: the grid slots of tokens that may merge (not ``protected`` (N,); padding is not free)."""
    free = torch.zeros(layout.num_chunks, layout.width, dtype=torch.bool, device=protected.device)
    free[layout.token_chunk, layout.token_slot] = ~protected
    return free


_WORD = 64  # tokens per int64 word of a packed row
_SHORT_WORD = 31  # chunks of at most this many tokens pack into one int32 word (the sign bit left unused)
_BYTE_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def word_dtype(width: int) -> torch.dtype:
    """The word of a packed row of ``width`` tokens: int32 up to 31 tokens (half the bytes), else int64."""
    return torch.int32 if width <= _SHORT_WORD else torch.int64


def pack_rows(mask: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Bool (..., W) -> (..., words) of ``dtype`` (int64, or int32 for W <= 31): bit ``j % b`` of word
    ``j // b`` is ``mask[..., j]``, for words of ``b`` bits."""
    width, size = mask.shape[-1], torch.iinfo(dtype).bits // 8
    words = -(-width // (8 * size))
    padded = mask.new_zeros(*mask.shape[:-1], words * 8 * size)
    padded[..., :width] = mask
    weights = torch.tensor(_BYTE_WEIGHTS, dtype=torch.uint8, device=mask.device)
    octets = (padded.view(torch.uint8).unflatten(-1, (words * size, 8)) * weights).sum(-1, dtype=torch.uint8)
    if sys.byteorder == "big":  # byte b of a word must hold bits 8b..8b+7 as the word reads them
        octets = octets.unflatten(-1, (words, size)).flip(-1).flatten(-2)
    return octets.view(dtype)


@dataclass(frozen=True, eq=False)
class JoinTable:
    """One layer's chunk similarity (or several layers' heads side by side), laid out for the greedy
    loop at any tau.

    Chunks are ordered longest first (step ``p`` of the loop runs over the first ``active[p]``
    chunks). Chunks of at most 64 tokens keep each row's similarities sorted, most similar first,
    with the packed mask of its ``r`` most similar tokens for every ``r``: the tokens that a row's
    token takes at a threshold are one search and one lookup away, for any number of thresholds.
    Longer chunks keep the similarity and pack the comparison at each threshold.
    """

    order: torch.Tensor  # (C,) chunks, longest first
    token_rank: torch.Tensor  # (N,) each token's chunk in that order
    active: list[int]  # chunks that have a token p, for each slot p
    similarity: torch.Tensor  # (H, C, W, W) float32 in chunk order; negated and sorted per row when masks is set
    masks: torch.Tensor | None  # (H, C, W, W + 1) int32/int64: bits of row p's r most similar tokens, and of p

    @property
    def word_bits(self) -> int:
        """Tokens per word of the loop's packed rows (int32 words for chunks of up to 31 tokens)."""
        return torch.iinfo(word_dtype(self.similarity.shape[-1])).bits

    @classmethod
    def build(cls, grids: Iterable[torch.Tensor], heads: int, layout: ChunkLayout) -> JoinTable:
        """From :func:`chunk_similarity` grids (H_i, C, W, W) of ``heads`` heads in all, side by side.

        ``grids`` may be a generator: each grid is copied into the table as it comes, and the table
        is sorted in place, so building takes the table's own memory and one grid at a time.
        """
        width = layout.width
        lengths = torch.bincount(layout.token_chunk, minlength=layout.num_chunks)
        order = lengths.argsort(descending=True, stable=True)
        token_rank = order.argsort()[layout.token_chunk]
        active = (lengths[order][None, :] > torch.arange(width, device=lengths.device)[:, None]).sum(1).tolist()
        similarity = side_by_side(grids, heads, layout, order)  # sorted in place below
        order, token_rank = order.to(similarity.device), token_rank.to(similarity.device)
        if width > _WORD:
            return cls(order, token_rank, active, similarity, None)
        masks = torch.empty(*similarity.shape[:-1], width + 1, dtype=word_dtype(width), device=similarity.device)
        ranked = masks[..., 1:]  # which token is each row's r-th most similar
        one = torch.ones((), dtype=masks.dtype, device=masks.device)
        # A seed always joins its own cluster, even when rounding puts its self-similarity below tau.
        own = torch.bitwise_left_shift(one, torch.arange(width, device=masks.device))[:, None]  # (W, 1)
        masks[..., 0] = own[:, 0]
        for row in range(heads):  # a block of one head at a time: sort's indices are int64, and the temporaries
            for first in range(0, layout.num_chunks, CHUNK_BLOCK):
                block = (row, slice(first, first + CHUNK_BLOCK))
                values, order_of = torch.sort(similarity[block].neg_(), -1)  # most similar first
                similarity[block] = values
                bits = torch.bitwise_left_shift(one, order_of.to(masks.dtype))
                ranked[block] = bits.cumsum_(-1).bitwise_or_(own)  # distinct bits: a running sum is a running OR
                del values, order_of, bits
        return cls(order, token_rank, active, similarity, masks)

    def joins(self, tau: torch.Tensor) -> torch.Tensor:
        """Packed rows (W, K * H, C, words) of the tokens each row's token takes at ``tau`` (K, H)."""
        width = self.similarity.shape[-1]
        if self.masks is None:
            joined = pack_rows(self.similarity[None] >= tau[..., None, None, None])  # (K, H, C, W, words)
        else:
            heads, chunks = self.similarity.shape[:2]
            limit = (-tau).T[:, None, None].expand(-1, chunks, width, -1).contiguous()  # (H, C, W, K)
            taken = torch.searchsorted(self.similarity, limit, right=True)  # tokens at least tau alike, per row
            joined = self.masks.new_empty(width, len(tau), heads, chunks)
            joined.permute(2, 3, 0, 1).copy_(self.masks.gather(-1, taken))  # into the loop's layout
            return joined.flatten(1, 2)[..., None]
        joined = joined.flatten(0, 1).permute(2, 0, 1, 3).contiguous()
        # A seed always joins its own cluster, even when rounding puts its self-similarity below tau.
        own = torch.arange(width, device=joined.device)
        joined[own, ..., own // _WORD] |= torch.ones_like(own).bitwise_left_shift_(own % _WORD)[:, None, None]
        return joined


@dataclass(frozen=True, eq=False)
class Clusters:
    """The greedy clustering of R rows (thresholds x heads), kept packed until its seeds are asked for.

    Attributes
    ----------
    counts : Tensor (R,) long
        Clusters per row.
    planes : Tensor (P, R, C, words) int32 or int64 (the table's words)
        Bit ``t`` of plane ``k`` (in the chunk order of ``table``): bit ``k`` of token ``t``'s seed slot.
    """

    counts: torch.Tensor
    planes: torch.Tensor
    table: JoinTable
    layout: ChunkLayout
    protected: torch.Tensor

    def seeds(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Token index of each token's seed, (R, N) or (len(rows), N) for the ``rows`` asked for."""
        layout, device = self.layout, self.planes.device
        planes = self.planes if rows is None else self.planes[:, rows.to(device)]
        word, bit = layout.token_slot // self.table.word_bits, layout.token_slot % self.table.word_bits
        held = (planes[:, :, self.table.token_rank, word] >> bit) & 1  # (P, rows, N)
        weights = 1 << torch.arange(planes.shape[0], device=device)
        slots = torch.where(self.protected, layout.token_slot, (held * weights[:, None, None]).sum(0))
        return layout.chunk_start[layout.token_chunk] + slots


def greedy_clusters(table: JoinTable, layout: ChunkLayout, tau: torch.Tensor, protected: torch.Tensor) -> Clusters:
    """Greedy Seed-based Clustering at K thresholds per head (``tau`` (K, H)) of a :class:`JoinTable`.

    The loop runs on bit-packed rows: a chunk's tokens are the bits of one int32 word (W <= 31) or
    of ``ceil(W / 64)`` int64 words, so a step of the loop (token ``p`` of every chunk seeding a
    cluster) is a few word-wise operations over (K * H, chunks). Each token's seed slot is kept as
    bit planes (plane ``k`` holds the tokens whose seed slot has bit ``k``), unpacked by
    :meth:`Clusters.seeds`.
    """
    device = table.order.device
    joins = table.joins(tau.reshape(-1, table.similarity.shape[0]).to(device))  # (W, K * H, C, words)
    free = free_slots(layout, protected.to(device))
    unassigned = pack_rows(free[table.order], joins.dtype).expand(joins.shape[1], -1, -1).clone()  # (K * H, C, words)
    planes = unassigned.new_zeros(max(1, (layout.width - 1).bit_length()), *unassigned.shape)
    seeded = unassigned.new_zeros(unassigned.shape[:2])  # clusters each chunk's free tokens seeded
    for p, count in enumerate(table.active):
        if count == 0:
            break
        # -- token p of every chunk, if still unassigned, seeds a cluster with the free tokens like it
        left = unassigned[:, :count]
        word, bit = divmod(p, table.word_bits)
        seeding = (left[:, :, word] >> bit).bitwise_and_(1)
        seeded[:, :count].add_(seeding)
        members = joins[p, :, :count].bitwise_and(left)
        members.bitwise_and_(seeding.neg_()[..., None])  # all ones where token p is free, else 0
        left.bitwise_xor_(members)
        for plane in range(p.bit_length()):
            if p >> plane & 1:
                planes[plane, :, :count].bitwise_or_(members)
    counts = seeded.sum(1) + int(protected.sum())
    return Clusters(counts, planes, table, layout, protected)


def greedy_seed_clustering(
    similarity: torch.Tensor, layout: ChunkLayout, tau: torch.Tensor, protected: torch.Tensor
) -> torch.Tensor:
    """Seed of each token's cluster, as a token index.

    Parameters
    ----------
    similarity : Tensor (H, C, W, W)
        From :func:`chunk_similarity`.
    layout : ChunkLayout
    tau : Tensor (H,) or (K, H)
        Cosine threshold per head, or K thresholds per head clustered at once (a search's candidates).
    protected : Tensor (N,) bool
        Tokens that stay alone (their own seed, never absorbed).

    Returns
    -------
    Tensor (H, N) long, or (K * H, N) for K thresholds per head
        Token index of the seed of each token's cluster (a seed is its own seed).
    """
    table = JoinTable.build([similarity], similarity.shape[0], layout)
    return greedy_clusters(table, layout, tau, protected).seeds()


def greedy_seeds(
    similarity: torch.Tensor, chunk_lengths: torch.Tensor, free: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSC of a chunked similarity grid at K thresholds per head, by slot: the torch twin of ``gsc_cpu.cpp``.

    Parameters
    ----------
    similarity : Tensor (H, C, W, W) float32
        From :func:`chunk_similarity` (chunks in token order).
    chunk_lengths : Tensor (C,) long
        Tokens of each chunk.
    free : Tensor (C, W) bool
        Tokens that may merge (not protected; inside their chunk).
    tau : Tensor (K, H) float32
        Thresholds per head.

    Returns
    -------
    slots : Tensor (K, H, C, W) int16
        Slot of each token's seed in its chunk; a token that is not free (or past its chunk) is its own.
    counts : Tensor (K, H) long
        Clusters of the free tokens.
    """
    heads, chunks, width = similarity.shape[:3]
    chunk_ids = torch.repeat_interleave(torch.arange(chunks, device=similarity.device), chunk_lengths)
    layout = ChunkLayout.from_chunk_ids(chunk_ids)
    layout = ChunkLayout(layout.token_chunk, layout.token_slot, layout.chunk_start, width)
    protected = ~free[layout.token_chunk, layout.token_slot]
    clusters = greedy_clusters(JoinTable.build([similarity], heads, layout), layout, tau, protected)
    own = torch.arange(width, dtype=torch.int16, device=similarity.device)
    slots = own.expand(tau.numel(), chunks, width).clone()
    start = layout.chunk_start[layout.token_chunk]
    slots[:, layout.token_chunk, layout.token_slot] = (clusters.seeds() - start).to(torch.int16)
    counts = clusters.counts - int(protected.sum())
    return slots.view(*tau.shape, chunks, width), counts.view(tau.shape)


def count_clusters(seeds: torch.Tensor) -> torch.Tensor:
    """Clusters per head: tokens that are their own seed. seeds (H, N) -> (H,)."""
    return (seeds == torch.arange(seeds.shape[1], device=seeds.device)).sum(1)


def merge_clusters(keys: torch.Tensor, values: torch.Tensor, seeds: torch.Tensor):
    """Size-weighted mean key and value per cluster, padded to the head with most clusters.

    Parameters
    ----------
    keys, values : Tensor (H, N, D)
        Entries to merge (each of size 1).
    seeds : Tensor (H, N) long
        From :func:`greedy_seed_clustering`.

    Returns
    -------
    keys, values : Tensor (H, M, D)
        Cores in order of their seed; rows past a head's cluster count are zero padding.
    sizes : Tensor (H, M)
        Original tokens per core; 0 marks padding.
    """
    heads, num_tokens, dim = keys.shape
    is_seed = seeds == torch.arange(num_tokens, device=seeds.device)
    entry_of_seed = is_seed.long().cumsum(1) - 1  # (H, N): entry index, valid where is_seed
    entry = entry_of_seed.gather(1, seeds)  # (H, N)
    width = int(is_seed.sum(1).max())
    device = keys.device
    sizes = torch.zeros(heads, width, device=device).scatter_add_(
        1, entry, torch.ones(heads, num_tokens, device=device)
    )
    index = entry[..., None].expand(-1, -1, dim)
    key_sum = torch.zeros(heads, width, dim, device=device).scatter_add_(1, index, keys.float())
    value_sum = torch.zeros(heads, width, dim, device=device).scatter_add_(1, index, values.float())
    denom = sizes.clamp(min=1)[..., None]
    return (key_sum / denom).to(keys.dtype), (value_sum / denom).to(values.dtype), sizes


def tau_per_batch(tau: torch.Tensor | float, batch: int, heads: int, device: torch.device) -> torch.Tensor:
    """Thresholds as a float32 (B, H_kv) tensor, from a float, (H_kv,) or (B, H_kv)."""
    tau = torch.as_tensor(tau, dtype=torch.float32, device=device)
    if tau.shape not in ((), (heads,), (batch, heads)):
        raise ValueError(f"tau must be a float, ({heads},) or ({batch}, {heads}), got shape {tuple(tau.shape)}")
    return tau.expand(batch, heads).contiguous()


def cluster_seeds(
    keys: torch.Tensor, chunk_ids: torch.Tensor, tau: torch.Tensor | float, protected: torch.Tensor | None = None
) -> torch.Tensor:
    """GSC of one layer's keys, batched (the torch twin of the Triton clustering kernel).

    Parameters
    ----------
    keys : Tensor (B, H_kv, N, D)
        Post-RoPE keys.
    chunk_ids : Tensor (B, N) int
        Chunk of each token; a chunk is a run of equal ids (at most 512 tokens).
    tau : float or Tensor (H_kv,) or (B, H_kv)
        Cosine threshold, compared in float32 with the similarity in the keys' dtype.
    protected : Tensor (B, N) bool, optional
        Tokens that stay alone.

    Returns
    -------
    Tensor (B, H_kv, N) long
        Token index of the seed of each token's cluster.
    """
    batch, heads, num_tokens, _ = keys.shape
    tau = tau_per_batch(tau, batch, heads, keys.device)
    if protected is None:
        protected = torch.zeros(batch, num_tokens, dtype=torch.bool, device=keys.device)
    seeds = []
    for b in range(batch):
        layout = ChunkLayout.from_chunk_ids(chunk_ids[b])
        seeds.append(greedy_seed_clustering(chunk_similarity(keys[b], layout), layout, tau[b], protected[b]))
    return torch.stack(seeds)


def merge_cores(keys: torch.Tensor, values: torch.Tensor, seeds: torch.Tensor):
    """:func:`merge_clusters` over a batch: (B, H_kv, N, D) -> cores (B, H_kv, M, D), sizes (B, H_kv, M)."""
    batch, heads = keys.shape[:2]
    core_keys, core_values, sizes = merge_clusters(keys.flatten(0, 1), values.flatten(0, 1), seeds.flatten(0, 1))
    return (
        core_keys.unflatten(0, (batch, heads)),
        core_values.unflatten(0, (batch, heads)),
        sizes.unflatten(0, (batch, heads)),
    )


def semantic_cores(
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk_ids: torch.Tensor,
    tau: torch.Tensor | float,
    protected: torch.Tensor | None = None,
):
    """Cluster one layer's keys (:func:`cluster_seeds`) and merge each cluster into a semantic core.

    Returns
    -------
    seeds : Tensor (B, H_kv, N) long
    keys, values : Tensor (B, H_kv, M, D)
        Size-weighted mean key and value per core, in seed order, zero-padded to the head with most cores.
    sizes : Tensor (B, H_kv, M) float32
        Original tokens per core; 0 marks padding.
    """
    seeds = cluster_seeds(keys, chunk_ids, tau, protected)
    return (seeds, *merge_cores(keys, values, seeds))
