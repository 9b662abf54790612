"""KV-Kaizen: coded layer storage, the per-layer selector under one byte budget, composition."""

from __future__ import annotations

import pytest
import torch
from conftest import corpus_text

from semanticache_rag import ConfigError, Engine, KaizenCompressor, NoCompression, SemantiCacheCompressor
from semanticache_rag.compressors import make_compressor
from semanticache_rag.compressors.kaizen import (
    DEFAULT_OPTIONS,
    encode_layer,
    layer_option,
    option_nbytes,
    select_options,
)
from semanticache_rag.compressors.kaizen_calibration import calibrate, merge_tables, save_table
from semanticache_rag.kv import CodedLayerKV, ConversationKV, LayerKV, SharedLayerKV
from semanticache_rag.tensor_codes import HalfTensor, LowRankTensor, QuantizedTensor

QUESTION = "Who may copy it?"


@pytest.fixture(scope="module")
def engine(tiny_llama, tiny_tokenizer):
    return Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=128)


@pytest.fixture(scope="module")
def prefill(engine):
    return engine.prefill(corpus_text()[:3000], progress=False, surprisal=True)


def _kv(length=40, dim=64, scale=3.0, seed=0):
    torch.manual_seed(seed)
    return torch.randn(1, 3, length, dim) * scale + torch.linspace(-5, 5, dim)  # offsets per channel


def test_int8_error_is_within_half_a_step_of_the_group_absmax():
    x = _kv()
    code = QuantizedTensor.encode(x, 8, 32)
    error = (code.decode() - x).abs().unflatten(-1, (2, 32))
    bound = x.abs().unflatten(-1, (2, 32)).amax(-1, keepdim=True) / 127 / 2
    assert (error <= bound * (1 + 1e-5)).all()
    assert code.codes.dtype == torch.uint8 and code.nbytes == x.numel() + x.numel() // 32 * 4


def test_int4_packs_two_codes_a_byte_within_half_a_step():
    x = _kv(dim=16)
    code = QuantizedTensor.encode(x, 4, 8)
    groups = x.unflatten(-1, (2, 8))
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    error = (code.decode() - x).abs().unflatten(-1, (2, 8))
    assert (error <= step / 2 * 1.002 + 1e-6).all()  # scale rounded up to fp16: at most 2^-10 wider
    assert code.codes.shape[-1] == 8 and code.shape == x.shape
    constant = torch.full((1, 1, 2, 8), 0.3)  # zero range: every code decodes to the (rounded-down) minimum
    assert torch.allclose(QuantizedTensor.encode(constant, 4, 8).decode(), constant, atol=1e-3)


def test_int3_packs_eight_codes_in_three_bytes_within_half_a_step():
    x = _kv(dim=16)
    code = QuantizedTensor.encode(x, 3, 8)
    groups = x.unflatten(-1, (2, 8))
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 7
    error = (code.decode() - x).abs().unflatten(-1, (2, 8))
    assert (error <= step / 2 * 1.002 + 1e-6).all()
    assert code.codes.shape[-1] == 6 and code.shape == x.shape and code.nbytes == x.numel() * 3 // 8 + x.numel() // 2
    codes = code.unpacked()  # every level 0..7 is used and comes back where it was put
    assert set(codes.unique().tolist()) == set(range(8))
    assert torch.equal(
        codes.unflatten(-1, (2, 8)).float(),
        ((groups - code.minimums.float()[..., None]) / code.scales.float()[..., None]).round().clamp(0, 7),
    )
    with pytest.raises(ValueError, match="3 bits"):
        QuantizedTensor.encode(_kv(dim=12), 3, 4)  # 12 channels do not pack in eights


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_decoding_is_code_times_scale_plus_minimum_bit_for_bit(bits):
    """The fast in-place decode computes exactly what one fp32 multiply and one add per element give."""
    code = QuantizedTensor.encode(_kv(dim=64), bits, 32)
    codes = code.unpacked()
    if bits == 4:  # the documented packing: two codes per byte, even channels in the low nibble
        assert torch.equal(codes, torch.stack([code.codes & 15, code.codes >> 4], dim=-1).flatten(-2))
    groups = codes.unflatten(-1, (2, 32)).float()
    want = (groups * code.scales.float()[..., None] + code.minimums.float()[..., None]).flatten(-2)
    assert torch.equal(code.decode(), want)
    assert torch.equal(code.decode_into(torch.full(code.shape, float("nan"))), want)  # the attention's path


def test_attention_decodes_coded_layers_into_one_reused_scratch_bit_for_bit():
    """Each code written into the conversation's scratch is its decode, bit for bit; the scratch's
    buffers are reused across layers (no new tensors per layer and step), grown for a longer one."""
    x, y = _kv(dim=64), _kv(dim=64, seed=1)
    layers = [
        CodedLayerKV(QuantizedTensor.encode(x, 8, 32), QuantizedTensor.encode(y, 4, 32)),
        CodedLayerKV(LowRankTensor.encode(x, 8), HalfTensor.encode(y)),
        SharedLayerKV(CodedLayerKV(QuantizedTensor.encode(y, 4, 32), QuantizedTensor.encode(x, 8, 32))),
        LayerKV(x, y),
        CodedLayerKV(QuantizedTensor.encode(_kv(length=90), 4, 32), HalfTensor.encode(_kv(length=90))),
    ]
    kv = ConversationKV(layers)
    pointers = set()
    for index, layer in enumerate(layers):
        keys, values, _ = kv.document_tensors(index)
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
        if index < 3:
            pointers.add((keys.data_ptr(), values.data_ptr()))
    assert len(pointers) == 1
    assert kv.document_tensors(3)[0] is x  # a plain layer is attended as stored


def test_low_rank_is_exact_at_full_rank_and_shrinks_below_it():
    x = _kv(dim=16)
    assert torch.allclose(LowRankTensor.encode(x, 16).decode(), x, atol=2e-2)  # fp16 factors
    errors = [float((LowRankTensor.encode(x, r).decode() - x).norm()) for r in (2, 8, 16)]
    assert errors[0] > errors[1] > errors[2]


@pytest.mark.parametrize("option", ["fp", "fp16", "int8", "int4", "int3", "rank8", "rank64", "share"])
@pytest.mark.parametrize("sizes", [False, True])
def test_planned_bytes_are_the_stored_bytes(option, sizes):
    keys, values = _kv(dim=16), _kv(dim=16, seed=1)
    layer = LayerKV(keys, values, torch.ones(1, 3, 40, dtype=torch.int16) if sizes else None)
    stored = encode_layer(option, layer, layer, group_size=8)
    assert stored.nbytes == option_nbytes(option, layer, 8)
    assert layer_option(stored) == ("rank16" if option == "rank64" else option)  # rank capped at head_dim
    assert stored.keys.shape == keys.shape and stored.keys.dtype == keys.dtype
    assert stored.num_entries == layer.num_entries


def test_selector_takes_the_cheapest_damage_per_byte_and_refills():
    costs = [{"fp": 100, "int8": 50, "int4": 25}] * 2
    sensitivity = [{"int8": 1.0, "int4": 3.0}, {"int8": 0.1, "int4": 5.0}]
    assert select_options(costs, sensitivity, 200) == ["fp", "fp"]
    assert select_options(costs, sensitivity, 150) == ["fp", "int8"]
    assert select_options(costs, sensitivity, 100) == ["int8", "int8"]
    assert select_options(costs, sensitivity, 80) == ["int4", "int8"]
    with pytest.raises(ConfigError, match="budget of 10 bytes"):
        select_options(costs, sensitivity, 10)


def test_selector_never_chains_shared_layers():
    costs = [{"fp": 10, "share": 0}] * 4
    choice = select_options(costs, [{}] + [{"share": 0.0}] * 3, 20)
    assert choice == ["fp", "share", "fp", "share"]


def _answer(engine, cache, tokens=12):
    return engine.ask(cache, QUESTION, max_new_tokens=tokens).completion_ids


@pytest.mark.parametrize("ratio", [0.3, 0.6, 0.8])
def test_budget_is_met_to_the_byte(engine, prefill, ratio):
    compressor = KaizenCompressor(ratio)
    cache = engine.compress(prefill, compressor)
    budget = compressor.budget(cache.full_nbytes)
    assert budget == int((1 - ratio) * cache.full_nbytes)
    assert cache.nbytes <= budget
    assert len(_answer(engine, cache, 4)) > 0
    # With options ordered by bytes and error, the bytes left cannot buy any layer a finer option.
    ladder = ("int4", "int8", "fp16", "fp")
    cache = engine.compress(prefill, KaizenCompressor(ratio, options=ladder[:-1]))
    slack = budget - cache.nbytes
    assert slack >= 0
    for layer, full in zip(cache.layers, prefill.keys_values):
        option = layer_option(layer)
        if option != "fp":
            finer = ladder[ladder.index(option) + 1]
            assert option_nbytes(finer, LayerKV(*full), 16) - layer.nbytes > slack
    exact = KaizenCompressor(budget_bytes=cache.nbytes - 1)
    assert engine.compress(prefill, exact).nbytes <= cache.nbytes - 1


def test_ratio_zero_keeps_the_full_cache_and_its_answer(engine, prefill):
    full = engine.compress(prefill, NoCompression())
    cache = engine.compress(prefill, KaizenCompressor(0.0, inner="semanticache"))
    same = engine.compress(prefill, KaizenCompressor(0.0, inner=SemantiCacheCompressor()))  # an instance works alike
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, same.layers))
    assert cache.nbytes == full.nbytes and {layer_option(layer) for layer in cache.layers} == {"fp"}
    assert _answer(engine, cache) == _answer(engine, full)


def test_depth_sharing_answers_like_separate_identical_layers(engine, prefill):
    """When layer 1's cache equals layer 0's, sharing it answers exactly as storing it twice."""
    keys, values = prefill.keys_values[0]
    base = engine.compress(prefill, NoCompression())
    separate = LayerKV(keys.clone(), values.clone())
    shared = SharedLayerKV(base.layers[0])
    outputs = []
    for layer in (separate, shared):
        cache = type(base)(**{**base.__dict__, "layers": (base.layers[0], layer)})
        outputs.append((_answer(engine, cache), cache.nbytes))
    assert outputs[0][0] == outputs[1][0]
    assert outputs[1][1] == outputs[0][1] // 2  # the shared storage is counted once
    tail = engine.tokenizer(QUESTION)["input_ids"]
    logits = [
        engine.forward(ConversationKV((base.layers[0], layer)), tail, base.length, len(tail))
        for layer in (separate, shared)
    ]
    assert torch.equal(logits[0], logits[1])


def test_composes_with_semanticache_at_the_same_bytes(engine, prefill):
    alone = engine.compress(prefill, SemantiCacheCompressor(0.9))
    both = engine.compress(prefill, make_compressor("kaizen+semanticache", 0.9))
    assert both.nbytes <= int(0.1 * both.full_nbytes) < alone.nbytes
    assert all(layer.sizes is not None and layer.sizes.dtype == torch.int16 for layer in both.layers)
    assert (both.layers[0].sizes.sum(-1) == both.length).all()  # cores still stand for every token
    assert both.entries_removed < alone.entries_removed  # more entries kept, stored coded
    assert {layer_option(layer) for layer in both.layers} - {"fp"}  # and stored coded
    assert len(_answer(engine, both, 4)) > 0


def test_coarser_groups_only_when_entries_must_merge(engine, prefill):
    def groups(cache) -> set[int]:  # channels per scale of the quantised layers
        codes = [
            layer.key_code for layer in cache.layers if isinstance(getattr(layer, "key_code", None), QuantizedTensor)
        ]
        return {code.shape[-1] // code.scales.shape[-1] for code in codes}

    options = dict(inner="semanticache", group_size=4, merge_group_size=8, options=("int8", "int4"))
    unmerged = engine.compress(prefill, KaizenCompressor(0.5, **options))  # int4 holds every entry: no merging
    merged = engine.compress(prefill, KaizenCompressor(0.9, **options))
    assert unmerged.entries_removed == 0 and groups(unmerged) == {4}
    assert merged.entries_removed > 0 and groups(merged) == {8}
    fine = engine.compress(prefill, KaizenCompressor(0.9, **(options | {"merge_group_size": None})))
    assert groups(fine) == {4} and fine.entries_removed > merged.entries_removed  # coarser scales kept more entries
    assert merged.nbytes <= int(0.1 * merged.full_nbytes)


def test_lowest_share_merges_between_the_two_lowest_precisions(engine, prefill):
    def compress(**options):
        return engine.compress(prefill, KaizenCompressor(0.9, inner="semanticache", group_size=4, **options))

    int4 = compress(options=("int8", "int4"))
    int3 = compress(options=("int8", "int4", "int3"))
    half = compress(options=("int8", "int4", "int3"), lowest_share=0.5)
    assert int4.entries_removed > half.entries_removed > int3.entries_removed > 0
    assert max(c.nbytes / c.full_nbytes for c in (int4, int3, half)) <= 0.1
    assert {layer_option(layer) for layer in half.layers} >= {"int3"}  # 3-bit codes pay for the entries kept
    int8 = compress(options=("int8", "int4"), lowest_share=0.5)  # half the layers afford 8-bit codes: more merged
    assert int8.entries_removed > int4.entries_removed and {layer_option(layer) for layer in int8.layers} >= {"int8"}


def test_auto_is_kaizen_over_semanticache_with_a_quarter_of_the_layers_budgeted_at_3_bits(engine, prefill):
    auto = make_compressor("auto", 0.9)
    want = KaizenCompressor(0.9, options=(*DEFAULT_OPTIONS, "int3"), lowest_share=0.25, inner=SemantiCacheCompressor())
    assert auto == want
    assert make_compressor("auto", 0.9, lowest_share=1.0).lowest_share == 1.0  # the caller's options win
    cache = engine.compress(prefill, auto)
    assert cache.nbytes <= int(0.1 * cache.full_nbytes) and cache.entries_removed > 0
    for ratio in (0.5, 0.75):  # no merging there: the same storage as Kaizen without 3-bit codes
        chosen = engine.compress(prefill, make_compressor("auto", ratio))
        plain = engine.compress(prefill, make_compressor("kaizen+semanticache", ratio))
        assert chosen.entries_removed == plain.entries_removed == 0


def test_calibration_table_is_used_when_it_fits(engine, prefill, tmp_path):
    options = ("int8", "int4", "share")
    table = calibrate(
        engine, corpus_text()[:3000], document_tokens=96, eval_tokens=16, options=options, group_size=8, progress=False
    )
    assert len(table["sensitivity"]) == 2 and table["sensitivity"][0]["share"] is None
    assert all(v >= -1e-6 for row in table["sensitivity"] for v in row.values() if v is not None)
    path = save_table(table, tmp_path / "kaizen-tiny.json")
    cache = engine.compress(prefill, KaizenCompressor(0.6, options=options, group_size=8, calibration=str(path)))
    assert cache.nbytes <= 0.4 * cache.full_nbytes
    with pytest.raises(ConfigError, match="group_size is 8, not 4"):
        engine.compress(prefill, KaizenCompressor(0.6, options=options, group_size=4, calibration=str(path)))
    kwargs = dict(document_tokens=96, eval_tokens=16, group_size=8, progress=False)
    added = calibrate(engine, corpus_text()[:3000], options=("int3",), **kwargs)  # one option more, measured alone
    merged = merge_tables(table, added)
    assert merged["options"] == [*options, "int3"]
    assert [{k: v for k, v in row.items() if k != "int3"} for row in merged["sensitivity"]] == table["sensitivity"]
    assert [row["int3"] for row in merged["sensitivity"]] == [row["int3"] for row in added["sensitivity"]]
    with pytest.raises(ConfigError, match="group_size"):
        merge_tables(table, calibrate(engine, corpus_text()[:3000], options=("int3",), **{**kwargs, "group_size": 4}))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(options=("int2",)), "'int2'"),
        (dict(group_size=7), "7"),
        (dict(merge_group_size=3), "3"),
        (dict(budget_bytes=-1), "-1"),
        (dict(inner="sekv"), "'sekv'"),
        (dict(inner_ratio=0.5), "0.5"),
        (dict(lowest_share=0.0), "0.0"),
        (dict(lowest_share=1.5), "1.5"),
        (dict(compression_ratio=1.0), "1.0"),
    ],
)
def test_bad_configs_name_the_value(options, match):
    with pytest.raises(ConfigError, match=match):
        KaizenCompressor(**options)


def test_unreachable_budget_and_bad_group_size_raise(engine, prefill):
    with pytest.raises(ConfigError, match="budget of 0 bytes"):
        engine.compress(prefill, KaizenCompressor(budget_bytes=0, options=("int4",)))
    with pytest.raises(ConfigError, match="group_size=12 does not divide the head dimension 16"):
        engine.compress(prefill, KaizenCompressor(group_size=12))
    assert make_compressor("kaizen", 0.5) == KaizenCompressor(0.5)


def test_the_default_models_packaged_table_is_found_by_name(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from semanticache_rag.compressors.base import CompressionContext

    monkeypatch.setenv("SEMANTICACHE_HOME", str(tmp_path))  # no user calibration
    torch.manual_seed(0)
    keys_values = [(torch.randn(1, 3, 64, 64), torch.randn(1, 3, 64, 64)) for _ in range(30)]
    tokenizer = SimpleNamespace(name_or_path=str(tmp_path / "models" / "SmolLM2-135M-Instruct"))
    context = CompressionContext(torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.bool), None, tokenizer)
    layers, _ = KaizenCompressor(0.75).compress_cache(keys_values, context)
    options = [layer_option(layer) for layer in layers]
    assert set(options) == {"int8", "int4"}
    # the table's least and most int4-sensitive layers (0 and 18)
    assert options[0] == "int4" and options[18] == "int8"


def test_a_damaged_user_calibration_is_skipped_with_a_warning(engine, prefill, tmp_path, monkeypatch, caplog):
    from semanticache_rag.compressors import kaizen

    monkeypatch.setenv("SEMANTICACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kaizen, "model_identity", lambda context: "tiny")
    path = kaizen.table_path("tiny")
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "sensitivity": [')  # cut off while it was written
    with caplog.at_level("WARNING"):
        cache = engine.compress(prefill, KaizenCompressor(0.6, options=("int8", "int4"), group_size=8))
    assert cache.nbytes <= 0.4 * cache.full_nbytes and "kaizen_calibration makes it again" in caplog.text
    assert path.read_text().startswith('{"format": 1')  # the user's file is left as it is
