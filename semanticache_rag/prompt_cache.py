"""Serve stock pipelines' prompts from cached documents (prompt caching for registered documents).

LangChain's stuff-documents chain or LlamaIndex's query engines paste a document into a prompt of
their own. Register the document once; any prompt that contains it is split at the document's
end: everything up to there (the pipeline's instructions and the document) is prefilled once,
compressed with the engine's compressor and kept; the rest (the question) is all that later
calls compute. The split is at the same character for every prompt of that pipeline, so later
prompts find the cache by exact text match and answers stay identical to a fresh prefill of the
same cache.

Retrieval pipelines (loader -> splitter -> retriever -> prompt with the retrieved chunks) paste
*pieces* of a document, a few at a time, in any order. Register the pieces the retriever returns
(the splitter's chunks, or the pages): every registered piece found verbatim in a prompt is
spliced from a cache of its own instead of being prefilled (non-prefix reuse). A piece's cache
holds the text between the previous piece and it (the pipeline's separator or node metadata) and
the piece itself, prefilled after the prompt's head (its text before the first piece) and
compressed with the engine's compressor; pieces are placed one after the other with their keys
moved to their new positions (:mod:`semanticache_rag.sections`). Spliced pieces did not attend to
each other when they were prefilled: the same trade as a long document's sections.

A long system message (or a long first user message that later messages follow) is taken for a
document pasted by hand: when the engine compresses, it is registered automatically (at most
``max_prefixes`` such documents, least recently used forgotten) and its prompt prefix cached
compressed, in memory only, as a registered document's is. ``compress_messages_over`` sets the
length in tokens from which a message counts (0 turns it off).

Any other prompt is cached automatically, as llama.cpp's prompt cache and vLLM's prefix caching
do: the KV of every prompt is kept (uncompressed, least recently used first out of
``max_prompt_bytes``), and a later prompt that starts with the same tokens computes only the
tokens after the longest common prefix (the same system message, document or earlier turns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from semanticache_rag.cache import DocumentCache, Selection
from semanticache_rag.compressors.base import NoCompression
from semanticache_rag.conversation import Answer, Conversation
from semanticache_rag.documents import Document, document_from_text, load_document
from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import LayerKV
from semanticache_rag.reading import compress_section, prefill_section, read_head
from semanticache_rag.sections import SectionedCache

_ANCHOR = 80  # characters matched at each end of a document
MIN_PIECE_CHARS = 64  # shorter registered pieces are not looked for in prompts
MIN_PREFIX_TOKENS = 16  # a shorter common prefix is computed again rather than copied
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_MESSAGE = "message-"  # ids of the long messages registered automatically


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

    def __init__(self, pieces: Iterator[str], conversation: Conversation, created: tuple, doc_id, on_end=None):
        self._pieces, self._conversation = pieces, conversation
        (self._created, self._created_s), self._doc_id = created, doc_id
        self._on_end = on_end
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        yield from self._pieces
        answer = self._conversation.last_answer
        assert answer is not None  # set when the conversation's stream ends
        # Tokens prefilled by this very call were created, not read, from the cache.
        self.answer = dataclasses.replace(
            answer,
            cached_tokens=answer.cached_tokens - self._created,
            cache_creation_tokens=self._created,
            document_id=self._doc_id,
            prefill_s=answer.prefill_s + self._created_s,
        )
        if self._on_end is not None:
            self._on_end(self._conversation)


class PromptCache:
    """Registered documents and the compressed caches of the prompts that contain them.

    Parameters
    ----------
    engine : Engine
    max_prefixes : int
        Prompt prefixes (document caches) kept in memory, least recently used evicted.
    max_piece_bytes : int
        Memory for the caches of registered pieces found in prompts, least recently used evicted.
    max_prompt_bytes : int
        Memory for the automatic cache of other prompts, least recently used evicted; 0 turns it off.
    compress_messages_over : int
        A system message, or a first user message that later messages follow, of at least this many
        tokens is compressed as a document when the engine compresses; 0 turns it off.
    """

    def __init__(
        self,
        engine,
        max_prefixes: int = 4,
        max_piece_bytes: int = 512 * 2**20,
        max_prompt_bytes: int = 2**30,
        compress_messages_over: int = 1024,
    ):
        budgets = (max_piece_bytes, max_prompt_bytes, compress_messages_over)
        if max_prefixes < 1 or any(not isinstance(b, int) or b < 0 for b in budgets):
            raise ConfigError(
                "max_prefixes must be >= 1 and max_piece_bytes, max_prompt_bytes, compress_messages_over "
                f"whole numbers >= 0, got {max_prefixes!r}, {max_piece_bytes!r}, {max_prompt_bytes!r}, "
                f"{compress_messages_over!r}"
            )
        self.engine, self.max_prefixes, self.max_piece_bytes = engine, max_prefixes, max_piece_bytes
        self.max_prompt_bytes, self.compress_messages_over = max_prompt_bytes, compress_messages_over
        self._automatic: OrderedDict[str, None] = OrderedDict()  # documents registered from long messages
        self._prompts: OrderedDict[int, DocumentCache] = OrderedDict()
        self.documents: dict[str, Document] = {}
        self._anchors: dict[str, list[tuple[str, str]]] = {}
        self._caches: OrderedDict[str, DocumentCache] = OrderedDict()
        self._pieces: dict[str, list[str]] = {}
        self._piece_caches: OrderedDict[str, DocumentCache] = OrderedDict()
        self._heads: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._empty = None

    def register(self, source, doc_id: str | None = None) -> str:
        """Register a document (path, text, :class:`Document`, or page or chunk texts); return its id.

        A prompt that contains the whole document reuses its cache; given as a list of texts,
        each one (of at least :data:`MIN_PIECE_CHARS` characters) found in a prompt is spliced
        from a cache of its own too, wherever it is and whatever else the prompt holds.
        """
        pages = [str(p) for p in source] if isinstance(source, Sequence) and not isinstance(source, str) else None
        document = load_document(document_from_text("\n\n".join(pages)) if pages is not None else source)
        doc_id = doc_id or document.sha256[:16]
        if not _ID.match(doc_id) or doc_id.startswith(_MESSAGE):
            raise ConfigError(
                f"document id {doc_id!r} may only hold letters, digits, '_', '-', '.' (1-128) and may not start "
                f"with {_MESSAGE!r} (the ids of long messages compressed automatically)"
            )
        raw = pages if pages is not None else [source if isinstance(source, str) and "\n" in source else document.text]
        with self._lock:
            for old in [i for i in self._automatic if self.documents[i].sha256 == document.sha256]:
                self._forget(old)  # the same text seen in a message before: registered by hand now
            self._add(doc_id, document, _anchor_pairs(raw, document.text), pages or ())
        return doc_id

    def _touch(self, doc_id: str) -> bool:
        """Mark a document from a message as used now (least recently used go first); False for others."""
        if doc_id not in self._automatic:
            return False
        self._automatic.move_to_end(doc_id)
        return True

    def _forget(self, doc_id: str) -> None:
        self._automatic.pop(doc_id, None)
        for table in (self.documents, self._anchors, self._pieces):
            table.pop(doc_id, None)

    def _add(self, doc_id: str, document: Document, anchors, pieces) -> None:
        self.documents[doc_id] = document
        self._anchors[doc_id] = anchors
        self._pieces[doc_id] = [p for p in pieces if len(p.strip()) >= MIN_PIECE_CHARS]

    def _long_message(self, messages) -> str | None:
        """The content of a long system or first user message to compress as a document, if any."""
        if self.compress_messages_over == 0 or isinstance(messages, str) or not messages:
            return None
        if isinstance(self.engine.compressor, NoCompression):
            return None  # nothing to compress: the automatic prompt cache keeps the whole prompt instead
        candidates = [0] if messages[0].get("role") == "system" else []
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if users and users[0] < len(messages) - 1:  # a lone last user message holds the question itself
            candidates.append(users[0])
        for index in candidates:
            content = messages[index].get("content")
            if not isinstance(content, str) or len(content) < MIN_PIECE_CHARS:
                continue
            if (
                len(self.engine.tokenizer(content, add_special_tokens=False)["input_ids"])
                >= self.compress_messages_over
            ):
                return content
        return None

    def _register_message(self, content: str) -> None:
        """Register a long message as a document (in memory, the oldest such forgotten first)."""
        document = document_from_text(content)  # never a path, whatever the text says
        doc_id = f"{_MESSAGE}{document.sha256[:16]}"
        with self._lock:
            if self._touch(doc_id):
                return
            self._add(doc_id, document, _anchor_pairs([content], document.text), ())
            self._automatic[doc_id] = None
            while len(self._automatic) > self.max_prefixes:
                self._forget(next(iter(self._automatic)))

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

    def find_pieces(self, text: str) -> list[tuple[int, int, str]]:
        """(start, end, document id) of the registered pieces found in ``text``, in order, not overlapping."""
        found = []
        for doc_id, pieces in list(self._pieces.items()):
            for piece in pieces:
                at = text.find(piece)
                if at >= 0:
                    found.append((at, at + len(piece), doc_id))
        chosen, end = [], 0
        for start, stop, doc_id in sorted(found, key=lambda f: (f[0], f[0] - f[1])):
            if start >= end:
                chosen.append((start, stop, doc_id))
                end = stop
        return chosen

    def stream(self, messages, **options) -> AnswerStream:
        """Answer a pipeline's prompt, reusing the caches of the registered documents or pieces it contains."""
        text = self.render(messages)
        found = self.locate(text)
        if found is None and (content := self._long_message(messages)) is not None:
            self._register_message(content)
            found = self.locate(text)
        elif found is not None:
            with self._lock:
                self._touch(found[0])
        cache, created, doc_id, split = self._empty_cache(), (0, 0.0), None, 0
        if found:
            doc_id, start, split = found
            cache, created = self._cache_for(text, start, split, doc_id)
        elif pieces := self.find_pieces(text):
            doc_id, split = pieces[0][2], pieces[-1][1]
            cache, created = self._spliced(text, pieces)
        question = messages if isinstance(messages, str) else messages[-1]["content"]
        if doc_id is None:  # no registered document: reuse the longest prefix of a prompt computed before
            ids = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            cache, reused = self._reused_prompt(ids)
            conversation = Conversation(self.engine, cache)
            answer = conversation.stream_tokens(ids[reused:], question, **options)
            remember = functools.partial(self._remember_prompt, ids, reused)
            return AnswerStream(answer, conversation, created, None, on_end=remember)
        tail = self.engine.tokenizer(text[split:], add_special_tokens=False)["input_ids"]
        conversation = Conversation(self.engine, cache)
        return AnswerStream(conversation.stream_tokens(tail, question, **options), conversation, created, doc_id)

    def ask(self, messages, **options) -> Answer:
        """:meth:`stream`, consumed; returns the :class:`Answer`."""
        stream = self.stream(messages, **options)
        for _ in stream:
            pass
        assert stream.answer is not None
        return stream.answer

    # -- automatic prompt caching --------------------------------------------------------------

    def _reused_prompt(self, ids: list[int]) -> tuple[DocumentCache, int]:
        """The cached prompt sharing the longest token prefix with ``ids``, cut to that prefix, and its length."""
        best, length = None, 0
        wanted = torch.tensor(ids)
        with self._lock:
            for key, cache in self._prompts.items():
                n = min(cache.length, len(ids))
                common = int((cache.prefix_ids[:n] == wanted[:n]).long().cumprod(0).sum())
                if common > length:
                    best, length = key, common
            if best is None or length < MIN_PREFIX_TOKENS:
                return self._empty_cache(), 0
            self._prompts.move_to_end(best)
            cache = self._prompts[best]
        length = min(length, len(ids) - 1)  # at least one token is computed, for the next logits
        return cache.prefix(length), length

    def _remember_prompt(self, ids: list[int], reused: int, conversation: Conversation) -> None:
        """Keep the KV of the whole prompt ``ids`` for the prompts that will start like it."""
        if self.max_prompt_bytes == 0 or len(ids) < MIN_PREFIX_TOKENS:
            return
        new, layers = len(ids) - reused, []
        for document, appended in zip(conversation.cache.layers, conversation.kv.layers):
            keys, values = appended.appended()
            layers.append(
                LayerKV(
                    torch.cat([document.keys[:, :, :reused], keys[:, :, :new]], 2).clone(),
                    torch.cat([document.values[:, :, :reused], values[:, :, :new]], 2).clone(),
                )
            )
        pages = torch.full((len(ids),), -1, dtype=torch.int32)
        cache = dataclasses.replace(
            self._empty_cache(), layers=tuple(layers), prefix_ids=torch.tensor(ids), token_pages=pages
        )
        with self._lock:
            for key, old in list(self._prompts.items()):  # a prompt this one extends is no longer needed
                if old.length <= len(ids) and old.prefix_ids.tolist() == ids[: old.length]:
                    del self._prompts[key]
            self._prompts[hash(tuple(ids))] = cache
            total = sum(c.nbytes for c in self._prompts.values())
            while total > self.max_prompt_bytes and self._prompts:
                total -= self._prompts.popitem(last=False)[1].nbytes

    def _empty_cache(self):
        if self._empty is None:
            self._empty = self.engine.empty_cache()
        return self._empty

    @contextlib.contextmanager
    def _building_lock(self, key: str):
        """One build per key: a thread that finds another building the same cache waits for it."""
        with self._lock:
            lock = self._building.setdefault(key, threading.Lock())
        with lock:
            yield

    def _cache_for(self, text: str, start: int, split: int, doc_id: str):
        """The compressed cache of ``text[:split]`` and (tokens, seconds) this call spent building it."""
        key = hashlib.sha256(text[:split].encode()).hexdigest()
        with self._building_lock(key):
            with self._lock:
                if key in self._caches:
                    self._caches.move_to_end(key)
                    return self._caches[key], (0, 0.0)
            cache, created = self._build_prefix(text, start, split, doc_id)
            with self._lock:
                self._caches[key] = cache
                while len(self._caches) > self.max_prefixes:
                    self._caches.popitem(last=False)
        return cache, created

    def _build_prefix(self, text: str, start: int, split: int, doc_id: str):
        tokenizer, engine = self.engine.tokenizer, self.engine
        # a message's document may have been forgotten since it was found: it is the located text
        document = self.documents.get(doc_id) or document_from_text(text[start:split])
        created = (0, 0.0)

        def compute(sections=None):  # a prompt prefix is read whole: no sections to keep
            nonlocal created
            head = tokenizer(text[:start], add_special_tokens=False)["input_ids"]
            body = tokenizer(text[start:split], add_special_tokens=False)["input_ids"]
            pages = torch.cat([torch.full((len(head),), -1), torch.zeros(len(body))]).to(torch.int32)
            cache = engine.compress(engine.prefill_tokens(document, head + body, pages, progress=False))
            created = (len(head) + len(body), cache.prefill_s + cache.compress_s)
            return cache

        if engine.store is None or doc_id.startswith(_MESSAGE):  # a request's message is not kept on disk
            return compute(), created
        # kept on disk too: another process (or a later run) with this prompt loads it
        prompt = hashlib.sha256(f"{start}\0{text[:split]}".encode()).hexdigest()
        return engine.store.fetch(engine, document, compute, prompt=prompt), created

    # -- pieces ----------------------------------------------------------------------------

    def _spliced(self, text: str, pieces: list[tuple[int, int, str]]):
        """The prompt's head and every found piece (with the text before it) spliced from their caches."""
        engine, document = self.engine, self.documents[pieces[0][2]]
        head_text = text[: pieces[0][0]]
        (head, logits), created, seconds = self._head(head_text, document)
        parts, previous = [], pieces[0][0]
        for _, end, _ in pieces:
            part, made, spent = self._piece(head_text, text[previous:end], head, logits)
            parts.append(part)
            created, seconds, previous = created + made, seconds + spent, end
        spliced = SectionedCache(document, head, tuple(parts), ((0, 0),) * len(parts))
        chosen = list(range(len(parts)))
        selection = Selection(tuple(chosen), len(parts), (), "prompt pieces")
        compact = engine.positions == "compact"
        return spliced.splice(chosen, engine.rope_frequencies, selection, compact), (created, seconds)

    def _head(self, head_text: str, document):
        key = hashlib.sha256(head_text.encode()).hexdigest()
        with self._building_lock(f"head:{key}"):
            with self._lock:
                if key in self._heads:
                    self._heads.move_to_end(key)
                    return self._heads[key], 0, 0.0
            ids = self.engine.tokenizer(head_text, add_special_tokens=False)["input_ids"]
            read = read_head(self.engine, document, ids)  # (cache, last logits)
            with self._lock:
                self._heads[key] = read
                while len(self._heads) > self.max_prefixes:
                    self._heads.popitem(last=False)
        return read, len(ids), read[0].prefill_s

    def _piece(self, head_text: str, piece_text: str, head, logits):
        """The cache of ``piece_text`` read after ``head``: (cache, tokens built now, seconds spent)."""
        key = hashlib.sha256(f"{head_text}\0{piece_text}".encode()).hexdigest()
        with self._building_lock(f"piece:{key}"):
            with self._lock:
                if key in self._piece_caches:
                    self._piece_caches.move_to_end(key)
                    return self._piece_caches[key], 0, 0.0
            engine = self.engine
            ids = engine.tokenizer(piece_text, add_special_tokens=False)["input_ids"]
            prefill = prefill_section(engine, head, logits, ids, engine.compressor.needs_surprisal)
            pages = torch.full((len(ids),), -1, dtype=torch.int32)  # a piece's pages are its pipeline's metadata
            cache = compress_section(engine, engine.compressor, head, prefill, ids, pages)
            with self._lock:
                self._piece_caches[key] = cache
                total = sum(c.nbytes for c in self._piece_caches.values())
                while total > self.max_piece_bytes and len(self._piece_caches) > 1:
                    total -= self._piece_caches.popitem(last=False)[1].nbytes
        return cache, len(ids), cache.prefill_s + cache.compress_s
