"""One query's attention over a document layer as it is stored, for the decoding step.

A decoding step attends one query per head to every layer's document entries. Plain layers are
multiplied as they are. A rank-``r`` layer of KV-Kaizen (``A @ B``,
:class:`~semanticache_rag.tensor_codes.LowRankTensor`) is attended through its factors,
``q . k = (q @ B^T) @ A^T`` and ``p @ v = (p @ A) @ B``, never forming the ``L x D``
product that decoding it builds (5x faster at 2,000 entries per head on a 2-core CPU).
Quantised and 16-bit layers are decoded into the conversation's scratch and multiplied: folding the
scales and minimums into the products (``q . k = sum_g s_g (q_g . c_g) + m_g sum(q_g)``) saves two
passes over the layer but needs four small products instead of two, and measured slower with torch's
CPU kernels (0.68 vs 0.41 ms per int8 layer of 2,000 entries per head, keys and values).

The results equal decode-then-attend up to the rounding of the reordered sums
(``tests/test_coded_attention.py``).
"""

from __future__ import annotations

import torch

from semanticache_rag.kv import CodedLayerKV, DecodeScratch
from semanticache_rag.tensor_codes import LowRankTensor, TensorCode

Stored = torch.Tensor | TensorCode


def stored(document) -> tuple[Stored, Stored]:
    """A document layer's keys and values as stored: tensors, or the codes of a coded layer."""
    source = getattr(document, "source", document)  # a shared layer attends to its source's storage
    if isinstance(source, CodedLayerKV):
        return source.key_code, source.value_code
    return source.keys, source.values


def scores(keys: Stored, query: torch.Tensor, scratch: DecodeScratch) -> torch.Tensor:
    """``query @ keys^T``: query (H_kv, G, D) (scaled), keys (1, H_kv, L, D) stored; returns (H_kv, G, L)."""
    if isinstance(keys, LowRankTensor):
        basis, coefficients = keys.basis[0].float(), keys.coefficients[0].float()  # (H, r, D), (H, L, r)
        return torch.bmm(torch.bmm(query, basis.transpose(1, 2)), coefficients.transpose(1, 2))
    matrix = keys[0] if isinstance(keys, torch.Tensor) else scratch.decode("keys", keys)[0]
    return torch.bmm(query, matrix.transpose(1, 2))


def mix(values: Stored, probs: torch.Tensor, out: torch.Tensor, scratch: DecodeScratch) -> torch.Tensor:
    """``out + probs @ values``: probs (H_kv, G, L), values (1, H_kv, L, D) stored, out (H_kv, G, D)."""
    if isinstance(values, LowRankTensor):
        basis, coefficients = values.basis[0].float(), values.coefficients[0].float()
        return torch.baddbmm(out, torch.bmm(probs, coefficients), basis)
    matrix = values[0] if isinstance(values, torch.Tensor) else scratch.decode("values", values)[0]
    return torch.baddbmm(out, probs, matrix)
