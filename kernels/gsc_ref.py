"""Greedy Seed-based Clustering (GSC) of keys inside semantic chunks, and core merging, in torch.

GSC, per KV head and chunk: the first unassigned token is a seed; every later unassigned token
of the chunk whose key has cosine similarity >= tau with the seed's joins it; repeat. Each
cluster becomes one *semantic core*: size-weighted mean key and value, and its size ``s``.

Tokens are laid out as a padded (chunks, slots) grid so that one step of the greedy loop runs
for every head and chunk at once; the loop has as many steps as the longest chunk.
"""

from __future__ import annotations

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
        token_slot = torch.arange(chunk_ids.numel()) - chunk_start[token_chunk]
        return cls(token_chunk, token_slot, chunk_start, int(token_slot.max()) + 1)

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_start.numel())


def chunk_similarity(keys: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Cosine similarity of keys inside each chunk: keys (H, N, D) -> (H, C, W, W)."""
    heads, _, dim = keys.shape
    grid = keys.new_zeros(heads, layout.num_chunks, layout.width, dim)
    grid[:, layout.token_chunk, layout.token_slot] = F.normalize(keys.float(), dim=-1).to(keys.dtype)
    return grid @ grid.transpose(-1, -2)


def greedy_seed_clustering(
    similarity: torch.Tensor, layout: ChunkLayout, tau: torch.Tensor, protected: torch.Tensor
) -> torch.Tensor:
    """Seed of each token's cluster, as a token index.

    Parameters
    ----------
    similarity : Tensor (H, C, W, W)
        From :func:`chunk_similarity`.
    layout : ChunkLayout
    tau : Tensor (H,)
        Cosine threshold per head.
    protected : Tensor (N,) bool
        Tokens that stay alone (their own seed, never absorbed).

    Returns
    -------
    Tensor (H, N) long
        Token index of the seed of each token's cluster (a seed is its own seed).
    """
    heads = similarity.shape[0]
    grid_shape = (layout.num_chunks, layout.width)
    free = torch.zeros(grid_shape, dtype=torch.bool)
    free[layout.token_chunk, layout.token_slot] = ~protected
    unassigned = free.expand(heads, *grid_shape).clone()  # (H, C, W)
    seed_slot = torch.arange(layout.width).expand(heads, *grid_shape).clone()
    joins = similarity >= tau[:, None, None, None]
    for p in range(layout.width):
        # -- token p of every chunk, if still unassigned, seeds a cluster with the free tokens like it
        members = unassigned & joins[:, :, p, :] & unassigned[:, :, p, None]
        seed_slot[members] = p
        unassigned &= ~members
    slots = seed_slot[:, layout.token_chunk, layout.token_slot]  # (H, N)
    return layout.chunk_start[layout.token_chunk] + slots


def count_clusters(seeds: torch.Tensor) -> torch.Tensor:
    """Clusters per head: tokens that are their own seed. seeds (H, N) -> (H,)."""
    return (seeds == torch.arange(seeds.shape[1])).sum(1)


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
    is_seed = seeds == torch.arange(num_tokens)
    entry_of_seed = is_seed.long().cumsum(1) - 1  # (H, N): entry index, valid where is_seed
    entry = entry_of_seed.gather(1, seeds)  # (H, N)
    width = int(is_seed.sum(1).max())
    sizes = torch.zeros(heads, width).scatter_add_(1, entry, torch.ones(heads, num_tokens))
    index = entry[..., None].expand(-1, -1, dim)
    key_sum = torch.zeros(heads, width, dim).scatter_add_(1, index, keys.float())
    value_sum = torch.zeros(heads, width, dim).scatter_add_(1, index, values.float())
    denom = sizes.clamp(min=1)[..., None]
    return (key_sum / denom).to(keys.dtype), (value_sum / denom).to(values.dtype), sizes
