"""Decoding steps of converted Llama models: the lean forward pass, the TorchScript step and the C++ step,
each against the one before it, token for token; the rotation table; where the C++ step's time goes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tests_support import q8_0_weights, tie_head

from semanticache_rag import Engine, scripted_step
from semanticache_rag.kernels import cpu_ops
from semanticache_rag.weights import (
    Fp32Linear,
    GroupedInt8Linear,
    convert_weights,
)


@pytest.fixture(autouse=True)
def _seeded():
    """Each test's torch.randn inputs from seed 0, whatever ran before it in its worker (as in test_weights.py)."""
    torch.manual_seed(0)


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int4", "int4-exact"])
def test_lean_forward_equals_transformers_forward_on_the_converted_model(tiny_llama, tiny_tokenizer, weights):
    from semanticache_rag.fused import FusedLlama, RowSlice
    from semanticache_rag.kv import ConversationKV

    model = convert_weights(copy.deepcopy(tiny_llama), weights)
    assert isinstance(model.semanticache_forward, FusedLlama)
    assert isinstance(model.model.layers[0].self_attn.k_proj, RowSlice)
    engine = Engine(model, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    cache = engine.read("Alpha beta gamma delta. " * 30, progress=False)
    ids = tiny_tokenizer("Which letter comes after beta?")["input_ids"]
    lean_kv, stock_kv = ConversationKV(cache.layers), ConversationKV(cache.layers)
    lean = engine.forward(lean_kv, ids, cache.positions, logits_to_keep=len(ids))
    with torch.inference_mode():  # transformers' own forward, through the row slices
        positions = torch.arange(cache.positions, cache.positions + len(ids))[None]
        stock = model(
            input_ids=torch.tensor([ids]),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=len(ids),
            semanticache_kv=stock_kv,
            cache=stock_kv,
        ).logits[0]
    assert torch.allclose(lean, stock, rtol=0, atol=1e-5)
    step = engine.forward(lean_kv, [5], cache.positions + len(ids))
    with torch.inference_mode():
        stock_step = model(
            input_ids=torch.tensor([[5]]),
            position_ids=torch.tensor([[cache.positions + len(ids)]]),
            use_cache=True,
            semanticache_kv=stock_kv,
            cache=stock_kv,
        ).logits[0, -1:]
    difference = (step - stock_step).abs()
    if weights == "int4":
        # The one-token step attends through the C++ kernel, the stock forward through torch's attention: the
        # same within a rounding, which int4's Q8_0 rows (each product's input rounded to 8 bits, as llama.cpp
        # does) can turn into one code step of a product's input. On an Intel CPU 5 of 400 logits moved so,
        # by up to 2^-10 (on AMD's Zen 4 none); a wrong step moves all of them.
        assert (difference > 1e-5).float().mean() <= 0.05 and difference.max() <= 4e-3
    else:
        assert difference.max() <= 1e-5
    # and stock generation still runs on the sliced projections
    assert model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False).shape[1] == len(ids) + 3


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-attention", "cpu-kernel"])
@pytest.mark.parametrize("compression", [("none", None), ("semanticache", 0.75), ("kaizen", 0.75), ("auto", 0.9)])
def test_decoding_step_equals_the_general_lean_pass(tiny_llama, tiny_tokenizer, compression, kernel):
    """The one-token path (fused norms, direct products, four batched attention products, log s once)
    computes what the general lean pass computes, over plain, merged (log s) and coded (Kaizen) caches.
    The int4 layers quantise each row to Q8_0, and the two paths' attention sums in another order (the
    C++ kernel's, or torch's batched products): a last-bit difference can flip one int8 rounding of a
    row, so the bound is a few such steps and the next token must agree."""
    from semanticache_rag import make_compressor
    from semanticache_rag.kernels import cpu_ops
    from semanticache_rag.kv import ConversationKV

    if kernel and not cpu_ops.available():
        pytest.skip("the CPU attention kernel did not build here")
    model = convert_weights(copy.deepcopy(tiny_llama), "int4")
    lean = model.semanticache_forward
    lean._kernel = kernel
    atol = 2e-2
    engine = Engine(model, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    prefill = engine.prefill("Alpha beta gamma delta. The code is 4417. " * 30, progress=False, surprisal=True)
    cache = engine.compress(prefill, make_compressor(*compression))
    full = engine.compress(prefill, make_compressor("none"))
    assert (cache.nbytes < full.nbytes) == (compression[0] != "none")
    step_kv, general_kv = ConversationKV(cache.layers), ConversationKV(cache.layers)
    ids = tiny_tokenizer("Which code?")["input_ids"]
    engine.forward(step_kv, ids, cache.positions)
    engine.forward(general_kv, ids, cache.positions)
    general_kv.observe = lambda *args: None  # any observer sends a step down the general path
    with torch.inference_mode():
        for offset, token in enumerate([5, 17, 5, 30]):
            position = torch.tensor([[cache.positions + len(ids) + offset]])
            step = lean(step_kv, torch.tensor([[token]]), position)
            general = lean(general_kv, torch.tensor([[token]]), position)
            assert torch.allclose(step, general, rtol=0, atol=atol), (offset, float((step - general).abs().max()))
            assert torch.equal(step.argmax(-1), general.argmax(-1))
            alone = lean(ConversationKV(num_layers=len(cache.layers)), torch.tensor([[token]]), position)
            assert not torch.allclose(step, alone, rtol=0, atol=1e-3)  # the document does count
    assert step_kv.layers[0].length == general_kv.layers[0].length == len(ids) + 4


def _scripted_and_python_steps(tiny_llama, tiny_tokenizer, weights):
    """(engine, prefill, decode): ``decode(cache, scripted, native=False)`` takes four steps after a
    question, with the C++ int4 step (``native``), the scripted layers or the Python loop, and returns
    their logits and the conversation."""
    from semanticache_rag.kv import ConversationKV

    model = convert_weights(copy.deepcopy(tiny_llama), weights)
    lean = model.semanticache_forward
    engine = Engine(model, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    prefill = engine.prefill("Alpha beta gamma delta. The code is 4417. " * 30, progress=False, surprisal=True)
    ids = tiny_tokenizer("Which code?")["input_ids"]

    def decode(cache, scripted, native=False):
        lean._scripted = False if scripted else None  # False: script at the first step; None: never
        lean._native = False if native else None  # the same for the C++ step (int4 weights)
        kv = ConversationKV(cache.layers, capacity=len(ids) + 1)  # room for one step: the buffers must grow
        engine.forward(kv, ids, cache.positions)
        steps = [engine.forward(kv, [token], cache.positions + len(ids) + i) for i, token in enumerate([5, 17, 5, 30])]
        assert kv.layers[0].length == kv.layers[-1].length == len(ids) + 4
        return torch.stack(steps), kv

    return engine, prefill, decode


@pytest.mark.parametrize("weights", ["fp32", "fp16", "int4", "int4-exact"])
def test_scripted_decoding_step_is_the_python_step_token_for_token(tiny_llama, tiny_tokenizer, weights, monkeypatch):
    """The layers as one TorchScript call compute exactly what the Python loop computes, over plain and
    merged (log s) caches; a failure to script keeps the Python loop."""
    from semanticache_rag import make_compressor

    engine, prefill, decode = _scripted_and_python_steps(tiny_llama, tiny_tokenizer, weights)
    lean = engine.model.semanticache_forward
    for compression in [("none", None), ("semanticache", 0.75)]:
        cache = engine.compress(prefill, make_compressor(*compression))
        python, _ = decode(cache, scripted=False)
        scripted, kv = decode(cache, scripted=True)
        assert isinstance(lean._scripted, torch.jit.ScriptModule) and set(kv.step_inputs[1]) == {"plain"}
        assert torch.equal(scripted, python), (compression, float((scripted - python).abs().max()))

    def refuse(module):
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(torch.jit, "script", refuse)
    steps, kv = decode(cache, scripted=True)
    assert lean._scripted is None and torch.equal(steps, python)


def test_scripted_decoding_step_attends_kaizen_layers_as_the_python_step(tiny_llama, tiny_tokenizer):
    """Kaizen's int8/int4/int3 codes, 16-bit, low-rank and shared layers through the scripted step give
    the Python loop's logits exactly."""
    from semanticache_rag import make_compressor
    from semanticache_rag.kv import SharedLayerKV

    engine, prefill, decode = _scripted_and_python_steps(tiny_llama, tiny_tokenizer, "fp16")
    # one option allowed at a time, at a ratio it can reach
    kaizen = [("int8", 0.5, "int8"), ("int4", 0.6, "int4"), ("int3", 0.7, "int3"), ("fp16", 0.4, "half")]
    kaizen += [("rank8", 0.6, "low_rank")]
    for option, ratio, kind in kaizen + [("share", 0.3, "plain")]:
        cache = engine.compress(prefill, make_compressor("kaizen", ratio, options=(option,)))
        python, _ = decode(cache, scripted=False)
        scripted, kv = decode(cache, scripted=True)
        assert kind in kv.step_inputs[1] and kind in kv.step_inputs[3], (option, kv.step_inputs[1])
        assert torch.equal(scripted, python), (option, float((scripted - python).abs().max()))
    assert any(isinstance(layer, SharedLayerKV) for layer in cache.layers)  # the last: shared layers


@pytest.mark.parametrize("weights", ["int4", "int4-exact", "fp32"])
def test_native_step_is_the_scripted_step_token_for_token(tiny_llama, tiny_tokenizer, weights):
    """Every layer of an int4 or fp32 model in one C++ call (kernels/decoder_step_cpu.cpp), with its tied head
    (Q8_0; fp32's own) in the same call, gives the scripted step's and the Python loop's logits exactly, over
    plain, merged (log s) and Kaizen-coded caches; a cache with low-rank layers, which the attention kernel
    does not take, keeps the scripted step."""
    from semanticache_rag import make_compressor

    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    model = copy.deepcopy(tiny_llama)
    with torch.no_grad():  # a tied table of Q8_0 values, as the default model's: a Q8_0 head of either kind
        model.model.embed_tokens.weight.copy_(q8_0_weights(*model.model.embed_tokens.weight.shape, seed=11))
    tie_head(model)
    engine, prefill, decode = _scripted_and_python_steps(model, tiny_tokenizer, weights)
    lean = engine.model.semanticache_forward
    # int4 (llama.cpp's arithmetic) scores coded keys against the query rounded to Q8_0 in all three steps
    assert isinstance(engine.model.lm_head, Fp32Linear if weights == "fp32" else GroupedInt8Linear)
    assert {scripted_step.rounds_query(layer) for layer in engine.model.model.layers} == {weights == "int4"}
    compressions = [("none", None, ()), ("semanticache", 0.75, ()), ("kaizen", 0.6, ("int4",))]
    compressions += [("kaizen", 0.5, ("int8",)), ("kaizen", 0.4, ("fp16",)), ("kaizen", 0.3, ("share",))]
    compressions += [("fp16", None, ()), ("fp16 as bf16", None, ())]
    for compression, ratio, options in compressions:
        extra = {"options": options} if options else {}
        cache = engine.compress(prefill, make_compressor(compression.split()[0], ratio, **extra))
        if compression == "fp16 as bf16":  # what the fp16 compressor stores where fp16 cannot hold a layer
            cache = dataclasses.replace(cache, layers=tuple(_as_bf16(layer) for layer in cache.layers))
        python, _ = decode(cache, scripted=False)
        scripted, _ = decode(cache, scripted=True)
        native, kv = decode(cache, scripted=False, native=True)
        assert lean._native is not None and isinstance(kv.step_document, torch.ScriptObject), compression
        # the tied head (Q8_0 of either kind, or fp32): the C++ step computes the logits too, in the same call
        assert lean._native.has_head()
        assert torch.equal(scripted, python) and torch.equal(native, python), (
            compression,
            options,
            float((native - python).abs().max()),
        )
    cache = engine.compress(prefill, make_compressor("kaizen", 0.6, options=("rank8",)))
    scripted, _ = decode(cache, scripted=True)
    native, kv = decode(cache, scripted=True, native=True)
    assert kv.step_document is False and "low_rank" in kv.step_inputs[1] and torch.equal(native, scripted)


def _as_bf16(layer):
    from semanticache_rag.kv import CodedLayerKV
    from semanticache_rag.tensor_codes import HalfTensor

    def code(half):
        return HalfTensor(half.data.float().bfloat16(), half.dtype)

    return CodedLayerKV(code(layer.key_code), code(layer.value_code), layer.sizes)


def test_timed_native_steps_say_where_their_time_goes(tiny_llama, tiny_tokenizer):
    """FusedLlama.timed_steps (for benchmarks): the C++ steps inside are counted and their time split into
    the layers' attention, the rest of the layers, the head and the call's own rest, each part inside the
    whole; steps after it are not counted, and the answers are the untimed steps' own. Without the C++
    step (fp16 weights) it says nothing."""
    from semanticache_rag import make_compressor
    from semanticache_rag.kv import ConversationKV

    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    model = copy.deepcopy(tiny_llama)
    with torch.no_grad():  # a tied Q8_0 head, as the default model's: computed in the C++ call
        model.model.embed_tokens.weight.copy_(q8_0_weights(*model.model.embed_tokens.weight.shape, seed=11))
    tie_head(model)
    engine, prefill, decode = _scripted_and_python_steps(model, tiny_tokenizer, "int4")
    cache = engine.compress(prefill, make_compressor("kaizen", 0.6, options=("int4",)))
    untimed, _ = decode(cache, scripted=False, native=True)
    lean = engine.model.semanticache_forward
    ids = tiny_tokenizer("Which code?")["input_ids"]
    kv = ConversationKV(cache.layers, capacity=len(ids) + 1)
    engine.forward(kv, ids, cache.positions)
    tokens = [5, 17, 5, 30]
    with lean.timed_steps() as timings:
        timed = [engine.forward(kv, [token], cache.positions + len(ids) + i) for i, token in enumerate(tokens[:3])]
    timed.append(engine.forward(kv, [tokens[3]], cache.positions + len(ids) + 3))  # after: not counted
    assert torch.equal(torch.stack(timed), untimed)
    assert timings["steps"] == 3 and set(timings) == {"steps", "step", "attention", "products", "head", "other"}
    assert min(timings["attention"], timings["products"], timings["head"]) > 0 and timings["other"] >= 0
    assert timings["attention"] + timings["products"] + timings["head"] <= timings["step"]
    assert lean._native.timings()[0] == 3.0  # the step after it was not counted

    engine, prefill, decode = _scripted_and_python_steps(tiny_llama, tiny_tokenizer, "fp16")
    with engine.model.semanticache_forward.timed_steps() as timings:
        decode(engine.compress(prefill, make_compressor("none")), scripted=False)
    assert timings == {}


@pytest.mark.parametrize("weights", ["int4", "int4-exact"])
def test_native_step_takes_an_untied_head_in_python_and_refuses_bad_tokens(tiny_llama, tiny_tokenizer, weights):
    """A head that is not Q8_0 (here an untied one: bf16 for int4, as loaded for int4-exact) is left to the
    model: the C++ step gives the final hidden state and the logits are the Python loop's. A token outside
    the vocabulary is refused with its value, not read; asking the step for logits without a head, too."""
    from semanticache_rag import make_compressor
    from semanticache_rag.scripted_step import kept_step_document

    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    model = copy.deepcopy(tiny_llama)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)  # untied
    model.config.tie_word_embeddings = False
    engine, prefill, decode = _scripted_and_python_steps(model, tiny_tokenizer, weights)
    lean = engine.model.semanticache_forward
    cache = engine.compress(prefill, make_compressor("semanticache", 0.75))
    python, _ = decode(cache, scripted=False)
    native, kv = decode(cache, scripted=False, native=True)
    assert isinstance(kv.step_document, torch.ScriptObject)  # the C++ step ran
    assert not isinstance(engine.model.lm_head, GroupedInt8Linear) and not lean._native.has_head()
    assert torch.equal(native, python)
    cos, sin = lean._rotation(torch.tensor([[0]]), torch.float32)
    keys, values, length = kv.buffers(1)
    vocabulary = engine.model.model.embed_tokens.weight.shape[0]
    with pytest.raises(RuntimeError, match=f"token {vocabulary} is outside the vocabulary of {vocabulary}"):
        lean._native.token_step(vocabulary, cos, sin, kept_step_document(kv), keys, values, length, False)
    with pytest.raises(RuntimeError, match="needs a Q8_0 or float32 head"):
        lean._native.token_step(0, cos, sin, kept_step_document(kv), keys, values, length, True)
    hidden = engine.model.config.hidden_size
    with pytest.raises(RuntimeError, match=f"x must hold {hidden} values, got {hidden + 32}"):
        lean._native.step(torch.zeros(1, hidden + 32), cos, sin, kept_step_document(kv), keys, values, length)


def test_native_layers_refuse_weights_that_do_not_fit_their_heads(tiny_llama):
    """The C++ step's weights are checked once, when they are taken: products whose sizes do not fit the
    heads they are said to have are refused, naming the layer and the sizes."""
    from semanticache_rag.fused import native_layers

    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    model = convert_weights(copy.deepcopy(tiny_llama), "int4")
    config = model.config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    assert native_layers(model, heads, kv_heads, dim) is not None
    with pytest.raises(RuntimeError, match=r"layer 0: products of 96->160, .* do not fit 96 hidden values and 12 \+ 2"):
        native_layers(model, 2 * heads, kv_heads, dim)


def test_rotation_table_rows_are_each_position_computed_alone(tiny_llama):
    """The one-token step's RoPE rows come from tables of ROTATION_BLOCK positions; each row is, bit for
    bit, what that position alone gives, across block edges, with more blocks in turn than are kept (the
    oldest goes); a step of several positions is refused."""
    from semanticache_rag.fused import ROTATION_BLOCK, ROTATION_TABLES, FusedLlama

    lean = FusedLlama(tiny_llama)
    half = lean.head_dim // 2
    positions = [0, 1, ROTATION_BLOCK - 1, ROTATION_BLOCK, 3 * ROTATION_BLOCK + 7, 20_000, 7]
    positions += [b * ROTATION_BLOCK + 5 for b in range(ROTATION_TABLES + 3)] + [2]
    for position in positions:
        cos, sin = lean._cos_sin(torch.tensor([[position]]), torch.float32)
        sin[..., :half].neg_()
        table_cos, table_sin = lean._rotation(torch.tensor([[position]]), torch.float32)
        assert torch.equal(table_cos, cos.view(-1)) and torch.equal(table_sin, sin.view(-1)), position
    assert len(lean._rotations) == ROTATION_TABLES
    with pytest.raises(ValueError, match="one position, got 2"):
        lean._rotation(torch.tensor([[3, 4]]), torch.float32)
