"""A layer's int4 weights, as torch's CPU int4 kernel packs them, decoded to fp32, in torch.

``torch._convert_weight_to_int4pack_for_cpu`` packs a layer's codes (out, in) in blocks of
``block`` outputs: each block is ``in`` rows of ``block / 2`` bytes, output ``j`` of the block in
the low half-byte and output ``j + block / 2`` in the high one. That layout is torch's own and not
documented, so :class:`~semanticache_rag.weights.Int4Linear` checks it against the codes it packed
(:func:`unpack_codes`) before it decodes by it. :mod:`.cpu_ops` builds the C++ twins
(``int4_weights_cpu.cpp``): the decoding in one pass instead of four, and the one-row products of
int4 and of int8 codes (:class:`~semanticache_rag.weights.Int8Linear`'s, one scale per output) in fp32.
"""

from __future__ import annotations

import torch


def unpack_codes(packed: torch.Tensor, out_features: int, block: int) -> torch.Tensor:
    """The codes (in, out) uint8 in 0..15 of ``packed`` (out, in / 2)."""
    in_features = 2 * packed.numel() // out_features
    grid = packed.view(out_features // block, in_features, block // 2)
    codes = torch.stack([grid & 15, grid >> 4], dim=2)  # (out / block, in, 2, block / 2)
    return codes.permute(1, 0, 2, 3).reshape(in_features, out_features)


def unpack_int4_weight(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int, block: int
) -> torch.Tensor:
    """The weights (in, out) fp32 that torch's int4 kernel multiplies by: ``(code - 8) * scale + zero``
    per group of ``in / scales_and_zeros.shape[0]`` inputs (``scales_and_zeros`` (in / group, out, 2) bf16)."""
    codes = unpack_codes(packed, out_features, block)
    in_features, groups = codes.shape[0], scales_and_zeros.shape[0]
    scales, zeros = scales_and_zeros.float().unbind(-1)  # (in / group, out) each
    grouped = codes.view(groups, in_features // groups, out_features).float() - 8
    return torch.addcmul(zeros[:, None], grouped, scales[:, None]).view(in_features, out_features)


def int4_row_product(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int, block: int
) -> torch.Tensor:
    """``x`` (in,) fp32 times those weights: (out,) fp32 (decoding's one-row product)."""
    return x @ unpack_int4_weight(packed, scales_and_zeros, out_features, block)


def int8_row_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (in,) fp32 times int8 ``codes`` (out, in) with one bf16 scale per output: (out,) fp32."""
    return (codes.float() @ x) * scales.float()
