"""Reading a document longer than the model's context, one section at a time.

The prompt head is prefilled once; each section is then prefilled after it (at positions
``h .. h + n``) in chunks, compressed with the engine's compressor as soon as its prefill ends,
and only the compressed result is kept: memory holds one section's full KV at most, whatever the
document's length. A checkpoint (the store's partial entry) lets an interrupted read resume from
the sections it had finished.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from semanticache_rag.cache import DocumentCache
from semanticache_rag.compressors import CompressionContext
from semanticache_rag.documents import Document
from semanticache_rag.kv import ConversationKV, LayerKV
from semanticache_rag.sections import SectionedCache, character_spans, plan_sections


class Progress:
    """Reading progress: a tqdm bar over tokens (``progress=True``), or calls of ``progress(done, total)``
    (a server reporting to its clients), or nothing (``False``)."""

    def __init__(self, progress, total: int, name: str):
        self.callback = progress if callable(progress) else None
        self.bar = tqdm(total=total, desc=f"Reading {name}", unit="tok", disable=progress is not True, leave=False)
        self.done, self.total = 0, total

    def update(self, tokens: int) -> None:
        self.done += tokens
        self.bar.update(tokens)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def note(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def read_head(engine, document: Document, ids: list[int] | None = None) -> tuple[DocumentCache, torch.Tensor]:
    """The prompt head's cache (uncompressed) and its last logits, which predict a section's first token.

    ``ids``: the head's tokens (default: the engine's template head).
    """
    ids = engine.head_ids if ids is None else ids
    started = time.perf_counter()
    kv = ConversationKV(num_layers=engine.model.config.num_hidden_layers, capacity=len(ids))
    logits = engine.forward(kv, ids, 0)[-1]
    layers = tuple(LayerKV(*layer.appended()) for layer in kv.layers)
    pages = torch.full((len(ids),), -1, dtype=torch.int32)
    cache = DocumentCache(
        document, layers, torch.tensor(ids), pages, engine.model_name, "none", time.perf_counter() - started, 0.0
    )
    return cache, logits


def prefill_section(engine, head: DocumentCache, head_logits, ids: list[int], surprisal: bool, on_chunk=None):
    """A section's full KV prefilled after ``head`` (positions ``h..h+n``): (keys_values, surprisal, seconds)."""
    started = time.perf_counter()
    kv = ConversationKV(head.layers, capacity=len(ids))
    token_surprisal = engine.run_tokens(kv, ids, head.length, surprisal, on_chunk)
    if token_surprisal is not None:  # the head's last position predicts the section's first token
        token_surprisal[0] = -torch.log_softmax(head_logits.float(), -1)[ids[0]]
    keys_values = [layer.appended() for layer in kv.layers]
    return keys_values, token_surprisal, time.perf_counter() - started


def compress_section(engine, compressor, head: DocumentCache, prefill, ids: list[int], pages: torch.Tensor):
    """A section's :class:`DocumentCache`: its prefill (from :func:`prefill_section`) compressed."""
    keys_values, surprisal, read_s = prefill
    started = time.perf_counter()
    tokens = torch.tensor(ids)
    context = CompressionContext(
        tokens, torch.zeros(len(ids), dtype=torch.bool), surprisal, engine.tokenizer, release_layers=True
    )
    layers, zoom = compressor.compress_cache(keys_values, context)
    compress_s = time.perf_counter() - started
    name, method = engine.model_name, repr(compressor)
    return DocumentCache(head.document, layers, tokens, pages, name, method, read_s, compress_s, zoom)


def read_sections(engine, document: Document, tokens, *, progress=True, checkpoint=None) -> SectionedCache:
    """Read ``document`` (``tokens``: ids, character offsets, pages from :meth:`Engine.tokenize_document`)
    as sections of at most ``engine.section_tokens`` tokens.

    ``checkpoint``, when given, has ``load(k) -> DocumentCache | None`` (a section finished by an
    earlier, interrupted read) and ``save(k, section)``.
    """
    ids, offsets, pages = tokens
    ranges = plan_sections(document, offsets, engine.section_tokens)
    head, head_logits = read_head(engine, document)
    sections = []
    with Progress(progress, len(ids), document.name) as bar:
        for k, (start, end) in enumerate(ranges):
            section = checkpoint.load(k) if checkpoint is not None else None
            if section is not None and section.prefix_ids.tolist() != ids[start:end]:
                section = None  # another plan (cannot happen for the same key): read it again
            if section is None:
                need = engine.compressor.needs_surprisal
                prefill = prefill_section(engine, head, head_logits, ids[start:end], need, bar.update)
                section = compress_section(engine, engine.compressor, head, prefill, ids[start:end], pages[start:end])
                del prefill  # one section's full KV at a time
                if checkpoint is not None:
                    checkpoint.save(k, section)
            else:
                bar.update(end - start)
            sections.append(section)
            bar.note(f"page {document.pages[int(pages[end - 1])].label} of {document.total_pages}")
    return SectionedCache(document, head, tuple(sections), character_spans(document, offsets, ranges))
