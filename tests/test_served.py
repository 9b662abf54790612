"""Stored caches served to another engine: read back checked, expanded token-major, refused with reasons."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import corpus_text

from semanticache_rag import ConfigError, DocumentStore, Engine, KaizenCompressor, NoCompression, SemantiCacheCompressor
from semanticache_rag.compressors import make_compressor
from semanticache_rag.expansion import expand_cache
from semanticache_rag.served import (
    PrefixCache,
    ServeError,
    document_salt,
    load_prefix,
    request_fields,
    requested_entry,
    slots,
)


@pytest.fixture()
def stored(tiny_llama, tiny_tokenizer, tmp_path):
    """(engine, store directory, read) where read(compressor) returns (cache, entry id)."""
    store = DocumentStore(tmp_path / "store")
    engine = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=128, store=store)

    def read(compressor, text=None):
        text = corpus_text()[:1500] if text is None else text
        engine.compressor = compressor
        before = {e.id for e in store.entries()}
        cache = engine.read(text, progress=False)
        (entry_id,) = {e.id for e in store.entries()} - before
        return cache, entry_id

    return engine, store.directory, read


@pytest.mark.parametrize(
    "compressor", [NoCompression(), SemantiCacheCompressor(0.5), KaizenCompressor(0.75)], ids=lambda c: c.name
)
def test_a_stored_cache_is_served_as_its_expansion_token_major(stored, compressor):
    engine, directory, read = stored
    cache, entry_id = read(compressor)
    prefix = load_prefix(directory, entry_id, engine.spec)
    assert prefix.prefix_ids == tuple(cache.prefix_ids.tolist())
    for (keys, values), (want_keys, want_values) in zip(prefix.layers, expand_cache(cache), strict=True):
        assert keys.shape == (cache.length, want_keys.shape[1], want_keys.shape[3]) and keys.is_contiguous()
        torch.testing.assert_close(keys, want_keys[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(values, want_values[0].transpose(0, 1), rtol=0, atol=0)
    ids = list(prefix.prefix_ids)
    assert prefix.matches(ids + [5]) and not prefix.matches(ids) and not prefix.matches([ids[0] + 1, *ids[1:], 5])
    half = load_prefix(directory, entry_id, dataclasses.replace(engine.spec, dtype=torch.bfloat16))
    assert half.layers[0][0].dtype == torch.bfloat16  # in the serving engine's dtype


def test_damaged_missing_and_plainless_caches_are_refused_with_the_reason(stored):
    engine, directory, read = stored
    _, entry_id = read(NoCompression())
    tensors = directory / f"{entry_id}.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-10] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(ServeError, match="damaged"):
        load_prefix(directory, entry_id, engine.spec)
    assert tensors.exists()  # serving never deletes: the store decides what is damaged
    with pytest.raises(ServeError, match="no stored cache"):
        load_prefix(directory, "0" * 64, engine.spec)
    with pytest.raises(ServeError, match="64 hex digits"):
        load_prefix(directory, "../../etc/passwd", engine.spec)
    _, sekv_id = read(make_compressor("sekv", 0.5), corpus_text()[:1400])
    with pytest.raises(ServeError, match="no plain form"):
        load_prefix(directory, sekv_id, engine.spec)
    _, streaming_id = read(make_compressor("streaming_llm", 0.5), corpus_text()[:1300])
    with pytest.raises(ServeError, match="dropped"):
        load_prefix(directory, streaming_id, engine.spec)
    other = dataclasses.replace(engine.spec, num_layers=engine.spec.num_layers + 1)
    _, good_id = read(NoCompression(), corpus_text()[:1200])
    with pytest.raises(ServeError, match="another model"):
        load_prefix(directory, good_id, other)


def test_requests_name_a_cache_with_its_own_salt_and_prefixes_are_kept_lru(stored):
    engine, directory, read = stored
    fields = request_fields("ab" * 32)
    assert requested_entry(fields["kv_transfer_params"]) == "ab" * 32
    assert fields["cache_salt"] == document_salt("ab" * 32)
    assert requested_entry(None) is None and requested_entry({"other": 1}) is None
    assert requested_entry({"semanticache_document": 3}) is None
    ids = [read(NoCompression(), corpus_text()[:n])[1] for n in (900, 1000, 1100)]
    kept = PrefixCache(directory, engine.spec, capacity=2)
    first = kept.get(ids[0])
    assert kept.get(ids[0]) is first
    kept.get(ids[1]), kept.get(ids[2])
    assert kept.get(ids[0]) is not first  # forgotten, read again


def test_a_served_request_names_the_stored_entry_and_sends_our_prompt_tokens(stored, tiny_tokenizer):
    from semanticache_rag.prompts import Turn
    from semanticache_rag.served import served_request

    engine, _, read = stored
    cache, entry_id = read(SemantiCacheCompressor(0.5))
    body = served_request(engine, cache, "Who may copy it?")
    tail = tiny_tokenizer(engine.prompt.tail([Turn("Who may copy it?")]), add_special_tokens=False)["input_ids"]
    assert body["prompt"] == cache.prefix_ids.tolist() + tail
    assert body["kv_transfer_params"] == {"semanticache_document": entry_id}
    assert body["cache_salt"] == document_salt(entry_id)
    engine.store = None
    with pytest.raises(ConfigError, match="keeps no store"):
        served_request(engine, cache, "Who may copy it?")


def test_slots_follow_the_request_blocks():
    assert slots([7, 2, 9], 4, 0, 10).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert slots([7, 2, 9], 4, 5, 7).tolist() == [9, 10]
    with pytest.raises(ValueError, match="do not fit"):
        slots([7], 4, 0, 5)


@pytest.mark.parametrize(
    "compressor", [SemantiCacheCompressor(0.75), KaizenCompressor(0.9, inner="semanticache")], ids=["sc", "auto"]
)
def test_a_compact_prefix_is_the_compact_cache_with_its_log_sizes(stored, tiny_tokenizer, compressor):
    """Tier 2: one slot per entry (P < N), keys turned as compact_cache turns them, log s per slot
    (-inf for padding), the prompt's first P tokens standing for the slots."""
    from semanticache_rag.expansion import compact_cache
    from semanticache_rag.prompts import Turn
    from semanticache_rag.rotation import config_frequencies
    from semanticache_rag.served import served_request

    engine, directory, read = stored
    cache, entry_id = read(compressor)
    inv_freqs = [config_frequencies(engine.model.config)] * engine.spec.num_layers
    prefix = load_prefix(directory, entry_id, engine.spec, inv_freqs)
    want = compact_cache(cache, engine.rope_frequencies)
    slots_ = want.positions
    assert slots_ < cache.length and prefix.prefix_ids == tuple(cache.prefix_ids[:slots_].tolist())
    for (keys, values), log_sizes, layer in zip(prefix.layers, prefix.log_sizes, want.layers, strict=True):
        torch.testing.assert_close(keys, layer.keys[0].transpose(0, 1), rtol=0, atol=1e-6)
        torch.testing.assert_close(values, layer.values[0].transpose(0, 1), rtol=0, atol=1e-6)
        assert torch.equal(log_sizes, layer.sizes[0].float().log().T)
    assert float(torch.stack(prefix.log_sizes).max()) > 0  # merged cores
    body = served_request(engine, cache, "Who may copy it?", compact=True)
    tail = tiny_tokenizer(engine.prompt.tail([Turn("Who may copy it?")]), add_special_tokens=False)["input_ids"]
    assert body["prompt"] == list(prefix.prefix_ids) + tail
    assert body["kv_transfer_params"] == {"semanticache_document": entry_id, "semanticache_compact": True}
    assert body["cache_salt"] == document_salt(entry_id, compact=True) != document_salt(entry_id)
    kept = PrefixCache(directory, engine.spec)  # no rotary frequencies: compact requests cannot be served
    with pytest.raises(ServeError, match="plain RoPE"):
        kept.get(entry_id, compact=True)
    assert kept.get(entry_id).log_sizes is None


def test_config_frequencies_are_the_models_and_scaled_rope_is_refused(tiny_llama):
    from semanticache_rag.rotation import config_frequencies, rope_frequencies

    want = rope_frequencies(tiny_llama)[0]
    torch.testing.assert_close(config_frequencies(tiny_llama.config), want, rtol=1e-6, atol=0)
    config = type(tiny_llama.config).from_dict(tiny_llama.config.to_dict())
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigError, match="plain RoPE"):
        config_frequencies(config)
