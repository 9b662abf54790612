"""Weight formats for CPU decoding: fp16, bf16, int8 and int4 (GGUF Q4_1's layout) linear layers."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from tests_support import needs_default_model, q4_1_weights, q8_0_weights, tie_head

from semanticache_rag import Engine
from semanticache_rag.errors import ConfigError
from semanticache_rag.gguf_codes import group_codes, int8_codes
from semanticache_rag.kernels import cpu_ops, int4_weights_ref
from semanticache_rag.store_key import model_identity
from semanticache_rag.weights import (
    BF16Linear,
    FP16Linear,
    Fp32Linear,
    GroupedInt8Linear,
    Int4Linear,
    Int8Linear,
    convert_weights,
)


@pytest.fixture(autouse=True)
def _seeded():
    """Each test's torch.randn inputs from seed 0, whatever ran before it in its worker: the tolerances here
    are measured against the inputs, and one order of files put the int4 product at 1.01% of the largest
    output against a bound of 1%."""
    torch.manual_seed(0)


def test_group_codes_finds_q4_1_codes_again():
    weight = q4_1_weights(64, 96)
    codes, scale, low = group_codes(weight)
    assert codes.min() == 0 and codes.max() == 15
    rebuilt = (codes.float().reshape(64, 3, 32) * scale[..., None] + low[..., None]).reshape(64, 96)
    assert torch.equal(rebuilt, weight) or torch.allclose(rebuilt, weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "kind, tolerance",
    # relative to the largest output: bf16 inputs round at 2**-9; int8 rows add absmax / 254 per weight;
    # fp16 weights round at 2**-11 and nothing else does
    [(BF16Linear, 0.01), (Int8Linear, 0.02), (Int4Linear, 0.01), (GroupedInt8Linear, 0.01), (FP16Linear, 0.002)],
)
def test_weight_only_linear_matches_the_full_precision_product(kind, tolerance):
    linear = torch.nn.Linear(96, 64, bias=True)
    with torch.no_grad():
        linear.weight.copy_(q4_1_weights(64, 96, seed=1))  # exact for Int4Linear, any weights for the others
    x = torch.randn(2, 5, 96)
    want = linear(x)
    got = kind(linear)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() <= tolerance * want.abs().max()


def test_fp16_products_multiply_the_weights_rounded_to_fp16_with_fp32_sums():
    linear = torch.nn.Linear(96, 64, bias=True)
    layer = FP16Linear(linear)
    x = torch.randn(700, 96)  # one row (decoding) and many (reading) take the same product
    want = x @ linear.weight.detach().half().float().T + linear.bias.detach()
    assert torch.allclose(layer.rows(x), want, rtol=0, atol=1e-5)
    assert torch.allclose(layer.rows(x[:1]), want[:1], rtol=0, atol=1e-5)
    assert layer.packed_nbytes == 2 * 96 * 64


def test_many_rows_multiply_by_the_decoded_weights_in_fp32():
    """From MANY_ROWS rows on (reading), int8 layers multiply fp32 inputs by the weights their kernel
    multiplies by, decoded to fp32: the kernel's result up to its bf16 rounding of the inputs, and the
    weights' own product to fp32 rounding. Below, rows still go through the kernel."""
    from semanticache_rag import weights

    linear = torch.nn.Linear(96, 64, bias=True)
    with torch.no_grad():
        linear.weight.copy_(q4_1_weights(64, 96, seed=2))
    layer = Int8Linear(linear)
    assert layer.many_rows == weights.MANY_ROWS
    x = torch.randn(weights.MANY_ROWS + 3, 96)
    decoded = layer.decoded()
    assert decoded.shape == (64, 96) and decoded.dtype == torch.float32
    bf16_inputs = layer.product(x.to(torch.bfloat16)).float() + linear.bias.detach()  # the kernel, all rows
    got = layer.rows(x)
    torch.testing.assert_close(got, x @ decoded.T + linear.bias.detach(), rtol=0, atol=1e-5)
    assert (got - bf16_inputs).abs().max() <= 0.01 * bf16_inputs.abs().max()
    few = layer.rows(x[: weights.MANY_ROWS - 1])
    torch.testing.assert_close(few, bf16_inputs[: weights.MANY_ROWS - 1].to(few.dtype), rtol=0, atol=1e-6)


def _kernel_layer(kind, seed: int):
    """A 96 -> 64 layer with a bias and Q4_1-exact weights, and ``kind`` of it (skips without the C++ kernels)."""
    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    linear = torch.nn.Linear(96, 64, bias=True)
    with torch.no_grad():
        linear.weight.copy_(q4_1_weights(64, 96, seed=seed))
    return linear, kind(linear)


def test_int4_decodes_the_q4_1_weights_exactly_and_multiplies_few_rows_as_llama_cpp():
    """Many rows (reading): the fp32 product by the decoded weights, which are the Q4_1 weights exactly
    (fp16 scales and minimums, as the GGUF's). Fewer rows, one included: the rows quantised to Q8_0 and
    integer sums (the C++ kernel, its twin's result to fp32 rounding), within 1% of the exact product."""
    from semanticache_rag import weights

    linear, layer = _kernel_layer(Int4Linear, seed=2)
    assert layer.many_rows == weights.MANY_ROWS and layer.one_row
    decoded = layer.decoded()
    codes, scale, low = group_codes(linear.weight.detach())  # code * scale + minimum, those two in fp16
    rebuilt = codes.float().view(64, 3, 32) * scale.half().float()[..., None] + low.half().float()[..., None]
    assert decoded.shape == (64, 96) and torch.equal(decoded, rebuilt.view(64, 96))
    x = torch.randn(weights.MANY_ROWS + 3, 96)
    exact = (x @ decoded.T + linear.bias).detach()
    torch.testing.assert_close(layer.rows(x), exact, rtol=0, atol=1e-5)
    for rows in (weights.MANY_ROWS - 1, 1):
        got = layer.rows(x[:rows])
        twin = int4_weights_ref.q4_1_product(x[:rows], layer.codes, layer.scales, layer.minimums) + linear.bias
        torch.testing.assert_close(got, twin.detach(), rtol=1e-5, atol=1e-6)
        assert (got - exact[:rows]).abs().max() <= 0.01 * exact[:rows].abs().max()
    torch.testing.assert_close(layer.rows(x[:1]), layer.rows(x[:5])[:1], rtol=0, atol=0)  # rows independent


def test_int4_exact_multiplies_every_row_count_in_fp32_by_the_decoded_weights():
    """int4-exact layers: one row, a few and many, the decoded weights' fp32 product to fp32 rounding."""
    from semanticache_rag import weights
    from semanticache_rag.weights import ExactInt4Linear

    linear, layer = _kernel_layer(ExactInt4Linear, seed=4)
    assert layer.one_row and layer.many_rows == weights.MANY_ROWS
    x = torch.randn(weights.MANY_ROWS + 1, 96)
    exact = (x.double() @ layer.decoded().double().T + linear.bias.double()).float().detach()
    for rows in (1, 5, weights.MANY_ROWS + 1):
        torch.testing.assert_close(layer.rows(x[:rows]), exact[:rows], rtol=0, atol=2e-5)


def test_int4_without_the_cpu_kernels_multiplies_every_row_count_by_the_decoded_weights(monkeypatch):
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    linear = torch.nn.Linear(96, 64, bias=False)
    layer = Int4Linear(linear)
    assert layer.many_rows == 1 and not layer.one_row
    assert layer.decoded() is layer.dense and layer.dense.shape == (64, 96)  # decoded once, not at every product
    assert "dense" not in layer.state_dict()
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer.rows(x[:1]), x[:1] @ layer.decoded().T, rtol=0, atol=0)
    torch.testing.assert_close(layer.rows(x), x @ layer.decoded().T, rtol=0, atol=0)


@pytest.mark.parametrize("kind", [Int4Linear, GroupedInt8Linear, Int8Linear])
def test_one_row_is_multiplied_by_the_cpu_kernel(kind):
    """Decoding's one row goes through kernels/int4_weights_cpu.cpp (Q4_1) and kernels/q8_0_weights_cpu.cpp
    (Q8_0, int8): int8 rows in fp32 (the decoded weights' product to fp32 rounding); Q4_1 and Q8_0 as their
    few-row product (the row quantised to Q8_0), within 2% of the full-precision product."""
    linear, layer = _kernel_layer(kind, seed=3)
    assert layer.one_row
    x = torch.randn(1, 96)
    got = layer.rows(x)
    if kind is Int8Linear:
        torch.testing.assert_close(got, x @ layer.decoded().T + linear.bias.detach(), rtol=0, atol=1e-5)
    else:
        torch.testing.assert_close(got, layer.product(x) + linear.bias.detach(), rtol=0, atol=0)
    want = linear(x).detach()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_int4_of_arbitrary_weights_is_within_half_a_step():
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(1, 64)
    codes, scale, low = group_codes(linear.weight.detach())
    rebuilt = (codes.float().reshape(32, 2, 32) * scale[..., None] + low[..., None]).reshape(32, 64)
    assert ((rebuilt - linear.weight).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-7).all()
    assert torch.allclose(Int4Linear(linear)(x), x @ rebuilt.T, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int8", "int4", "int4-exact"])
def test_converted_tiny_model_answers_close_to_the_original(tiny_llama, tiny_tokenizer, weights):
    from semanticache_rag.weights import ExactInt4Linear

    model = convert_weights(copy.deepcopy(tiny_llama), weights)
    kinds = {type(m) for m in model.modules()}
    assert {Fp32Linear, FP16Linear, BF16Linear, Int8Linear, Int4Linear, ExactInt4Linear} & kinds
    # int4-exact: a head that is not a tied Q8_0 table (the tiny model's is untied) stays as loaded
    assert (torch.nn.Linear in kinds) == (weights == "int4-exact")
    assert model.semanticache_weights == weights
    ids = torch.tensor([tiny_tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]])
    with torch.inference_mode():
        want = tiny_llama(ids).logits.float().log_softmax(-1)
        got = model(ids).logits.float().log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1)
    assert kl.mean() < 0.01, float(kl.mean())
    # and the engine answers from a cache with it, as with the original weights
    engine = Engine(model, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    cache = engine.read("Alpha beta gamma. " * 20, progress=False)
    assert engine.ask(cache, "What?", max_new_tokens=4).completion_tokens >= 1


def test_q8_0_head_finds_its_codes_again_and_multiplies_by_them():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (48, 3, 32), generator=g).float()
    codes[..., 0] = 127  # Q8_0: the group's largest magnitude has code 127
    codes[0, 0, 1:] = -127  # both ends of the range through the two 4-bit planes
    scales = torch.randint(1, 64, (48, 3, 1), generator=g) / 4096  # 127 * s / 127 == s in fp32
    linear = torch.nn.Linear(96, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_((codes * scales).reshape(48, 96))
    found, found_scales = int8_codes(linear.weight, 32)
    assert torch.equal((found.float() * found_scales[..., None]).reshape(48, 96), linear.weight.detach())
    head = GroupedInt8Linear(linear)
    x = torch.randn(3, 96)
    # the codes exactly, the scales in bf16, the inputs quantised to Q8_0 (as llama.cpp's product), fp32 sums
    weight = (codes * scales.to(torch.bfloat16).float()).reshape(48, 96)
    input_codes, input_scales = int4_weights_ref.quantize_rows(x)
    want = (input_codes * input_scales[..., None]).flatten(1) @ weight.T
    torch.testing.assert_close(head(x), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head(x)[1], head(x[1:2])[0], rtol=0, atol=0)
    assert (head(x) - x @ weight.T).abs().max() <= 0.01 * (x @ weight.T).abs().max()  # what quantising x costs


def test_q8_0_refuses_a_layer_its_layout_cannot_take():
    with pytest.raises(ValueError, match="outputs in 16s and inputs in 32s"):
        GroupedInt8Linear(torch.nn.Linear(96, 40, bias=False))
    with pytest.raises(ValueError, match="got \\(48, 40\\)"):
        GroupedInt8Linear(torch.nn.Linear(40, 48, bias=False))


def test_int4_leaves_layers_its_kernel_cannot_take_as_they_are(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    hidden = model.config.hidden_size
    model.odd_outputs, model.odd_inputs = torch.nn.Linear(hidden, 40), torch.nn.Linear(40, hidden)
    convert_weights(model, "int4")
    assert type(model.odd_outputs) is torch.nn.Linear and type(model.odd_inputs) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)


@pytest.mark.parametrize(
    "weights, decoding_head, untied_head", [("int4", GroupedInt8Linear, BF16Linear), ("int8", Int8Linear, Int8Linear)]
)
def test_tied_head_decodes_in_codes_and_reads_with_the_embedding(tiny_llama, weights, decoding_head, untied_head):
    """int4: GGUF's Q8_0 head; int8: int8 rows. Reading's surprisal multiplies by the embedding table, and
    a head never decodes its codes for the many rows of reading (that would be its whole vocabulary in fp32)."""
    model = copy.deepcopy(tiny_llama)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    convert_weights(model, weights)
    assert isinstance(model.lm_head, decoding_head) and model.lm_head.many_rows > 2**40
    assert model.semanticache_reading_head is model.get_input_embeddings()
    untied = convert_weights(copy.deepcopy(tiny_llama), weights)
    assert isinstance(untied.lm_head, untied_head) and not hasattr(untied, "semanticache_reading_head")
    # (a layer of 256 outputs: torch's packing of 96, the tiny model's width, on AVX-512 is not the known one)
    assert untied.lm_head.many_rows > 2**40 and untied.model.layers[0].mlp.gate_up_proj.many_rows < 1000


def test_weight_format_is_part_of_a_stored_cache_key(tiny_llama, tiny_tokenizer):
    original = Engine(tiny_llama, tiny_tokenizer, model_name="tiny")
    converted = Engine(convert_weights(copy.deepcopy(tiny_llama), "int4"), tiny_tokenizer, model_name="tiny")
    assert model_identity(original) != model_identity(converted)


def test_bad_weight_options_are_config_errors(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    with pytest.raises(ConfigError, match="weights must be one of"):
        convert_weights(model, "int3")
    assert convert_weights(model, "model") is model and not hasattr(model, "semanticache_weights")
    convert_weights(model, "int8")
    with pytest.raises(ConfigError, match="already 'int8'"):
        convert_weights(model, "int4")


@pytest.mark.slow
@needs_default_model
def test_default_model_answers_as_the_fp32_model():
    """fp16 weights (through the scripted step), int4-exact ones (the GGUF's codes in fp32 arithmetic,
    through the C++ step, and its Q8_0 head) and fp32 ones (the model's own, through the C++ step with its tied
    head) keep the fp32 model's greedy answer, full cache and compressed."""
    from semanticache_rag import make_compressor

    text = "The vault code for the east wing is 4417. " + "Nothing else happened. " * 40
    question = "What is the vault code for the east wing?"
    answers = {}
    for kind in ("model", "fp16", "int4-exact", "fp32"):
        engine = Engine.from_pretrained(weights=kind)
        prefill = engine.prefill(text, progress=False, surprisal=True)
        for compression in (("none", None), ("semanticache", 0.75)):
            cache = engine.compress(prefill, make_compressor(*compression))
            answers.setdefault(kind, []).append(engine.ask(cache, question, max_new_tokens=24).answer)
        lean = getattr(engine.model, "semanticache_forward", None)  # "model": transformers' forward
        if kind == "fp16":
            assert isinstance(lean._scripted, torch.jit.ScriptModule)
        elif kind == "int4-exact" and cpu_ops.available():
            from semanticache_rag.weights import ExactGroupedInt8Linear

            assert lean._native is not None  # the C++ step, and the GGUF's Q8_0 head in fp32:
            assert isinstance(engine.model.lm_head, ExactGroupedInt8Linear)
        elif kind == "fp32" and cpu_ops.available():
            assert lean._native is not None and lean._native.has_head()
    assert answers["fp16"] == answers["model"] == answers["int4-exact"] == answers["fp32"], answers
    assert "4417" in answers["model"][0], answers


@pytest.mark.slow
@needs_default_model
def test_default_model_int4_keeps_the_gguf_codes_and_answers():
    """int4 holds the default model's decoder weights exactly (they are the GGUF's Q4_1 values)."""
    engine = Engine.from_pretrained(weights="int4")
    layers = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * engine.model.config.num_hidden_layers  # q|k|v, o, gate|up, down
    from semanticache_rag.models import load_model

    original, _, _ = load_model(None, weights="model")
    for name, module in original.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            weight = module.weight.detach()
            codes, scale, low = group_codes(weight)
            rebuilt = codes.float().unflatten(1, (-1, 32)) * scale[..., None] + low[..., None]
            assert torch.equal(rebuilt.flatten(1), weight), name
    assert isinstance(engine.model.lm_head, GroupedInt8Linear)  # the GGUF's Q8_0 table, tied to the embedding
    embedding = original.get_input_embeddings().weight.detach()
    codes, scales = int8_codes(embedding, 32)
    assert torch.equal((codes.float() * scales[..., None]).flatten(1), embedding)
    cache = engine.read("The vault code for the east wing is 4417. " + "Nothing else happened. " * 40, progress=False)
    question = "What is the vault code for the east wing?"
    answer = engine.ask(cache, question, max_new_tokens=24)
    assert "4417" in answer.answer
    # the one-token decoding step answers token for token what the general lean pass answers
    from semanticache_rag.fused import FusedLlama

    general = FusedLlama.sequence
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            FusedLlama, "step", lambda self, kv, ids, positions, head=True: general(self, kv, ids, positions, 1, head)
        )
        assert engine.ask(cache, question, max_new_tokens=24).answer == answer.answer


def test_int4_exact_answers_as_the_fp32_model_whose_weights_are_q4_1(tiny_llama, tiny_tokenizer):
    """A model whose decoder weights Q4_1 holds exactly and whose tied head Q8_0 does (as the default
    model's): int4-exact decodes the fp32 model's greedy tokens (the C++ step and the Q8_0 head in fp32
    included)."""
    from semanticache_rag import make_compressor
    from semanticache_rag.gguf_codes import is_q8_0
    from semanticache_rag.weights import ExactGroupedInt8Linear

    model = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        for seed, linear in enumerate(m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)):
            codes, scale, low = group_codes(q4_1_weights(*linear.weight.shape, seed=seed))
            exact = (
                codes.float().unflatten(1, (-1, 32)) * scale.half().float()[..., None] + low.half().float()[..., None]
            )
            linear.weight.copy_(exact.flatten(1))
        embedding = model.get_input_embeddings().weight
        embedding.copy_(q8_0_weights(*embedding.shape, seed=11))
        model.lm_head.weight = embedding  # tied, as the default model's head
    assert is_q8_0(embedding) and not is_q8_0(embedding + 1e-4)
    original = Engine(copy.deepcopy(model), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    converted = Engine(convert_weights(model, "int4-exact"), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    text = "Alpha beta gamma delta. The code is 4417. " * 30
    for compression in [("none", None), ("semanticache", 0.75)]:
        answers = []
        for engine in (original, converted):
            cache = engine.compress(engine.prefill(text, progress=False, surprisal=True), make_compressor(*compression))
            answers.append(engine.ask(cache, "Which code?", max_new_tokens=12).answer)
        assert answers[0] == answers[1], (compression, answers)
    if cpu_ops.available():
        assert converted.model.semanticache_forward._native is not None  # the C++ step ran
        assert isinstance(converted.model.lm_head, ExactGroupedInt8Linear)
        x = torch.randn(1, embedding.shape[1])
        torch.testing.assert_close(converted.model.lm_head(x), x @ embedding.T, rtol=0, atol=1e-5)


def test_native_step_is_only_for_int4_layers_on_their_codes_and_fp32_layers(tiny_llama, monkeypatch):
    """fp16 layers, and int4 layers that kept their decoded weights (no C++ kernels), have no C++ step; fp32
    layers have one."""
    from semanticache_rag.fused import native_layers

    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    config = tiny_llama.config
    shape = (config.num_attention_heads, config.num_key_value_heads, config.hidden_size // config.num_attention_heads)
    assert native_layers(convert_weights(copy.deepcopy(tiny_llama), "fp16"), *shape) is None
    assert native_layers(convert_weights(copy.deepcopy(tiny_llama), "fp32"), *shape) is not None
    model = convert_weights(copy.deepcopy(tiny_llama), "int4")
    assert native_layers(model, *shape) is not None
    layer = model.model.layers[1].mlp.down_proj
    layer.dense = layer.decoded()
    assert native_layers(model, *shape) is None


def test_converted_parameters_are_copies_and_ties_stay_tied(tiny_llama):
    from semanticache_rag.weights import _own_parameters

    model = copy.deepcopy(tiny_llama)
    model.lm_head.weight = model.get_input_embeddings().weight
    before = model.get_input_embeddings().weight
    _own_parameters(model)
    after = model.get_input_embeddings().weight
    assert after is model.lm_head.weight and after.data_ptr() != before.data_ptr()
    assert torch.equal(after, before)


def test_fp16_weights_without_fbgemm_are_a_config_error_that_names_the_alternatives(tiny_llama, monkeypatch):
    model = copy.deepcopy(tiny_llama)
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", ["qnnpack"])  # e.g. an ARM build
    with pytest.raises(ConfigError, match="fbgemm.*'int8' or 'bf16'"):
        convert_weights(model, "fp16")
    assert not hasattr(model, "semanticache_weights")  # the model is left as it was
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)


def test_weight_formats_refuse_a_model_off_the_cpu(tiny_llama):
    model = copy.deepcopy(tiny_llama).to("meta")  # any device but the CPU: these are torch's CPU kernels
    with pytest.raises(ConfigError, match="runs on CPUs"):
        convert_weights(model, "int4")


def _advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding ``address`` carries the ``hg`` flag (madvise(MADV_HUGEPAGE)) in
    /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's first line: its address range
            low, high = (int(v, 16) for v in fields[0].split("-"))
            inside = low <= address < high
        elif inside and fields[0] == "VmFlags:":
            return "hg" in fields[1:]
    raise AssertionError(f"no mapping holds {address:#x} in /proc/self/smaps")


def test_decoding_weights_sit_in_blocks_advised_for_huge_pages(tiny_llama):
    """The converted layers' codes, scales and minimums, and the tied Q8_0 head's codes, are copies in
    one block per dtype (semanticache_rag.huge_pages), equal to what the conversion made, in memory
    advised for transparent huge pages where Linux offers them."""
    import mmap

    from semanticache_rag import huge_pages
    from semanticache_rag.weights import Int4Linear

    model = tie_head(copy.deepcopy(tiny_llama))  # tied: a Q8_0 head
    model = convert_weights(model, "int4")
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert isinstance(model.lm_head, GroupedInt8Linear) and len(layers) > 4
    for name in ("codes", "scales", "minimums"):  # one block per dtype
        assert len({getattr(m, name).untyped_storage().data_ptr() for m in layers}) == 1, name
    codes, scales = layers[0].codes, layers[0].scales
    assert model.lm_head.codes.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
    assert scales.untyped_storage().data_ptr() != codes.untyped_storage().data_ptr()
    torch.save(model.state_dict(), io.BytesIO())  # one type per storage: torch.save takes them
    fresh = Int4Linear(torch.nn.Linear(96, 32, bias=False))
    [fresh_codes, fresh_scales] = huge_pages.pack([fresh.codes, fresh.scales])
    assert torch.equal(fresh_codes, fresh.codes) and torch.equal(fresh_scales, fresh.scales)
    assert fresh_scales.dtype == torch.float16 and fresh_scales.shape == fresh.scales.shape
    if hasattr(mmap, "MADV_HUGEPAGE") and Path("/proc/self/smaps").exists():
        assert fresh_codes.data_ptr() % huge_pages.PAGE == 0 and fresh_scales.data_ptr() % huge_pages.PAGE == 0
        for tensor in (codes, scales, model.lm_head.scales):  # the model's own blocks
            assert _advised_for_huge_pages(tensor.untyped_storage().data_ptr()), tensor.dtype
