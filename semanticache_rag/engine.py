"""The engine: owns one model, reads documents once, answers questions from their caches."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from semanticache_rag.compressors import CompressionContext, Compressor, NoCompression
from semanticache_rag.documents import Document, load_document
from semanticache_rag.errors import ConfigError, ContextLengthError
from semanticache_rag.kv import ConversationKV, LayerKV
from semanticache_rag.prompts import DEFAULT_SYSTEM_PROMPT, PromptFormat

if TYPE_CHECKING:
    from semanticache_rag.store import DocumentStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class DocumentCache:
    """A document read once: its (compressed) KV cache and what maps tokens back to pages.

    Immutable: questions and conversations append to caches of their own.

    Attributes
    ----------
    document : Document
        The text and pages that were read.
    layers : tuple of LayerKV
        Per decoder layer, the cache after compression.
    prefix_ids : Tensor (N,)
        Template head + document tokens; ``N`` is also where appended positions start.
    token_pages : Tensor (N,) int32
        0-based index into ``document.pages`` per token, -1 for template tokens.
    model_name, compressor : str
        What produced the cache.
    prefill_s, compress_s : float
        Seconds spent reading and compressing.
    zoom : object or None
        Host-side state of compressors that re-expand parts of the document per question
        (:class:`~semanticache_rag.compressors.sekv.SpanIndex`); ``None`` for the others.
    """

    document: Document
    layers: tuple[LayerKV, ...]
    prefix_ids: torch.Tensor
    token_pages: torch.Tensor
    model_name: str
    compressor: str
    prefill_s: float
    compress_s: float
    zoom: object | None = None

    @property
    def length(self) -> int:
        """Original tokens (template head + document) the cache stands for."""
        return int(self.prefix_ids.numel())

    @property
    def nbytes(self) -> int:
        """Bytes of all cache tensors, padding and size bookkeeping included."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def full_nbytes(self) -> int:
        """Bytes the uncompressed cache of the same tokens takes."""
        return sum(2 * layer.keys[:, :, :1].nbytes * self.length for layer in self.layers)

    @property
    def host_nbytes(self) -> int:
        """Bytes kept beside the cache in host memory (SeKV's span copies), 0 for most compressors."""
        return 0 if self.zoom is None else self.zoom.nbytes

    @property
    def layer_compression_ratios(self) -> list[float]:
        """Fraction of KV entries removed, per layer."""
        return [1 - layer.num_entries / (layer.keys.shape[1] * self.length) for layer in self.layers]

    @property
    def compression_ratio(self) -> float:
        """Fraction of KV entries removed, over all layers and heads."""
        full = sum(layer.keys.shape[1] * self.length for layer in self.layers)
        return 1 - sum(layer.num_entries for layer in self.layers) / full


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
    ):
        if prefill_chunk < 1 or answer_reserve < 0:
            raise ConfigError(
                f"prefill_chunk must be >= 1 and answer_reserve >= 0, got {prefill_chunk}, {answer_reserve}"
            )
        self.model, self.tokenizer = model, tokenizer
        self.compressor = compressor or NoCompression()
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or "model"
        self.prompt = PromptFormat(tokenizer, system_prompt)
        self.prefill_chunk, self.answer_reserve = prefill_chunk, answer_reserve
        self.store = store
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
        **kwargs,
    ) -> Engine:
        """Load ``model`` (default: SmolLM2-135M-Instruct) and build an engine around it.

        ``kwargs`` are the constructor's (``store=DocumentStore()`` keeps document caches on disk).
        """
        from semanticache_rag.models import load_model

        hf_model, tokenizer, name = load_model(model, device=device, dtype=dtype)
        return cls(hf_model, tokenizer, compressor=compressor, model_name=name, **kwargs)

    @property
    def context_length(self) -> int:
        """Most tokens (document + question + answer) the model can attend to."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, kv: ConversationKV, ids: list[int], start: int, logits_to_keep: int = 1) -> torch.Tensor:
        """Run ``ids`` at positions ``start...`` appending to ``kv``; return their last logits (K, V)."""
        input_ids = torch.tensor([ids], device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        with self._lock, torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                semanticache_kv=kv,
                **{self._cache_kwarg: kv},
            )
        return out.logits[0]

    def tokenize_prefix(self, document: Document) -> tuple[list[int], torch.Tensor]:
        """Tokens of template head + document, and each token's page index (-1: template)."""
        head = self.tokenizer(self.prompt.head, add_special_tokens=False)["input_ids"]
        body = self.tokenizer(document.text, add_special_tokens=False, return_offsets_mapping=True)
        starts = torch.tensor([p.start for p in document.pages])
        offsets = torch.tensor([o[0] for o in body["offset_mapping"]], dtype=torch.long)
        pages = (torch.searchsorted(starts, offsets, right=True) - 1).clamp(min=0).to(torch.int32)
        return head + body["input_ids"], torch.cat([torch.full((len(head),), -1, dtype=torch.int32), pages])

    def read(self, source, *, progress: bool = True) -> DocumentCache:
        """Read a document (path, text or :class:`Document`) once and return its cache.

        With a :attr:`store`, a document read before by the same model and compressor is loaded
        from it instead (same tensors, so the same answers), and a new one is stored.

        Raises
        ------
        DocumentError
            The document cannot be read.
        ContextLengthError
            The document and room for an answer exceed the model's context (checked before
            any model work).
        """
        if self.store is None:
            return self.compress(self.prefill(source, progress=progress))
        document = self.store.load_document(source)  # skips text extraction for a file read before
        return self.store.fetch(self, document, lambda: self.compress(self.prefill(document, progress=progress)))

    def prefill(self, source, *, progress: bool = True, surprisal: bool | None = None) -> Prefill:
        """Read a document into its full, uncompressed KV (the expensive step of :meth:`read`).

        ``surprisal`` (default: whether the engine's compressor needs it) also records each
        token's ``-log p``. Benchmarks prefill once and :meth:`compress` with several compressors.
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
        progress: bool = True,
        surprisal: bool | None = None,
    ) -> Prefill:
        """Prefill given prefix tokens (``pages``: page index per token, -1 for template tokens)."""
        limit = self.context_length - self.answer_reserve
        if len(ids) > limit:
            raise ContextLengthError(
                f"{document.name} is {len(ids):,} tokens; {self.model_name} reads at most {limit:,} "
                f"({self.context_length:,} context minus {self.answer_reserve} for question and answer). "
                "Use a model with a longer context (--model) or split the document."
            )
        need = self.compressor.needs_surprisal if surprisal is None else surprisal
        started = time.perf_counter()
        keys_values, token_surprisal = self._prefill(ids, document.name, progress, need)
        return Prefill(document, ids, pages, keys_values, token_surprisal, time.perf_counter() - started)

    def compress(self, prefill: Prefill, compressor: Compressor | None = None) -> DocumentCache:
        """Compress a :class:`Prefill` with ``compressor`` (default: the engine's) into a cache."""
        compressor = compressor or self.compressor
        if compressor.needs_surprisal and prefill.surprisal is None:
            raise ConfigError(f"{compressor.name} needs token surprisal: prefill with surprisal=True")
        started = time.perf_counter()
        context = CompressionContext(torch.tensor(prefill.ids), prefill.pages < 0, prefill.surprisal, self.tokenizer)
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

    def _prefill(self, ids: list[int], name: str, progress: bool, need_surprisal: bool):
        kv = ConversationKV(num_layers=self.model.config.num_hidden_layers, capacity=len(ids))
        surprisal = torch.zeros(len(ids))
        steps = range(0, len(ids), self.prefill_chunk)
        for start in tqdm(steps, desc=f"Reading {name}", unit="chunk", disable=not progress, leave=False):
            chunk = ids[start : start + self.prefill_chunk]
            logits = self.forward(kv, chunk, start, logits_to_keep=len(chunk) if need_surprisal else 1)
            if need_surprisal:  # logits at t predict token t + 1, the next chunk's first token included
                targets = torch.tensor(ids[start + 1 : start + len(chunk) + 1])
                logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
                surprisal[start + 1 : start + 1 + len(targets)] = -logp.gather(1, targets[:, None])[:, 0]
        return [layer.appended() for layer in kv.layers], surprisal if need_surprisal else None

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

    def empty_cache(self) -> DocumentCache:
        """A cache of no tokens, for prompts that hold no known document."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        empty = torch.zeros(1, heads, 0, head_dim, dtype=self.model.dtype, device=self.device)
        layers = tuple(LayerKV(empty, empty) for _ in range(config.num_hidden_layers))
        none = torch.zeros(0, dtype=torch.long)
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
