"""A GGUF's codes found again in its dequantised weights, and the weight format ``"auto"`` picks from them.

The default model ships as a Q4_1 GGUF (its head a Q8_0 table) and loads dequantised to fp32: every
weight is ``code * scale + minimum`` (Q4_1) or ``code * scale`` (Q8_0) with fp16 scales and minimums.
llama.cpp quantises a group of :data:`GROUP` inputs from its smallest and largest weights (Q4_1) or its
largest magnitude (Q8_0), so the same rule applied to the dequantised weights finds the file's codes
again, and the int4 layers of :mod:`semanticache_rag.weights` hold those weights exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

GROUP = 32  # GGUF's Q4_1 and Q8_0 block


def int8_codes(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``weight`` (out, in) per group of ``group`` inputs, and their scales.

    Returns codes (out, in / group, group) and fp32 scales (out, in / group), ``w ≈ code * scale``:
    the scale is the group's largest magnitude over 127, as GGUF's Q8_0 quantises (0 for a zero group).
    """
    rows, columns = weight.shape
    blocks = weight.detach().float().reshape(rows, columns // group, group)
    scales = blocks.abs().amax(dim=-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8), scales


def group_codes(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 codes of ``weight`` (out, in): ``(codes, scales, minimums)`` with ``w ≈ codes * scale + minimum``.

    Per group of ``group`` inputs, the minimum is the group's smallest weight and the scale a
    fifteenth of its range, as llama.cpp quantises Q4_1; on weights dequantised from Q4_1 that
    finds the file's codes again (the group's smallest weight has code 0, its largest code 15).
    """
    rows, columns = weight.shape
    blocks = weight.float().reshape(rows, columns // group, group)
    low = blocks.amin(dim=-1, keepdim=True)
    scale = (blocks.amax(dim=-1, keepdim=True) - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((blocks - low) / safe).clamp(0, 15)
    return codes.reshape(rows, columns).to(torch.int32), scale.squeeze(-1), low.squeeze(-1)


def is_q8_0(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (out, in) is made of Q8_0 values exactly: per group of :data:`GROUP` inputs, an
    int8 code times the group's scale (as GGUF dequantises a Q8_0 table), the codes and scales that
    :func:`int8_codes` finds."""
    if weight.shape[1] % GROUP:
        return False
    codes, scales = int8_codes(weight, GROUP)
    return torch.equal(codes.float() * scales[..., None], weight.detach().float().reshape(codes.shape))


def is_q4_1(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (out, in) is what an int4 layer holds: the :func:`group_codes` times their scale plus
    their minimum, those two rounded to fp16 as the layer (and the GGUF) keeps them, equal to every weight."""
    if weight.shape[1] % GROUP or weight.dtype != torch.float32:
        return False
    codes, scale, low = group_codes(weight.detach())
    blocks = codes.float().unflatten(1, (-1, GROUP))
    decoded = blocks * scale.half().float()[..., None] + low.half().float()[..., None]
    return torch.equal(decoded.flatten(1), weight.detach())


def auto_weights(model: Any, decoder: list[nn.Linear], kernels: Callable[[], bool]) -> str:
    """The format ``weights="auto"`` gives ``model``, for an fp32 Llama-style model on the CPU with the C++
    ``kernels()`` built: ``"int4-exact"`` where that is the model's own arithmetic on its own weights at int4's
    memory (its ``decoder`` layers' matrices all Q4_1 values exactly, a Q4_1 GGUF dequantised as the default
    model is), else ``"fp32"`` (its own weights, each decoding step one C++ call: the same arithmetic up to the
    order of the sums, ~1.9x faster than as loaded). Any other model: ``"model"`` (as loaded)."""
    parameter = next(model.parameters(), None)
    why = None
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        why = "not an fp32 model on the CPU"
    elif not decoder:
        why = "not a Llama-style decoder"
    elif not kernels():
        why = "the C++ CPU kernels could not be built (a C++ compiler is needed)"
    if why:
        logger.info("weights='auto': as loaded (%s)", why)
        return "model"
    if all(is_q4_1(linear.weight) for linear in decoder):  # other weights fail at their first matrix
        logger.info("weights='auto': int4-exact (its weights are Q4_1 values)")
        return "int4-exact"
    logger.info("weights='auto': fp32 (its weights are not Q4_1 values: its own, decoding steps in C++)")
    return "fp32"
