"""Documents longer than the model's context: section caches, routing and splicing.

A long document is read as sections at page or paragraph boundaries, each at most
``section_tokens`` tokens, each prefilled after the one shared prompt head at the same positions
(``h .. h + n``, ``h`` the head's length) and compressed as soon as it is read. Per question the
sections are ranked by a router (:mod:`semanticache_rag.routing`), and the best ones that fit the
context are spliced, in document order, into one working cache behind one copy of the head:
each section's keys are rotated to its new start (:mod:`semanticache_rag.rotation`; exact up to
float32 rounding, merged cores included), values are copied as they are.

Positions. Sections are placed *compactly*: each starts where the previous one's entries end
(a section compressed 4x takes a quarter of the positions it was read at, except the last, which
keeps its full extent so the question follows its last token as in a plain read). So compression
buys breadth: at ratio ``r`` about ``1 / (1 - r)`` times as many sections fit into one answer.
``positions="contiguous"`` places every section at its full extent instead.

Sections prefilled independently do not attend to each other; the question attends to all of
them. This is the trade the splice makes for reading once (see the README's long-document results
for what it costs on the default model).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from semanticache_rag.cache import DocumentCache, Selection, page_labels
from semanticache_rag.documents import Document
from semanticache_rag.errors import ConfigError, ContextLengthError
from semanticache_rag.kv import LayerKV
from semanticache_rag.prompts import Turn
from semanticache_rag.rotation import rotate_keys
from semanticache_rag.routing import AttentionRouter, BM25Router, fused_ranking, ranking

POSITIONS = ("compact", "contiguous")
ROUTINGS = ("bm25", "attention", "hybrid")

# -- where sections end ---------------------------------------------------------------------


def _break_strength(text: str, offsets: list[int], page_starts: list[int]) -> list[int]:
    """Per token ``t``, how good a section boundary before it is: 3 a new page, 2 a new paragraph,
    1 a new line or sentence, 0 inside one (decided on the text before the token, whatever the
    tokenizer made of the line breaks)."""
    strength = [3] * len(offsets)
    for t in range(1, len(offsets)):
        before, at = offsets[t - 1], offsets[t]
        if at == before:  # byte pieces of one character (byte-level BPE): never cut between them
            strength[t] = 0
            continue
        if bisect.bisect_right(page_starts, at) > bisect.bisect_right(page_starts, before):
            continue  # a page starts between the two tokens
        tail = text[max(0, at - 8) : at].rstrip(" \t")
        if tail.endswith("\n\n"):
            strength[t] = 2
        elif tail.endswith(("\n", ".", "?", "!", ":", ";")):
            strength[t] = 1
        else:
            strength[t] = 0
    return strength


def plan_sections(document: Document, offsets: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of sections of at most ``max_tokens`` tokens.

    ``offsets`` are the character offsets where the document's tokens start. Each section ends at
    the strongest boundary (page, then paragraph, then line or sentence) in the second half of
    its allowed length, the latest such one; a run with no boundary is cut at ``max_tokens``.
    """
    if max_tokens < 2:
        raise ConfigError(f"section_tokens must be >= 2, got {max_tokens}")
    page_starts = [page.start for page in document.pages[1:]]
    strength = _break_strength(document.text, offsets, page_starts)
    sections, start, count = [], 0, len(offsets)
    while count - start > max_tokens:
        window = range(start + max_tokens // 2, start + max_tokens + 1)
        end = max(window, key=lambda t: (strength[t] if t < count else 3, t))
        sections.append((start, end))
        start = end
    if sections and count - start < max_tokens // 2:  # no short last section: split the last two evenly
        start = sections.pop()[0]
        length, middle = count - start, (start + count) // 2
        window = range(
            max(start + length // 4, count - max_tokens), min(start + 3 * length // 4, start + max_tokens) + 1
        )
        end = max(window, key=lambda t: (strength[t], -abs(t - middle)))
        sections.append((start, end))
        start = end
    sections.append((start, count))
    return sections


def character_spans(
    document: Document, offsets: list[int], ranges: list[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """The character span in ``document.text`` of each token range of :func:`plan_sections`."""
    end = len(document.text)
    return tuple((offsets[a], offsets[b] if b < len(offsets) else end) for a, b in ranges)


# -- splicing --------------------------------------------------------------------------------


def section_positions(section: DocumentCache, compact: bool) -> int:
    """Positions a section takes when another section follows it: its entries per head, or its tokens."""
    if not compact:
        return section.length
    heads = section.layers[0].keys.shape[1]
    return max(math.ceil(layer.num_entries / heads) for layer in section.layers)


def splice_layers(parts: Sequence[tuple[Any, int]], inv_freq: torch.Tensor) -> LayerKV:
    """One layer spliced from ``(layer, delta)`` parts: keys rotated by ``delta`` positions, in order.

    Coded (KV-Kaizen) parts are decoded: the spliced cache is a per-question working cache, at
    most one context long; the stored sections stay coded.
    """
    keys, values, sizes = [], [], []
    with_sizes = any(layer.sizes is not None for layer, _ in parts)
    for layer, delta in parts:
        layer_keys = layer.keys
        keys.append(rotate_keys(layer_keys, delta, inv_freq))
        values.append(layer.values)
        if with_sizes:
            own = layer.sizes
            sizes.append(own.int() if own is not None else layer_keys.new_ones(layer_keys.shape[:3], dtype=torch.int))
    if not with_sizes:
        return LayerKV(torch.cat(keys, 2), torch.cat(values, 2))
    joined = torch.cat(sizes, 2)
    return LayerKV(
        torch.cat(keys, 2), torch.cat(values, 2), joined.to(torch.int16 if joined.max() < 2**15 else torch.int)
    )


@dataclass(frozen=True, eq=False)
class SectionedCache:
    """A document longer than the context: its sections' caches and what routes questions to them.

    Attributes
    ----------
    document : Document
    head : DocumentCache
        The prompt head before the document (template tokens), uncompressed, at positions ``0..h``.
    sections : tuple of DocumentCache
        One per section, in document order: its tokens (``prefix_ids``), their pages, and its
        (compressed) layers at positions ``h..h + n``, as read after the head.
    spans : tuple of (int, int)
        Character span of each section in ``document.text``.

    How sections are ranked, placed and how many are taken per question are the engine's settings
    (``Engine(routing=..., positions=..., max_sections=...)``), read at each question.
    """

    document: Document
    head: DocumentCache
    sections: tuple[DocumentCache, ...]
    spans: tuple[tuple[int, int], ...]

    # -- what it stands for (the same names as DocumentCache) ---------------------------------

    @property
    def model_name(self) -> str:
        return self.head.model_name

    @property
    def compressor(self) -> str:
        return self.sections[0].compressor

    @property
    def prefill_s(self) -> float:
        return self.head.prefill_s + sum(s.prefill_s for s in self.sections)

    @property
    def compress_s(self) -> float:
        return sum(s.compress_s for s in self.sections)

    @property
    def zoom(self) -> None:
        return None

    @property
    def length(self) -> int:
        """Tokens of the head and every section."""
        return self.head.length + sum(s.length for s in self.sections)

    @property
    def prefix_ids(self) -> torch.Tensor:
        return torch.cat([self.head.prefix_ids, *(s.prefix_ids for s in self.sections)])

    @property
    def token_pages(self) -> torch.Tensor:
        return torch.cat([self.head.token_pages, *(s.token_pages for s in self.sections)])

    @property
    def total_pages(self) -> int:
        return self.document.total_pages

    @property
    def layers(self):
        raise AttributeError(
            "a sectioned cache has no single set of layers; Engine.ask and conversations splice the sections "
            "each question needs (SectionedCache.select, then SectionedCache.assemble)"
        )

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + sum(s.nbytes for s in self.sections)

    @property
    def full_nbytes(self) -> int:
        return self.head.full_nbytes + sum(s.full_nbytes for s in self.sections)

    @property
    def host_nbytes(self) -> int:
        return sum(s.host_nbytes for s in self.sections)

    @property
    def num_entries(self) -> int:
        return self.head.num_entries + sum(s.num_entries for s in self.sections)

    @property
    def entries_removed(self) -> float:
        """Fraction of KV entries removed, over all sections, layers and heads."""
        parts = (self.head, *self.sections)
        full = sum(layer.keys.shape[1] * part.length for part in parts for layer in part.layers)
        return 1 - self.num_entries / full

    @property
    def bytes_removed(self) -> float:
        """Fraction of the uncompressed cache's bytes saved."""
        return 1 - self.nbytes / self.full_nbytes

    @property
    def layer_entries_removed(self) -> list[float]:
        parts = (self.head, *self.sections)
        ratios = []
        for i in range(len(self.head.layers)):
            kept = sum(part.layers[i].num_entries for part in parts)
            full = sum(part.layers[i].keys.shape[1] * part.length for part in parts)
            ratios.append(1 - kept / full)
        return ratios

    # -- routing and splicing -----------------------------------------------------------------

    @cached_property
    def router(self) -> BM25Router:
        """The lexical routing index over the sections' text (built on first use, milliseconds)."""
        return BM25Router([self.document.text[a:b] for a, b in self.spans])

    @cached_property
    def attention_router(self) -> AttentionRouter:
        """Summaries of every section for the model's own routing (built on first use)."""
        return AttentionRouter(self.head, self.sections)

    def ranking(self, engine, question: str) -> tuple[list[int], bool]:
        """Sections best first for ``question`` by ``engine.routing``, and whether any shares a word with it."""
        lexical = self.router.scores(question)
        matched = bool(lexical.max() > 0)
        if engine.routing == "bm25":
            return ranking(lexical), matched
        tail = engine.tokenizer(engine.prompt.tail([Turn(question)]), add_special_tokens=False)["input_ids"]
        model = self.attention_router.scores(engine, tail)
        return (ranking(model) if engine.routing == "attention" else fused_ranking(lexical, model)), matched

    @cached_property
    def _extents(self) -> dict[bool, list[int]]:
        return {compact: [section_positions(s, compact) for s in self.sections] for compact in (True, False)}

    def _placement(self, chosen: list[int], compact: bool) -> tuple[list[int], int]:
        """Where ``chosen`` (document order) go behind the head: each one's shift from the position it
        was read at, and the first position after them all.

        Each section was read at positions ``head..head + n``. Compact: the next section starts after
        this one's entries per head, but this one's keys keep their own span, and what follows the
        splice starts after every one of them.
        """
        head = self.head.length
        deltas, start, end = [], head, head
        for k in chosen:
            deltas.append(start - head)
            end = max(end, start + self.sections[k].length)
            start += self._extents[compact][k]
        return deltas, end

    def positions_needed(self, chosen: list[int], compact: bool = True) -> int:
        """Positions the head and ``chosen`` sections take, spliced in document order (see :meth:`splice`)."""
        return self._placement(sorted(chosen), compact)[1]

    def fit(self, order: list[int], room: int, compact: bool = True, limit: int | None = None) -> list[int]:
        """The leading sections of ``order`` (at most ``limit``) that fit ``room`` positions, in document order.

        Sections are taken best first; one that does not fit is skipped for the next. At least the
        best section is taken.

        Raises
        ------
        ContextLengthError
            Not even the best section fits (the conversation has filled the context).
        """
        chosen: list[int] = []
        for k in order:
            if limit is not None and len(chosen) >= limit:
                break
            if self.positions_needed(chosen + [k], compact) <= room:
                chosen.append(k)
        if not chosen:
            raise ContextLengthError(
                f"the conversation leaves {room:,} positions of context, too few for one section of "
                f"{self.document.name} ({self.positions_needed(order[:1], compact):,} with the prompt head); "
                "start a new conversation or ask a shorter question"
            )
        return sorted(chosen)

    def select(self, engine, question: str, room: int, previous: Selection | None = None) -> Selection:
        """Route ``question`` to the best sections that fit ``room`` positions (head included).

        A question that matches no section (no shared word) keeps the previous turn's sections in a
        conversation (as many as still fit), else takes the first sections; either way ``matched``
        is False.
        """
        order, matched = self.ranking(engine, question)
        if not matched and previous is not None and previous.total_sections == len(self.sections):
            order = list(previous.sections)  # a follow-up ("and then?") stays where the conversation is
        chosen = self.fit(order, room, engine.positions == "compact", engine.max_sections)
        return Selection(tuple(chosen), len(self.sections), self._pages(chosen), engine.routing, matched)

    def assemble(self, engine, selection: Selection) -> DocumentCache:
        """The working cache of ``selection``: its sections spliced behind the head."""
        compact = engine.positions == "compact"
        return self.splice(list(selection.sections), engine.rope_frequencies, selection, compact)

    def _pages(self, chosen: list[int]) -> tuple[str, ...]:
        pages = torch.cat([self.sections[k].token_pages for k in chosen])
        return page_labels(self.document, pages)

    def splice(
        self, chosen: list[int], inv_freqs: list[torch.Tensor], selection: Selection, compact: bool = True
    ) -> DocumentCache:
        """The head and ``chosen`` sections (document order) as one working :class:`DocumentCache`."""
        deltas, end = self._placement(chosen, compact)
        layers = tuple(
            splice_layers(
                [(self.head.layers[i], 0)] + [(self.sections[k].layers[i], d) for k, d in zip(chosen, deltas)],
                inv_freqs[i],
            )
            for i in range(len(self.head.layers))
        )
        parts = [self.head] + [self.sections[k] for k in chosen]
        return replace(
            self.head,
            document=self.document,  # the head's may be an earlier copy (a store hit renames the document)
            layers=layers,
            zoom=self._spliced_zoom(chosen, deltas, inv_freqs),
            prefix_ids=torch.cat([p.prefix_ids for p in parts]),
            token_pages=torch.cat([p.token_pages for p in parts]),
            compressor=self.compressor,
            prefill_s=self.prefill_s,
            compress_s=self.compress_s,
            next_position=end,
            selection=selection,
        )

    def _spliced_zoom(self, chosen: list[int], deltas: list[int], inv_freqs: list[torch.Tensor]):
        """The chosen sections' zoom state (SeKV) joined for the spliced cache, or ``None``."""
        zooms = [self.sections[k].zoom for k in chosen]
        first: Any = next((zoom for zoom in zooms if zoom is not None), None)
        if first is None:
            return None
        offsets, at = [], [layer.keys.shape[2] for layer in self.head.layers]  # entries per layer before each
        for k in chosen:
            offsets.append(at)
            at = [n + layer.keys.shape[2] for n, layer in zip(at, self.sections[k].layers)]
        return type(first).join(list(zip(offsets, zooms, deltas)), inv_freqs)
