"""Greedy decoding's next token chosen in the C++ step (``greedy_step``), where the head's logits are made, and
runs of such steps in one call (``greedy_steps``: ``Engine.greedy``, ``Conversation``'s greedy answers)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests_support import needs_cpu_kernels, tie_head

from semanticache_rag import Engine, KaraCompressor, make_compressor
from semanticache_rag import conversation as conversation_module
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
            run = lean.greedy_tokens(fused, token, position, 1)
        assert run is not None, "the step did not run in C++ with its head"
        (chosen,) = run
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


def _tail(engine: Engine) -> list[int]:
    return engine.tokenizer(engine.prompt.tail([Turn("Which code?")]), add_special_tokens=False)["input_ids"]


def _appended(kv: ConversationKV) -> list[torch.Tensor]:
    return [t for layer in kv.layers for t in layer.appended()]


@pytest.mark.parametrize("weights", ["int4", "fp32"])
def test_a_run_of_steps_in_one_call_equals_the_steps_one_at_a_time(tiny_llama, tiny_tokenizer, weights):
    needs_cpu_kernels()
    engine = Engine(convert_weights(_tied(tiny_llama), weights), tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    cache = engine.compress(engine.prefill(TEXT, progress=False, surprisal=True), make_compressor("kaizen", 0.75))
    lean, tail = engine.model.semanticache_forward, _tail(engine)
    kvs = [ConversationKV(cache.layers) for _ in range(3)]
    first = [int(engine.forward(kv, tail, cache.positions)[-1].argmax()) for kv in kvs][0]
    position = cache.positions + len(tail)
    with torch.inference_mode():
        run = lean.greedy_tokens(kvs[0], first, position, 9)
        single, token = [], first
        for step in range(9):
            (token,) = lean.greedy_tokens(kvs[1], token, position + step, 1)
            single.append(token)
        assert run == single and kvs[0].appended_length == kvs[1].appended_length == len(tail) + 9
        assert all(torch.equal(a, b) for a, b in zip(_appended(kvs[0]), _appended(kvs[1])))
        # a stop ends the run where it is chosen, and is not run
        stop = run[5]
        stopped = lean.greedy_tokens(kvs[2], first, position, 9, (stop, 10**9))
    assert stopped == run[: run.index(stop) + 1] and kvs[2].appended_length == len(tail) + len(stopped)
    assert all(torch.equal(a, b[..., : a.shape[-2], :]) for a, b in zip(_appended(kvs[2]), _appended(kvs[0])))


def test_a_plain_greedy_sampler_lets_the_step_choose_and_answers_stay_the_same(tiny_llama, tiny_tokenizer, monkeypatch):
    needs_cpu_kernels()
    assert Sampler(GenerationOptions()).argmax_only
    assert not Sampler(GenerationOptions(repetition_penalty=1.3)).argmax_only
    assert not Sampler(GenerationOptions(temperature=0.7)).argmax_only
    engine = Engine(convert_weights(_tied(tiny_llama), "int4"), tiny_tokenizer, model_name="tiny")
    cache = engine.compress(engine.prefill(TEXT, progress=False), make_compressor("kaizen", 0.75))
    runs = []
    greedy = engine.greedy
    monkeypatch.setattr(engine, "greedy", lambda *args: runs.append(greedy(*args)) or list(runs[-1]))
    fused = engine.ask(cache, "Which code?", max_new_tokens=20)
    steps = fused.completion_tokens - (fused.finish_reason != "length")  # each said token is run, but a stop
    assert sum(map(len, runs)) >= steps and len(runs) == -(-steps // conversation_module.GREEDY_RUN)
    monkeypatch.setattr(Sampler, "argmax_only", property(lambda self: False))
    runs.clear()
    plain = engine.ask(cache, "Which code?", max_new_tokens=20)
    assert not runs and plain.completion_ids == fused.completion_ids


def _chat(engine: Engine, cache, turns: int, **options) -> tuple[list, ConversationKV]:
    conversation = engine.conversation(cache, max_new_tokens=24, **options)
    answers = [conversation.ask(q) for q in ["Which code?", "And the letters?", "Say it again."][:turns]]
    return [(a.answer, a.completion_ids, a.finish_reason) for a in answers], conversation


@pytest.mark.parametrize("case", ["stop string", "loop guard", "kara"])
def test_answers_and_the_working_cache_do_not_depend_on_how_many_steps_a_call_runs(
    tiny_llama, tiny_tokenizer, monkeypatch, case
):
    """Steps run GREEDY_RUN at a time against one at a time: the same answers, and the same working cache after
    them (steps run past a stop string or a repeat forgotten; Kara compressing after the same steps). fp32 weights
    with the tiny model's own head (its tied head answers one token over and over)."""
    needs_cpu_kernels()
    kara = KaraCompressor(budget_tokens=24, window_tokens=8, recent_tokens=4) if case == "kara" else None
    model = convert_weights(copy.deepcopy(tiny_llama), "fp32")
    engine = Engine(model, tiny_tokenizer, model_name="tiny", prefill_chunk=64, compressor=kara)
    cache = engine.read(TEXT[:600], progress=False)
    options = {"loop_guard": case != "stop string"}
    if case == "stop string":  # two characters from the middle of the first answer
        text = _chat(engine, cache, 1, **options)[0][0][0]
        options["stop"] = [next(text[i : i + 2] for i in range(3, len(text)) if "\ufffd" not in text[i : i + 2])]
    runs = []
    greedy = engine.greedy
    monkeypatch.setattr(engine, "greedy", lambda *args: runs.append(greedy(*args)) or list(runs[-1]))
    answers, chat = _chat(engine, cache, 3, **options)
    monkeypatch.setattr(conversation_module, "GREEDY_RUN", 1)
    one_at_a_time, plain = _chat(engine, cache, 3, **options)
    assert answers == one_at_a_time
    assert any(len(run) > 1 for run in runs)
    if case in ("stop string", "loop guard"):  # answers ended inside a run: the steps run past them forgotten
        ending = "stop" if case == "stop string" else "repetition"
        assert answers[0][2] == ending and sum(map(len, runs)) > sum(len(ids) for _, ids, _ in answers)
    if case == "kara":
        assert chat._compressed_tokens == plain._compressed_tokens > 0
    assert chat.kv.appended_length == plain.kv.appended_length
    assert all(torch.equal(a, b) for a, b in zip(_appended(chat.kv), _appended(plain.kv)))


@pytest.mark.parametrize("how", ["raises", "closed"])
def test_an_answer_that_stops_midway_leaves_the_cache_holding_the_tokens_it_counts(tiny_llama, tiny_tokenizer, how):
    """A step that raises (an interrupt) or a consumer that stops reading: the working cache holds exactly the tokens
    the conversation counts as its own (the next turn reuses them), each at its place: its keys are those a fresh
    pass over the same tokens makes."""
    needs_cpu_kernels()
    engine = Engine(convert_weights(copy.deepcopy(tiny_llama), "fp32"), tiny_tokenizer, model_name="tiny")
    cache = engine.read(TEXT[:600], progress=False)
    chat = engine.conversation(cache, max_new_tokens=24, loop_guard=False)
    greedy, calls = engine.greedy, []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return greedy(*args)

    stream = chat.stream("Which code?")
    if how == "raises":
        engine.greedy = interrupted
        with pytest.raises(KeyboardInterrupt):
            list(stream)
    else:
        next(stream)
        next(stream)
        assert chat.kv.appended_length > len(chat._tail_ids)  # steps run ahead of what was said
        stream.close()
    assert chat.kv.appended_length == len(chat._tail_ids) > 0
    fresh = ConversationKV(cache.layers)
    engine.forward(fresh, chat._tail_ids, cache.positions)
    for kept, made in zip(_appended(chat.kv)[::2], _appended(fresh)[::2]):  # keys
        torch.testing.assert_close(kept, made, rtol=1e-4, atol=1e-4)
