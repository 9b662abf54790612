"""Group codes decoded into an fp32 tensor: one function for the stored cache
(:meth:`~semanticache_rag.tensor_codes.QuantizedTensor.decode` and ``decode_into``) and the scripted decoding step
(:mod:`~semanticache_rag.scripted_step`), so that both round the same way.

This module has no ``from __future__ import annotations``: TorchScript compiles its functions.
"""

import torch


def three_bit_words(codes: torch.Tensor) -> torch.Tensor:
    """The 24-bit words (..., D / 8) int32 of 3-bit codes packed eight per three bytes (the first byte lowest)."""
    triples = codes.unflatten(-1, (-1, 3)).to(torch.int32)
    return triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)


def decode_groups_into(
    codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, bits: int, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (..., D) fp32 set to ``code * scale + minimum`` per group of channels (``scales`` and
    ``minimums`` (..., D / group)); ``codes`` as :class:`~semanticache_rag.tensor_codes.QuantizedTensor` packs
    them: one per channel at 8 bits, two per byte at 4 (even channels in the low nibble), eight per
    three bytes at 3 (the first channel lowest). Codes go straight into ``out`` as floats, then
    in-place scale and shift (2-3x faster than addcmul on the uint8 codes, with the same two roundings)."""
    if bits == 4:
        pairs = out.unflatten(-1, (-1, 2))
        pairs[..., 0] = codes & 15
        pairs[..., 1] = codes >> 4
    elif bits == 3:
        words = three_bit_words(codes)
        eights = out.unflatten(-1, (-1, 8))
        for k in range(8):
            eights[..., k] = (words >> (3 * k)) & 7
    else:
        out.copy_(codes)
    out.unflatten(-1, (scales.shape[-1], -1)).mul_(scales[..., None]).add_(minimums[..., None])
    return out
