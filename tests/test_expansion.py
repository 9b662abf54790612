"""Expansion of compressed caches into plain KV: ``s`` copies of an entry attend as ``+ log s``."""

from __future__ import annotations

import pytest
import torch
from conftest import corpus_text
from transformers import DynamicCache

from semanticache_rag import Engine, KaizenCompressor, NoCompression, SemantiCacheCompressor
from semanticache_rag.compressors import make_compressor
from semanticache_rag.expansion import ExpansionError, compact_cache, expand_cache, expand_layer
from semanticache_rag.kernels.dispatch import proportional_attention
from semanticache_rag.kv import CodedLayerKV, ConversationKV, LayerKV, SharedLayerKV

QUESTION = "Who may copy it?"


def test_s_copies_of_an_entry_attend_as_one_entry_with_log_s():
    torch.manual_seed(0)
    heads, length, dim = 3, 7, 16
    keys, values = torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim)
    sizes = torch.randint(1, 5, (1, heads, length), dtype=torch.int32)
    sizes[0, 1, -2:] = 0  # a head padded to the longest one
    tokens = int(sizes[0].sum(-1).max())
    sizes[0, :, 0] += tokens - sizes[0].sum(-1)  # every head stands for the same tokens
    layer = LayerKV(keys, values, sizes)
    plain_keys, plain_values = expand_layer(layer, tokens)
    assert plain_keys.shape == (1, heads, tokens, dim)
    query, new_key, new_value = torch.randn(1, 6, 1, dim), torch.randn(1, heads, 1, dim), torch.randn(1, heads, 1, dim)
    merged = proportional_attention(query, new_key, new_value, keys, values, layer.log_sizes, scaling=0.25)
    copies = proportional_attention(query, new_key, new_value, plain_keys, plain_values, None, scaling=0.25)
    torch.testing.assert_close(copies, merged, rtol=1e-5, atol=1e-6)
    # plain softmax by hand over the copies (what any engine computes)
    grouped_k = torch.cat([plain_keys, new_key], 2).repeat_interleave(2, dim=1)
    grouped_v = torch.cat([plain_values, new_value], 2).repeat_interleave(2, dim=1)
    by_hand = torch.softmax(query @ grouped_k.transpose(-1, -2) * 0.25, -1) @ grouped_v
    torch.testing.assert_close(by_hand.transpose(1, 2), merged, rtol=1e-5, atol=1e-6)  # (B, Q, H, D) out


def test_coded_and_shared_layers_expand_to_their_decoded_entries():
    torch.manual_seed(1)
    keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    from semanticache_rag.tensor_codes import QuantizedTensor

    coded = CodedLayerKV(QuantizedTensor.encode(keys, 8, 8), QuantizedTensor.encode(values, 8, 8))
    shared = SharedLayerKV(coded)
    for layer in (coded, shared):
        plain_keys, plain_values = expand_layer(layer, 5)
        torch.testing.assert_close(plain_keys, coded.keys)
        torch.testing.assert_close(plain_values, coded.values)


def test_entries_that_do_not_stand_for_the_prefix_are_refused():
    keys = torch.randn(1, 2, 4, 8)
    with pytest.raises(ExpansionError, match="dropped"):
        expand_layer(LayerKV(keys, keys), 6)
    with pytest.raises(ExpansionError, match="dropped"):
        expand_layer(LayerKV(keys, keys, torch.ones(1, 2, 4, dtype=torch.int32)), 6)


@pytest.fixture(scope="module")
def engine(tiny_llama, tiny_tokenizer):
    return Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=128)


@pytest.fixture(scope="module")
def prefill(engine):
    return engine.prefill(corpus_text()[:2500], progress=False, surprisal=True)


def _stock_greedy(engine, cache, tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of the stock model (transformers' own attention and cache) over the expanded KV."""
    past = DynamicCache()
    for index, (keys, values) in enumerate(expand_cache(cache)):
        past.update(keys.clone(), values.clone(), index)
    tail = engine.tokenizer(engine.prompt.tail([_turn()]), add_special_tokens=False)["input_ids"]
    ids, produced, first = tail, [], None
    position = cache.length
    with torch.inference_mode():
        for _ in range(tokens):
            positions = torch.arange(position, position + len(ids))[None]
            kwargs = {engine._cache_kwarg: past}  # past_key_values, or cache in newer transformers
            out = engine.model(input_ids=torch.tensor([ids]), position_ids=positions, **kwargs)
            logits = out.logits[0, -1]
            first = logits if first is None else first
            position += len(ids)
            ids = [int(logits.argmax())]
            if ids[0] == engine.tokenizer.eos_token_id:
                break
            produced.append(ids[0])
    return produced, first


def _turn():
    from semanticache_rag.prompts import Turn

    return Turn(QUESTION)


@pytest.mark.parametrize(
    "compressor",
    [NoCompression(), SemantiCacheCompressor(0.5), SemantiCacheCompressor(0.75), KaizenCompressor(0.75)],
    ids=["none", "semanticache-0.5", "semanticache-0.75", "kaizen-0.75"],
)
def test_a_stock_model_over_the_expanded_cache_answers_as_our_engine(engine, prefill, compressor):
    cache = engine.compress(prefill, compressor)
    ours = engine.ask(cache, QUESTION, max_new_tokens=8, loop_guard=False)
    stock, first_logits = _stock_greedy(engine, cache, 8)
    assert stock == list(ours.completion_ids)
    tail = engine.tokenizer(engine.prompt.tail([_turn()]), add_special_tokens=False)["input_ids"]
    our_logits = engine.forward(ConversationKV(cache.layers), tail, cache.length)[-1]
    torch.testing.assert_close(first_logits, our_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["streaming_llm", "sekv"])
def test_caches_without_a_plain_form_say_why(engine, prefill, name):
    cache = engine.compress(prefill, make_compressor(name, 0.5))
    with pytest.raises(ExpansionError, match="dropped|re-expands"):
        expand_cache(cache)


def test_sections_and_compact_splices_are_refused_with_what_to_do(engine, prefill):
    import dataclasses

    cache = engine.compress(prefill, SemantiCacheCompressor(0.5))
    moved = dataclasses.replace(cache, next_position=cache.length // 2)  # as a compact splice places a question
    with pytest.raises(ExpansionError, match=f"start at position {cache.length // 2}"):
        expand_cache(moved)
    long_engine = Engine(engine.model, engine.tokenizer, model_name="tiny", section_tokens=256)
    sections = long_engine.read(corpus_text()[:40_000], progress=False)
    with pytest.raises(ExpansionError, match="SectionedCache"):
        expand_cache(sections)


@pytest.mark.parametrize(
    "compressor",
    [SemantiCacheCompressor(0.5), SemantiCacheCompressor(0.75), make_compressor("auto", 0.9)],
    ids=["semanticache-0.5", "semanticache-0.75", "auto-0.9"],
)
def test_compact_positions_answer_as_the_positions_read_at(engine, prefill, compressor):
    cache = engine.compress(prefill, compressor)
    compact = compact_cache(cache, engine.rope_frequencies)
    most = max(
        int((layer.sizes[0] > 0).sum(-1).max()) if layer.sizes is not None else layer.keys.shape[2]
        for layer in cache.layers
    )
    assert compact.positions == most
    assert all(layer.keys.shape[2] == most for layer in compact.layers)
    assert compact.positions < 0.75 * cache.length  # the question starts well before N
    ours = engine.ask(cache, QUESTION, max_new_tokens=8, loop_guard=False)
    moved = engine.ask(compact, QUESTION, max_new_tokens=8, loop_guard=False)
    assert moved.completion_ids == ours.completion_ids
    tail = engine.tokenizer(engine.prompt.tail([_turn()]), add_special_tokens=False)["input_ids"]
    expected = engine.forward(ConversationKV(cache.layers), tail, cache.positions)[-1]
    got = engine.forward(ConversationKV(compact.layers), tail, compact.positions)[-1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    shifted_wrong = engine.forward(ConversationKV(compact.layers), tail, cache.positions)[-1]
    assert (shifted_wrong - expected).abs().max() > 1e-3  # positions do matter: the turn is what keeps them


def test_compact_positions_refuse_what_expansion_refuses(engine, prefill):
    cache = engine.compress(prefill, make_compressor("sekv", 0.5))
    with pytest.raises(ExpansionError, match="re-expands"):
        compact_cache(cache, engine.rope_frequencies)
