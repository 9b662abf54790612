"""A layer's int4 weights, as torch's CPU int4 kernel packs them, decoded to fp32, in torch.

``torch._convert_weight_to_int4pack_for_cpu`` packs a layer's codes (out, in) in blocks of
``block`` outputs: each block is ``in`` rows of ``block / 2`` bytes, output ``j`` of the block in
the low half-byte and output ``j + block / 2`` in the high one. That layout is torch's own and not
documented, so :class:`~semanticache_rag.weights.Int4Linear` checks it against the codes it packed
(:func:`unpack_codes`) before it decodes by it. :mod:`.cpu_ops` builds the C++ twins
(``int4_weights_cpu.cpp``): the decoding in one pass instead of four, and the one-row products of
int4 and of int8 codes (:class:`~semanticache_rag.weights.Int8Linear`'s, one scale per output) in fp32, and the
product of Q8_0 weights (:class:`~semanticache_rag.weights.GroupedInt8Linear`) by Q8_0-quantised rows.
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


def quantize_rows(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 of fp32 rows (rows, in), as llama.cpp quantises a layer's input: per ``group`` inputs,
    scale = largest magnitude / 127 and code = round(x / scale) (ties to even): codes (rows, in / group,
    group) int32 and scales (rows, in / group) fp32."""
    grouped = x.float().unflatten(-1, (-1, group))
    scales = grouped.abs().amax(-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(grouped / safe[..., None]).to(torch.int32), scales


def q8_0_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, in) fp32 times Q8_0 weights, ``x`` quantised by :func:`quantize_rows`: (rows, out) fp32.

    ``codes`` (out / 16, in / 4, 16, 4) uint8 hold code + 128, the codes of 4 consecutive inputs of 16
    outputs side by side; ``scales`` (out / 16, in / 32, 16) bf16 one per output and group of 32 inputs.
    Per output and group: weight scale * input scale * the integer sum of code products, summed in fp32.
    """
    blocks, quads = codes.shape[:2]
    groups = 4 * quads // 32
    weight_codes = (codes.to(torch.int32) - 128).permute(0, 2, 1, 3).reshape(16 * blocks, groups, 32)
    input_codes, input_scales = quantize_rows(x)
    dots = torch.einsum("ogk,rgk->rog", weight_codes.double(), input_codes.double()).float()  # exact integers
    weight_scales = scales.float().permute(0, 2, 1).reshape(16 * blocks, groups)
    return (weight_scales[None] * input_scales[:, None, :] * dots).sum(-1)
