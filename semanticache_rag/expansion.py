"""A compressed document cache as the plain KV that a stock engine attends to (vLLM, transformers).

Proportional attention gives an entry that stands for ``s`` tokens the logit ``q.k + log s``: under
a softmax that is exactly the weight ``s`` identical copies of the entry get, and the copies bring
the same value each. So a cache whose entries account for every token of its prefix expands into
one key and value per prefix token and per KV head, and any engine that attends with a plain
softmax over them (its own kernel, its own paged cache) gives the same output as our engine.
Expanding saves that engine the prefill (and the store keeps the compressed bytes), not memory.

Which caches expand exactly:

- no compression; SemantiCache's cores (each core ``s`` times); KV-Kaizen's coded layers
  (int8/int4, low-rank, 16-bit: decoded first) and shared layers (the layer they share);
- not StreamingLLM (it dropped tokens: its entries stand for fewer tokens than its prefix), SeKV
  (its summary is re-expanded per question), a long document's sections before they are spliced,
  or sections spliced at positions of their own (the question does not start at the prefix's
  length): :class:`ExpansionError` says so.

Keys are post-RoPE, so the order of a head's entries does not matter to attention; copies sit
where their core sits.
"""

from __future__ import annotations

import torch

from semanticache_rag.errors import SemantiCacheError


class ExpansionError(SemantiCacheError):
    """A cache whose attention plain copies of its entries cannot reproduce."""


def expand_layer(layer, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (1, H_kv, ``tokens``, D) of one layer, each entry repeated its size times.

    ``layer`` is any document-cache layer (:class:`~semanticache_rag.kv.LayerKV`, coded or shared).

    Raises
    ------
    ExpansionError
        A KV head whose entries do not stand for exactly ``tokens`` tokens.
    """
    check_fixed_layers([layer], tokens)
    keys, values, sizes = layer.keys, layer.values, layer.sizes
    if sizes is None:
        return keys, values
    counts = sizes[0].long()  # (H_kv, L); 0 marks padding

    def expand(tensor: torch.Tensor) -> torch.Tensor:  # heads may differ in entries, not in tokens
        return torch.stack([torch.repeat_interleave(tensor[0, h], counts[h], dim=0) for h in range(len(counts))])[None]

    return expand(keys), expand(values)


def check_fixed_layers(layers, tokens: int) -> None:
    """Raise :class:`ExpansionError` unless every KV head of every layer stands for exactly ``tokens`` tokens."""
    for layer in layers:
        sizes = getattr(layer, "sizes", None)
        if sizes is None:
            entries = _stored_shape(layer)[2]
            if entries != tokens:
                raise ExpansionError(
                    f"the layer keeps {entries} entries of single tokens for a prefix of {tokens}: tokens "
                    "were dropped (an evicting compressor such as streaming_llm), so no copies reproduce its attention"
                )
            continue
        totals = sizes[0].long().sum(-1)
        if bool((totals != tokens).any()):
            raise ExpansionError(
                f"the layer's heads stand for {sorted(set(totals.tolist()))} tokens, not the prefix's {tokens}: "
                "a cache that dropped tokens cannot be expanded"
            )


def expand_cache(cache) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per decoder layer, the plain keys and values (1, H_kv, N, D) of a :class:`~semanticache_rag.DocumentCache`.

    A question appended after them starts at position ``N`` (``cache.length``), as it does in
    our engine.

    Raises
    ------
    ExpansionError
        SeKV caches, sections spliced at compact positions, caches that dropped tokens.
    """
    _check_fixed(cache)
    return tuple(expand_layer(layer, cache.length) for layer in cache.layers)


def _check_fixed(cache) -> None:
    """Refuse what has no fixed plain form at the positions it was read at (see :func:`expand_cache`)."""
    from semanticache_rag.cache import DocumentCache

    if not isinstance(cache, DocumentCache):
        raise ExpansionError(
            f"expected a DocumentCache, got {type(cache).__name__}: a long document's sections are spliced per "
            "question; expand the cache a question is answered from (SectionedCache.assemble(...))"
        )
    if cache.zoom is not None:
        raise ExpansionError(
            f"a {cache.compressor} cache re-expands its spans for each question: it has no fixed plain form; "
            "use semanticache or kaizen for a cache another engine reads"
        )
    if cache.positions != cache.length:
        raise ExpansionError(
            f"this cache's questions start at position {cache.positions}, not right after its {cache.length} tokens "
            "(sections spliced at positions of their own): another engine would start them at "
            f"{cache.length}; expand a document read whole, or sections spliced back to back"
        )


def compact_cache(cache, inv_freqs: list[torch.Tensor]):
    """The same cache at compact positions: ``P`` slots per head instead of ``N`` positions.

    ``P`` is the most entries any KV head of any layer keeps; shorter heads are padded (size 0, so
    ``log s = -inf``), every key is turned by ``P - N`` positions (:func:`~semanticache_rag.rotation.rotate_keys`,
    ``inv_freqs`` per layer as :attr:`Engine.rope_frequencies`) and the question starts at ``P``
    instead of ``N``. RoPE scores depend on the query's and key's positions only through their
    difference, which one shared turn leaves unchanged: the answers are the original cache's (up to
    float32 rounding of the rotation), so compact positions cost no accuracy. An engine that pages
    one slot per position (vLLM) could then hold ``P`` slots for a document of ``N`` tokens; what it
    lacks is the ``+ log s`` bias per slot (kept here as ``sizes``).

    Raises
    ------
    ExpansionError
        The caches :func:`expand_cache` refuses.
    """
    from dataclasses import replace

    _check_fixed(cache)
    layers = compact_layers(cache.layers, cache.length, inv_freqs)
    return replace(cache, layers=layers, next_position=layers[0].keys.shape[2])


def compact_layers(layers, tokens: int, inv_freqs: list[torch.Tensor]) -> tuple:
    """:func:`compact_cache`'s layers for a cache's ``layers`` over a prefix of ``tokens`` tokens:
    plain :class:`~semanticache_rag.kv.LayerKV` (coded layers decoded) of ``P`` entries each, with
    their sizes (0 for padding).

    Raises
    ------
    ExpansionError
        A KV head whose entries do not stand for exactly ``tokens`` tokens (tokens were dropped).
    """
    from semanticache_rag.kv import LayerKV
    from semanticache_rag.rotation import rotate_keys

    check_fixed_layers(layers, tokens)
    slots = compact_slots(layers)
    compact = []
    for layer, inv_freq in zip(layers, inv_freqs, strict=True):
        keys, values = layer.keys, layer.values
        sizes = layer.sizes if layer.sizes is not None else torch.ones(keys.shape[:3], dtype=torch.int32)
        pad = slots - keys.shape[2]
        keys, values = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (keys, values))
        sizes = torch.nn.functional.pad(sizes, (0, pad))  # padding: size 0
        compact.append(LayerKV(rotate_keys(keys, slots - tokens, inv_freq), values, sizes))
    return tuple(compact)


def compact_slots(layers) -> int:
    """``P``, the slots per head of a cache's ``layers`` at compact positions (the most entries any head keeps)."""
    return max(int(_entries_per_head(layer).max()) for layer in layers)


def _entries_per_head(layer) -> torch.Tensor:
    """Real entries per KV head (H_kv,) of a document-cache layer."""
    sizes = layer.sizes
    if sizes is None:
        _, heads, entries, _ = _stored_shape(layer)
        return torch.full((heads,), entries)
    return (sizes[0] > 0).sum(-1)


def _stored_shape(layer) -> torch.Size:
    """The (1, H_kv, L, D) shape of a document-cache layer's keys, without decoding a coded layer."""
    source = getattr(layer, "source", layer)  # a shared layer's storage
    return source.key_code.shape if hasattr(source, "key_code") else source.keys.shape
