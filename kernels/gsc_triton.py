"""Greedy Seed-based Clustering (GSC) of one layer's keys in Triton.

Same signatures and results as :func:`.gsc_ref.cluster_seeds` and :func:`.gsc_ref.semantic_cores`.
One program per (chunk, batch and KV head): it loads the chunk's keys once, builds their cosine
similarity tile with one ``tl.dot`` (rounded to the keys' dtype, as the torch twin's grid
matmul is), and resolves the greedy loop on that tile in registers, as a fixed point that
needs one small ``tl.dot`` per slot and no reductions inside the loop. Merging clusters into
cores is a scatter-add, left to torch (:func:`.gsc_ref.merge_cores`).

Exactness: the assignment equals the torch twin's for the same tau whenever no similarity lies
within one rounding step of tau (the two sides sum the dot products in different orders).
Chunks should be at most 128 tokens wide for speed (the tile lives in registers); up to 512
works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from semanticache_rag.kernels.dispatch import interpreting
from semanticache_rag.kernels.gsc_ref import merge_cores, tau_per_batch

MAX_CHUNK_WIDTH = 512
_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _gsc_kernel(
    keys_ptr, protected_ptr, tau_ptr, chunk_start_ptr, chunk_length_ptr, seeds_ptr,
    stride_kb, stride_kh, stride_kn,  # keys (B, H_kv, N, D)
    stride_pb,  # protected (B, N) int8
    stride_tb, stride_th,  # tau (B, H_kv) float32
    stride_cb,  # chunk starts and lengths (B, C) int32
    stride_sb, stride_sh,  # seeds (B, H_kv, N) int64
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    SIM_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, MANUAL_BF16: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)  # on the grid's first axis: up to 2**31 - 1 chunks (the others stop at 65535)
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_kv_heads
    head = pid_bh % num_kv_heads
    start = tl.load(chunk_start_ptr + batch * stride_cb + chunk)
    length = tl.load(chunk_length_ptr + batch * stride_cb + chunk)  # 0 past the batch row's last chunk
    slots = tl.arange(0, BLOCK_W)
    in_chunk = slots < length
    tokens = start + slots
    dims = tl.arange(0, BLOCK_D)
    k_ptrs = keys_ptr + batch * stride_kb + head * stride_kh + tokens[:, None] * stride_kn + dims[None, :]
    k = tl.load(k_ptrs, mask=in_chunk[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)

    # -- cosine similarity as the torch twin computes it: unit keys in fp32, rounded to the keys'
    # dtype, one matmul, the result rounded to the keys' dtype again
    norm = tl.maximum(tl.sqrt_rn(tl.sum(k * k, 1)), 1e-12)
    unit = tl.div_rn(k, norm[:, None])
    if MANUAL_BF16:  # the interpreter truncates fp32 -> bf16: round to nearest even on the bits first
        bits = unit.to(tl.uint32, bitcast=True)
        unit = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    unit = unit.to(SIM_DTYPE).to(DOT_DTYPE)
    similarity = tl.dot(unit, tl.trans(unit), input_precision=DOT_PRECISION)  # (BLOCK_W, BLOCK_W)
    if MANUAL_BF16:
        bits = similarity.to(tl.uint32, bitcast=True)
        similarity = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    similarity = similarity.to(SIM_DTYPE).to(tl.float32)
    tau = tl.load(tau_ptr + batch * stride_tb + head * stride_th)
    # joins[p, j]: token j joins a cluster seeded by p; a seed always joins its own (as the torch twin)
    joins = (similarity >= tau) | (slots[:, None] == slots[None, :])

    # -- the greedy loop, restated: p *acts* as a seed at its step iff it is free (in the chunk,
    # not protected) and no earlier acting seed q < p has joins[q, p]; a free token's seed is
    # the first acting p with joins[p, j], else itself. Acting seeds are the fixed point of
    # acts = free & (acts @ joins_below == 0); k sweeps settle the first k slots, so `length`
    # sweeps settle all. Each sweep is one tl.dot, with the vector broadcast over 16 rows.
    protected = tl.load(protected_ptr + batch * stride_pb + tokens, mask=in_chunk, other=1)
    free = in_chunk & (protected == 0)
    joins_below = (joins & (slots[:, None] < slots[None, :])).to(tl.float16)  # q < p
    free_rows = tl.broadcast_to(free[None, :], (16, BLOCK_W))
    acts = free_rows
    for _ in range(0, length):
        absorbed = tl.dot(acts.to(tl.float16), joins_below)  # (16, BLOCK_W) counts, exact in fp32
        acts = free_rows & (absorbed == 0)
    acts = tl.max(acts.to(tl.int32), 0) > 0  # (BLOCK_W,): the 16 rows are equal
    first = tl.min(tl.where(acts[:, None] & joins, slots[:, None], BLOCK_W), 0)
    seed = tl.where(free & (first < BLOCK_W), first, slots)
    seeds_ptrs = seeds_ptr + batch * stride_sb + head * stride_sh + tokens
    tl.store(seeds_ptrs, (start + seed).to(tl.int64), mask=in_chunk)


_gsc_kernel_tuned = triton.autotune(
    configs=[triton.Config({}, num_warps=warps) for warps in (1, 2, 4, 8)],
    key=["HEAD_DIM", "BLOCK_W", "SIM_DTYPE"],
)(_gsc_kernel)


@dataclass(frozen=True)
class ClusterConfig:
    """Explicit launch configuration (the interpreter and tests; ``None`` autotunes on a GPU)."""

    num_warps: int = 4


def _chunks(chunk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First token and length of each chunk (runs of equal ids): chunk_ids (B, N) -> 2 x (B, C) int32."""
    starts = torch.ones_like(chunk_ids, dtype=torch.bool)
    starts[:, 1:] = chunk_ids[:, 1:] != chunk_ids[:, :-1]
    index = starts.long().cumsum(1) - 1  # (B, N) chunk of each token
    num_chunks = int(index[:, -1].max()) + 1
    ones = torch.ones_like(index, dtype=torch.int32)
    length = torch.zeros(chunk_ids.shape[0], num_chunks, dtype=torch.int32, device=chunk_ids.device)
    length.scatter_add_(1, index, ones)
    return (length.cumsum(1, dtype=torch.int32) - length).contiguous(), length


def _dot_flags(dtype: torch.dtype) -> dict:
    """The interpreter multiplies bf16 dot operands as raw integers (triton 3.9): widen them there (exact)."""
    widen = dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())
    return {
        "SIM_DTYPE": _DTYPES[dtype],
        "DOT_DTYPE": tl.float32 if widen else _DTYPES[dtype],
        "DOT_PRECISION": "ieee" if widen else "tf32",
        "MANUAL_BF16": dtype == torch.bfloat16 and interpreting(),
    }


def cluster_seeds(
    keys: torch.Tensor,
    chunk_ids: torch.Tensor,
    tau: torch.Tensor | float,
    protected: torch.Tensor | None = None,
    *,
    config: ClusterConfig | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`.gsc_ref.cluster_seeds`: keys (B, H_kv, N, D) -> seeds (B, H_kv, N) long."""
    batch, heads, num_tokens, dim = keys.shape
    assert keys.dtype in _DTYPES, f"keys dtype {keys.dtype} not in {tuple(_DTYPES)}"
    assert keys.stride(-1) == 1, "the head dimension of keys must be contiguous (stride 1)"
    assert chunk_ids.shape == (batch, num_tokens), f"chunk_ids must be ({batch}, {num_tokens})"
    assert not chunk_ids.is_floating_point() and chunk_ids.device == keys.device, "chunk_ids: int, on the keys' device"
    if protected is None:
        protected = torch.zeros(batch, num_tokens, dtype=torch.bool, device=keys.device)
    assert protected.shape == (batch, num_tokens) and protected.dtype == torch.bool, "protected must be (B, N) bool"
    chunk_start, chunk_length = _chunks(chunk_ids)
    width = int(chunk_length.max())
    assert width <= MAX_CHUNK_WIDTH, f"a chunk has {width} tokens; at most {MAX_CHUNK_WIDTH} are supported"
    thresholds = tau_per_batch(tau, batch, heads, keys.device)
    protected = protected.to(torch.int8).contiguous()
    seeds = torch.empty(batch, heads, num_tokens, dtype=torch.long, device=keys.device)
    if config is None and interpreting():
        config = ClusterConfig()
    kernel = _gsc_kernel_tuned if config is None else _gsc_kernel
    launch = {} if config is None else {"num_warps": config.num_warps}
    kernel[(chunk_start.shape[1], batch * heads)](
        keys, protected, thresholds, chunk_start, chunk_length, seeds, *keys.stride()[:3], protected.stride(0),
        *thresholds.stride(), chunk_start.stride(0), *seeds.stride()[:2], heads, HEAD_DIM=dim,
        BLOCK_W=max(16, triton.next_power_of_2(width)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        **_dot_flags(keys.dtype), **launch,
    )  # fmt: skip
    return seeds


def semantic_cores(
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk_ids: torch.Tensor,
    tau: torch.Tensor | float,
    protected: torch.Tensor | None = None,
    *,
    config: ClusterConfig | None = None,
):
    """Triton twin of :func:`.gsc_ref.semantic_cores`: clustering in Triton, merging in torch."""
    assert values.shape == keys.shape and values.dtype == keys.dtype, "values must match keys in shape and dtype"
    seeds = cluster_seeds(keys, chunk_ids, tau, protected, config=config)
    return (seeds, *merge_cores(keys, values, seeds))
