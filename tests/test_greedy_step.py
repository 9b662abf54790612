"""Greedy decoding's next token chosen in the C++ step (``greedy_step``), where the head's logits are made."""

from __future__ import annotations

import copy

import pytest
import torch
from tests_support import needs_cpu_kernels, tie_head

from semanticache_rag import Engine, make_compressor
from semanticache_rag.conversation import ConversationKV
from semanticache_rag.generation import GenerationOptions, Sampler
from semanticache_rag.prompts import Turn
from semanticache_rag.weights import convert_weights

TEXT = "Alpha beta gamma delta. The code is 4417. " * 30


def _tied(model):
    return tie_head(copy.deepcopy(model))


def _side_by_side(engine: Engine, cache, steps: int, first: int | None = None) -> list[tuple[int, int]]:
    """Two conversations on ``cache`` fed the same tokens (``first``, or the tail's argmax, then argmax's choices):
    per step (the C++ step's choice, argmax of the logits)."""
    tail = engine.tokenizer(engine.prompt.tail([Turn("Which code?")]), add_special_tokens=False)["input_ids"]
    fused, plain = ConversationKV(cache.layers), ConversationKV(cache.layers)
    lean = engine.model.semanticache_forward
    engine.forward(fused, tail, cache.positions)
    token = int(engine.forward(plain, tail, cache.positions)[-1].argmax()) if first is None else first
    pairs = []
    for step in range(steps):
        position = cache.positions + len(tail) + step
        with torch.inference_mode():
            chosen = lean.greedy_token(fused, token, position)
        assert chosen is not None, "the step did not run in C++ with its head"
        logits = engine.forward(plain, [token], position)[-1]
        pairs.append((chosen, int(logits.argmax())))
        token = pairs[-1][1]
    return pairs


@pytest.mark.parametrize("weights", ["int4", "fp32"])  # a Q8_0 head, an fp32 one
@pytest.mark.parametrize("compression", [("none", None), ("kaizen", 0.75)])
def test_the_cpp_step_chooses_the_token_argmax_chooses(tiny_llama, tiny_tokenizer, weights, compression):
    needs_cpu_kernels()
    engine = Engine(convert_weights(_tied(tiny_llama), weights), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    cache = engine.compress(engine.prefill(TEXT, progress=False, surprisal=True), make_compressor(*compression))
    pairs = _side_by_side(engine, cache, 10)
    assert all(chosen == wanted for chosen, wanted in pairs), pairs


@pytest.mark.parametrize("nan", [False, True])
def test_ties_go_to_the_first_token_and_a_nan_logit_wins_as_in_argmax(tiny_llama, tiny_tokenizer, nan):
    """With fp32 weights the tied head is the embedding table itself. The final norm's weights zero but the first
    channel's make each logit the table's first column times one number: rows of +1 and -1 there make two pairs
    of equal largest logits (the first of the pair wins), a NaN there a NaN logit (it wins)."""
    needs_cpu_kernels()
    engine = Engine(convert_weights(_tied(tiny_llama), "fp32"), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    cache = engine.compress(engine.prefill(TEXT, progress=False, surprisal=True), make_compressor("none"))
    table, norm = engine.model.model.embed_tokens.weight, engine.model.model.norm.weight
    vocabulary = table.shape[0]
    with torch.no_grad():
        norm[1:] = 0
        table[:, 0] = 0
        table[[vocabulary - 7, vocabulary - 2], 0] = 1.0
        table[[40, 41], 0] = -1.0
        if nan:  # a token the tail does not hold: its row makes a NaN state
            tail = engine.prompt.tail([Turn("Which code?")])
            fed = set(engine.tokenizer(tail, add_special_tokens=False)["input_ids"])
            unfed = max(set(range(vocabulary - 16, vocabulary)) - fed - {vocabulary - 7, vocabulary - 2})
            table[unfed, 0] = float("nan")
    # fed the NaN row's token, a step's every logit is NaN: the first wins, token 0
    pairs = _side_by_side(engine, cache, 4, first=5)
    assert all(chosen == wanted for chosen, wanted in pairs), pairs
    if nan:
        assert [chosen for chosen, _ in pairs] == [unfed, 0, 0, 0], pairs
    else:
        assert {chosen for chosen, _ in pairs} <= {vocabulary - 7, 40}, pairs


def test_a_plain_greedy_sampler_lets_the_step_choose_and_answers_stay_the_same(tiny_llama, tiny_tokenizer, monkeypatch):
    needs_cpu_kernels()
    assert Sampler(GenerationOptions()).argmax_only
    assert not Sampler(GenerationOptions(repetition_penalty=1.3)).argmax_only
    assert not Sampler(GenerationOptions(temperature=0.7)).argmax_only
    engine = Engine(convert_weights(_tied(tiny_llama), "int4"), tiny_tokenizer, model_name="tiny")
    cache = engine.compress(engine.prefill(TEXT, progress=False), make_compressor("kaizen", 0.75))
    calls = []
    greedy = engine.greedy
    monkeypatch.setattr(engine, "greedy", lambda *args: calls.append(args) or greedy(*args))
    fused = engine.ask(cache, "Which code?", max_new_tokens=12)
    assert len(calls) == fused.completion_tokens - (fused.finish_reason != "length")
    monkeypatch.setattr(Sampler, "argmax_only", property(lambda self: False))
    calls.clear()
    plain = engine.ask(cache, "Which code?", max_new_tokens=12)
    assert not calls and plain.completion_ids == fused.completion_ids
