"""Anchors: tokens a compressor keeps whole because they carry the facts (shared by SemantiCache and SeKV).

Question-agnostic signals rank the candidates: tokens holding a digit first (numbers, dates,
versions, codes), then, when asked, capitalised words inside a sentence (names, places), then
tokens the model found surprising at prefill (surprisal > mean + ``anchor_std`` std). With
``unit="word"`` an anchor keeps every token of its whitespace-delimited word (up to
``max_word_tokens``), so "Q7-TANGERINE-318" cannot lose its hyphens to a merge.
"""

from __future__ import annotations

import torch

from semanticache_rag.chunking import digit_mask, name_mask, word_ids
from semanticache_rag.compressors.base import CompressionContext

UNITS = ("word", "token")
_NAME_PRIORITY = 1e6  # above any surprisal (nats), below digits (inf)


def anchor_priority(
    context: CompressionContext,
    protected: torch.Tensor,
    anchor_std: float | None,
    protect_digits: bool,
    protect_names: bool = False,
) -> torch.Tensor:
    """(N,) float: each candidate token's rank (``inf`` for digits), ``-inf`` for non-candidates and
    ``protected`` tokens (already kept)."""
    priority = torch.full(protected.shape, float("-inf"))
    if anchor_std is not None and context.surprisal is not None:
        surprisal = context.surprisal.float()
        free = surprisal[~protected]
        threshold = free.mean() + anchor_std * free.std() if free.numel() > 1 else float("inf")
        priority = torch.where(surprisal > threshold, surprisal, priority)
    if protect_names:  # ranked after digits, before any surprising token
        names = name_mask(context.token_ids, context.tokenizer)
        priority = torch.where(names, _NAME_PRIORITY + priority.clamp(min=0), priority)
    if protect_digits:
        priority = torch.where(digit_mask(context.token_ids, context.tokenizer), float("inf"), priority)
    return priority.masked_fill(protected, float("-inf"))


def choose_anchors(
    priority: torch.Tensor,
    protected: torch.Tensor,
    room: int,
    words: torch.Tensor | None = None,
    max_word_tokens: int = 16,
) -> torch.Tensor:
    """(N,) bool: at most ``room`` new anchors by ``priority``; whole words when ``words``
    (:func:`~semanticache_rag.chunking.word_ids`) is given, single tokens otherwise."""
    anchors = torch.zeros_like(protected)
    if words is None:
        count = min(room, int((priority > float("-inf")).sum()))
        anchors[priority.topk(count).indices] = True
        return anchors
    count = int(words.max()) + 1 if words.numel() else 0
    best = torch.full((count,), float("-inf")).scatter_reduce(0, words, priority, reduce="amax")
    lengths = torch.bincount(words, minlength=count)
    used = 0
    order = best.argsort(descending=True).tolist()
    firsts = torch.searchsorted(words, torch.arange(count)).tolist()
    for word in order:  # whole words, by the priority of their best token, while their tokens fit
        if best[word] == float("-inf") or used >= room:
            break
        span = slice(firsts[word], firsts[word] + int(lengths[word]))
        members = ~protected[span] & ~anchors[span]
        if int(lengths[word]) > max_word_tokens:  # no spaces for long: keep its anchor tokens only
            members &= priority[span] > float("-inf")
        take = int(members.sum())
        if used + take <= room:
            anchors[span] |= members
            used += take
    return anchors


def context_words(context: CompressionContext, unit: str) -> torch.Tensor | None:
    """The word index :func:`choose_anchors` takes for ``unit`` (``None`` for single tokens)."""
    return word_ids(context.token_ids, context.tokenizer) if unit == "word" else None
