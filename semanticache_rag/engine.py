"""The engine: owns one model, reads documents once, answers questions from their caches."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from semanticache_rag import surprisal
from semanticache_rag.cache import DocumentCache, ModelSpec
from semanticache_rag.compressors import CompressionContext, Compressor, NoCompression
from semanticache_rag.documents import Document, load_document
from semanticache_rag.errors import ConfigError, ContextLengthError
from semanticache_rag.kv import ConversationKV
from semanticache_rag.prompts import DEFAULT_SYSTEM_PROMPT, PromptFormat
from semanticache_rag.reading import Progress
from semanticache_rag.rotation import rope_frequencies
from semanticache_rag.sections import POSITIONS, ROUTINGS

if TYPE_CHECKING:
    from semanticache_rag.sections import SectionedCache
    from semanticache_rag.store import DocumentStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Prefill:
    """A document's full KV before compression (see :meth:`Engine.prefill`)."""

    document: Document
    ids: list[int]
    pages: torch.Tensor
    keys_values: list[tuple[torch.Tensor, torch.Tensor]]
    surprisal: torch.Tensor | None
    seconds: float


class Engine:
    """Reads documents once and answers questions from their cached, compressed KV.

    Parameters
    ----------
    model, tokenizer
        A transformers causal LM loaded with :func:`~semanticache_rag.models.load_model` (or any
        model whose attention implementation is ``"semanticache_rag"``) and its tokenizer.
    compressor : Compressor, optional
        How document caches are compressed; :class:`NoCompression` by default.
    model_name : str, optional
        Name reported in results.
    system_prompt : str or None
        System message for chat templates.
    prefill_chunk : int
        Tokens per forward pass while reading a document (bounds peak memory).
    answer_reserve : int
        Tokens of context kept free for a question and its answer when reading.
    store : DocumentStore or None
        Where :meth:`read` keeps document caches and finds those read before (in memory and on
        disk, shared between processes); ``None`` (the default) reads every document afresh.
    section_tokens : int
        A document longer than the context is read in sections of at most this many tokens
        (:mod:`semanticache_rag.sections`); one that fits is read whole.
    positions : str
        How a long document's sections are placed per question: ``"compact"`` (each starts where
        the previous one's entries end, so compressed sections take fewer positions) or
        ``"contiguous"``.
    routing : str
        How a long document's sections are ranked per question: ``"bm25"`` (lexical), ``"attention"``
        (the model's attention to section summaries) or ``"hybrid"`` (both, rank-fused).
    max_sections : int or None
        Most sections of a long document per question; ``None``: as many as fit the context. The
        default, 2, is what the default 135M model answers best from: on RULER-style haystacks of
        16K-32K tokens it found 46% / 42% of the facts from 1 / 2 sections and 17% from 6, because
        more sections are more distraction for a small model (``benchmarks/long_documents.py``).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        compressor: Compressor | None = None,
        model_name: str | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        prefill_chunk: int = 512,
        answer_reserve: int = 256,
        store: DocumentStore | None = None,
        section_tokens: int = 1024,
        positions: str = "compact",
        max_sections: int | None = 2,
        routing: str = "bm25",
    ):
        if prefill_chunk < 1 or answer_reserve < 0 or section_tokens < 16:
            raise ConfigError(
                "prefill_chunk must be >= 1, answer_reserve >= 0 and section_tokens >= 16, got "
                f"{prefill_chunk}, {answer_reserve}, {section_tokens}"
            )
        if positions not in POSITIONS or (max_sections is not None and max_sections < 1):
            raise ConfigError(f"positions must be one of {POSITIONS} and max_sections >= 1 or None")
        if routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if compressor is not None and not isinstance(compressor, Compressor):
            raise ConfigError(
                f"compressor must be a Compressor, got {compressor!r}: make one by name with "
                "semanticache_rag.make_compressor, e.g. make_compressor('semanticache', 0.75)"
            )
        self.model, self.tokenizer = model, tokenizer
        self.compressor = compressor or NoCompression()
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or "model"
        self.prompt = PromptFormat(tokenizer, system_prompt)
        self.prefill_chunk, self.answer_reserve = prefill_chunk, answer_reserve
        self.store = store
        self.section_tokens, self.positions, self.max_sections = section_tokens, positions, max_sections
        self.routing = routing
        self._lock = threading.Lock()
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        compressor: Compressor | None = None,
        device: str | None = None,
        dtype=None,
        weights: str = "auto",
        **kwargs,
    ) -> Engine:
        """Load ``model`` (default: SmolLM2-135M-Instruct) and build an engine around it.

        ``weights``: ``"auto"`` (the default: ``"int4-exact"`` for a Llama model whose weights are Q4_1 values, as
        the default model's, which decodes 3-7x faster with the fp32 model's arithmetic; ``"fp32"`` for another
        fp32 Llama model: its own weights, each decoding step one C++ call; else as loaded), ``"model"`` (as
        loaded), or ``"fp32"`` / ``"fp16"`` / ``"bf16"`` / ``"int8"`` / ``"int4"`` / ``"int4-exact"``
        weight-only matrices for faster decoding on CPUs (see :mod:`semanticache_rag.weights`).
        ``kwargs`` are the constructor's (``store=DocumentStore()`` keeps document caches on disk).
        """
        from semanticache_rag.models import load_model

        hf_model, tokenizer, name = load_model(model, device=device, dtype=dtype, weights=weights)
        return cls(hf_model, tokenizer, compressor=compressor, model_name=name, **kwargs)

    @property
    def context_length(self) -> int:
        """Most tokens (document + question + answer) the model can attend to."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def read_limit(self) -> int:
        """Most tokens (template head + document) read whole; longer documents are read in sections."""
        return self.context_length - self.answer_reserve

    @cached_property
    def rope_frequencies(self) -> list[torch.Tensor]:
        """Per layer, the rotary frequencies that move cached keys (:mod:`semanticache_rag.rotation`)."""
        return [f.to(self.device) for f in rope_frequencies(self.model)]

    def forward(self, kv: ConversationKV, ids: list[int], start: int, logits_to_keep: int = 1) -> torch.Tensor:
        """Run ``ids`` at positions ``start...`` appending to ``kv``; return their last logits (K, V)."""
        return self._run(kv, ids, start, logits_to_keep, head=True)

    def greedy(
        self, kv: ConversationKV, token: int, position: int, count: int = 1, stops: Collection[int] = ()
    ) -> list[int]:
        """Greedy decoding for up to ``count`` steps appending to ``kv``: the first runs ``token`` at ``position``,
        each later one the token the step before chose (its largest logit, as ``forward(...)[-1].argmax()``
        chooses it), until one chooses a token of ``stops`` (never run). Returns the tokens chosen, one a step run.
        Where the step runs in one C++ call with its head, all the steps are one call: the logits never reach
        Python, and nothing runs in Python between steps."""
        if count < 1:
            return []
        lean = getattr(self.model, "semanticache_forward", None)
        if lean is not None:
            with self._lock, torch.inference_mode():
                chosen = lean.greedy_tokens(kv, token, position, count, tuple(stops))
            if chosen is not None:
                return chosen
        chosen = []
        for step in range(count):
            token = int(self.forward(kv, [token], position + step)[-1].argmax())
            chosen.append(token)
            if token in stops:
                break
        return chosen

    def _run(self, kv: ConversationKV, ids: list[int], start: int, keep: int, head: bool) -> torch.Tensor:
        """:meth:`forward`; with ``head=False`` the last ``keep`` final hidden states (K, hidden) instead of logits.

        ``head=False`` is for models whose logits are their output head over those states
        (the lean pass, or a class in :data:`~semanticache_rag.surprisal.PLAIN_HEAD`).
        """
        lean = getattr(self.model, "semanticache_forward", None)
        if lean is not None and len(ids) == 1:  # a decoding step: no tensors made for the token and position
            with self._lock, torch.inference_mode():
                return lean.token(kv, ids[0], start, head=head)[0]
        device = self.device
        input_ids = torch.tensor([ids], device=device)
        positions = torch.arange(start, start + len(ids), device=device)[None]
        with self._lock, torch.inference_mode():
            if lean is not None:  # converted weights on a Llama model: fused products (semanticache_rag.fused)
                return lean(kv, input_ids, positions, keep, head=head)[0]
            model = self.model if head else self.model.base_model
            out = model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=True,
                semanticache_kv=kv,
                **({"logits_to_keep": keep} if head else {}),
                **{self._cache_kwarg: kv},
            )
        return out.logits[0] if head else out.last_hidden_state[0, -keep:]

    @cached_property
    def head_ids(self) -> list[int]:
        """Tokens of the prompt head, before the document."""
        return self.tokenizer(self.prompt.head, add_special_tokens=False)["input_ids"]

    def tokenize_document(self, document: Document) -> tuple[list[int], list[int], torch.Tensor]:
        """The document's tokens, the character offset where each starts, and each one's page index."""
        body = self.tokenizer(document.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [start for start, _ in body["offset_mapping"]]
        starts = torch.tensor([p.start for p in document.pages])
        pages = (torch.searchsorted(starts, torch.tensor(offsets, dtype=torch.long), right=True) - 1).clamp(min=0)
        return body["input_ids"], offsets, pages.to(torch.int32)

    def tokenize_prefix(self, document: Document) -> tuple[list[int], torch.Tensor]:
        """Tokens of template head + document, and each token's page index (-1: template)."""
        ids, _, pages = self.tokenize_document(document)
        head = self.head_ids
        return head + ids, torch.cat([torch.full((len(head),), -1, dtype=torch.int32), pages])

    def read(self, source, *, progress=True) -> DocumentCache | SectionedCache:
        """Read a document (path, text or :class:`Document`) once and return its cache.

        A document that fits the context (with :attr:`answer_reserve` to spare) is read whole into
        a :class:`DocumentCache`; a longer one section by section into a
        :class:`~semanticache_rag.sections.SectionedCache`, each section compressed as soon as it
        is read, so memory holds one section's full KV at most. Either answers questions the same
        way (:meth:`ask`, :meth:`conversation`). With a :attr:`store`, a document read before by
        the same model and compressor is loaded from it instead (same tensors, so the same
        answers), and a new one is stored.

        ``progress``: a bar over tokens (``True``), none (``False``), or a function called with
        (tokens read, tokens to read) as reading goes (a server reporting progress).

        Raises
        ------
        DocumentError
            The document cannot be read.
        ContextLengthError
            The model's context cannot hold one section and a question (checked before any model work).
        StoreError
            The document's cache would not fit the store's disk budget (checked before reading).
        """
        if self.store is None:
            return self._read(load_document(source), progress)
        document = self.store.load_document(source)  # skips text extraction for a file read before
        return self.store.fetch(self, document, lambda sections=None: self._read(document, progress, sections))

    def _read(self, document: Document, progress, sections=None):
        from semanticache_rag.reading import read_sections

        ids, offsets, pages = self.tokenize_document(document)
        if len(self.head_ids) + len(ids) <= self.read_limit:
            head = torch.full((len(self.head_ids),), -1, dtype=torch.int32)
            prefill = self.prefill_tokens(document, self.head_ids + ids, torch.cat([head, pages]), progress=progress)
            return self.compress(prefill, release=True)
        if len(self.head_ids) + self.section_tokens > self.read_limit:
            raise ContextLengthError(
                f"{document.name} ({len(ids):,} tokens) is read in sections of up to {self.section_tokens:,} tokens; "
                f"{self.model_name} reads at most {self.read_limit:,} with the prompt head ({len(self.head_ids)}); "
                "use a smaller section_tokens"
            )
        if self.store is not None:  # a long read whose result the store could not keep: say so before it starts
            self.store.check_fits(self.estimated_nbytes(len(self.head_ids) + len(ids)), document.name)
        return read_sections(self, document, (ids, offsets, pages), progress=progress, checkpoint=sections)

    def estimated_nbytes(self, tokens: int) -> int:
        """About how many bytes the cache of ``tokens`` tokens takes with this engine's compressor."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * heads * head_dim * self.model.dtype.itemsize
        return int(tokens * per_token * (1 - self.compressor.compression_ratio))

    def prefill(self, source, *, progress: bool = True, surprisal: bool | None = None) -> Prefill:
        """Read a document into its full, uncompressed KV (the expensive step of :meth:`read`).

        ``surprisal`` (default: whether the engine's compressor needs it) also records each
        token's ``-log p``. Benchmarks prefill once and :meth:`compress` with several compressors.
        Only documents that fit the context are prefilled whole; :meth:`read` reads longer ones.
        """
        document = load_document(source)
        ids, pages = self.tokenize_prefix(document)
        return self.prefill_tokens(document, ids, pages, progress=progress, surprisal=surprisal)

    def prefill_tokens(
        self,
        document: Document,
        ids: list[int],
        pages: torch.Tensor,
        *,
        progress=True,
        surprisal: bool | None = None,
    ) -> Prefill:
        """Prefill given prefix tokens (``pages``: page index per token, -1 for template tokens);
        ``progress`` as for :meth:`read`."""
        limit = self.read_limit
        if len(ids) > limit:
            raise ContextLengthError(
                f"{document.name} is {len(ids):,} tokens; {self.model_name} prefills at most {limit:,} in one piece "
                f"({self.context_length:,} context minus {self.answer_reserve} for question and answer). "
                "Engine.read() reads longer documents in sections."
            )
        need = self.compressor.needs_surprisal if surprisal is None else surprisal
        started = time.perf_counter()
        kv = ConversationKV(num_layers=self.model.config.num_hidden_layers, capacity=len(ids))
        with Progress(progress, len(ids), document.name) as bar:
            token_surprisal = self.run_tokens(kv, ids, 0, need, on_chunk=bar.update)
        keys_values = [layer.appended() for layer in kv.layers]
        return Prefill(document, ids, pages, keys_values, token_surprisal, time.perf_counter() - started)

    def compress(
        self, prefill: Prefill, compressor: Compressor | None = None, *, release: bool = False
    ) -> DocumentCache:
        """Compress a :class:`Prefill` with ``compressor`` (default: the engine's) into a cache.

        ``release=True`` lets the compressor drop each layer's full keys and values as soon as that
        layer is compressed (:meth:`read` does; the prefill cannot be compressed again after that).
        """
        compressor = compressor or self.compressor
        if compressor.needs_surprisal and prefill.surprisal is None:
            raise ConfigError(f"{compressor.name} needs token surprisal: prefill with surprisal=True")
        started = time.perf_counter()
        context = CompressionContext(
            torch.tensor(prefill.ids), prefill.pages < 0, prefill.surprisal, self.tokenizer, release_layers=release
        )
        layers, zoom = compressor.compress_cache(prefill.keys_values, context)
        return DocumentCache(
            prefill.document,
            layers,
            torch.tensor(prefill.ids),
            prefill.pages,
            self.model_name,
            repr(compressor),
            prefill.seconds,
            time.perf_counter() - started,
            zoom,
        )

    def run_tokens(self, kv: ConversationKV, ids: list[int], start: int, surprisal: bool, on_chunk=None):
        """Prefill ``ids`` at positions ``start...`` into ``kv`` in chunks of :attr:`prefill_chunk`.

        Returns each token's surprisal ``-log p`` (the first one's stays 0: nothing in ``ids``
        predicts it) when ``surprisal``, else ``None``; ``on_chunk(n)`` is called after each chunk.
        """
        token_surprisal = torch.zeros(len(ids))
        for offset in range(0, len(ids), self.prefill_chunk):
            chunk = ids[offset : offset + self.prefill_chunk]
            if not surprisal:
                self.forward(kv, chunk, start + offset)
            else:  # logits at t predict token t + 1, the next chunk's first token included
                targets = torch.tensor(ids[offset + 1 : offset + len(chunk) + 1])
                token_surprisal[offset + 1 : offset + 1 + len(targets)] = self._surprisal(
                    kv, chunk, start + offset, targets
                )
            if on_chunk is not None:
                on_chunk(len(chunk))
        return token_surprisal if surprisal else None

    def _surprisal(self, kv: ConversationKV, chunk: list[int], start: int, targets: torch.Tensor) -> torch.Tensor:
        """Run ``chunk`` into ``kv``; return ``-log p`` of ``targets`` (the tokens that follow each position),
        computed a block of positions and vocabulary at a time (:mod:`semanticache_rag.surprisal`)."""
        if not surprisal.plain_head(self.model):
            return surprisal.blockwise(self._run(kv, chunk, start, len(chunk), head=True), targets, None)  # logits
        # converted weights may keep a head for many positions at once (semanticache_rag.weights)
        hidden = self._run(kv, chunk, start, len(chunk), head=False)  # final hidden states
        reading = getattr(self.model, "semanticache_reading_head", None)
        return surprisal.blockwise(
            hidden, targets, reading if reading is not None else self.model.get_output_embeddings()
        )

    def generate_uncached(self, cache: DocumentCache, turns, max_new_tokens: int = 256) -> str:
        """Greedy answer from re-reading the whole prompt with ``model.generate`` (no cache reuse).

        What a stock pipeline computes for every question; the reference our cached answers must
        equal (with :class:`NoCompression`) and the baseline of the follow-up latency benchmark.
        """
        tail = self.tokenizer(self.prompt.tail(list(turns)), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([cache.prefix_ids.tolist() + tail], device=self.device)
        eos = self.tokenizer.eos_token_id
        with self._lock, torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        text = self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        return text.rstrip("\ufffd").strip()  # as answers do: an incomplete last character is dropped

    @property
    def spec(self) -> ModelSpec:
        """The shapes, dtype and device of this model's caches."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return ModelSpec(config.num_hidden_layers, heads, head_dim, self.model.dtype, self.device)

    def empty_cache(self) -> DocumentCache:
        """A cache of no tokens, for prompts that hold no known document."""
        none = torch.zeros(0, dtype=torch.long)
        layers = self.spec.empty_layers()
        return DocumentCache(load_document("(empty)"), layers, none, none.int(), self.model_name, "none", 0.0, 0.0)

    def conversation(self, cache: DocumentCache, **options):
        """A multi-turn chat over ``cache`` (a cheap fork: the document cache is shared)."""
        from semanticache_rag.conversation import Conversation

        return Conversation(self, cache, **options)

    def ask(self, cache: DocumentCache, question: str, **options):
        """Answer one question from ``cache``; returns an :class:`~semanticache_rag.Answer`."""
        return self.conversation(cache).ask(question, **options)

    def stream(self, cache: DocumentCache, question: str, **options):
        """Yield the answer to ``question`` as text pieces."""
        return self.conversation(cache).stream(question, **options)
