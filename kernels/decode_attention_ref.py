"""One query token's attention over a stored document layer plus the appended tokens, in torch.

The decoding step attends one query per head to each layer's document entries as they are stored
(fp32; fp16 or bf16; 8/4/3-bit group codes with fp16 scales and minimums, as
:class:`~semanticache_rag.tensor_codes.QuantizedTensor` packs them), with ``log s`` per entry, and to the
tokens appended since (question, answer). This twin decodes coded layers into fp32 and multiplies;
:mod:`.cpu_ops` computes the same in one pass without the decoded copy.
"""

from __future__ import annotations

import torch

from semanticache_rag.dequantize import decode_groups_into
from semanticache_rag.kernels.int4_weights_ref import quantize_rows

#: ``bits`` of a stored side: 32 fp32 rows, 16 fp16/bf16 rows, 8/4/3 group codes.
BITS = (32, 16, 8, 4, 3)


def decoded(data: torch.Tensor, scales: torch.Tensor | None, minimums: torch.Tensor | None, bits: int, dim: int):
    """The stored rows ``data`` (H, L, ...) as fp32 (H, L, ``dim``)."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if bits == 32:
        return data
    if bits == 16:
        return data.float()
    if scales is None or minimums is None:
        raise ValueError(f"{bits}-bit codes need their scales and minimums")
    out = torch.empty(*data.shape[:2], dim, dtype=torch.float32, device=data.device)
    return decode_groups_into(data, scales, minimums, bits, out)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor | None,
    key_minimums: torch.Tensor | None,
    key_bits: int,
    values: torch.Tensor,
    value_scales: torch.Tensor | None,
    value_minimums: torch.Tensor | None,
    value_bits: int,
    bias: torch.Tensor | None,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    q8_query: bool = False,
) -> torch.Tensor:
    """Attention of one token's queries over document entries and appended tokens.

    Parameters
    ----------
    query : Tensor (H_kv, G, D) float32
        The token's queries, already scaled; query head ``h * G + g`` shares kv head ``h``.
    keys, values : Tensor (H_kv, L, D) or codes (H_kv, L, D * bits / 8) uint8
        The document layer as stored, ``key_bits`` / ``value_bits`` (:data:`BITS`) bits per channel.
    key_scales, key_minimums, value_scales, value_minimums : Tensor (H_kv, L, D / group) float16 or None
        The codes' scale and minimum per group of channels (``None`` for 32 and 16 bits).
    bias : Tensor (H_kv, L) float32 or None
        ``log s`` per document entry, ``-inf`` for padding; ``None``: every entry is one token.
    new_keys, new_values : Tensor (H_kv, T, D) float32
        The appended tokens, the querying token's own last.
    q8_query : bool
        Coded document keys (8/4/3 bits) are scored against the query rounded to Q8_0 (:func:`rounded_query`),
        as llama.cpp scores a quantised K cache; the appended tokens meet the query as it is. The C++ kernel
        also weighs 8-bit and paired 4-bit values in integers then (``kernels/attention_values_int.h``: each
        weight * scale rounded to 15 bits against its pass's largest), which this twin does not: within 2^-10 of
        the largest group's range of it, beyond rounding.

    Returns
    -------
    Tensor (H_kv, G, D) float32
    """
    dim = query.shape[-1]
    doc_keys = decoded(keys, key_scales, key_minimums, key_bits, dim)
    doc_values = decoded(values, value_scales, value_minimums, value_bits, dim)
    doc_query = rounded_query(query) if q8_query and key_bits <= 8 else query
    doc_scores = torch.bmm(doc_query, doc_keys.transpose(1, 2))
    if bias is not None:
        doc_scores += bias[:, None]
    probs = torch.softmax(torch.cat([doc_scores, torch.bmm(query, new_keys.transpose(1, 2))], dim=-1), dim=-1)
    length = doc_scores.shape[-1]
    return torch.baddbmm(torch.bmm(probs[..., length:], new_values), probs[..., :length], doc_values)


def rounded_query(query: torch.Tensor) -> torch.Tensor:
    """``query`` (..., D) rounded to Q8_0 as llama.cpp rounds a layer's input (:func:`quantize_rows`: blocks of 32
    channels, the whole head where D < 32): code * scale."""
    dim = query.shape[-1]
    codes, scales = quantize_rows(query.reshape(-1, dim), min(dim, 32))
    return (codes.float() * scales[..., None]).reshape(query.shape)
