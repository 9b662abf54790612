"""Questions and multi-turn chats over a document cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from semanticache_rag.compressors.kara import KaraCompressor
from semanticache_rag.errors import ContextLengthError
from semanticache_rag.generation import GenerationOptions, LoopGuard, Sampler, TextStream
from semanticache_rag.kv import ConversationKV
from semanticache_rag.prompts import Turn

if TYPE_CHECKING:
    from semanticache_rag.cache import DocumentCache, Selection

# Greedy steps run in one call (Engine.greedy): Python between steps cost ~0.45 ms of a ~6 ms step. An answer that
# ends on a stop string or the loop guard runs up to GREEDY_RUN - 1 steps past its end (forgotten); the text comes
# GREEDY_RUN tokens at a time.
GREEDY_RUN = 8


@dataclass(frozen=True)
class Answer:
    """An answer and how it was computed.

    ``prompt_tokens`` counts every token the answer was conditioned on (document included);
    ``cached_tokens`` of them were reused from caches, so only ``prompt_tokens - cached_tokens``
    were computed for this question. ``cache_creation_tokens`` were prefilled into a new document
    cache by this call (prompt caching of registered documents, :mod:`semanticache_rag.prompt_cache`).
    ``cache_bytes`` is the device memory of the document cache this answer used (``entries_removed``
    and ``bytes_removed``: the fractions of its KV entries and of its bytes saved, against the full
    cache of the same tokens); with SeKV's
    zoom-in it includes the spans rebuilt for this question (``spans_expanded`` spans,
    ``tokens_reconstructed`` tokens), and ``host_bytes`` is the host copy of all spans.
    ``conversation_bytes`` is what the turns appended after the document take in the working
    cache when the answer ends (bounded by Kara's decode-time compression).
    ``finish_reason`` is ``"stop"`` (end of turn or a stop string), ``"length"`` (``max_new_tokens``
    or the context ran out) or ``"repetition"`` (the loop guard ended an answer that began to
    repeat itself; the repeat is not in ``answer``). ``prefill_s`` is the time to the first answer token,
    ``decode_s`` the time for the rest, ``tokens_per_s`` the decode rate after the first token.
    ``pages`` are the labels of the pages the answer was conditioned on: every page of a document
    read whole; for a long document, those of the ``sections`` (indices, of ``sections_total``)
    that ``routing`` chose for this turn. ``routing_matched`` is False when the question matched
    no section and the nearest ones were used instead.
    """

    question: str
    answer: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    document_tokens: int
    cache_bytes: int
    finish_reason: str
    completion_ids: tuple[int, ...] = field(default=(), repr=False)
    cache_creation_tokens: int = 0
    document_id: str | None = None
    spans_expanded: int = 0
    tokens_reconstructed: int = 0
    host_bytes: int = 0
    conversation_bytes: int = 0
    entries_removed: float = 0.0
    bytes_removed: float = 0.0
    pages: tuple[str, ...] = ()
    sections: tuple[int, ...] = ()
    sections_total: int = 1
    routing: str = "whole document"
    routing_matched: bool = True

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (the ``--json`` line format)."""
        return {k: v for k, v in asdict(self).items() if k != "completion_ids"}


def working_cache(engine, cache, tail: list[int]):
    """A fresh working cache to run ``tail`` over ``cache``, and what zooming did (or None).

    For most caches that is the document's layers as they are; a SeKV cache first rebuilds the
    spans ``tail`` needs (:meth:`~semanticache_rag.compressors.span_index.SpanIndex.working_kv`).
    """
    if cache.zoom is None:
        return ConversationKV(cache.layers), None
    return cache.zoom.working_kv(engine, cache, tail)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Conversation:
    """A chat over one document; earlier turns stay in context.

    The document cache is shared, never modified; this object keeps only the tokens appended
    after it. For a long document (:class:`~semanticache_rag.sections.SectionedCache`) each turn
    is routed to the sections it needs, and the tokens of earlier turns are computed again after
    them when the sections change. Not safe to use from two threads at once (use one conversation
    per thread; the engine itself is thread-safe).

    Attributes
    ----------
    document : DocumentCache or SectionedCache
        What was read.
    cache : DocumentCache
        The cache the last turn was answered from (``document`` itself for a document read whole;
        the spliced sections for a long one); set by the first turn.
    kv : ConversationKV
        The working cache: ``cache`` and the tokens appended after it; set by the first turn.
    selection : Selection or None
        Which parts of the document the last turn used; ``None`` before the first turn.
    """

    cache: DocumentCache
    kv: ConversationKV

    def __init__(self, engine, cache, **options):
        self.engine, self.document = engine, cache
        self.options = GenerationOptions(**options)
        self.turns: list[Turn] = []
        self.selection: Selection | None = None
        self._tail_ids: list[int] = []  # tokens in self.kv, after the document
        self.last_answer: Answer | None = None
        self._kara: KaraCompressor | None = None
        self._compressed_tokens = 0  # tail tokens whose entries Kara has compressed...
        self._squeezed = 0  # ...into this many entries (per head), at the front of the appended ones

    def ask(self, question: str, **options) -> Answer:
        """Answer ``question`` in this conversation and return the :class:`Answer`."""
        for _ in self.stream(question, **options):
            pass
        assert self.last_answer is not None  # set when the stream ends
        return self.last_answer

    def stream(self, question: str, **options) -> Iterator[str]:
        """Yield the answer as text pieces; :attr:`last_answer` is set when it ends."""
        engine = self.engine
        text = engine.prompt.tail(self.turns + [Turn(question)])
        tail = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        yield from self.stream_tokens(tail, question, **options)

    def stream_tokens(self, tail: list[int], question: str, **options) -> Iterator[str]:
        """Like :meth:`stream`, for a tail already tokenised (everything after the document)."""
        opts = GenerationOptions(**{**asdict(self.options), **options})
        engine, start = self.engine, time.perf_counter()
        self._use_document(question, len(tail), opts)
        reused, budget = self._prepare(tail)
        zoom = None
        if self.cache.zoom is not None:  # rebuild the spans this question needs; the whole tail is recomputed
            self.kv, zoom = working_cache(engine, self.cache, tail)
            reused = 0
        guard = LoopGuard(said=tuple(t.answer for t in self.turns if t.answer)) if opts.loop_guard else None
        stream = TextStream(engine.tokenizer, tuple(opts.stop) + engine.prompt.stop_strings, guard)
        sampler, eos = Sampler(opts, engine.device), self._eos_ids()
        logits = engine.forward(self.kv, tail[reused:], self.cache.positions + reused)[-1]
        self._tail_ids = list(tail)
        self._squeeze()
        first = time.perf_counter()
        finish, generated, limit = "length", 0, min(opts.max_new_tokens, budget)
        # tokens chosen and not yet said, all but the last already run (greedy steps run GREEDY_RUN at a time)
        chosen = [sampler(logits, stream.ids)]
        try:
            for _ in range(limit):
                token = chosen.pop(0)
                generated += 1
                if token in eos:
                    finish = "stop"
                    break
                piece = stream.push(token)
                if piece:
                    yield piece
                if stream.stopped:
                    finish = stream.reason
                    break
                self._tail_ids.append(token)
                if chosen:  # run already
                    continue
                self._squeeze()
                position = self.cache.positions + len(self._tail_ids) - 1
                if sampler.argmax_only:  # the next tokens chosen where the logits are made, several steps a call
                    chosen = engine.greedy(self.kv, token, position, self._run_length(limit - generated + 1), eos)
                else:
                    logits = engine.forward(self.kv, [token], position)[-1]
                    chosen = [sampler(logits, stream.ids)]
        finally:  # also where the consumer stopped early or a step raised
            self._agree()
        self._squeeze()  # Kara, as after every step
        rest = stream.flush(cut_off=finish == "length")
        if rest:
            yield rest
        if stream.reason == "repetition":
            finish = "repetition"
        self._finish(question, stream, len(tail), reused, generated, finish, (start, first), zoom)

    def _use_document(self, question: str, tail_len: int, opts: GenerationOptions) -> None:
        """Choose the parts of the document this turn needs; a new choice starts a new working cache."""
        engine = self.engine
        room = engine.context_length - tail_len - min(opts.max_new_tokens, engine.answer_reserve)
        previous = self.selection
        selection = self.document.select(engine, question, room, previous)
        if previous is None or selection.sections != previous.sections:
            self.cache = self.document.assemble(engine, selection)
            self.kv, self._tail_ids = ConversationKV(self.cache.layers), []
            self._compressed_tokens = self._squeezed = 0
            compressor = engine.compressor
            self._kara = compressor if isinstance(compressor, KaraCompressor) and self.cache.zoom is None else None
        self.selection = selection

    def _prepare(self, tail: list[int]) -> tuple[int, int]:
        """How many of ``tail`` are already cached (the rest is cropped), and room to answer."""
        engine = self.engine
        if not tail:
            raise ValueError("a question needs at least one token after the document")
        budget = engine.context_length - self.cache.positions - len(tail)
        if budget < 1:
            raise ContextLengthError(
                f"the conversation needs {self.cache.positions + len(tail):,} tokens of context; "
                f"{engine.model_name} has {engine.context_length:,}. "
                "Start a new conversation or ask a shorter question."
            )
        # Reuse every appended token the new prompt shares with the cache; feed at least one.
        reused = min(_common_prefix(self._tail_ids, tail), len(tail) - 1)
        if reused < self._compressed_tokens:  # the prompt changed inside what Kara compressed: start over
            self.kv, reused = ConversationKV(self.cache.layers), 0
            self._compressed_tokens = self._squeezed = 0
        self.kv.crop(self._entries(reused))
        return reused, budget

    def _agree(self) -> None:
        """Make the working cache and the tokens it holds (``_tail_ids``) agree where an answer stopped: steps a
        greedy run ran past its end forgotten, and tokens whose step did not run (it raised) dropped."""
        held = self.kv.appended_length + self._compressed_tokens - self._squeezed
        if held < len(self._tail_ids):
            del self._tail_ids[held:]
        self.kv.crop(self._entries(len(self._tail_ids)))

    def _entries(self, tokens: int) -> int:
        """How many appended entries the first ``tokens`` of ``_tail_ids`` take (Kara keeps fewer for those it
        compressed)."""
        return tokens - self._compressed_tokens + self._squeezed

    def _run_length(self, left: int) -> int:
        """How many greedy steps to run in one call: at most GREEDY_RUN and the ``left`` the answer may take, and
        with Kara none past the step after which it compresses (:meth:`_squeeze` runs before the next)."""
        kara, steps = self._kara, min(GREEDY_RUN, left)
        if kara is not None:
            steps = min(steps, max(1, kara.budget_tokens + kara.window_tokens + 1 - self.kv.appended_length))
        return steps

    def _squeeze(self) -> None:
        """Kara: compress appended entries a window at a time once they exceed the budget."""
        kara = self._kara
        if kara is None:
            return
        entries = self.kv.appended_length
        while entries > kara.budget_tokens + kara.window_tokens:
            if entries - self._squeezed - kara.recent_tokens >= kara.window_tokens:  # oldest window not yet compressed
                start = self._squeezed
                self._compressed_tokens += kara.window_tokens
                self._squeezed += kara.kept_per_window
            elif self._squeezed >= kara.window_tokens:  # else the oldest compressed entries, once more
                start = 0
                self._squeezed -= kara.window_tokens - kara.kept_per_window
            else:
                return
            kara.compress_window(self.kv.layers, self.kv.prefix_length + start)
            entries = self.kv.appended_length

    def _finish(self, question, stream, tail_len, reused, generated, finish, times, zoom=None) -> None:
        (start, first), text = times, stream.text.strip()
        decode_s = time.perf_counter() - first
        cache_bytes = self.cache.nbytes if zoom is None else zoom.device_bytes
        selection = self.selection
        assert selection is not None  # chosen at the start of the turn
        self.turns.append(Turn(question, text))
        self.last_answer = Answer(
            question=question,
            answer=text,
            prompt_tokens=self.cache.length + tail_len,
            cached_tokens=self.cache.length + reused,
            completion_tokens=generated,
            prefill_s=first - start,
            decode_s=decode_s,
            tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            document_tokens=self.cache.length,
            cache_bytes=cache_bytes,
            entries_removed=self.cache.entries_removed,
            bytes_removed=1 - cache_bytes / self.cache.full_nbytes if self.cache.full_nbytes else 0.0,
            finish_reason=finish,
            completion_ids=tuple(stream.ids),
            spans_expanded=0 if zoom is None else zoom.spans_expanded,
            tokens_reconstructed=0 if zoom is None else zoom.tokens_reconstructed,
            host_bytes=self.cache.host_nbytes,
            conversation_bytes=sum(2 * int(layer.keys[:, :, : layer.length].nbytes) for layer in self.kv.layers),
            pages=selection.pages,
            sections=selection.sections,
            sections_total=selection.total_sections,
            routing=selection.routing,
            routing_matched=selection.matched,
        )

    def _eos_ids(self) -> set[int]:
        tok, config = self.engine.tokenizer, self.engine.model.generation_config
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        eos = getattr(config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        for special in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
            token_id = tok.convert_tokens_to_ids(special)
            if isinstance(token_id, int) and token_id != tok.unk_token_id:
                ids.add(token_id)
        return ids
