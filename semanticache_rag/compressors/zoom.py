"""Zoom-in, shared by SeKV's indexes: score a document's entries against a question, choose what to
rebuild within a budget, and build the question's working cache with the chosen entries masked and
their tokens rebuilt in front of it. The document cache itself never changes.

The indexes (:class:`~semanticache_rag.compressors.span_index.SpanIndex` over surprisal spans,
:class:`~semanticache_rag.compressors.core_index.CoreIndex` over SemantiCache's cores) decide what a
question scores and how their host copies are rebuilt; :mod:`.sekv` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from semanticache_rag.kv import ConversationKV, LayerKV
from semanticache_rag.rotation import rotate_keys


@dataclass(frozen=True, eq=False)
class ZoomInfo:
    """What zooming did for one question (reported on the :class:`~semanticache_rag.Answer`)."""

    spans_expanded: int
    tokens_reconstructed: int
    device_bytes: int


def question_attention(engine, layers, start: int, tail: list[int], each) -> None:
    """Run ``tail`` once over document ``layers`` from position ``start``; call ``each(layer_idx, attention)``
    with the attention (H_kv, E) each document entry gets in that layer, max over the question's tokens and
    the query heads of a KV head."""

    def observe(layer_idx, query, document, scaling):
        batch, heads, num_queries, dim = query.shape
        kv_heads = document.keys.shape[1]
        q = query.reshape(batch, kv_heads, -1, dim)
        logits = (q @ document.keys.transpose(-1, -2)).float() * scaling
        if document.log_sizes is not None:
            logits = logits + document.log_sizes[:, :, None, :]
        each(layer_idx, torch.softmax(logits, -1).amax(dim=(0, 2)).cpu())

    kv = ConversationKV(layers)
    kv.observe = observe
    engine.forward(kv, tail, start)


def entry_scores(engine, cache, tail: list[int]) -> torch.Tensor:
    """Attention each document entry of ``cache`` gets from ``tail`` (E,): max over heads and tokens,
    summed over layers (the question runs once over the summary)."""
    total = torch.zeros(cache.layers[0].keys.shape[2])
    question_attention(
        engine, cache.layers, cache.positions, tail, lambda layer_idx, attention: total.add_(attention.amax(0))
    )
    return total


def select_spans(scores: torch.Tensor, length: torch.Tensor, budget: int) -> torch.Tensor:
    """Entries of multi-token spans (``length`` > 1) by score, highest first, while their tokens fit ``budget``."""
    candidates = (length > 1).nonzero()[:, 0]
    order = candidates[scores[candidates].argsort(descending=True)].tolist()
    lengths, chosen, used = length.tolist(), [], 0
    for entry in order:
        if used + lengths[entry] <= budget:
            chosen.append(entry)
            used += lengths[entry]
    return torch.tensor(chosen, dtype=torch.long)


def zoomed_kv(cache, selected: torch.Tensor, rebuilt, tail_len: int, keep=None):
    """The working cache with ``selected`` summary entries masked and their ``rebuilt`` tokens in front of the tail.

    ``keep`` (one (H, E) bool mask per layer) masks per layer and head instead, for summaries whose
    entries differ between heads (:class:`CoreIndex`).
    """
    count = 0 if rebuilt is None else rebuilt[0].shape[2]
    if keep is None:
        masked = torch.ones(cache.layers[0].keys.shape[2], dtype=torch.bool)
        masked[selected] = False
        keep = [masked] * len(cache.layers)
    layers = []
    for layer, mask in zip(cache.layers, keep):
        sizes = layer.sizes if layer.sizes is not None else layer.keys.new_ones(layer.keys.shape[:3], dtype=torch.int16)
        layers.append(LayerKV(layer.keys, layer.values, sizes * mask.to(sizes)))
    kv = ConversationKV(layers, capacity=count + tail_len + 256)
    if rebuilt is not None:
        for index, layer in enumerate(kv.layers):
            layer.update(rebuilt[0][index][None], rebuilt[1][index][None])
        kv.prefix_length = count
    extra = sum(layer.nbytes - layer.keys.nbytes - layer.values.nbytes for layer in layers)  # the masked sizes
    extra += 0 if rebuilt is None else rebuilt[0].nbytes * 2
    return kv, ZoomInfo(int(selected.numel()), count, cache.nbytes + extra)


def reconstruct_sections(parts, selected: torch.Tensor, inv_freqs: list[torch.Tensor], device, dtype):
    """Token-level keys and values of the ``selected`` entries of spliced sections, per layer: (L, H, T, D)
    each, or None. ``parts``: (first entry of the section, its index (``length``, ``reconstruct``), how far
    its keys moved); rebuilt keys move the same way, per layer's RoPE."""
    keys, values = [], []
    for first, index, delta in parts:
        local = selected[(selected >= first) & (selected < first + index.length.numel())] - first
        rebuilt = index.reconstruct(local, device, dtype) if local.numel() else None
        if rebuilt is not None:
            keys.append(torch.stack([rotate_keys(k[None], delta, f)[0] for k, f in zip(rebuilt[0], inv_freqs)]))
            values.append(rebuilt[1])
    return (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
