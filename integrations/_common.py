"""What the LangChain and LlamaIndex adapters share; imports neither framework.

The adapters stay thin: they translate messages and results, and everything they do with the
model goes through one :class:`Runtime` (an :class:`~semanticache_rag.Engine` and a
:class:`~semanticache_rag.prompt_cache.PromptCache`). Runtimes are built on first use and shared
per process by their settings, so LangChain and LlamaIndex objects configured alike load the model
once and see the same registered documents.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar, cast

from pydantic import BaseModel, Field, PrivateAttr

from semanticache_rag.errors import ConfigError

T = TypeVar("T")

GENERATION_OPTIONS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "loop_guard",
)


@dataclass(frozen=True)
class Runtime:
    """An engine and the prompt cache of the documents registered with it.

    Attributes
    ----------
    engine : Engine
    prompt_cache : PromptCache
    """

    engine: object
    prompt_cache: object

    @classmethod
    def for_engine(cls, engine, prompt_cache=None) -> Runtime:
        """Wrap an engine that is already loaded (``prompt_cache`` defaults to a new one)."""
        from semanticache_rag.prompt_cache import PromptCache

        return cls(engine, prompt_cache if prompt_cache is not None else PromptCache(engine))


# Kept for reuse, least recently used dropped first; adapters keep their own runtime alive as long as they live.
MAX_RUNTIMES = 8  # settings combinations
MAX_MODELS = 2  # loaded models (each settings combination of the same model shares one)
_RUNTIMES: OrderedDict[tuple, Runtime] = OrderedDict()
_MODELS: OrderedDict[tuple, tuple] = OrderedDict()  # (model, weights) -> (model, tokenizer, name)
_AUTO: dict[str | None, str] = {}  # model -> the format weights="auto" gave it (one load for "auto" and that format)
_RUNTIMES_LOCK = threading.Lock()


def shared_runtime(
    model: str | None,
    compression: str,
    compression_ratio: float | None,
    store: bool | str = False,
    weights: str = "auto",
) -> Runtime:
    """The process-wide runtime for these settings, loading the model on first use.

    ``store``: ``False`` keeps document caches in memory only; ``True`` also on disk in the default
    store directory (as the command line does); a path: in that directory. ``weights``: the
    matrices: ``"auto"`` (the default), as loaded or weight-only (:mod:`semanticache_rag.weights`). Settings that differ
    only in compression or store share one loaded model; the last :data:`MAX_RUNTIMES` settings
    and :data:`MAX_MODELS` models are kept for reuse (an adapter keeps its own alive).

    Raises
    ------
    ConfigError
        Unknown compression or a ratio outside the compressor's range.
    ModelLoadError
        The model cannot be loaded offline.
    """
    from semanticache_rag import Engine, make_compressor
    from semanticache_rag.models import DEFAULT_MODEL, load_model

    if model is not None and model.lower() in {DEFAULT_MODEL.lower(), "default"}:
        model = None  # the names Engine.from_pretrained treats as the default model: one load
    key = (model, compression, compression_ratio, store, weights)
    with _RUNTIMES_LOCK:  # one load per model, also when threads race for it
        if key in _RUNTIMES:
            _RUNTIMES.move_to_end(key)
            return _RUNTIMES[key]
        from semanticache_rag.store import DocumentStore

        compressor = make_compressor(compression, compression_ratio)
        loaded = (model, _AUTO.get(model, weights) if weights == "auto" else weights)
        if loaded not in _MODELS:
            result = load_model(model, weights=weights)
            if weights == "auto":
                _AUTO[model] = getattr(result[0], "semanticache_weights", "model")
                loaded = (model, _AUTO[model])
            _MODELS[loaded] = result
        _MODELS.move_to_end(loaded)
        hf_model, tokenizer, name = _MODELS[loaded]
        disk = None if store is False else DocumentStore(None if store is True else store)
        engine = Engine(hf_model, tokenizer, compressor=compressor, model_name=name, store=disk)
        _RUNTIMES[key] = Runtime.for_engine(engine)
        for kept, limit in ((_RUNTIMES, MAX_RUNTIMES), (_MODELS, MAX_MODELS)):
            while len(kept) > limit:
                kept.popitem(last=False)
        return _RUNTIMES[key]


class EngineSettings(BaseModel):
    """Pydantic fields and lazy engine access that every adapter has (mixed into its base class).

    Construction only validates fields; the model loads on first use of :attr:`runtime`
    (or at once with :meth:`from_pretrained`), or comes ready-made with :meth:`from_engine`.
    """

    model: str | None = Field(
        default=None, description="transformers causal-LM id or local directory; None: SmolLM2-135M-Instruct."
    )
    compression: str = Field(default="none", description="Compressor of document caches: none, semanticache, ...")
    compression_ratio: float | None = Field(
        default=None, description="Fraction of KV entries the compressor removes; None: its default."
    )
    weights: str = Field(
        default="auto",
        description="'auto' (int4-exact for a Llama model whose weights are Q4_1 values, as the default model's; "
        "'fp32' for another fp32 Llama model; else as loaded), 'model' (as loaded), 'fp32' (an fp32 Llama model's "
        "own weights, its decoding steps in one C++ call), or 'fp16' / 'bf16' / 'int8' / 'int4' / 'int4-exact' "
        "weight-only ones: faster on CPUs.",
    )
    store: bool | str = Field(
        default=False,
        description="Keep document caches on disk too: True for the default store directory, or a directory path.",
    )
    max_new_tokens: int = Field(default=256, ge=1, description="Most tokens per answer.")
    temperature: float = Field(default=0.0, ge=0, description="0 decodes greedily; > 0 samples.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass, when sampling.")
    seed: int | None = Field(default=None, description="Seed for sampling, for reproducible samples.")
    repetition_penalty: float = Field(
        default=1.0,
        gt=0,
        description="> 1 makes the answer's own tokens less likely (transformers' processor); 1: off.",
    )
    no_repeat_ngram_size: int = Field(default=0, ge=0, description="No n-gram of this size twice in an answer; 0: off.")
    loop_guard: bool = Field(
        default=True,
        description="End an answer that repeats a sentence or a run of tokens (finish_reason 'repetition').",
    )

    _runtime: Runtime | None = PrivateAttr(default=None)

    @classmethod
    def from_engine(cls, engine, *, prompt_cache=None, **fields):
        """Wrap an already loaded :class:`~semanticache_rag.Engine` (and optionally its prompt cache).

        Pass ``prompt_cache=other.prompt_cache`` to share registered documents with another adapter.
        """
        fields.setdefault("model", engine.model_name)
        fields.setdefault("compression", engine.compressor.name)
        fields.setdefault("compression_ratio", engine.compressor.compression_ratio)
        fields.setdefault("weights", getattr(engine.model, "semanticache_weights", "model"))
        adapter = cls(**fields)
        adapter._runtime = Runtime.for_engine(engine, prompt_cache)
        return adapter

    @classmethod
    def from_pretrained(cls, model: str | None = None, **fields):
        """Build the adapter and load its model now, instead of on first use."""
        adapter = cls(model=model, **fields)
        adapter.runtime  # noqa: B018 - load eagerly
        return adapter

    @property
    def runtime(self) -> Runtime:
        """Engine and prompt cache; loaded on first use, shared by adapters with equal settings."""
        if self._runtime is None:
            self._runtime = shared_runtime(
                self.model, self.compression, self.compression_ratio, self.store, self.weights
            )
        return self._runtime

    @property
    def engine(self):
        """The :class:`~semanticache_rag.Engine` (loads the model on first use)."""
        return self.runtime.engine

    @property
    def prompt_cache(self):
        """The :class:`~semanticache_rag.prompt_cache.PromptCache` of registered documents."""
        return self.runtime.prompt_cache

    def default_options(self) -> dict:
        """The generation options these fields set (``stop`` too, where the adapter has one)."""
        return {name: getattr(self, name) for name in GENERATION_OPTIONS if hasattr(self, name)}


def generation_options(defaults: dict, overrides: dict, stop: list[str] | None = None) -> dict:
    """Per-call generation options: ``defaults`` updated by ``overrides``, stop strings merged.

    Options that are None keep the default; stop strings of the call and the defaults both apply.

    Raises
    ------
    ConfigError
        An option the engine does not know (names the allowed ones).
    """
    unknown = sorted(set(overrides) - set(GENERATION_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown generation option(s) {unknown}; use {list(GENERATION_OPTIONS)}")
    options = {k: v for k, v in {**defaults, **overrides}.items() if v is not None and k != "stop"}
    stops = [*(defaults.get("stop") or ()), *(overrides.get("stop") or ()), *(stop or ())]
    if stops:
        options["stop"] = tuple(dict.fromkeys(stops))
    return options


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Run a blocking iterator in worker threads, one step at a time; the event loop stays free.

    ``make_iterator`` is itself called in a thread, since starting a prompt-cache stream can
    prefill a whole document. Stopping early leaves the iterator unfinished, as a sync loop would.
    """
    iterator = await asyncio.to_thread(lambda: iter(make_iterator()))
    done = object()
    while True:
        item = await asyncio.to_thread(next, iterator, done)
        if item is done:
            return
        yield cast(T, item)


def usage_counts(answer) -> dict[str, int]:
    """Token counts of an :class:`~semanticache_rag.Answer` in the OpenAI-style names."""
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        "cached_tokens": answer.cached_tokens,
        "cache_creation_tokens": answer.cache_creation_tokens,
    }


# -- which pages an answer came from ----------------------------------------------------------

_WORD = re.compile(r"\w(?:[\w.'-]*\w)?")
_STOPWORDS = frozenset(
    "the and for are was were with that this from what which who whom whose when where why how "
    "does did has have had not but its into than then them they their there these those you your "
    "can could should would will shall may might must about also only any all one".split()
)


def _words(text: str) -> set[str]:
    """Lower-cased words of >= 3 characters (any length if they hold a digit), stopwords dropped."""
    words = {w.lower() for w in _WORD.findall(text)}
    return {w for w in words if (len(w) >= 3 or any(c.isdigit() for c in w)) and w not in _STOPWORDS}


def _squash(text: str) -> str:
    return " ".join(text.lower().split())


def rank_pages(page_texts: list[str], question: str, answer: str, limit: int) -> list[tuple[int, float]]:
    """Pick the pages an answer most likely came from: ``(page index, score)``, best first.

    The rule, deliberately simple: pages that contain the whole answer (case and whitespace
    ignored, a trailing period dropped) score 1.0. Failing that, a page scores the fraction of
    the distinct words of the question and the answer (>= 3 characters or holding a digit,
    stopwords dropped) it contains; words of the answer count twice, since the question's words
    also appear on pages that do not answer it. At most ``limit`` pages with a score above 0.
    """
    needle = _squash(answer).rstrip(".")
    texts = [_squash(text) for text in page_texts]
    if len(needle) >= 2:
        hits = [(i, 1.0) for i, text in enumerate(texts) if needle in text]
        if hits:
            return hits[:limit]
    answer_words, question_words = _words(answer), _words(question)
    weights = {w: 1.0 for w in question_words} | {w: 2.0 for w in answer_words}
    total = sum(weights.values())
    if not total:
        return []
    scores = []
    for i, text in enumerate(page_texts):
        present = _words(text)
        score = sum(weight for word, weight in weights.items() if word in present) / total
        if score > 0:
            scores.append((i, round(score, 4)))
    scores.sort(key=lambda item: (-item[1], item[0]))
    return scores[:limit]
