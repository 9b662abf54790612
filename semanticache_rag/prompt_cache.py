"""Serve stock pipelines' prompts from cached documents (prompt caching for registered documents).

LangChain's stuff-documents chain or LlamaIndex's query engines paste a document into a prompt of
their own. Register the document once; any prompt that contains it is split at the document's
end: everything up to there (the pipeline's instructions and the document) is prefilled once,
compressed with the engine's compressor and kept; the rest (the question) is all that later
calls compute. The split is at the same character for every prompt of that pipeline, so later
prompts find the cache by exact text match and answers stay identical to a fresh prefill of the
same cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from semanticache_rag.conversation import Answer, Conversation
from semanticache_rag.documents import Document, document_from_text, load_document
from semanticache_rag.errors import ConfigError

_ANCHOR = 80  # characters matched at each end of a document
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def _anchor_pairs(raw_pages: list[str], normalised: str) -> list[tuple[str, str]]:
    """(head, tail) strings that mark a document's ends in a prompt, most specific first.

    Pipelines paste the pages as *they* hold them (ligatures, CRLF) with their own text between
    pages (node metadata), so the first pair comes from the raw text of the first and last pages
    long enough to carry an anchor; the second from the normalised document text.
    """
    long_pages = [p.strip() for p in raw_pages if len(p.strip()) >= _ANCHOR] or ["\n\n".join(raw_pages).strip()]
    pairs = [
        (long_pages[0][:_ANCHOR], long_pages[-1][-_ANCHOR:]),
        (normalised.strip()[:_ANCHOR], normalised.strip()[-_ANCHOR:]),
    ]
    return list(dict.fromkeys(pair for pair in pairs if all(pair)))


class AnswerStream:
    """Iterate for text pieces; :attr:`answer` is the :class:`Answer` once iteration ends."""

    def __init__(self, pieces: Iterator[str], conversation: Conversation, created: int, doc_id: str | None):
        self._pieces, self._conversation = pieces, conversation
        self._created, self._doc_id = created, doc_id
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        yield from self._pieces
        answer, cache = self._conversation.last_answer, self._conversation.cache
        # Tokens prefilled by this very call were created, not read, from the cache.
        created_s = cache.prefill_s + cache.compress_s if self._created else 0.0
        self.answer = dataclasses.replace(
            answer,
            cached_tokens=answer.cached_tokens - self._created,
            cache_creation_tokens=self._created,
            document_id=self._doc_id,
            prefill_s=answer.prefill_s + created_s,
        )


class PromptCache:
    """Registered documents and the compressed caches of the prompts that contain them.

    Parameters
    ----------
    engine : Engine
    max_prefixes : int
        Prompt prefixes (document caches) kept in memory, least recently used evicted.
    """

    def __init__(self, engine, max_prefixes: int = 4):
        if max_prefixes < 1:
            raise ConfigError(f"max_prefixes must be >= 1, got {max_prefixes!r}")
        self.engine, self.max_prefixes = engine, max_prefixes
        self.documents: dict[str, Document] = {}
        self._anchors: dict[str, list[tuple[str, str]]] = {}
        self._caches: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self._empty = None

    def register(self, source, doc_id: str | None = None) -> str:
        """Register a document (path, text, :class:`Document` or page texts); return its id."""
        pages = [str(p) for p in source] if isinstance(source, Sequence) and not isinstance(source, str) else None
        document = load_document(document_from_text("\n\n".join(pages)) if pages is not None else source)
        doc_id = doc_id or document.sha256[:16]
        if not _ID.match(doc_id):
            raise ConfigError(f"document id {doc_id!r} may only hold letters, digits, '_', '-', '.' (1-128)")
        raw = pages if pages is not None else [source if isinstance(source, str) and "\n" in source else document.text]
        with self._lock:
            self.documents[doc_id] = document
            self._anchors[doc_id] = _anchor_pairs(raw, document.text)
        return doc_id

    def render(self, messages) -> str:
        """Prompt text of ``messages`` (a string is one user message) through the chat template."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        tokenizer = self.engine.tokenizer
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n\n".join(m["content"] for m in messages) + "\n\nAnswer:"

    def locate(self, text: str) -> tuple[str, int, int] | None:
        """(document id, start, end) of the registered document found furthest into ``text``."""
        best = None
        for doc_id, pairs in list(self._anchors.items()):
            for head, tail in pairs:
                start, end = text.find(head), text.rfind(tail)
                if start >= 0 and end >= start:
                    if best is None or end + len(tail) > best[2]:
                        best = (doc_id, start, end + len(tail))
                    break
        return best

    def stream(self, messages, **options) -> AnswerStream:
        """Answer a pipeline's prompt, reusing the cache of a registered document it contains."""
        text = self.render(messages)
        found = self.locate(text)
        cache, created, doc_id, split = self._empty_cache(), 0, None, 0
        if found:
            doc_id, start, split = found
            cache, created = self._cache_for(text, start, split, doc_id)
        tail = self.engine.tokenizer(text[split:], add_special_tokens=False)["input_ids"]
        question = messages if isinstance(messages, str) else messages[-1]["content"]
        conversation = Conversation(self.engine, cache)
        return AnswerStream(conversation.stream_tokens(tail, question, **options), conversation, created, doc_id)

    def ask(self, messages, **options) -> Answer:
        """:meth:`stream`, consumed; returns the :class:`Answer`."""
        stream = self.stream(messages, **options)
        for _ in stream:
            pass
        return stream.answer

    def _empty_cache(self):
        if self._empty is None:
            self._empty = self.engine.empty_cache()
        return self._empty

    def _cache_for(self, text: str, start: int, split: int, doc_id: str):
        """The compressed cache of ``text[:split]``, built (and counted as created) on first use."""
        key = hashlib.sha256(text[:split].encode()).hexdigest()
        with self._lock:
            if key in self._caches:
                self._caches.move_to_end(key)
                return self._caches[key], 0
        tokenizer, engine, document = self.engine.tokenizer, self.engine, self.documents[doc_id]
        created = 0

        def compute(sections=None):  # a prompt prefix is read whole: no sections to keep
            nonlocal created
            head = tokenizer(text[:start], add_special_tokens=False)["input_ids"]
            body = tokenizer(text[start:split], add_special_tokens=False)["input_ids"]
            pages = torch.cat([torch.full((len(head),), -1), torch.zeros(len(body))]).to(torch.int32)
            created = len(head) + len(body)
            return engine.compress(engine.prefill_tokens(document, head + body, pages, progress=False))

        if engine.store is None:
            cache = compute()
        else:  # kept on disk too: another process (or a later run) with this prompt loads it
            prompt = hashlib.sha256(f"{start}\0{text[:split]}".encode()).hexdigest()
            cache = engine.store.fetch(engine, document, compute, prompt=prompt)
        with self._lock:
            self._caches[key] = cache
            while len(self._caches) > self.max_prefixes:
                self._caches.popitem(last=False)
        return cache, created
