"""Kara: decode-time compression of the turns a conversation appends after the document."""

from __future__ import annotations

import pytest
import torch

from semanticache_rag import ConfigError, Engine, KaraCompressor, NoCompression, SemantiCacheCompressor
from semanticache_rag.compressors import make_compressor

QUESTIONS = ["Who may copy it?", "What may be changed?", "Is there a warranty?", "Who holds the rights?"]


def _chat(tiny_llama, tiny_tokenizer, document_text, compressor, turns):
    engine = Engine(tiny_llama, tiny_tokenizer, compressor=compressor, prefill_chunk=128)
    conversation = engine.conversation(engine.read(document_text[:800], progress=False), max_new_tokens=12)
    return conversation, [conversation.ask(QUESTIONS[i % len(QUESTIONS)]) for i in range(turns)]


def test_window_selection_keeps_whole_chunks_and_the_best_tokens():
    kara = KaraCompressor(window_tokens=16, keep_share=0.5, chunk_tokens=1)
    direction = torch.randn(8)
    keys = 0.3 * torch.randn(2, 16, 8) + direction
    keys[:, 4:8] = 3 * direction  # a phrase every other entry attends to
    index = kara.select(keys)
    assert index.shape == (2, 8) and (index.diff(dim=1) > 0).all()
    assert all({4, 5, 6, 7} <= set(row) for row in index.tolist())


def test_long_chat_stays_within_budget(tiny_llama, tiny_tokenizer, document_text):
    kara = KaraCompressor(budget_tokens=96, window_tokens=32, recent_tokens=16)
    conversation, answers = _chat(tiny_llama, tiny_tokenizer, document_text, kara, 30)
    per_entry = sum(2 * layer.keys[:, :, :1].nbytes for layer in conversation.kv.layers)  # K and V, all layers
    limit = kara.budget_tokens + kara.window_tokens + 12  # at most one window (and one step) over the budget
    assert conversation.kv.appended_length <= limit
    assert max(a.conversation_bytes for a in answers) <= limit * per_entry
    assert answers[-1].prompt_tokens > 30 * 10  # every turn is still in the prompt, compressed
    assert conversation._compressed_tokens > 0


def test_budget_off_answers_equal_the_uncompressed_conversation(tiny_llama, tiny_tokenizer, document_text):
    big = KaraCompressor(budget_tokens=100_000)
    _, plain = _chat(tiny_llama, tiny_tokenizer, document_text, NoCompression(), 6)
    _, kara = _chat(tiny_llama, tiny_tokenizer, document_text, big, 6)
    assert [a.completion_ids for a in kara] == [a.completion_ids for a in plain]
    assert [a.cached_tokens for a in kara] == [a.cached_tokens for a in plain]  # prefix reuse unchanged


def test_turns_after_compression_reuse_the_compressed_prefix(tiny_llama, tiny_tokenizer, document_text):
    kara = KaraCompressor(budget_tokens=64, window_tokens=32, recent_tokens=8)
    conversation, _ = _chat(tiny_llama, tiny_tokenizer, document_text, kara, 7)
    compressed = conversation._compressed_tokens
    last = conversation.ask("And after that?")
    # the compressed turns were reused, not recomputed: the reused prefix reaches past them
    assert last.cached_tokens - last.document_tokens >= compressed > 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"keep_share": 1.0}, "keep_share"),
        ({"window_tokens": 1}, "window_tokens"),
        ({"inner": "kara"}, "inner"),
        ({"inner": "sekv"}, "SeKV rebuilds every turn"),
        ({"compression_ratio": 0.5}, "compression_ratio"),
        ({"inner": SemantiCacheCompressor(0.5), "compression_ratio": 0.5}, "inner compressor instance"),
    ],
)
def test_bad_configs_name_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        KaraCompressor(**kwargs)


def test_kara_composes_with_a_document_compressor():
    kara = make_compressor("kara", 0.5, inner="semanticache")
    assert kara.document_compressor().compression_ratio == 0.5 and kara.needs_surprisal
    inner = SemantiCacheCompressor(0.75)
    assert KaraCompressor(inner=inner).document_compressor() is inner  # an instance, as kvpress composes presses
