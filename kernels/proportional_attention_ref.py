"""Proportional attention over a document cache plus appended tokens, in torch.

A compressed document cache holds *entries* that may stand for several original tokens. An entry
of size ``s`` gets ``log s`` added to its attention logit, which is exact for duplicates: ``s``
identical key/value rows attend exactly like one row with bias ``log s`` (Token Merging,
Bolya et al. 2023, https://arxiv.org/abs/2210.09461). Padding entries carry a bias of ``-inf``.

The document segment and the appended segment (question, answer and chat tokens) are kept in
separate tensors so that decoding never copies the document's keys and values; grouped-query
attention is computed by viewing the query heads as ``(kv_heads, group)`` rather than repeating
the keys per query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    # The queries are the last `num_queries` of the `num_keys` appended tokens.
    offset = num_keys - num_queries
    rows = torch.arange(num_queries, device=device)[:, None] + offset
    return torch.arange(num_keys, device=device)[None, :] <= rows  # (Q, T)


def proportional_attention(
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    doc_keys: torch.Tensor | None = None,
    doc_values: torch.Tensor | None = None,
    doc_log_sizes: torch.Tensor | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attend ``query`` to a document cache and to the appended tokens.

    Parameters
    ----------
    query : Tensor (B, H, Q, D)
        Queries of the last ``Q`` appended tokens.
    new_keys, new_values : Tensor (B, H_kv, T, D)
        Appended tokens, the queries' own tokens last (causal among themselves).
    doc_keys, doc_values : Tensor (B, H_kv, L, D), optional
        Document entries, visible to every query.
    doc_log_sizes : Tensor (B, H_kv, L), optional
        ``log s`` per document entry (``-inf`` for the padding of ragged heads); ``None`` means
        every entry is one token.
    scaling : float, optional
        Logit scale, ``D ** -0.5`` by default.

    Returns
    -------
    Tensor (B, Q, H, D)
        Attention output, in the layout transformers' attention functions return.
    """
    batch, heads, num_queries, dim = query.shape
    kv_heads = new_keys.shape[1]
    group = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    if doc_keys is None or doc_keys.shape[2] == 0:
        mask = _causal_mask(num_queries, new_keys.shape[2], query.device)
        out = F.scaled_dot_product_attention(
            query, new_keys, new_values, attn_mask=mask, scale=scaling, enable_gqa=group > 1
        )
        return out.transpose(1, 2)
    # (B, H_kv, G*Q, D): query heads h = kv_head * G + g, as transformers' repeat_kv orders them.
    q = query.reshape(batch, kv_heads, group * num_queries, dim)
    doc_scores = torch.matmul(q, doc_keys.transpose(-1, -2)).float() * scaling
    if doc_log_sizes is not None:
        doc_scores = doc_scores + doc_log_sizes[:, :, None, :].float()
    new_scores = torch.matmul(q, new_keys.transpose(-1, -2)).float() * scaling
    if num_queries > 1:  # one query (a decoding step) sees every appended token: nothing to mask
        mask = _causal_mask(num_queries, new_keys.shape[2], query.device)
        new_scores = new_scores.masked_fill(~mask.repeat(group, 1), float("-inf"))
    # -- one softmax over both segments, so the document and the new tokens compete fairly
    probs = torch.softmax(torch.cat([doc_scores, new_scores], dim=-1), dim=-1).to(query.dtype)
    num_doc = doc_keys.shape[2]
    out = torch.matmul(probs[..., :num_doc], doc_values) + torch.matmul(probs[..., num_doc:], new_values)
    return out.reshape(batch, heads, num_queries, dim).transpose(1, 2)
