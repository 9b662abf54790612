"""The fp16 compressor: every entry kept, keys and values in 16 bits (bf16 where fp16 cannot hold them)."""

from __future__ import annotations

import pytest
import torch
from conftest import corpus_text

from semanticache_rag import ConfigError, Engine, HalfCompressor, KaizenCompressor, KaraCompressor, NoCompression
from semanticache_rag.compressors import make_compressor
from semanticache_rag.compressors.base import CompressionContext
from semanticache_rag.compressors.half import half_code
from semanticache_rag.kv import CodedLayerKV, LayerKV
from semanticache_rag.tensor_codes import HalfTensor


@pytest.fixture(scope="module")
def engine(tiny_llama, tiny_tokenizer):
    return Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=128)


@pytest.fixture(scope="module")
def prefill(engine):
    return engine.prefill(corpus_text()[:3000], progress=False)


def test_every_entry_is_kept_in_half_the_bytes_with_the_full_caches_answer(engine, prefill):
    full = engine.compress(prefill, NoCompression())
    cache = engine.compress(prefill, make_compressor("fp16"))
    assert cache.length == full.length and 2 * cache.nbytes == full.nbytes
    for layer, (keys, values) in zip(cache.layers, prefill.keys_values):
        assert isinstance(layer, CodedLayerKV) and layer.sizes is None
        assert layer.key_code.data.dtype == layer.value_code.data.dtype == torch.float16
        assert torch.equal(layer.keys, keys.half().float()) and torch.equal(layer.values, values.half().float())
    question = "Who may copy it?"
    got = engine.ask(cache, question, max_new_tokens=12).completion_ids
    assert got == engine.ask(full, question, max_new_tokens=12).completion_ids


def test_it_stores_what_kaizen_stores_with_fp16_as_its_one_option_at_half_the_bytes(engine, prefill):
    half = engine.compress(prefill, HalfCompressor())
    kaizen = engine.compress(prefill, KaizenCompressor(0.5, options=("fp16",), calibration=None))
    assert half.nbytes == kaizen.nbytes
    for a, b in zip(half.layers, kaizen.layers):
        assert torch.equal(a.key_code.data, b.key_code.data) and torch.equal(a.value_code.data, b.value_code.data)


def test_elements_beyond_fp16s_range_are_stored_in_bf16():
    small, large = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    large[0, 1, 3, 2] = 7e4  # fp16's largest finite value is 65504
    assert half_code(small).data.dtype == torch.float16
    code = half_code(large)
    assert code.data.dtype == torch.bfloat16 and code.dtype == torch.float32
    assert torch.equal(code.decode(), large.bfloat16().float())


def test_a_16_bit_cache_is_kept_as_it_is(tiny_tokenizer):
    keys, values = torch.randn(1, 2, 6, 8).bfloat16(), torch.randn(1, 2, 6, 8).bfloat16()
    context = CompressionContext(torch.arange(6), torch.zeros(6, dtype=torch.bool), None, tiny_tokenizer)
    (layer,) = HalfCompressor().compress_document([(keys, values)], context)
    assert type(layer) is LayerKV and layer.keys is keys and layer.values is values


def test_it_removes_no_entry_and_codes_are_not_coded_again():
    assert isinstance(make_compressor("fp16"), HalfCompressor) and make_compressor("fp16", 0).compression_ratio == 0
    with pytest.raises(ConfigError, match="compression_ratio must be 0, got 0.5.*kaizen\\+semanticache"):
        make_compressor("fp16", 0.5)
    with pytest.raises(ConfigError, match="inner compressor 'fp16' cannot be wrapped"):
        make_compressor("kaizen+fp16", 0.75)
    with pytest.raises(ConfigError, match="inner compressor 'fp16' cannot be wrapped"):
        KaizenCompressor(0.75, inner=HalfCompressor())
    assert KaraCompressor(inner="fp16").document_compressor() == HalfCompressor()


def test_a_cache_in_fp16_reads_back_from_the_store(tiny_llama, tiny_tokenizer, tmp_path):
    from semanticache_rag import DocumentStore

    def engine_with_store():
        store = DocumentStore(tmp_path / "store")
        return Engine(tiny_llama, tiny_tokenizer, model_name="tiny", compressor=HalfCompressor(), store=store)

    first = engine_with_store().read(corpus_text()[:2000], progress=False)
    again = engine_with_store()
    loaded = again.read(corpus_text()[:2000], progress=False)
    assert again.store.stats.disk_hits == 1
    for a, b in zip(first.layers, loaded.layers):
        assert isinstance(b.key_code, HalfTensor) and b.key_code.data.dtype == torch.float16
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
