"""weights="auto": for an fp32 Llama model on the CPU, int4-exact where the weights are Q4_1 values (the default
model), else fp32 (its own weights, decoding steps in C++); any other model as loaded."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tests_support import needs_default_model

from semanticache_rag import Engine
from semanticache_rag.gguf_codes import is_q4_1
from semanticache_rag.kernels import cpu_ops
from semanticache_rag.models import load_model
from semanticache_rag.weights import ExactInt4Linear, convert_weights


def q4_1_values(rows: int, columns: int, seed: int) -> torch.Tensor:
    """What a Q4_1 GGUF dequantises to: per group of 32 inputs, codes 0..15 (both ends present) times an fp16
    scale plus an fp16 minimum."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, columns // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(rows, columns // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    low = (torch.randn(rows, columns // 32, 1, generator=g) * 0.1).half().float()
    return (codes * scale + low).flatten(1)


def as_q4_1_model(model):
    """A copy of ``model`` whose decoder matrices are Q4_1 values (a Q4_1 GGUF's model, dequantised)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for seed, linear in enumerate(m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)):
            linear.weight.copy_(q4_1_values(*linear.weight.shape, seed=seed))
    return model


def test_q4_1_values_are_found_exactly_and_nothing_else_is():
    weight = q4_1_values(32, 96, seed=3)
    assert is_q4_1(weight)
    nudged = weight.clone()
    nudged[5, 40] = torch.nextafter(nudged[5, 40], torch.tensor(1.0))
    assert not is_q4_1(nudged)
    assert not is_q4_1(torch.randn(32, 96)) and not is_q4_1(weight[:, :80]) and not is_q4_1(weight.bfloat16())


def test_auto_takes_fp32_for_other_weights_and_keeps_other_models_as_loaded(tiny_llama, tiny_model_dir, caplog):
    from semanticache_rag.weights import Fp32Linear

    with caplog.at_level(logging.INFO, logger="semanticache_rag.gguf_codes"):
        model, _, _ = load_model(str(tiny_model_dir))  # the default: "auto"
    if cpu_ops.available():
        assert model.semanticache_weights == "fp32" and isinstance(model.model.layers[0].mlp.down_proj, Fp32Linear)
        assert "fp32 (its weights are not Q4_1 values" in caplog.text
    else:
        assert getattr(model, "semanticache_weights", "model") == "model"
    q4 = as_q4_1_model(tiny_llama).bfloat16()
    assert convert_weights(q4, "auto") is q4 and not hasattr(q4, "semanticache_weights")  # not fp32: as loaded


def test_auto_takes_int4_exact_where_the_weights_are_q4_1_values_with_the_same_answers(tiny_llama, tiny_tokenizer):
    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    loaded = as_q4_1_model(tiny_llama)
    model = convert_weights(copy.deepcopy(loaded), "auto")
    assert model.semanticache_weights == "int4-exact"
    assert sum(isinstance(m, ExactInt4Linear) for m in model.modules()) == 4 * model.config.num_hidden_layers
    assert convert_weights(model, "auto") is model and model.semanticache_weights == "int4-exact"  # converted once
    text = "Alpha beta gamma delta. The code is 4417. " * 12
    answers = []
    for weights in (loaded, model):
        engine = Engine(weights, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
        cache = engine.read(text, progress=False)
        answers.append(engine.ask(cache, "Which code?", max_new_tokens=12).completion_ids)
    assert answers[0] == answers[1]


def test_auto_takes_fp32_for_a_model_q4_1_but_for_one_matrix_and_keeps_one_without_the_kernels(tiny_llama, monkeypatch):
    partly = as_q4_1_model(tiny_llama)
    with torch.no_grad():
        partly.model.layers[1].mlp.down_proj.weight[3, 7] += 1e-3
    want = "fp32" if cpu_ops.available() else "model"
    assert getattr(convert_weights(partly, "auto"), "semanticache_weights", "model") == want
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    q4 = as_q4_1_model(tiny_llama)
    assert convert_weights(q4, "auto") is q4 and not hasattr(q4, "semanticache_weights")


def test_auto_leaves_a_converted_model_as_it_is(tiny_llama):
    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    model = convert_weights(copy.deepcopy(tiny_llama), "int4")
    layers = list(model.modules())
    assert convert_weights(model, "auto").semanticache_weights == "int4" and list(model.modules()) == layers


@pytest.mark.slow
@needs_default_model
def test_the_default_model_loads_with_int4_exact_weights():
    """Its decoder matrices are its GGUF's Q4_1 values, so the default ("auto") decodes with int4-exact."""
    engine = Engine.from_pretrained()
    assert engine.model.semanticache_weights == "int4-exact"
