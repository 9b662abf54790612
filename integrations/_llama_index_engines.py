"""LlamaIndex query and chat engines over one document read once into a compressed cache.

Exported by :mod:`semanticache_rag.integrations.llama_index`; import them from there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.base.response.schema import Response
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.chat_engine.types import AgentChatResponse, BaseChatEngine, StreamingAgentChatResponse
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from semanticache_rag.errors import ConfigError
from semanticache_rag.integrations._common import generation_options, iterate_in_thread, rank_pages
from semanticache_rag.prompts import Turn


def _default_llm():
    from semanticache_rag.integrations.llama_index import SemantiCacheLlamaLLM

    return SemantiCacheLlamaLLM()


class DocumentQueryEngine(CustomQueryEngine):
    """Answer questions about one document from its cache: read once, then only the question is computed.

    ``Response.source_nodes`` are the pages the answer most likely came from (see
    :func:`~semanticache_rag.integrations._common.rank_pages`); ``Response.metadata`` holds the
    :class:`~semanticache_rag.Answer` fields (``cached_tokens``, ``prompt_tokens``, timings, ...).
    """

    source: Any = Field(description="Path of a PDF or text file, the text itself, or a semanticache Document.")
    llm: Any = Field(
        default_factory=_default_llm,
        description="A SemantiCacheLlamaLLM: the engine, compressor and generation options to use.",
    )
    max_source_pages: int = Field(default=2, ge=0, description="Most pages returned as source nodes.")

    _cache: Any = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def from_cache(cls, cache, llm, **fields) -> DocumentQueryEngine:
        """Use a :class:`~semanticache_rag.DocumentCache` already read by ``llm.engine``.

        Raises
        ------
        ConfigError
            The cache comes from another model.
        """
        if cache.model_name != llm.engine.model_name:
            raise ConfigError(f"the cache was read by {cache.model_name!r}, the LLM is {llm.engine.model_name!r}")
        engine = cls(source=cache.document, llm=llm, **fields)
        engine._cache = cache
        return engine

    @property
    def cache(self):
        """The document's :class:`~semanticache_rag.DocumentCache` (read on first use)."""
        with self._lock:  # read once, also when the first queries race
            if self._cache is None:
                self._cache = self.llm.engine.read(self.source, progress=False)
        return self._cache

    def options(self, **overrides) -> dict[str, Any]:
        """Generation options: the LLM's fields, updated by ``overrides``."""
        return generation_options(self.llm.default_options(), overrides)

    def source_nodes(self, question: str, answer: str, pages: Sequence[str] | None = None) -> list[NodeWithScore]:
        """The pages ``answer`` most likely came from, as scored text nodes.

        ``pages``: the labels of the pages the answer was conditioned on (``Answer.pages``; for a
        long document, those of the sections it was answered from); all pages when ``None``.
        """
        document = self.cache.document
        candidates = [p for p in document.pages if pages is None or p.label in set(pages)]
        texts = [document.text[page.start : page.end] for page in candidates]
        nodes = []
        for index, score in rank_pages(texts, question, answer, self.max_source_pages):
            page = candidates[index]
            metadata = {"page_label": page.label, "file_name": document.name, "file_path": document.source}
            node = TextNode(id_=f"{document.sha256[:16]}-p{page.number}", text=texts[index], metadata=metadata)
            nodes.append(NodeWithScore(node=node, score=score))
        return nodes

    def custom_query(self, query_str: str) -> Response:
        answer = self.llm.engine.ask(self.cache, query_str, **self.options())
        return Response(answer.answer, self.source_nodes(query_str, answer.answer, answer.pages), answer.to_dict())

    async def acustom_query(self, query_str: str) -> Response:
        return await asyncio.to_thread(self.custom_query, query_str)

    def as_chat_engine(self, **options) -> DocumentChatEngine:
        """A multi-turn chat over the same cache (``options``: generation options)."""
        return DocumentChatEngine(self, **options)


class DocumentChatEngine(BaseChatEngine):
    """Multi-turn chat over one document: a :class:`~semanticache_rag.Conversation` on its cache.

    Every turn reuses the document cache and all earlier turns' tokens. Responses carry source
    pages and the :class:`~semanticache_rag.Answer` fields in ``metadata``. Not safe for two
    threads at once (use one chat engine per thread; they can share the query engine).

    Parameters
    ----------
    query_engine : DocumentQueryEngine
        Provides the document cache (read on the first message) and the LLM's options.
    **options
        Generation options that override the LLM's.
    """

    def __init__(self, query_engine: DocumentQueryEngine, **options):
        self.query_engine = query_engine
        self.options = query_engine.options(**options)
        self._conversation = None

    @property
    def conversation(self):
        """The :class:`~semanticache_rag.Conversation` (started on first use)."""
        if self._conversation is None:
            self._conversation = self.query_engine.llm.engine.conversation(self.query_engine.cache, **self.options)
        return self._conversation

    def reset(self) -> None:
        """Forget the turns; the document cache stays."""
        self._conversation = None

    @property
    def chat_history(self) -> list[ChatMessage]:
        if self._conversation is None:
            return []
        history = []
        for turn in self._conversation.turns:
            history.append(ChatMessage(role=MessageRole.USER, content=turn.question))
            history.append(ChatMessage(role=MessageRole.ASSISTANT, content=turn.answer))
        return history

    def _use_history(self, chat_history: list[ChatMessage] | None) -> None:
        """Replace the turns with ``chat_history`` (alternating user and assistant messages)."""
        if chat_history is None:
            return
        roles = [m.role for m in chat_history]
        if roles != [MessageRole.USER, MessageRole.ASSISTANT] * (len(roles) // 2):
            raise ValueError("chat_history must alternate user and assistant messages, starting with user")
        self.reset()
        pairs = zip(chat_history[::2], chat_history[1::2])
        self.conversation.turns = [Turn(q.content or "", a.content or "") for q, a in pairs]

    def _pieces(self, message: str, response: StreamingAgentChatResponse) -> Iterator[str]:
        yield from self.conversation.stream(message)
        answer = self.conversation.last_answer
        response.source_nodes.extend(self.query_engine.source_nodes(message, answer.answer, answer.pages))
        response.metadata = answer.to_dict()  # type: ignore[attr-defined]  # not a field; documented

    def chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        self._use_history(chat_history)
        answer = self.conversation.ask(message)
        nodes = self.query_engine.source_nodes(message, answer.answer, answer.pages)
        return AgentChatResponse(response=answer.answer, source_nodes=nodes, metadata=answer.to_dict())

    def stream_chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> StreamingAgentChatResponse:
        """Stream the answer: iterate ``response_gen``.

        When it ends, ``source_nodes`` are filled and ``metadata`` (an attribute this engine adds;
        ``StreamingAgentChatResponse`` has no such field) holds the :class:`~semanticache_rag.Answer` fields.
        """
        self._use_history(chat_history)
        response = StreamingAgentChatResponse(is_writing_to_memory=False)
        response.chat_stream = (_delta(piece) for piece in self._pieces(message, response))
        return response

    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        return await asyncio.to_thread(self.chat, message, chat_history)

    async def astream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        """Stream without blocking the event loop: iterate ``async_response_gen()``."""
        await asyncio.to_thread(self._use_history, chat_history)
        response = StreamingAgentChatResponse(is_writing_to_memory=False)

        async def deltas() -> AsyncGenerator[ChatResponse, None]:
            async for piece in iterate_in_thread(lambda: self._pieces(message, response)):
                yield _delta(piece)

        response.achat_stream = deltas()
        return response


def _delta(piece: str) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=piece), delta=piece)
