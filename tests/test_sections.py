"""Long documents: key rotation, section planning, routing, splicing and chat over sections (tiny models)."""

from __future__ import annotations

import pytest
import torch
from conftest import corpus_text
from tests_support import NEEDLE, QUESTION

from semanticache_rag import (
    ConfigError,
    ContextLengthError,
    Engine,
    SectionedCache,
    SemantiCacheCompressor,
    StreamingLLMCompressor,
)
from semanticache_rag.cache import DocumentCache
from semanticache_rag.documents import Document, Page, document_from_text
from semanticache_rag.kernels.gsc_ref import ChunkLayout, chunk_similarity, greedy_seed_clustering, merge_clusters
from semanticache_rag.kv import ConversationKV
from semanticache_rag.prompts import Turn
from semanticache_rag.rotation import rope_frequencies, rotate_keys
from semanticache_rag.sections import plan_sections

SECTION_TOKENS = 256


def prefilled_at(engine: Engine, ids: list[int], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = ConversationKV(num_layers=engine.model.config.num_hidden_layers, capacity=len(ids))
    engine.run_tokens(kv, ids, start, surprisal=False)
    return [layer.appended() for layer in kv.layers]


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = max(float(a.abs().max()), 1.0)
    assert float((a - b).abs().max()) <= 1e-4 * scale  # fp32 rounding of different absolute angles


@pytest.fixture()
def long_text(tiny_tokenizer) -> str:
    """~18K tokens of real text with the needle at 60% depth: longer than the tiny model's 2,048 context."""
    text = corpus_text()
    cut = text.rfind("\n", 0, int(0.6 * len(text))) + 1
    return text[:cut] + NEEDLE.format(value="7351946") + "\n" + text[cut:]


@pytest.fixture()
def long_engine(tiny_model, tiny_tokenizer):
    return Engine(tiny_model, tiny_tokenizer, model_name="tiny", prefill_chunk=64, section_tokens=SECTION_TOKENS)


# -- moving keys --------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [37, 1500, -12])
def test_moving_a_section_equals_prefilling_it_there(tiny_engine, document_text, delta):
    ids = tiny_engine.tokenizer(document_text[:600], add_special_tokens=False)["input_ids"]
    start = max(0, -delta)
    here, there = prefilled_at(tiny_engine, ids, start), prefilled_at(tiny_engine, ids, start + delta)
    for (keys, values), (moved_keys, moved_values), freq in zip(here, there, tiny_engine.rope_frequencies):
        assert_close(rotate_keys(keys, delta, freq), moved_keys)
        assert_close(values, moved_values)  # values do not depend on absolute positions


def test_moving_semantic_cores_equals_merging_moved_keys(tiny_engine, document_text):
    """Rotation is linear: a core (mean of rotated keys) moves like its members."""
    ids = tiny_engine.tokenizer(document_text[:600], add_special_tokens=False)["input_ids"]
    here, there = prefilled_at(tiny_engine, ids, 0), prefilled_at(tiny_engine, ids, 700)
    layout = ChunkLayout.from_chunk_ids(torch.arange(len(ids)) // 8)
    for (keys, values), (moved_keys, moved_values), freq in zip(here, there, tiny_engine.rope_frequencies):
        tau = torch.full((keys.shape[1],), 0.3)
        seeds = greedy_seed_clustering(
            chunk_similarity(keys[0], layout), layout, tau, torch.zeros(len(ids), dtype=torch.bool)
        )
        cores, core_values, sizes = merge_clusters(keys[0], values[0], seeds)
        moved_cores, moved_core_values, moved_sizes = merge_clusters(moved_keys[0], moved_values[0], seeds)
        assert torch.equal(sizes, moved_sizes) and int((sizes > 1).sum()) > 0  # something was merged
        assert_close(rotate_keys(cores[None], 700, freq), moved_cores[None])
        assert_close(core_values, moved_core_values)


def test_partial_rotary_keys_turn_only_their_rotary_channels():
    keys, inv_freq = torch.randn(1, 2, 5, 64), 1.0 / 10000 ** (torch.arange(0, 48, 2).float() / 48)  # 48 of 64
    moved = rotate_keys(keys, 300, inv_freq)
    assert torch.equal(moved[..., 48:], keys[..., 48:])
    assert torch.equal(moved[..., :48], rotate_keys(keys[..., :48].contiguous(), 300, inv_freq))
    assert_close(rotate_keys(moved, -300, inv_freq), keys)


def test_rotary_scaling_that_depends_on_length_is_refused(tiny_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(ConfigError, match="dynamic rotary scaling"):
        rope_frequencies(AutoModelForCausalLM.from_config(config))


# -- planning ----------------------------------------------------------------------------------


def test_sections_end_at_pages_then_paragraphs_and_cover_every_token(tiny_tokenizer):
    paragraph = "A licensee may copy the work. " * 6
    pages = ["\n\n".join([paragraph] * 5) for _ in range(4)]
    text, spans, start = "\n\n".join(pages), [], 0
    for i, page in enumerate(pages):
        spans.append(Page(i + 1, str(i + 1), start, start + len(page)))
        start += len(page) + 2
    document = Document(text, tuple(spans), "pages", None, "0", "text")
    encoded = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [a for a, _ in encoded["offset_mapping"]]
    page_tokens = len(offsets) // 4
    ranges = plan_sections(document, offsets, max_tokens=int(1.3 * page_tokens))
    assert [a for a, _ in ranges][0] == 0 and ranges[-1][1] == len(offsets)
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))  # contiguous, no token lost
    assert all(b - a <= int(1.3 * page_tokens) for a, b in ranges)
    page_starts = {p.start for p in document.pages}
    assert all(offsets[a] in page_starts for a, _ in ranges)  # each section starts a page
    short = plan_sections(document, offsets, max_tokens=page_tokens // 3)
    starts = {offsets[a] for a, _ in short[1:]}
    assert all(text[:s].rstrip(" ").endswith("\n\n") for s in starts)  # paragraphs when no page end fits
    assert min(b - a for a, b in short) >= page_tokens // 6  # no short last section


# -- reading, routing, splicing -----------------------------------------------------------------


def test_a_document_that_fits_is_read_whole_as_before(tiny_engine, document_text):
    cache = tiny_engine.read(document_text, progress=False)
    assert isinstance(cache, DocumentCache)
    reference = tiny_engine.compress(tiny_engine.prefill(document_text, progress=False))
    answer = tiny_engine.ask(cache, QUESTION, max_new_tokens=12)
    assert answer.completion_ids == tiny_engine.ask(reference, QUESTION, max_new_tokens=12).completion_ids
    assert answer.sections == (0,) and answer.sections_total == 1 and answer.routing == "whole document"
    assert answer.pages == ("1",) and answer.routing_matched


def test_long_document_is_routed_and_spliced_within_the_context(long_engine, long_text):
    cache = long_engine.read(long_text, progress=False)
    assert isinstance(cache, SectionedCache) and cache.length > long_engine.context_length
    assert len(cache.sections) >= cache.length // SECTION_TOKENS
    needle = next(k for k, (a, b) in enumerate(cache.spans) if "blue harbor" in cache.document.text[a:b])
    answer = long_engine.ask(cache, QUESTION, max_new_tokens=8)
    order = sorted(range(len(cache.sections)), key=lambda k: -cache.router.scores(QUESTION)[k])
    assert order[0] == needle and needle in answer.sections and answer.routing == "bm25"
    assert answer.routing_matched and answer.sections_total == len(cache.sections)
    tail = long_engine.tokenizer(long_engine.prompt.tail([Turn(QUESTION)]), add_special_tokens=False)["input_ids"]
    assert answer.prompt_tokens - answer.cached_tokens == len(tail)  # the sections came from their caches
    assert answer.document_tokens == len(long_engine.head_ids) + sum(cache.sections[k].length for k in answer.sections)


def test_splicing_places_each_section_behind_the_previous_ones_entries(long_engine, long_text):
    """Head, then each chosen section with its keys moved to where the previous one's entries end."""
    long_engine.compressor = SemantiCacheCompressor(0.5)
    cache = long_engine.read(long_text[:9000], progress=False)
    first, second = cache.sections[3], cache.sections[9]
    selection = cache.select(long_engine, "anything", 10_000)
    spliced = cache.splice([3, 9], long_engine.rope_frequencies, selection, compact=True)
    head, step = cache.head.length, max(layer.keys.shape[2] for layer in first.layers)
    assert spliced.positions == head + step + second.length and spliced.length == head + first.length + second.length
    for i, layer in enumerate(spliced.layers):
        parts = [(cache.head.layers[i], 0), (first.layers[i], 0), (second.layers[i], step)]
        at = 0
        for part, delta in parts:
            n = part.keys.shape[2]
            freq = long_engine.rope_frequencies[i]
            assert torch.equal(layer.keys[:, :, at : at + n], rotate_keys(part.keys, delta, freq))
            assert torch.equal(layer.values[:, :, at : at + n], part.values)
            sizes = torch.ones_like(layer.sizes[:, :, at : at + n]) if part.sizes is None else part.sizes
            assert torch.equal(layer.sizes[:, :, at : at + n].int(), sizes.int())
            at += n
        assert at == layer.keys.shape[2]


def test_what_follows_a_splice_comes_after_every_sections_keys(long_engine, long_text):
    """Compact: a long section followed by a short one still ends before the question starts."""
    long_engine.compressor = SemantiCacheCompressor(0.75)
    cache = long_engine.read(long_text[:9000], progress=False)
    head, lengths = cache.head.length, [s.length for s in cache.sections]
    short = min(range(1, len(lengths)), key=lambda k: lengths[k])
    step = max(layer.keys.shape[2] for layer in cache.sections[0].layers)
    assert step + lengths[short] < lengths[0]  # the case: section 0's keys reach past the short one's end
    selection = cache.select(long_engine, "anything", 10_000)
    spliced = cache.splice([0, short], long_engine.rope_frequencies, selection, compact=True)
    assert spliced.positions == head + lengths[0] == cache.positions_needed([0, short])


def test_compression_buys_breadth_with_compact_positions(tiny_llama, tiny_tokenizer, long_text):
    def sections_used(engine, cache, positions):
        engine.positions = positions
        chat = engine.conversation(cache)
        answer = chat.ask("What may the licensee do?", max_new_tokens=4)
        tail = answer.prompt_tokens - answer.document_tokens
        assert chat.cache.positions + tail + answer.completion_tokens <= engine.context_length
        return len(answer.sections)

    plain = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", section_tokens=SECTION_TOKENS, max_sections=None)
    squeezed = Engine(
        tiny_llama,
        tiny_tokenizer,
        model_name="tiny",
        section_tokens=SECTION_TOKENS,
        compressor=SemantiCacheCompressor(0.75),
        max_sections=None,
    )
    full, compressed = plain.read(long_text, progress=False), squeezed.read(long_text, progress=False)
    uncompressed = sections_used(plain, full, "compact")
    assert sections_used(squeezed, compressed, "contiguous") <= uncompressed + 1
    assert sections_used(squeezed, compressed, "compact") >= 3 * uncompressed


def test_chat_draws_on_other_sections_and_keeps_its_turns(long_engine, long_text):
    long_engine.max_sections = 3  # room to spare: a later turn still fits the same sections
    cache = long_engine.read(long_text, progress=False)
    chat = long_engine.conversation(cache, max_new_tokens=6)
    first = chat.ask(QUESTION)
    second = chat.ask("What does the license say about patent claims and royalties?")
    assert first.sections != second.sections and len(chat.turns) == 2
    question = long_engine.tokenizer(long_engine.prompt.tail([Turn(second.question)]), add_special_tokens=False)
    assert second.prompt_tokens - second.document_tokens > len(question["input_ids"]) + 6  # the first turn too
    vague = chat.ask("zzqx qqzy?")  # matches no section: the previous turn's sections stay
    assert not vague.routing_matched and vague.sections == second.sections
    assert vague.cached_tokens > vague.document_tokens  # and the turns computed before are reused


def test_first_question_that_matches_nothing_says_so(long_engine, long_text):
    answer = long_engine.ask(long_engine.read(long_text, progress=False), "zzqx qqzy?", max_new_tokens=4)
    assert not answer.routing_matched and answer.sections[0] == 0


def test_reading_holds_one_sections_full_kv_at_most(long_engine, long_text, monkeypatch):
    """Peak tensor bytes while reading: one section's full KV (while it is compressed) plus what is kept."""
    long_engine.compressor = StreamingLLMCompressor(0.75)
    kept, peaks = [], []
    original = StreamingLLMCompressor.compress_cache

    def watched(self, keys_values, context):
        live = sum(k.nbytes + v.nbytes for k, v in keys_values)
        peaks.append(live + sum(kept))
        layers, zoom = original(self, keys_values, context)
        kept.append(sum(layer.nbytes for layer in layers))
        return layers, zoom

    monkeypatch.setattr(StreamingLLMCompressor, "compress_cache", watched)
    cache = long_engine.read(long_text, progress=False)
    section_full = max(s.full_nbytes for s in cache.sections)
    assert len(peaks) == len(cache.sections) > 10
    assert max(peaks) <= section_full + cache.nbytes  # never the document's full KV...
    assert cache.nbytes < 0.3 * cache.full_nbytes  # ...which is 4x what is kept


def test_section_length_must_fit_the_context(tiny_model, tiny_tokenizer):
    with pytest.raises(ConfigError, match="section_tokens"):
        Engine(tiny_model, tiny_tokenizer, section_tokens=8)
    with pytest.raises(ConfigError, match="positions"):
        Engine(tiny_model, tiny_tokenizer, positions="scattered")


def test_a_conversation_that_fills_the_context_says_what_to_do(long_engine, long_text):
    cache = long_engine.read(long_text, progress=False)
    chat = long_engine.conversation(cache, max_new_tokens=4)
    with pytest.raises(ContextLengthError, match="start a new conversation"):
        chat.ask("What may the licensee do? " * 300)


def test_answers_name_the_pages_of_their_sections(long_engine):
    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    pages = [f"Chapter {name}. " + corpus_text()[i * 3000 : (i + 1) * 3000] for i, name in enumerate(names)]
    text, spans, at = "\n\n".join(pages), [], 0
    for i, page in enumerate(pages):
        spans.append(Page(i + 1, f"p{i + 1}", at, at + len(page)))
        at += len(page) + 2
    document = Document(text, tuple(spans), "paged", None, document_from_text(text).sha256, "text")
    cache = long_engine.read(document, progress=False)
    answer = long_engine.ask(cache, "What does chapter echo say?", max_new_tokens=4)
    assert set(answer.pages) <= {p.label for p in document.pages} and "p5" in answer.pages
    assert list(answer.pages) == sorted(answer.pages, key=lambda label: int(label[1:]))
    assert len(answer.pages) < len(document.pages)


def _plain_and_exact_sekv(tiny_llama, tiny_tokenizer, long_text, summary):
    """(engine, cache) of 9K characters read in sections uncompressed ("plain") and with SeKV whose host copies
    are exact (rank = head dim) and whose zoom budget covers every span ("sekv"), contiguous positions (the
    same sections fit either way)."""
    from semanticache_rag import SeKVCompressor

    exact = SeKVCompressor(0.5, zoom_tokens=100_000, host_copy="rank", rank=16, summary=summary)
    read = {}
    for name, compressor in (("plain", None), ("sekv", exact)):
        engine = Engine(
            tiny_llama, tiny_tokenizer, model_name="tiny", section_tokens=SECTION_TOKENS, compressor=compressor
        )
        engine.positions = "contiguous"
        read[name] = (engine, engine.read(long_text[:9000], progress=False))
    return read


@pytest.mark.parametrize("summary", ["spans", "cores"])
def test_sekv_zooms_into_spliced_sections_and_exact_spans_give_the_plain_answer(
    tiny_llama, tiny_tokenizer, long_text, summary
):
    """Spans rebuilt from each section's host copy, moved with it: with exact copies (rank = head dim) and a
    zoom budget that covers every span, the answer is the uncompressed splice's, token for token."""
    answers = {
        name: engine.ask(cache, QUESTION, max_new_tokens=8)
        for name, (engine, cache) in _plain_and_exact_sekv(tiny_llama, tiny_tokenizer, long_text, summary).items()
    }
    plain, sekv = answers["plain"], answers["sekv"]
    assert sekv.sections == plain.sections and sekv.spans_expanded > 0 and sekv.host_bytes > 0
    assert sekv.completion_ids == plain.completion_ids


def test_sections_never_cut_a_character_into_its_byte_pieces():
    from semanticache_rag.sections import _break_strength

    # "a.\n\n東京": byte-level BPE gives each of 東's and 京's three byte pieces the character's offset
    assert _break_strength("a.\n\n東京", [0, 1, 2, 3, 4, 4, 4, 5, 5, 5], []) == [3, 0, 1, 1, 2, 0, 0, 0, 0, 0]


def test_bm25_matches_unspaced_chinese_and_japanese():
    from semanticache_rag.routing import BM25Router

    router = BM25Router(["東京は日本の首都です。", "大阪の食べ物はたこ焼きです。", "Osaka is in Kansai."])
    assert router.scores("大阪の食べ物は何ですか？").argmax() == 1 and router.scores("Where is Osaka?").argmax() == 2


def test_bm25_over_a_document_without_words_matches_nothing_instead_of_failing():
    from semanticache_rag.routing import BM25Router

    assert not BM25Router(["1 2 3 4", "the a of 5"]).scores("What is 1?").any()


@pytest.mark.parametrize("routing", ["attention", "hybrid"])
def test_the_models_own_routing_ranks_every_section(tiny_llama, tiny_tokenizer, long_text, routing):
    from semanticache_rag.routing import summarise

    engine = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", section_tokens=SECTION_TOKENS, routing=routing)
    cache = engine.read(long_text[:12000], progress=False)
    order, matched = cache.ranking(engine, QUESTION)
    assert sorted(order) == list(range(len(cache.sections))) and matched
    scores = cache.attention_router.scores(engine, [5, 6, 7])
    assert scores.shape == (len(cache.sections),) and (scores > 0).all()
    answer = engine.ask(cache, QUESTION, max_new_tokens=2)
    assert answer.routing == routing and len(answer.sections) == 2
    layer = cache.sections[0].layers[0]
    keys, values, sizes = summarise(layer, 64)  # one entry per 64: the mean, standing for all 64 tokens
    assert (
        keys.shape[2] == -(-layer.keys.shape[2] // 64)
        and int(sizes.sum()) == layer.keys.shape[1] * cache.sections[0].length
    )
    torch.testing.assert_close(keys[:, :, 0], layer.keys[:, :, :64].mean(2))


def test_the_models_own_routing_over_layers_of_different_lengths(tiny_llama, tiny_tokenizer, long_text):
    """A fixed tau merges each layer to its own number of entries: every layer's summaries score their sections."""
    engine = Engine(
        tiny_llama,
        tiny_tokenizer,
        model_name="tiny",
        section_tokens=SECTION_TOKENS,
        routing="attention",
        compressor=SemantiCacheCompressor(tau=0.5),
    )
    cache = engine.read(long_text[:12000], progress=False)
    assert len({layer.keys.shape[2] for layer in cache.sections[0].layers}) > 1
    scores = cache.attention_router.scores(engine, [5, 6, 7])
    assert scores.shape == (len(cache.sections),) and (scores > 0).all()


def test_unknown_routing_is_refused(tiny_llama, tiny_tokenizer):
    with pytest.raises(ConfigError, match="routing must be one of"):
        Engine(tiny_llama, tiny_tokenizer, routing="psychic")


@pytest.mark.parametrize("summary", ["spans", "cores"])
def test_sekv_rebuilt_sections_attend_as_the_plain_splice(tiny_llama, tiny_tokenizer, long_text, summary):
    """With exact host copies and a zoom budget that covers every span, the zoomed working cache of spliced
    sections holds the plain splice's entries (rebuilt keys moved with their sections): any query attends
    to both alike."""
    from semanticache_rag.conversation import working_cache

    caches = _plain_and_exact_sekv(tiny_llama, tiny_tokenizer, long_text, summary)
    engine, sekv = caches["sekv"]
    plain = caches["plain"][1]
    chosen = [1, 3, 4]  # not the first: every section moves
    inv_freqs = engine.rope_frequencies
    spliced = {
        name: cache.splice(chosen, inv_freqs, selection=None, compact=False)
        for name, cache in (("plain", plain), ("sekv", sekv))
    }
    assert any(delta != 0 for delta in sekv._placement(chosen, False)[0])
    tail = tiny_tokenizer(" Who may copy it?", add_special_tokens=False)["input_ids"]
    kv, zoom = working_cache(engine, spliced["sekv"], tail)
    assert zoom.spans_expanded > 0
    torch.manual_seed(0)
    for index, layer in enumerate(spliced["plain"].layers):
        query = torch.randn(layer.keys.shape[1], 5, layer.keys.shape[3])
        keys, values, log_sizes = kv.document_tensors(index)
        rebuilt_keys, rebuilt_values = kv.layers[index].appended()
        keys, values = torch.cat([keys, rebuilt_keys], 2)[0], torch.cat([values, rebuilt_values], 2)[0]
        bias = torch.cat([log_sizes[0], log_sizes.new_zeros(log_sizes.shape[1], rebuilt_keys.shape[2])], 1)
        ours = torch.softmax(query @ keys.transpose(-1, -2) + bias[:, None], -1) @ values
        expected = torch.softmax(query @ layer.keys[0].transpose(-1, -2), -1) @ layer.values[0]
        assert torch.allclose(ours, expected, atol=1e-4), index
