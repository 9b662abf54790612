"""weights="fp32": an fp32 model's own weights, its decoding steps in one C++ call (kernels/fp32_weights_cpu.cpp)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests_support import needs_cpu_kernels, tie_head

from semanticache_rag import Engine, make_compressor
from semanticache_rag.errors import ConfigError
from semanticache_rag.weights import Fp32Linear, TiedFp32Linear, convert_weights


@pytest.mark.parametrize("out_features", [1, 17, 48])
@pytest.mark.parametrize("in_features", [1, 15, 16, 17, 63, 64, 65, 100, 576])
def test_one_row_product_is_the_fp64_product_to_fp32_rounding(in_features, out_features):
    """Every input count (the vector loops' tails included) and output count (blocks of 16 shared out to
    threads): within the bound of an fp32 sum of the products' magnitudes, as torch's own product is."""
    needs_cpu_kernels()
    g = torch.Generator().manual_seed(in_features * 100 + out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(in_features, generator=g) * 10.0 ** torch.randint(-2, 3, (in_features,), generator=g)
    got = torch.ops.semanticache.fp32_row_product(x, weight)
    exact = weight.double() @ x.double()
    bound = 2 * in_features * torch.finfo(torch.float32).eps * (weight.double().abs() @ x.double().abs())
    assert got.shape == (out_features,) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= bound + 1e-30).all(), float((got.double() - exact).abs().max())
    assert ((weight @ x).double() - exact).abs().max() <= bound.max()  # the twin meets the same bound
    with pytest.raises(RuntimeError, match=f"x must be a contiguous float32 row of {in_features} inputs"):
        torch.ops.semanticache.fp32_row_product(torch.zeros(in_features + 1), weight)
    with pytest.raises(RuntimeError, match="contiguous .out, in. float32"):
        torch.ops.semanticache.fp32_row_product(x, weight.double())


def test_fp32_layers_multiply_one_row_in_cpp_and_many_by_torch():
    needs_cpu_kernels()
    linear = torch.nn.Linear(96, 40, bias=True)
    layer = Fp32Linear(linear)
    assert layer.one_row and layer.weight.data_ptr() == linear.weight.data_ptr()  # not copied
    x = torch.randn(5, 96)
    want = linear(x).detach()
    torch.testing.assert_close(layer.rows(x), want, rtol=0, atol=1e-5)
    one = layer.rows(x[:1])
    assert torch.equal(one[0], torch.ops.semanticache.fp32_row_product(x[0], layer.weight) + linear.bias)
    torch.testing.assert_close(one, want[:1], rtol=0, atol=1e-5)


def test_a_tied_head_stays_the_embedding_table_and_an_untied_one_is_an_fp32_layer(tiny_llama):
    """The tied head is the embedding's own parameter after conversion (no second copy of the table); an untied
    head becomes an fp32 layer of its own, its weights copied once."""
    tied = copy.deepcopy(tiny_llama)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    tied.config.tie_word_embeddings = True
    bytes_before = sum(t.numel() * t.element_size() for t in [*tied.parameters(), *tied.buffers()])
    tied = convert_weights(tied, "fp32")
    assert type(tied.lm_head) is TiedFp32Linear and tied.lm_head.weight is tied.model.embed_tokens.weight
    stored = sum(t.numel() * t.element_size() for t in [*tied.parameters(), *tied.buffers()])
    assert stored == bytes_before  # the layers' weights moved into buffers, none doubled
    untied = convert_weights(copy.deepcopy(tiny_llama), "fp32")
    assert type(untied.lm_head) is Fp32Linear
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_fp32_refuses_a_model_that_is_not_fp32_and_leaves_it_as_it_was(tiny_llama):
    model = copy.deepcopy(tiny_llama).bfloat16()
    with pytest.raises(ConfigError, match=r"weights='fp32' keeps an fp32 model's weights.*dtype=torch.float32"):
        convert_weights(model, "fp32")
    assert not hasattr(model, "semanticache_weights") and isinstance(
        model.model.layers[0].mlp.down_proj, torch.nn.Linear
    )


def test_fp32_answers_as_the_model_token_for_token(tiny_llama, tiny_tokenizer):
    """The same greedy tokens as the model as loaded (transformers' forward), full cache and compressed, the
    steps in one C++ call with the tied head in it."""
    needs_cpu_kernels()
    model = tie_head(copy.deepcopy(tiny_llama))
    original = Engine(copy.deepcopy(model), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    converted = Engine(convert_weights(model, "fp32"), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    text = "Alpha beta gamma delta. The code is 4417. " * 30
    for compression in [("none", None), ("semanticache", 0.75), ("kaizen", 0.75)]:
        answers = []
        for engine in (original, converted):
            cache = engine.compress(engine.prefill(text, progress=False, surprisal=True), make_compressor(*compression))
            answers.append(engine.ask(cache, "Which code?", max_new_tokens=12).completion_ids)
        assert answers[0] == answers[1], (compression, answers)
    lean = converted.model.semanticache_forward
    assert lean._native is not None and lean._native.has_head()


def test_a_model_with_biases_keeps_the_scripted_step_and_its_answers(tiny_tokenizer):
    """Projections with a bias (Llama's attention_bias / mlp_bias) are fp32 layers that add it; the C++ step does
    not take them, so the scripted step decodes, with the same greedy tokens as the model as loaded."""
    from conftest import _tiny_model

    model = _tiny_model("llama", len(tiny_tokenizer), attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for linear in (m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None):
            linear.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(linear.out_features))
    original = Engine(copy.deepcopy(model), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    converted = Engine(convert_weights(model, "fp32"), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    text = "Alpha beta gamma delta. The code is 4417. " * 30
    answers = []
    for engine in (original, converted):
        cache = engine.compress(engine.prefill(text, progress=False, surprisal=True), make_compressor("kaizen", 0.75))
        answers.append(engine.ask(cache, "Which code?", max_new_tokens=12).completion_ids)
    assert answers[0] == answers[1]
    assert converted.model.semanticache_forward._native is None  # refused: the step takes no biases
    assert isinstance(converted.model.model.layers[0].self_attn.qkv_proj, Fp32Linear)


def test_packing_lets_each_buffer_go_as_its_copy_is_placed():
    """huge_pages.pack_buffers moves a module's buffer into the block and lets the original go before the next one
    is copied, so a conversion does not hold its weights twice; a buffer shared by two modules stays shared."""
    import weakref

    from semanticache_rag import huge_pages

    made = [torch.full((1000,), float(i)) for i in range(3)]
    refs = [weakref.ref(t) for t in made]
    seen = []
    copies = huge_pages.pack(
        (made.pop(0) for _ in range(3)), lambda i, copy: seen.append((i, refs[i]() is None, float(copy[0])))
    )
    assert seen == [(0, True, 0.0), (1, True, 1.0), (2, True, 2.0)] and [float(c[-1]) for c in copies] == [0, 1, 2]
    first, second = torch.nn.Module(), torch.nn.Module()
    shared = torch.arange(64, dtype=torch.float32)
    first.register_buffer("weight", shared)
    second.register_buffer("weight", shared)
    original = weakref.ref(shared)
    del shared
    assert huge_pages.pack_buffers([first, second]) == 64 * 4
    assert first.weight is second.weight and torch.equal(first.weight, torch.arange(64.0)) and original() is None


def test_the_cpp_step_refuses_fp32_parts_that_do_not_fit(tiny_llama):
    """An fp32 product given scales, and an fp32 head whose rows are not the hidden size, are refused when the step
    takes them, saying what was wrong."""
    from semanticache_rag.fused import native_layers

    needs_cpu_kernels()
    model = convert_weights(copy.deepcopy(tiny_llama), "fp32")
    config = model.config
    shape = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    native = native_layers(model, *shape)
    assert native is not None
    layer, empty = model.model.layers[0], torch.empty(0)
    attention, mlp = layer.self_attn, layer.mlp
    tensors = [layer.input_layernorm.weight, attention.qkv_proj.weight, torch.ones(1), empty]  # qkv given scales
    tensors += [attention.o_proj.weight, empty, empty, layer.post_attention_layernorm.weight]
    tensors += [mlp.gate_up_proj.weight, empty, empty, mlp.down_proj.weight, empty, empty]
    with pytest.raises(RuntimeError, match="a float32 product takes no scales or minimums"):
        torch.classes.semanticache.Int4Layers(tensors, [1e-5, 1e-5], *shape, 0.25, True)
    tensors[2] = empty  # and the same layer as it should be is taken
    assert torch.classes.semanticache.Int4Layers(tensors, [1e-5, 1e-5], *shape, 0.25, True) is not None
    embedding, hidden = model.model.embed_tokens.weight, config.hidden_size
    with pytest.raises(RuntimeError, match=rf"a float32 head must be \(V, {hidden}\) with no scales"):
        native.set_ends(embedding, model.model.norm.weight, 1e-5, torch.zeros(8, hidden + 1), torch.empty(0))
