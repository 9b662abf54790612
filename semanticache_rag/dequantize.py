"""Group codes decoded into an fp32 tensor: one function for the stored cache
(:meth:`~semanticache_rag.kv.QuantizedTensor.decode_into`) and the scripted decoding step
(:mod:`~semanticache_rag.scripted_step`), so that both round the same way.

This module has no ``from __future__ import annotations``: TorchScript compiles its function.
"""

import torch


def decode_groups_into(
    codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, nibbles: bool, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (..., D) fp32 set to ``code * scale + minimum`` per group of channels (``scales`` and
    ``minimums`` (..., D / group)); ``codes`` one per channel (..., D), or two per byte (..., D / 2) when
    ``nibbles`` (even channels in the low nibble). Float codes, then in-place scale and shift."""
    if nibbles:
        pairs = out.unflatten(-1, (-1, 2))
        pairs[..., 0] = codes & 15
        pairs[..., 1] = codes >> 4
    else:
        out.copy_(codes)
    out.unflatten(-1, (scales.shape[-1], -1)).mul_(scales[..., None]).add_(minimums[..., None])
    return out
