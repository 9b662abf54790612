"""Attention over document layers as stored (coded, low-rank, shared) equals decoding them first and attending."""

from __future__ import annotations

import pytest
import torch

from semanticache_rag import coded_attention
from semanticache_rag.kv import CodedLayerKV, DecodeScratch, LayerKV, SharedLayerKV
from semanticache_rag.tensor_codes import HalfTensor, LowRankTensor, QuantizedTensor

CODES = {
    "int8": lambda x: QuantizedTensor.encode(x, 8, 32),
    "int4": lambda x: QuantizedTensor.encode(x, 4, 32),
    "int4, groups of 16": lambda x: QuantizedTensor.encode(x, 4, 16),
    "rank8": lambda x: LowRankTensor.encode(x, 8),
    "fp16": HalfTensor.encode,
}


@pytest.mark.parametrize("key_kind", list(CODES))
@pytest.mark.parametrize("value_kind", ["int8", "int4", "rank8", "fp16"])
def test_coded_layers_attended_as_stored_equal_decode_then_attend(key_kind, value_kind):
    g = torch.Generator().manual_seed(0)
    heads, group, length, dim = 3, 3, 50, 64
    keys, values = torch.randn(1, heads, length, dim, generator=g), torch.randn(1, heads, length, dim, generator=g)
    layer = CodedLayerKV(CODES[key_kind](keys), CODES[value_kind](values))
    query = torch.randn(heads, group, dim, generator=g) * dim**-0.5
    scratch = DecodeScratch()
    stored_keys, stored_values = coded_attention.stored(SharedLayerKV(layer))  # a shared layer: its source's codes
    assert stored_keys is layer.key_code and stored_values is layer.value_code
    decoded_keys, decoded_values = layer.keys, layer.values
    assert not torch.allclose(decoded_keys, keys, atol=1e-4)  # coded for real: the codes are not the inputs
    want = torch.bmm(query, decoded_keys[0].transpose(1, 2))
    got = coded_attention.scores(stored_keys, query, scratch)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())
    probs = torch.softmax(want, dim=-1)
    start = torch.randn(heads, group, dim, generator=g)
    want = start + torch.bmm(probs, decoded_values[0])
    got = coded_attention.mix(stored_values, probs, start.clone(), scratch)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())


def test_plain_layers_are_multiplied_as_they_are():
    g = torch.Generator().manual_seed(1)
    layer = LayerKV(torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g))
    keys, values = coded_attention.stored(layer)
    assert keys is layer.keys and values is layer.values
    query, probs = torch.randn(2, 2, 8, generator=g), torch.softmax(torch.randn(2, 2, 10, generator=g), -1)
    assert torch.equal(
        coded_attention.scores(keys, query, DecodeScratch()), torch.bmm(query, layer.keys[0].transpose(1, 2))
    )
    out = coded_attention.mix(values, probs, torch.zeros(2, 2, 8), DecodeScratch())
    assert torch.allclose(out, torch.bmm(probs, layer.values[0]))
