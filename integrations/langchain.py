"""LangChain adapters: a chat model, a text LLM and a PDF loader backed by semanticache-rag.

A stock chain (e.g. ``create_stuff_documents_chain``) pastes the document into every prompt.
Register the document once (:meth:`ChatSemantiCache.register_document`) and every prompt that
contains it is answered from the document's compressed KV cache: the first call prefills it
(``usage_metadata["input_token_details"]["cache_creation"]``), later calls read it
(``["cache_read"]``) and compute only the question's tokens.

Example
-------
>>> from semanticache_rag.integrations.langchain import ChatSemantiCache, SemantiCachePDFLoader
>>> pages = SemantiCachePDFLoader("guide.pdf").load()
>>> chat = ChatSemantiCache(compression="semanticache", compression_ratio=0.5)
>>> chat.register_document(pages)  # the pages as a stuff chain joins them, "\\n\\n"
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForLLMRun,
        CallbackManagerForLLMRun,
    )
    from langchain_core.documents import Document as LCDocument
    from langchain_core.language_models import BaseChatModel, LangSmithParams
    from langchain_core.language_models.llms import LLM
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
    from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
    from langchain_core.outputs import (
        ChatGeneration,
        ChatGenerationChunk,
        ChatResult,
        Generation,
        GenerationChunk,
        LLMResult,
    )
except ImportError as exc:  # pragma: no cover - exercised by the import-hint test
    raise ImportError(
        'semanticache_rag.integrations.langchain needs langchain-core: pip install "semanticache-rag[langchain]"'
    ) from exc
from pydantic import ConfigDict, Field, model_validator

from semanticache_rag.errors import ConfigError
from semanticache_rag.integrations._common import EngineSettings, generation_options, iterate_in_thread
from semanticache_rag.integrations._langchain_documents import SemantiCachePDFLoader, SemantiCacheRetriever
from semanticache_rag.models import DEFAULT_MODEL

__all__ = ["ChatSemantiCache", "SemantiCacheLLM", "SemantiCachePDFLoader", "SemantiCacheRetriever"]

_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_SKIPPED_BLOCKS = frozenset({"thinking", "reasoning"})  # a model's hidden reasoning is not content
# Set on each concrete class: LangChain's Serializable base sets extra="ignore", and the last base wins.
_CONFIG = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)


class _SemantiCacheModel(EngineSettings):
    """What :class:`ChatSemantiCache` and :class:`SemantiCacheLLM` add to the shared fields."""

    max_new_tokens: int = Field(
        default=256, ge=1, alias="max_tokens", description="Most tokens per answer (alias: max_tokens)."
    )
    stop: list[str] | None = Field(default=None, description="Strings that end every answer (not included).")
    streaming: bool = Field(default=False, description="Whether invoke() streams internally (token callbacks).")

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_max_tokens(cls, values: Any) -> Any:
        if isinstance(values, dict) and "max_tokens" in values and "max_new_tokens" in values:
            raise ValueError("pass max_new_tokens or its alias max_tokens, not both")
        return values

    def register_document(self, source, doc_id: str | None = None) -> str:
        """Register a document so prompts that contain it are served from its cache; return its id.

        ``source`` is a path, text, :class:`~semanticache_rag.Document`, page strings, or LangChain
        ``Document`` s, whose ``page_content`` is joined with ``"\\n\\n"`` as a stuff chain joins it.
        """
        if isinstance(source, LCDocument):
            source = [source]
        if isinstance(source, Sequence) and not isinstance(source, str):
            source = [page.page_content if isinstance(page, LCDocument) else page for page in source]
        return self.prompt_cache.register(source, doc_id)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with the model's own tokenizer (no special tokens), or ``custom_get_token_ids``."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model or DEFAULT_MODEL,
            "compression": self.compression,
            "compression_ratio": self.compression_ratio,
            **self.default_options(),
        }

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Generation options of one call; LangChain's ``max_tokens`` and ``model`` are understood."""
        kwargs = dict(kwargs)
        if "max_tokens" in kwargs:
            kwargs["max_new_tokens"] = kwargs.pop("max_tokens")
        model = kwargs.pop("model", None)
        if model is not None and model not in {self.model, self.engine.model_name}:
            raise ConfigError(
                f"this adapter serves {self.engine.model_name!r}; a per-call model={model!r} is not supported: "
                f"create another adapter with model={model!r}"
            )
        return generation_options(self.default_options(), kwargs, stop)

    def _ls_params(
        self, stop: list[str] | None, kwargs: dict[str, Any], model_type: Literal["chat", "llm"]
    ) -> LangSmithParams:
        return LangSmithParams(
            ls_provider="semanticache",
            ls_model_name=kwargs.get("model") or self.model or DEFAULT_MODEL,
            ls_model_type=model_type,
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens)),
            **({"ls_stop": stop} if stop else {}),
        )

    def _answer_metadata(self, answer) -> dict[str, Any]:
        return {
            "model_name": self.engine.model_name,
            "finish_reason": answer.finish_reason,
            "document_id": answer.document_id,
            "prefill_s": answer.prefill_s,
            "decode_s": answer.decode_s,
            "tokens_per_s": answer.tokens_per_s,
            "cache_bytes": answer.cache_bytes,
            "entries_removed": answer.entries_removed,
            "bytes_removed": answer.bytes_removed,
            "host_bytes": answer.host_bytes,
            "spans_expanded": answer.spans_expanded,
            "tokens_reconstructed": answer.tokens_reconstructed,
            "pages": list(answer.pages),
            "sections": list(answer.sections),
            "routing": answer.routing,
            "routing_matched": answer.routing_matched,
        }


def _usage(answer) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=answer.prompt_tokens,
        output_tokens=answer.completion_tokens,
        total_tokens=answer.prompt_tokens + answer.completion_tokens,
        input_token_details=InputTokenDetails(
            cache_read=answer.cached_tokens, cache_creation=answer.cache_creation_tokens
        ),
    )


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        kind = block.get("type") if isinstance(block, dict) else "text"
        if kind == "text":
            parts.append(block["text"] if isinstance(block, dict) else block)
        elif kind not in _SKIPPED_BLOCKS:
            raise ValueError(f"{type(message).__name__} holds a {kind!r} block; only text content is supported")
    return "".join(parts)


def to_role_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """System/Human/AI (and ``ChatMessage``) messages as ``{"role", "content"}`` dicts.

    Raises
    ------
    ValueError
        Tool or function messages, or content that is not text (the model reads text only).
    """
    converted = []
    for message in messages:
        if message.type not in _ROLES and not isinstance(message, ChatMessage):
            raise ValueError(f"{type(message).__name__} is not supported; use system, human and AI messages")
        role = message.role if isinstance(message, ChatMessage) else _ROLES[message.type]
        converted.append({"role": role, "content": _text(message)})
    return converted


class ChatSemantiCache(_SemantiCacheModel, BaseChatModel):
    """LangChain chat model on a local model; documents registered once are served from their cache.

    Construction is cheap: the model loads on first use (or use :meth:`from_pretrained` /
    :meth:`from_engine`). ``usage_metadata`` reports ``input_token_details`` ``cache_read`` (tokens
    reused from a document cache) and ``cache_creation`` (tokens this call prefilled into one).
    """

    model_config = _CONFIG

    @property
    def _llm_type(self) -> str:
        return "semanticache-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params(stop, kwargs, "chat")

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Tokens of ``messages`` rendered through the model's chat template (tools unsupported)."""
        if tools:
            raise ValueError("ChatSemantiCache does not support tools")
        prompt = self.prompt_cache.render(to_role_dicts(messages))
        return len(self.get_token_ids(prompt))

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        answer = self.prompt_cache.ask(to_role_dicts(messages), **self._options(stop, kwargs))
        return self._result(answer)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    def _result(self, answer) -> ChatResult:
        metadata = self._answer_metadata(answer)
        message = AIMessage(content=answer.answer, usage_metadata=_usage(answer), response_metadata=metadata)
        generation = ChatGeneration(message=message, generation_info={"finish_reason": answer.finish_reason})
        return ChatResult(generations=[generation], llm_output={"model_name": metadata["model_name"]})

    def _chunks(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> Iterator:
        """Text pieces, then an empty last chunk with usage and response metadata."""
        stream = self.prompt_cache.stream(to_role_dicts(messages), **self._options(stop, kwargs))
        for piece in stream:
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        answer = stream.answer
        last = AIMessageChunk(
            content="",
            usage_metadata=_usage(answer),
            response_metadata=self._answer_metadata(answer),
            chunk_position="last",
        )
        yield ChatGenerationChunk(message=last, generation_info={"finish_reason": answer.finish_reason})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._chunks(messages, stop, kwargs)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


class SemantiCacheLLM(_SemantiCacheModel, LLM):
    """LangChain text LLM: each prompt is one user message through the model's chat template.

    Shares its engine and registered documents with a :class:`ChatSemantiCache` of equal settings
    (or pass ``prompt_cache=chat.prompt_cache`` to :meth:`from_engine`). ``generation_info`` holds
    the finish reason and token counts, ``cache_read`` and ``cache_creation`` included.
    """

    model_config = _CONFIG

    @property
    def _llm_type(self) -> str:
        return "semanticache"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params(stop, kwargs, "llm")

    def _info(self, answer) -> dict[str, Any]:
        usage = _usage(answer)
        return {
            **self._answer_metadata(answer),
            "prompt_tokens": usage["input_tokens"],
            "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"],
            **usage["input_token_details"],
        }

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return self.prompt_cache.ask(prompt, **self._options(stop, kwargs)).answer

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        options = self._options(stop, kwargs)
        answers = [self.prompt_cache.ask(prompt, **options) for prompt in prompts]
        generations = [[Generation(text=a.answer, generation_info=self._info(a))] for a in answers]
        return LLMResult(generations=generations, llm_output={"model_name": self.engine.model_name})

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return await asyncio.to_thread(self._generate, prompts, stop, None, **kwargs)

    def _chunks(self, prompt: str, stop: list[str] | None, kwargs: dict) -> Iterator[GenerationChunk]:
        stream = self.prompt_cache.stream(prompt, **self._options(stop, kwargs))
        for piece in stream:
            yield GenerationChunk(text=piece)
        yield GenerationChunk(text="", generation_info=self._info(stream.answer))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(prompt, stop, kwargs):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._chunks(prompt, stop, kwargs)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
