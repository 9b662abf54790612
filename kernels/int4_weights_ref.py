"""Weight-only layers' products on CPUs as llama.cpp computes them, in torch (the twins of the C++ kernels).

The products quantise each input row to Q8_0 (:func:`quantize_rows`) and sum code products as integers:
Q4_1 weights (:class:`~semanticache_rag.weights.Int4Linear`: 4-bit codes, an fp16 scale and minimum per
group of 32 inputs, in a layout of their own, :func:`q4_1_layout`) and Q8_0 ones
(:class:`~semanticache_rag.weights.GroupedInt8Linear`). Many rows (reading) multiply by the decoded
Q4_1 weights instead (:func:`unpack_q4_1`). :class:`~semanticache_rag.weights.Int8Linear`'s one-row
product (int8 codes, one scale per output) stays in fp32. :mod:`.cpu_ops` builds the C++ twins
(``int4_weights_cpu.cpp``: Q4_1; ``int4_exact_weights_cpu.cpp``: Q4_1 in fp32 arithmetic;
``q8_0_weights_cpu.cpp``: Q8_0 and int8; ``fp32_weights_cpu.cpp``: one fp32 row times fp32 weights,
:func:`fp32_row_product`).
"""

from __future__ import annotations

import torch


def q4_1_layout(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (out, in) in 0..15 laid out as the Q4_1 products take them: (out / 16, in / 8, 16, 4)
    uint8, for 16 outputs and 8 consecutive inputs each output's 4 bytes, byte ``t`` holding input ``t``
    in its low half and input ``4 + t`` in its high one."""
    out_features, in_features = codes.shape
    octets = codes.to(torch.uint8).view(out_features // 16, 16, in_features // 8, 2, 4)
    return (octets[:, :, :, 0] | (octets[:, :, :, 1] << 4)).transpose(1, 2).contiguous()


def q4_1_codes(codes: torch.Tensor) -> torch.Tensor:
    """The codes (out, in) of a :func:`q4_1_layout`."""
    blocks, octets = codes.shape[:2]
    halves = torch.stack([codes & 15, codes >> 4], dim=3)  # (out / 16, in / 8, 16, 2, 4)
    return halves.permute(0, 2, 1, 3, 4).reshape(16 * blocks, 8 * octets)


def _per_output(values: torch.Tensor) -> torch.Tensor:
    """(out / 16, in / 32, 16) -> (out, in / 32) fp32."""
    return values.float().transpose(1, 2).reshape(-1, values.shape[1])


def unpack_q4_1(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """The Q4_1 weights (in, out) fp32 of a layout (``scales``, ``minimums`` fp16 (out / 16, in / 32, 16)):
    ``code * scale + minimum``."""
    grouped = q4_1_codes(codes).float().unflatten(1, (-1, 32))  # (out, in / 32, 32)
    weights = grouped * _per_output(scales)[..., None] + _per_output(minimums)[..., None]
    return weights.flatten(1).t()


def q4_1_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, in) fp32 times the Q4_1 weights, ``x`` quantised by :func:`quantize_rows`: (rows, out)
    fp32. Per output and group: scale * row scale * the integer sum of code products + minimum * the
    sum of the group's fp32 inputs, summed in fp32."""
    weight_codes = q4_1_codes(codes).unflatten(1, (-1, 32)).double()  # (out, in / 32, 32)
    input_codes, input_scales = quantize_rows(x)
    dots = torch.einsum("ogk,rgk->rog", weight_codes, input_codes.double()).float()  # exact integers
    sums = x.float().unflatten(-1, (-1, 32)).sum(-1)  # (rows, in / 32)
    scaled = _per_output(scales)[None] * input_scales[:, None, :] * dots
    return (scaled + _per_output(minimums)[None] * sums[:, None, :]).sum(-1)


def q4_1_product_fp32(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor
) -> torch.Tensor:
    """``x`` (rows, in) fp32 times the Q4_1 weights in fp32 arithmetic, ``x`` as it is: (rows, out) fp32.
    Per output and group: scale * the sum of input * code + minimum * the sum of the group's inputs."""
    weight_codes = q4_1_codes(codes).unflatten(1, (-1, 32)).float()  # (out, in / 32, 32)
    grouped = x.float().unflatten(-1, (-1, 32))  # (rows, in / 32, 32)
    dots = torch.einsum("ogk,rgk->rog", weight_codes, grouped)
    scaled = _per_output(scales)[None] * dots
    return (scaled + _per_output(minimums)[None] * grouped.sum(-1)[:, None, :]).sum(-1)


def int8_row_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (in,) fp32 times int8 ``codes`` (out, in) with one bf16 scale per output: (out,) fp32."""
    return (codes.float() @ x) * scales.float()


def fp32_row_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` (in,) fp32 times fp32 ``weight`` (out, in), as ``nn.Linear`` keeps it: (out,) fp32."""
    return weight @ x


def quantize_rows(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 of fp32 rows (rows, in), as llama.cpp quantises a layer's input: per ``group`` inputs,
    scale = largest magnitude / 127 and code = round(x / scale) (ties to even): codes (rows, in / group,
    group) int32 and scales (rows, in / group) fp32."""
    grouped = x.float().unflatten(-1, (-1, group))
    scales = grouped.abs().amax(-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(grouped / safe[..., None]).to(torch.int32), scales


def q8_0_codes(codes: torch.Tensor) -> torch.Tensor:
    """The signed codes (out, in / 32, 32) int32 of a Q8_0 layout (out / 16, in / 4, 16, 4) of code + 128."""
    blocks, quads = codes.shape[:2]
    return (codes.to(torch.int32) - 128).permute(0, 2, 1, 3).reshape(16 * blocks, 4 * quads // 32, 32)


def q8_0_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, in) fp32 times Q8_0 weights, ``x`` quantised by :func:`quantize_rows`: (rows, out) fp32.

    ``codes`` (out / 16, in / 4, 16, 4) uint8 hold code + 128, the codes of 4 consecutive inputs of 16
    outputs side by side; ``scales`` (out / 16, in / 32, 16) bf16 one per output and group of 32 inputs.
    Per output and group: weight scale * input scale * the integer sum of code products, summed in fp32.
    """
    weight_codes = q8_0_codes(codes)
    input_codes, input_scales = quantize_rows(x)
    dots = torch.einsum("ogk,rgk->rog", weight_codes.double(), input_codes.double()).float()  # exact integers
    return (_per_output(scales)[None] * input_scales[:, None, :] * dots).sum(-1)


def q8_0_product_fp32(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, in) fp32 times Q8_0 weights in fp32 arithmetic, ``x`` as it is: (rows, out) fp32.

    :func:`q8_0_product`'s ``codes``, with fp32 ``scales`` (out / 16, in / 32, 16). Per output and group:
    scale * the sum of input * code, summed over groups.
    """
    weight_codes = q8_0_codes(codes).float()
    dots = torch.einsum("ogk,rgk->rog", weight_codes, x.float().unflatten(-1, (-1, 32)))
    return (_per_output(scales)[None] * dots).sum(-1)
