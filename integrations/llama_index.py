"""LlamaIndex adapters: an LLM, a PDF reader, and a query and a chat engine over one cached document.

Two ways to use a document:

* Stock pipelines (``SummaryIndex(...).as_query_engine(llm=SemantiCacheLlamaLLM())``): register
  the document (:meth:`SemantiCacheLlamaLLM.register_document`) and every prompt that contains it
  is answered from its compressed cache; ``raw["usage"]`` reports ``cached_tokens`` and
  ``cache_creation_tokens``.
* :class:`DocumentQueryEngine` and its :meth:`~DocumentQueryEngine.as_chat_engine`: the document is
  read once into a :class:`~semanticache_rag.DocumentCache`; each question and chat turn computes
  only its own tokens, and responses cite the pages they most likely came from.

Example
-------
>>> from semanticache_rag.integrations.llama_index import DocumentQueryEngine, SemantiCacheLlamaLLM
>>> engine = DocumentQueryEngine(source="guide.pdf", llm=SemantiCacheLlamaLLM(max_new_tokens=64))
>>> print(engine.query("What is the latest version?"))
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
        TextBlock,
    )
    from llama_index.core.bridge.pydantic import ConfigDict
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.readers.base import BaseReader
    from llama_index.core.schema import BaseNode
    from llama_index.core.schema import Document as LIDocument
except ImportError as exc:  # pragma: no cover - exercised by the import-hint test
    raise ImportError(
        'semanticache_rag.integrations.llama_index needs llama-index-core: pip install "semanticache-rag[llama-index]"'
    ) from exc

from semanticache_rag.documents import read_pdf
from semanticache_rag.integrations._common import EngineSettings, generation_options, iterate_in_thread, usage_counts

__all__ = ["DocumentChatEngine", "DocumentQueryEngine", "SemantiCacheLlamaLLM", "SemantiCachePDFReader"]

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}
_SKIPPED_BLOCKS = frozenset({"thinking", "cache"})  # hidden reasoning and provider cache markers


def _text(message: ChatMessage) -> str:
    parts = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif block.block_type not in _SKIPPED_BLOCKS:
            raise ValueError(f"a {block.block_type!r} block in a {message.role.value} message; only text is supported")
    return "".join(parts)


def to_role_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages as ``{"role", "content"}`` dicts for the model's chat template.

    Raises
    ------
    ValueError
        Tool or function messages, or content that is not text.
    """
    converted = []
    for message in messages:
        if message.role not in _ROLES:
            raise ValueError(f"{message.role.value!r} messages are not supported; use system, user and assistant")
        converted.append({"role": _ROLES[message.role], "content": _text(message)})
    return converted


def _raw(answer) -> dict[str, Any]:
    """An Answer as ``raw``: its fields plus OpenAI-style ``usage`` (read by TokenCountingHandler)."""
    return {**answer.to_dict(), "usage": usage_counts(answer)}


class SemantiCacheLlamaLLM(EngineSettings, CustomLLM):
    """LlamaIndex LLM on a local model; documents registered once are served from their cache.

    Chat messages keep their roles through the model's chat template; a completion prompt is one
    user message (after :attr:`system_prompt`, if set). Construction is cheap: the model loads on
    first use; LLMs with equal settings (LangChain adapters included) share one engine.
    """

    model_config = ConfigDict(extra="forbid")  # a misspelt option raises instead of being ignored

    @classmethod
    def class_name(cls) -> str:
        return "SemantiCacheLlamaLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """Context window and model name of the loaded model (loads it on first use)."""
        return LLMMetadata(
            context_window=self.engine.context_length,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            model_name=self.engine.model_name,
        )

    def register_document(self, source, doc_id: str | None = None) -> str:
        """Register a document so prompts that contain it are served from its cache; return its id.

        ``source`` is a path, text, :class:`~semanticache_rag.Document`, page strings, or LlamaIndex
        documents/nodes (e.g. :class:`SemantiCachePDFReader`'s pages), whose texts are joined with
        ``"\\n\\n"``.
        """
        if isinstance(source, BaseNode):
            source = [source]
        if isinstance(source, Sequence) and not isinstance(source, str):
            source = [page.get_content() if isinstance(page, BaseNode) else page for page in source]
        return self.prompt_cache.register(source, doc_id)

    # -- completion and chat (sync) ----------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return generation_options(self.default_options(), kwargs)

    def _prompt_messages(self, prompt: str, formatted: bool) -> list[dict[str, str]]:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def _complete(self, messages: list[dict[str, str]], kwargs: dict) -> CompletionResponse:
        answer = self.prompt_cache.ask(messages, **self._options(kwargs))
        return CompletionResponse(text=answer.answer, raw=_raw(answer), additional_kwargs=usage_counts(answer))

    def _completions(self, messages: list[dict[str, str]], kwargs: dict) -> CompletionResponseGen:
        """Responses with growing text, then one with an empty delta and the usage."""
        stream = self.prompt_cache.stream(messages, **self._options(kwargs))
        text = ""
        for piece in stream:
            text += piece
            yield CompletionResponse(text=text, delta=piece)
        answer = stream.answer
        yield CompletionResponse(text=text, delta="", raw=_raw(answer), additional_kwargs=usage_counts(answer))

    def _chat_messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
        return to_role_dicts(self._extend_messages(list(messages)))

    @staticmethod
    def _as_chat(response: CompletionResponse) -> ChatResponse:
        message = ChatMessage(role=MessageRole.ASSISTANT, content=response.text)
        return ChatResponse(
            message=message, delta=response.delta, raw=response.raw, additional_kwargs=response.additional_kwargs
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(self._prompt_messages(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._completions(self._prompt_messages(prompt, formatted), kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._as_chat(self._complete(self._chat_messages(messages), kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return (self._as_chat(r) for r in self._completions(self._chat_messages(messages), kwargs))

    # -- async: the blocking work runs in worker threads ---------------------------------------

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, self._prompt_messages(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        messages = self._prompt_messages(prompt, formatted)
        return iterate_in_thread(lambda: self._completions(messages, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await asyncio.to_thread(self._complete, self._chat_messages(messages), kwargs)
        return self._as_chat(response)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        converted = self._chat_messages(messages)

        async def responses() -> ChatResponseAsyncGen:
            async for response in iterate_in_thread(lambda: self._completions(converted, kwargs)):
                yield self._as_chat(response)

        return responses()


class SemantiCachePDFReader(BaseReader):
    """Read a PDF as one LlamaIndex ``Document`` per page, with this package's text extraction.

    Metadata as LlamaIndex's ``PDFReader`` and ``SimpleDirectoryReader`` set it: ``file_path``,
    ``file_name`` and ``page_label``, plus ``extra_info``. The pages' texts joined with
    ``"\\n\\n"`` are exactly what :func:`~semanticache_rag.documents.read_pdf` reads.
    """

    def lazy_load_data(
        self, file: str | os.PathLike[str], extra_info: dict | None = None, fs: Any = None
    ) -> Iterator[LIDocument]:
        """Yield the pages; raises :class:`~semanticache_rag.DocumentError` for unreadable PDFs.

        ``fs`` (passed by ``SimpleDirectoryReader``) must be a local file system.
        """
        protocol = getattr(fs, "protocol", "file")
        if "file" not in ((protocol,) if isinstance(protocol, str) else tuple(protocol)):
            raise NotImplementedError(f"SemantiCachePDFReader reads local files only, not {protocol!r}")
        document = read_pdf(file)
        for page in document.pages:
            metadata = {"file_path": str(file), "file_name": Path(file).name, "page_label": page.label}
            yield LIDocument(text=document.text[page.start : page.end], metadata={**metadata, **(extra_info or {})})


from semanticache_rag.integrations._llama_index_engines import DocumentChatEngine, DocumentQueryEngine  # noqa: E402
