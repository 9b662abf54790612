"""Proportional attention decode in Triton: split-KV flash decoding over a compressed cache.

Same signature and semantics as :func:`.proportional_attention_ref.proportional_attention`.
Two segments feed one softmax: the document entries (bias ``log s``, ``-inf`` for padding,
optional ragged per-head lengths) and the appended tokens (causal among the queries' own tokens).

Phase 1 (``_segment_kernel``, launched once per segment): one program per (batch, KV head,
split of the segment, block of query rows). The query rows of a program are every query head of
its KV head times every query token (row = g * Q + q), so each key/value block is loaded once
for its whole group: grouped-query attention without K/V copies. Online softmax inside the
split; the program writes its normalised partial output and its log-sum-exp (base 2).
Phase 2 (``_combine_kernel``): merges the splits of both segments by their log-sum-exp
(flash decoding, Dao et al. 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from semanticache_rag.kernels.dispatch import interpreting

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _segment_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_qq,  # query (B, H, Q, D)
    stride_kb, stride_kh, stride_kn,  # keys (B, H_kv, N, D)
    stride_vb, stride_vh, stride_vn,  # values (B, H_kv, N, D)
    stride_bb, stride_bh, stride_bn,  # log sizes (B, H_kv, N)
    stride_pbh, stride_ps, stride_pm,  # partial outputs (B * H_kv, splits, rows, D)
    stride_lse_bh, stride_lse_s,  # partial log-sum-exps (B * H_kv, splits, rows)
    num_kv_heads, num_queries, num_entries, split_size, split_offset, causal_offset,
    qk_scale,  # scaling * log2(e): the softmax runs in base 2
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_split = tl.program_id(1)
    pid_m = tl.program_id(2)
    batch = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads

    # -- query rows of this program: row = g * Q + q, query head = kv_head * GROUP + g
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * num_queries
    q_index = rows % num_queries
    heads = kv_head * GROUP + rows // num_queries
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_ptrs = q_ptr + batch * stride_qb + heads[:, None] * stride_qh + q_index[:, None] * stride_qq + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)

    # -- entries of this split: [start, stop) (ragged heads are padded, their padding's bias is -inf)
    start = pid_split * split_size
    stop = tl.minimum(start + split_size, num_entries)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for block_start in range(start, stop, BLOCK_N):
        cols = block_start + tl.arange(0, BLOCK_N)
        col_ok = cols < stop
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kn + dims[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        visible = row_ok[:, None] & col_ok[None, :]
        if HAS_BIAS:
            bias = tl.load(
                bias_ptr + batch * stride_bb + kv_head * stride_bh + cols * stride_bn, mask=col_ok, other=0.0
            )
            scores += bias.to(tl.float32)[None, :] * 1.4426950408889634  # log s, in base 2
        if CAUSAL:
            visible = visible & (cols[None, :] <= q_index[:, None] + causal_offset)
        scores = tl.where(visible, scores, float("-inf"))

        # -- update m_i, l_i; a row that has seen only -inf so far keeps a finite reference of 0
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    # -- partial result of the split: normalised output and log2-sum-exp (-inf when nothing was visible)
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    split = split_offset + pid_split
    part = part_out_ptr + pid_bh * stride_pbh + split * stride_ps + rows[:, None] * stride_pm + dims[None, :]
    tl.store(part, out, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + pid_bh * stride_lse_bh + split * stride_lse_s + rows, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pbh, stride_ps, stride_pm,  # partial outputs (B * H_kv, splits, rows, D)
    stride_lse_bh, stride_lse_s,  # partial log-sum-exps (B * H_kv, splits, rows)
    stride_ob, stride_oq, stride_oh,  # output (B, Q, H, D)
    num_kv_heads, num_queries, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    MANUAL_BF16: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    batch = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * num_queries
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):
        lse = tl.load(
            part_lse_ptr + pid_bh * stride_lse_bh + split * stride_lse_s + rows, mask=row_ok, other=float("-inf")
        )
        part = part_out_ptr + pid_bh * stride_pbh + split * stride_ps + rows[:, None] * stride_pm + dims[None, :]
        out = tl.load(part, mask=mask, other=0.0)
        # -- log-sum-exp merge of one more split
        m_new = tl.maximum(m_i, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        weight = tl.exp2(lse - m_ref)
        l_i = l_i * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * out
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    q_index = rows % num_queries
    heads = kv_head * GROUP + rows // num_queries
    out_ptrs = out_ptr + batch * stride_ob + q_index[:, None] * stride_oq + heads[:, None] * stride_oh + dims[None, :]
    if MANUAL_BF16:  # the interpreter truncates fp32 -> bf16: round to nearest even on the bits first
        bits = out.to(tl.uint32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


_segment_kernel_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_n in (64, 128)
        for warps in (4, 8)
        for stages in (2, 3)
    ],
    key=["GROUP", "HEAD_DIM", "BLOCK_M", "HAS_BIAS", "CAUSAL"],
)(_segment_kernel)


@dataclass(frozen=True)
class DecodeConfig:
    """Explicit launch configuration (the interpreter and tests; ``None`` autotunes on a GPU).

    ``split_size`` entries per program along the sequence (a multiple of ``block_n``); ``None``
    picks enough splits to fill the device.
    """

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    split_size: int | None = None


_SPLIT_QUANTUM = 128  # largest BLOCK_N the autotuner tries: splits stay whole blocks


@dataclass(frozen=True)
class _Segment:
    """One segment of the softmax: document entries, or appended tokens (causal)."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor | None
    causal: bool


def _split_size(entries: int, programs_per_split: int, device: torch.device, config: DecodeConfig | None) -> int:
    """Entries per split: the config's, else about four programs per SM (whole quanta; one split off GPU)."""
    if config is not None and config.split_size:
        return config.split_size
    if device.type != "cuda":
        return max(_SPLIT_QUANTUM, entries)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, triton.cdiv(4 * sms, programs_per_split))
    return max(2 * _SPLIT_QUANTUM, triton.cdiv(triton.cdiv(entries, splits), _SPLIT_QUANTUM) * _SPLIT_QUANTUM)


def _dot_flags(dtype: torch.dtype) -> dict:
    """Dot operand dtype and precision: fp16 stays fp16; bf16 and fp32 go through fp32 dots.

    bf16 widened to fp32 is exact for q, k and v, and keeps the probabilities at tf32's 10-bit
    mantissa instead of bf16's 7 bits (decode is memory-bound, so the slower tf32 MMA costs
    nothing measurable). It also sidesteps the interpreter, whose ``tl.dot`` multiplies bf16
    operands as raw 16-bit integers (triton 3.9). fp32 uses IEEE dots, as torch's matmul does.
    """
    if dtype == torch.float16:
        return {"DOT_PRECISION": "tf32", "DOT_DTYPE": tl.float16}
    exact = dtype == torch.float32 or interpreting()
    return {"DOT_PRECISION": "ieee" if exact else "tf32", "DOT_DTYPE": tl.float32}


def _check(query, new_keys, new_values, doc_keys, doc_values, doc_log_sizes) -> None:
    batch, heads, num_queries, dim = query.shape
    assert query.dtype in _DTYPES, f"query dtype {query.dtype} not in {_DTYPES}"
    kv_heads, num_new = new_keys.shape[1], new_keys.shape[2]
    assert heads % kv_heads == 0, f"{heads} query heads are not a multiple of {kv_heads} KV heads"
    assert new_keys.shape == new_values.shape == (batch, kv_heads, num_new, dim), "new K/V must be (B, H_kv, T, D)"
    assert num_new >= num_queries, f"{num_queries} queries but only {num_new} appended tokens"
    tensors = [query, new_keys, new_values]
    if doc_keys is not None:
        shape = (batch, kv_heads, doc_keys.shape[2], dim)
        assert doc_keys.shape == doc_values.shape == shape, f"document K/V must be {shape}"
        tensors += [doc_keys, doc_values]
        if doc_log_sizes is not None:
            assert doc_log_sizes.shape == shape[:3], f"doc_log_sizes must be {shape[:3]}"
            assert doc_log_sizes.is_floating_point(), "doc_log_sizes must be a float tensor"
    for t in tensors + ([doc_log_sizes] if doc_log_sizes is not None else []):
        assert t.device == query.device, f"device mismatch: {t.device} vs query {query.device}"
    for t in tensors:
        assert t.dtype == query.dtype, f"dtype mismatch: {t.dtype} vs query {query.dtype}"
        assert t.stride(-1) == 1, "the head dimension must be contiguous (stride 1)"


def proportional_attention(
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    doc_keys: torch.Tensor | None = None,
    doc_values: torch.Tensor | None = None,
    doc_log_sizes: torch.Tensor | None = None,
    scaling: float | None = None,
    *,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`.proportional_attention_ref.proportional_attention` (same arguments).

    ``config`` fixes the launch configuration; without it a GPU autotunes and the interpreter
    uses ``DecodeConfig()``. Returns (B, Q, H, D) in the query's dtype.
    """
    if doc_keys is not None and doc_keys.shape[2] == 0:
        doc_keys = doc_values = doc_log_sizes = None
    _check(query, new_keys, new_values, doc_keys, doc_values, doc_log_sizes)
    batch, heads, num_queries, dim = query.shape
    kv_heads = new_keys.shape[1]
    if config is None and interpreting():
        config = DecodeConfig()
    block_m = max(16, min(64, triton.next_power_of_2(heads // kv_heads * num_queries)))
    row_blocks = triton.cdiv(heads // kv_heads * num_queries, block_m)
    segments = [_Segment(new_keys, new_values, None, causal=True)]
    if doc_keys is not None and doc_values is not None:
        segments.insert(0, _Segment(doc_keys, doc_values, doc_log_sizes, causal=False))
    sizes = [_split_size(s.keys.shape[2], batch * kv_heads * row_blocks, query.device, config) for s in segments]
    counts = [triton.cdiv(s.keys.shape[2], size) for s, size in zip(segments, sizes)]
    part_out = torch.empty(batch * kv_heads, sum(counts), row_blocks * block_m, dim, device=query.device)
    part_lse = torch.empty(batch * kv_heads, sum(counts), row_blocks * block_m, device=query.device)
    common = dict(GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(dim)))
    scale = (dim**-0.5 if scaling is None else scaling) * _LOG2E
    offset = 0
    for segment, size, count in zip(segments, sizes, counts):
        grid = (batch * kv_heads, count, row_blocks)
        _launch_segment(grid, segment, query, part_out, part_lse, size, offset, scale, common, config)
        offset += count
    out = torch.empty(batch, num_queries, heads, dim, dtype=query.dtype, device=query.device)
    # fmt: off
    _combine_kernel[(batch * kv_heads, row_blocks)](
        part_out, part_lse, out,
        *part_out.stride()[:3], *part_lse.stride()[:2], *out.stride()[:3],
        kv_heads, num_queries, offset,
        **common, MANUAL_BF16=query.dtype == torch.bfloat16 and interpreting(),
    )
    # fmt: on
    return out


def _launch_segment(grid, segment, query, part_out, part_lse, split_size, split_offset, scale, common, config):
    """Phase 1 over one segment: partial outputs at splits ``split_offset ...`` of the buffers."""
    keys, values, bias = segment.keys, segment.values, segment.bias
    num_queries, num_entries = query.shape[2], keys.shape[2]
    # fmt: off
    args = (
        query, keys, values, bias if bias is not None else keys,
        part_out, part_lse,
        *query.stride()[:3], *keys.stride()[:3], *values.stride()[:3],
        *(bias.stride() if bias is not None else (0, 0, 0)),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        query.shape[1] // common["GROUP"], num_queries, num_entries, split_size, split_offset,
        num_entries - num_queries, scale,
    )
    # fmt: on
    flags = dict(HAS_BIAS=bias is not None, CAUSAL=segment.causal, **common)
    flags.update(_dot_flags(query.dtype))
    if config is None:
        _segment_kernel_tuned[grid](*args, **flags)
    else:
        launch = dict(BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages)
        _segment_kernel[grid](*args, **flags, **launch)
