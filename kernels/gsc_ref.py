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
    tau : Tensor (H,) or (K, H)
        Cosine threshold per head, or K thresholds per head clustered at once (a search's candidates).
    protected : Tensor (N,) bool
        Tokens that stay alone (their own seed, never absorbed).

    Returns
    -------
    Tensor (H, N) long, or (K * H, N) for K thresholds per head
        Token index of the seed of each token's cluster (a seed is its own seed).
    """
    tau = tau.reshape(-1, similarity.shape[0])  # (K, H)
    device = similarity.device
    # Chunks longest first, so that step p of the greedy loop runs over the prefix of chunks that
    # have a token p (padding slots are never free: skipping them changes nothing, and saves work).
    lengths = torch.bincount(layout.token_chunk, minlength=layout.num_chunks)
    order = lengths.argsort(descending=True, stable=True)
    active = (lengths[order][None, :] > torch.arange(layout.width, device=device)[:, None]).sum(1).tolist()
    # A seed always joins its own cluster, even when rounding puts its self-similarity below tau.
    eye = torch.eye(layout.width, dtype=torch.bool, device=device)
    joins = ((similarity[:, order][None] >= tau[..., None, None, None]) | eye).flatten(0, 1)  # (K * H, C, W, W)
    heads = joins.shape[0]
    joins = joins.permute(2, 0, 1, 3).contiguous()  # (W, K * H, C, W): step p reads one contiguous block
    grid_shape = (layout.num_chunks, layout.width)
    free = torch.zeros(grid_shape, dtype=torch.bool, device=device)
    free[layout.token_chunk, layout.token_slot] = ~protected
    unassigned = free[order].expand(heads, *grid_shape).clone()  # (K * H, C, W)
    seed_slot = torch.arange(layout.width, device=device).expand(heads, *grid_shape).clone()
    for p, count in enumerate(active):
        if count == 0:
            break
        # -- token p of every chunk, if still unassigned, seeds a cluster with the free tokens like it
        left = unassigned[:, :count]
        members = joins[p, :, :count] & left[:, :, p, None]
        members &= left
        seed_slot[:, :count].masked_fill_(members, p)
        left &= ~members
    seed_slot = seed_slot[:, order.argsort()]
    slots = seed_slot[:, layout.token_chunk, layout.token_slot]  # (H, N)
    return layout.chunk_start[layout.token_chunk] + slots


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
