"""Prompt caching of registered documents on the tiny models."""

from __future__ import annotations

import pytest
import torch

from semanticache_rag import ConfigError
from semanticache_rag.prompt_cache import PromptCache


def stuff_prompt(document: str, question: str) -> list[dict]:
    """What a stuff-documents chain sends: instructions + document in the system message."""
    return [
        {"role": "system", "content": f"Use the following context to answer.\n\n{document}"},
        {"role": "user", "content": question},
    ]


def test_second_prompt_reads_the_cache(tiny_engine, document_text):
    cache = PromptCache(tiny_engine)
    doc_id = cache.register(document_text)
    first = cache.ask(stuff_prompt(document_text, "Who may copy it?"), max_new_tokens=6)
    second = cache.ask(stuff_prompt(document_text, "What is it about?"), max_new_tokens=6)
    assert first.document_id == second.document_id == doc_id
    assert first.cached_tokens == 0 and first.cache_creation_tokens > 1000
    assert second.cache_creation_tokens == 0 and second.cached_tokens == first.cache_creation_tokens
    assert second.prompt_tokens - second.cached_tokens < 30


def test_cached_answer_equals_full_prompt_generate(tiny_engine, document_text):
    cache = PromptCache(tiny_engine)
    cache.register(document_text)
    messages = stuff_prompt(document_text, "Who may copy it?")
    cache.ask(stuff_prompt(document_text, "Warm the cache."), max_new_tokens=3)
    answer = cache.ask(messages, max_new_tokens=8)
    text = cache.render(messages)
    ids = torch.tensor(
        [
            tiny_engine.tokenizer(text[: text.index(document_text[-80:]) + 80], add_special_tokens=False)["input_ids"]
            + tiny_engine.tokenizer(text[text.index(document_text[-80:]) + 80 :], add_special_tokens=False)["input_ids"]
        ]
    )
    with torch.inference_mode():
        out = tiny_engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=tiny_engine.tokenizer.eos_token_id,
            pad_token_id=0,
        )
    assert answer.answer == tiny_engine.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_prompt_without_a_registered_document_still_answers(tiny_engine):
    answer = PromptCache(tiny_engine).ask("Say something.", max_new_tokens=4)
    assert answer.document_id is None and answer.cached_tokens == 0 and answer.completion_tokens >= 1


def test_streaming_sets_the_answer(tiny_engine, document_text):
    cache = PromptCache(tiny_engine)
    cache.register(document_text)
    stream = cache.stream(stuff_prompt(document_text, "Who?"), max_new_tokens=5)
    pieces = list(stream)
    assert "".join(pieces).strip() == stream.answer.answer


def test_lru_keeps_a_bounded_number_of_prefixes(tiny_engine, document_text):
    cache = PromptCache(tiny_engine, max_prefixes=1)
    cache.register(document_text)
    for intro in ("Context A", "Context B", "Context A"):
        messages = [{"role": "system", "content": f"{intro}\n\n{document_text}"}, {"role": "user", "content": "?"}]
        answer = cache.ask(messages, max_new_tokens=2)
        assert answer.cache_creation_tokens > 0  # each evicted the other
    assert len(cache._caches) == 1


@pytest.mark.parametrize("bad", ["../etc", "a/b", "x y", "x" * 200])
def test_bad_document_ids_are_rejected(tiny_engine, bad):
    with pytest.raises(ConfigError):
        PromptCache(tiny_engine).register("Some text. " * 20, doc_id=bad)


def test_prompt_prefix_is_stored_for_the_next_process(tiny_model, tiny_tokenizer, document_text, tmp_path):
    from semanticache_rag import Engine, SemantiCacheCompressor
    from semanticache_rag.store import DocumentStore

    def new_prompt_cache():  # a fresh engine and store object on the same directory: another process
        store = DocumentStore(tmp_path / "store")
        compressor = SemantiCacheCompressor(0.5)
        engine = Engine(tiny_model, tiny_tokenizer, model_name="tiny", compressor=compressor, store=store)
        cache = PromptCache(engine)
        cache.register(document_text)
        return cache

    first, second = new_prompt_cache(), new_prompt_cache()
    before = first.ask(stuff_prompt(document_text, "Who may copy it?"), max_new_tokens=6)
    after = second.ask(stuff_prompt(document_text, "Who may copy it?"), max_new_tokens=6)
    assert before.cache_creation_tokens > 1000 and first.engine.store.stats.writes == 1
    assert after.cache_creation_tokens == 0 and after.cached_tokens == before.cache_creation_tokens
    assert second.engine.store.stats.disk_hits == 1 and after.answer == before.answer
    other = second.ask(stuff_prompt(document_text, "Other question."), max_new_tokens=3)
    assert other.cache_creation_tokens == 0  # the same prefix: only the question differs
    framed = [{"role": "system", "content": f"Different instructions.\n\n{document_text}"}]
    assert second.ask(framed + [{"role": "user", "content": "Hi"}], max_new_tokens=3).cache_creation_tokens > 1000
    plain = second.engine.read(document_text, progress=False)  # the engine's own read is another entry
    assert second.engine.store.stats.misses == 2 and plain.length != before.cache_creation_tokens


# -- pieces found anywhere in a prompt (retrieval pipelines) -------------------------------------


def chunks_of(text: str, size: int = 500) -> list[str]:
    return [text[i : i + size] for i in range(0, 3000, size)]


def rag_prompt(pieces: list[str], question: str) -> list[dict]:
    """What a retriever + stuff chain sends: the retrieved chunks joined, in the order it ranked them."""
    return stuff_prompt("\n\n".join(pieces), question)


def test_registered_chunks_are_spliced_wherever_a_prompt_has_them(tiny_engine, document_text):
    chunks = chunks_of(document_text)
    cache = PromptCache(tiny_engine)
    doc_id = cache.register(chunks)
    first = cache.ask(rag_prompt([chunks[3], chunks[1]], "Who may copy it?"), max_new_tokens=4)
    assert first.document_id == doc_id and first.cached_tokens == 0 and first.cache_creation_tokens > 300
    assert first.sections == (0, 1) and first.routing == "prompt pieces"
    second = cache.ask(rag_prompt([chunks[3], chunks[5]], "What is it about?"), max_new_tokens=4)
    tokens = len(tiny_engine.tokenizer("\n\n" + chunks[5], add_special_tokens=False)["input_ids"])
    assert second.cache_creation_tokens == tokens  # the head and chunk 3 came from their caches
    assert second.cached_tokens == first.cache_creation_tokens - len(
        tiny_engine.tokenizer("\n\n" + chunks[1], add_special_tokens=False)["input_ids"]
    )


def test_one_spliced_chunk_answers_as_the_plain_prompt(tiny_engine, document_text):
    """A single piece right after the head is prefilled exactly where the plain prompt has it (the text is
    tokenised in the same three parts: before the piece, the piece, after it)."""
    chunks = chunks_of(document_text)
    messages = rag_prompt([chunks[2]], "Who may copy it?")
    cache = PromptCache(tiny_engine)
    cache.register(chunks)
    spliced = cache.ask(messages, max_new_tokens=10, loop_guard=False)
    text = cache.render(messages)
    start = text.index(chunks[2])
    parts = (text[:start], chunks[2], text[start + len(chunks[2]) :])
    ids = torch.tensor([sum((tiny_engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in parts), [])])
    with torch.inference_mode():
        out = tiny_engine.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert spliced.document_id is not None
    assert list(spliced.completion_ids) == out[0, ids.shape[1] :].tolist()[: len(spliced.completion_ids)]


def test_two_threads_asking_with_a_new_document_build_its_cache_once(tiny_engine, document_text, monkeypatch):
    import threading

    cache = PromptCache(tiny_engine)
    cache.register(document_text)
    builds, original = [], PromptCache._build_prefix
    monkeypatch.setattr(PromptCache, "_build_prefix", lambda self, *a: builds.append(1) or original(self, *a))
    messages = [stuff_prompt(document_text, q) for q in ("Who may copy it?", "What is it about?")]
    expected = [PromptCache(tiny_engine, max_prefixes=1) for _ in messages]
    for other in expected:
        other.register(document_text)
    expected = [other.ask(m, max_new_tokens=6).answer for other, m in zip(expected, messages)]
    builds.clear()
    got = [None, None]
    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, cache.ask(messages[i], max_new_tokens=6)))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and [a.answer for a in got] == expected
    assert sorted(a.cache_creation_tokens > 0 for a in got) == [False, True]


# -- automatic prompt caching (no registration) ---------------------------------------------------


def test_a_repeated_prompt_prefix_is_reused_without_registration(tiny_engine, document_text):
    system = f"Use the following context to answer.\n\n{document_text[:2500]}"
    asks = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("Who?", "What is it?")]
    cache = PromptCache(tiny_engine)
    first, second = (cache.ask(m, max_new_tokens=6, loop_guard=False) for m in asks)
    fresh = PromptCache(tiny_engine, max_prompt_bytes=0).ask(asks[1], max_new_tokens=6, loop_guard=False)
    prefix = len(tiny_engine.tokenizer(cache.render(asks[0][:1]), add_special_tokens=False)["input_ids"])
    assert first.cached_tokens == 0 and second.cached_tokens >= prefix - 8  # up to the first differing token
    assert second.prompt_tokens - second.cached_tokens < 30 and fresh.cached_tokens == 0
    assert second.completion_ids == fresh.completion_ids  # the same tokens at the same positions


def test_a_chat_keeps_one_prompt_cache_entry_that_grows(tiny_engine, document_text):
    cache = PromptCache(tiny_engine)
    messages = [{"role": "system", "content": document_text[:1500]}, {"role": "user", "content": "Who?"}]
    for turn in range(3):
        answer = cache.ask(messages, max_new_tokens=4)
        messages += [{"role": "assistant", "content": answer.answer}, {"role": "user", "content": f"And {turn}?"}]
        assert turn == 0 or answer.cached_tokens > 400
    assert len(cache._prompts) == 1  # each turn's prompt extends the previous one, which is dropped


def test_the_prompt_cache_stays_within_its_budget(tiny_engine, document_text):
    cache = PromptCache(tiny_engine, max_prompt_bytes=3 * 2**20)
    for i in range(4):
        cache.ask(f"{i} " + document_text[i * 700 : (i + 1) * 700], max_new_tokens=2)
    assert sum(c.nbytes for c in cache._prompts.values()) <= 3 * 2**20 and len(cache._prompts) >= 1


# -- long messages compressed as documents ------------------------------------------------------


@pytest.fixture()
def compressing_engine(tiny_model, tiny_tokenizer, tmp_path):
    from semanticache_rag import Engine, SemantiCacheCompressor
    from semanticache_rag.store import DocumentStore

    store = DocumentStore(tmp_path / "store")
    compressor = SemantiCacheCompressor(0.5)
    return Engine(tiny_model, tiny_tokenizer, model_name="tiny", compressor=compressor, store=store, prefill_chunk=64)


def test_a_long_system_message_is_compressed_once_and_reused(compressing_engine, document_text):
    cache = PromptCache(compressing_engine, compress_messages_over=200)
    first, second = (cache.ask(stuff_prompt(document_text, q), max_new_tokens=4) for q in ("Who?", "What is it?"))
    assert first.document_id == second.document_id and first.document_id.startswith("message-")
    assert first.cache_creation_tokens > 1000 and second.cache_creation_tokens == 0
    assert second.cached_tokens == first.cache_creation_tokens and second.prompt_tokens - second.cached_tokens < 30
    (kept,) = cache._caches.values()
    assert kept.entries_removed > 0.3  # compressed, not only cached
    assert compressing_engine.store.stats.writes == 0  # a request's message is kept in memory only


def test_messages_are_not_compressed_when_off_short_or_holding_the_question(compressing_engine, document_text):
    cases = [
        (PromptCache(compressing_engine, compress_messages_over=0), stuff_prompt(document_text, "Who?")),
        (PromptCache(compressing_engine, compress_messages_over=10**6), stuff_prompt(document_text, "Who?")),
        (PromptCache(compressing_engine, compress_messages_over=200), [{"role": "user", "content": document_text}]),
    ]
    for cache, messages in cases:
        answer = cache.ask(messages, max_new_tokens=2)
        assert answer.document_id is None and not cache._automatic  # the automatic prefix cache instead
    first_user = [{"role": "user", "content": document_text}, {"role": "assistant", "content": "Yes."}]
    for system in ([], [{"role": "system", "content": "Be brief."}]):  # a short system message before it too
        cache = PromptCache(compressing_engine, compress_messages_over=200)
        answer = cache.ask(system + first_user + [{"role": "user", "content": "Who?"}], max_new_tokens=2)
        assert answer.document_id is not None and answer.document_id.startswith("message-")


def test_documents_from_messages_are_bounded_and_never_evict_registered_ones(compressing_engine, document_text):
    cache = PromptCache(compressing_engine, max_prefixes=2, compress_messages_over=100)
    mine = cache.register(document_text[2000:])
    texts = [f"Text number {i}. " + document_text[i * 400 : i * 400 + 900] for i in range(4)]
    ids = [cache.ask(stuff_prompt(texts[i], "Who?"), max_new_tokens=2).document_id for i in (0, 1, 0, 2)]
    assert ids[0] == ids[2] and len(set(ids)) == 3
    assert list(cache._automatic) == [ids[0], ids[3]]  # the least recently used one (text 1) went first
    assert set(cache.documents) == {mine, *cache._automatic}
    again = cache.ask(stuff_prompt(texts[0], "Who?"), max_new_tokens=2)
    assert again.document_id == ids[0] and again.cache_creation_tokens == 0


def test_a_message_registered_by_hand_later_takes_its_own_id(compressing_engine, document_text):
    cache = PromptCache(compressing_engine, compress_messages_over=100)
    seen = cache.ask([{"role": "system", "content": document_text}, {"role": "user", "content": "Who?"}])
    mine = cache.register(document_text, doc_id="licence")
    after = cache.ask([{"role": "system", "content": document_text}, {"role": "user", "content": "Who?"}])
    assert seen.document_id.startswith("message-") and after.document_id == mine and not cache._automatic
    with pytest.raises(ConfigError, match="message-"):
        cache.register(document_text, doc_id="message-mine")


@pytest.mark.parametrize("bad", [-1, 1.5, "1024"])
def test_bad_message_length_is_a_config_error(tiny_engine, bad):
    with pytest.raises(ConfigError, match="compress_messages_over"):
        PromptCache(tiny_engine, compress_messages_over=bad)
