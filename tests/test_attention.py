"""Proportional attention (torch path) against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from semanticache_rag.kernels.proportional_attention_ref import proportional_attention


def naive(query, new_k, new_v, doc_k=None, doc_v=None, doc_bias=None):
    """Repeat K/V per query head and softmax over [document, appended] with explicit masks."""
    group = query.shape[1] // new_k.shape[1]
    keys = new_k if doc_k is None else torch.cat([doc_k, new_k], 2)
    values = new_v if doc_v is None else torch.cat([doc_v, new_v], 2)
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    q_len, t_len, l_len = query.shape[2], new_k.shape[2], 0 if doc_k is None else doc_k.shape[2]
    scores = query @ keys.transpose(-1, -2) / math.sqrt(query.shape[-1])
    bias = torch.zeros(*new_k.shape[:2], l_len + t_len)
    if doc_bias is not None:
        bias[..., :l_len] = doc_bias
    scores = scores + bias.repeat_interleave(group, 1)[:, :, None, :]
    causal = torch.ones(q_len, t_len, dtype=torch.bool).tril(t_len - q_len)
    scores[..., l_len:] = scores[..., l_len:].masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2)


@pytest.mark.parametrize(
    "heads,kv_heads,q_len,t_len,l_len,dim",
    [(6, 2, 1, 5, 77, 16), (9, 3, 7, 11, 33, 64), (4, 4, 3, 3, 0, 8), (8, 2, 13, 13, 0, 32)],
)
def test_matches_naive(heads, kv_heads, q_len, t_len, l_len, dim):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, q_len, dim, generator=g)
    nk, nv = torch.randn(2, kv_heads, t_len, dim, generator=g), torch.randn(2, kv_heads, t_len, dim, generator=g)
    dk, dv = torch.randn(2, kv_heads, l_len, dim, generator=g), torch.randn(2, kv_heads, l_len, dim, generator=g)
    bias = torch.rand(2, kv_heads, l_len, generator=g).mul(3).log()
    got = proportional_attention(q, nk, nv, dk, dv, bias)
    torch.testing.assert_close(got, naive(q, nk, nv, dk, dv, bias if l_len else None), atol=1e-5, rtol=1e-4)


def test_duplicates_equal_one_entry_with_log_size():
    """s identical key/value rows attend exactly like one row with bias log s (GQA 3:1, odd sizes)."""
    g = torch.Generator().manual_seed(1)
    q, dim = torch.randn(1, 9, 3, 64, generator=g), 64
    nk, nv = torch.randn(1, 3, 3, dim, generator=g), torch.randn(1, 3, 3, dim, generator=g)
    k, v = torch.randn(1, 3, 5, dim, generator=g), torch.randn(1, 3, 5, dim, generator=g)
    sizes = torch.tensor([1, 4, 2, 7, 3])
    expanded = proportional_attention(q, nk, nv, k.repeat_interleave(sizes, 2), v.repeat_interleave(sizes, 2))
    merged = proportional_attention(q, nk, nv, k, v, sizes.float().log().expand(1, 3, 5))
    torch.testing.assert_close(merged, expanded, atol=1e-5, rtol=1e-4)


def test_padding_entries_are_ignored():
    g = torch.Generator().manual_seed(2)
    q, nk, nv = (
        torch.randn(1, 4, 1, 8, generator=g),
        torch.randn(1, 2, 1, 8, generator=g),
        torch.randn(1, 2, 1, 8, generator=g),
    )
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    bias = torch.zeros(1, 2, 6)
    bias[:, 1, 4:] = float("-inf")  # head 1 has only 4 real entries
    padded = proportional_attention(q, nk, nv, k, v, bias)
    head1 = proportional_attention(q[:, 2:], nk[:, 1:], nv[:, 1:], k[:, 1:, :4], v[:, 1:, :4])
    torch.testing.assert_close(padded[:, :, 2:], head1)
