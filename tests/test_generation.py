"""Answers that end: the loop guard, repetition options and incremental decoding (tiny models, no network)."""

from __future__ import annotations

import pytest
import torch

from semanticache_rag import ConfigError, GenerationOptions
from semanticache_rag.cli import main
from semanticache_rag.generation import LoopGuard, TextStream

LOOP = "The document that specifies koi8-r is RFC 1489."


def test_guard_finds_a_repeated_sentence_and_where_it_starts():
    guard = LoopGuard()
    text = f"{LOOP} It is old. {LOOP} "
    assert guard.repeated_sentence(text) == len(f"{LOOP} It is old.")
    assert guard.repeated_sentence(f"{LOOP} It is old. Another sentence here. ") is None
    assert guard.may_repeat(f"{LOOP} It is old. The document that") == len(f"{LOOP} It is old.")
    assert guard.may_repeat(f"{LOOP} It is old. The answer") is None
    assert guard.repeated_sentence("Yes. Yes. ") is None  # too short to call a loop
    assert guard.repeated_sentence("- the first item\n- the first item\n") == len("- the first item\n")  # lines


def test_guard_finds_runs_of_tokens_but_not_long_numbers():
    guard = LoopGuard()
    assert guard.repeated_run([9, 5, 6, 7] * 4) == 12  # all but the first copy of the block
    assert guard.repeated_run([3] * 11) is None and guard.repeated_run([3] * 12) == 11
    assert guard.repeated_run([1, 2, 3, 4, 5, 6, 7, 8]) is None


GUARD = LoopGuard()


def pieces_of(tokenizer, text: str, guard=GUARD, cut_off=False):
    stream = TextStream(tokenizer, (), guard)
    pieces = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        pieces.append(stream.push(token))
        if stream.stopped:
            break
    pieces.append(stream.flush(cut_off))
    return stream, "".join(pieces)


def test_a_repeated_sentence_is_never_streamed(tiny_tokenizer):
    stream, streamed = pieces_of(tiny_tokenizer, f"{LOOP} {LOOP} {LOOP} ")
    assert stream.reason == "repetition" and streamed == stream.text and streamed.strip() == LOOP


def test_an_answer_cut_off_while_it_starts_an_earlier_sentence_ends_before_it(tiny_tokenizer):
    text = f"{LOOP} It is old. The document that specifies"
    stream, streamed = pieces_of(tiny_tokenizer, text, cut_off=True)
    assert stream.reason == "repetition" and streamed == stream.text == f"{LOOP} It is old."
    stream, streamed = pieces_of(tiny_tokenizer, f"{LOOP} It is old. The answer is", cut_off=True)
    assert stream.reason == "stop" and streamed == f"{LOOP} It is old. The answer is"  # starts no earlier one
    stream, streamed = pieces_of(tiny_tokenizer, text)  # the model ended it there: its last words stay
    assert stream.reason == "stop" and streamed == text


def test_text_without_repeats_streams_unchanged(tiny_tokenizer):
    text = "Héllo wörld, 你好. The licensee may copy it.\n\nThe licensee may not sell it. 1000000 copies."
    stream, streamed = pieces_of(tiny_tokenizer, text)
    assert stream.reason == "stop" and streamed == text == tiny_tokenizer.decode(stream.ids)
    _, unguarded = pieces_of(tiny_tokenizer, f"{LOOP} {LOOP}", guard=None)
    assert unguarded == f"{LOOP} {LOOP}"


def scripted(engine, text: str):
    """Make ``engine``'s model "say" ``text`` over and over: each step's logits favour the next token."""
    script = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    forward, step = engine.forward, [0]

    def loop(kv, ids, start, logits_to_keep=1):
        logits = forward(kv, ids, start, logits_to_keep).clone()
        logits[-1] = 0
        logits[-1, script[step[0] % len(script)]] = 100.0
        step[0] += 1
        return logits

    return loop


def test_the_guard_stops_a_forced_loop_and_can_be_turned_off(tiny_engine, document_text, monkeypatch):
    cache = tiny_engine.read(document_text[:1500], progress=False)
    monkeypatch.setattr(tiny_engine, "forward", scripted(tiny_engine, f"{LOOP} "))
    guarded = tiny_engine.ask(cache, "Which RFC?", max_new_tokens=200)
    assert guarded.answer == LOOP and guarded.finish_reason == "repetition"
    monkeypatch.setattr(tiny_engine, "forward", scripted(tiny_engine, f"{LOOP} "))
    unguarded = tiny_engine.ask(cache, "Which RFC?", max_new_tokens=200, loop_guard=False)
    assert unguarded.answer.count(LOOP) > 2 and unguarded.finish_reason == "length"
    chat = tiny_engine.conversation(cache)
    monkeypatch.setattr(tiny_engine, "forward", scripted(tiny_engine, "-S-GUID"))
    run = chat.ask("Which RFC?", max_new_tokens=80)
    assert run.finish_reason == "repetition" and run.answer.count("GUID") <= 2
    assert chat.turns[-1].answer == run.answer  # the conversation keeps the answer without its loop


def test_no_repeat_ngram_size_keeps_ngrams_unique(tiny_engine, document_text):
    cache = tiny_engine.read(document_text[:1500], progress=False)
    answer = tiny_engine.ask(cache, "Explain.", max_new_tokens=40, no_repeat_ngram_size=2, loop_guard=False)
    pairs = list(zip(answer.completion_ids, answer.completion_ids[1:]))
    assert len(pairs) == len(set(pairs)) and len(pairs) >= 20


def test_repetition_penalty_makes_repeats_rarer(tiny_engine, document_text):
    cache = tiny_engine.read(document_text[:1500], progress=False)
    plain = tiny_engine.ask(cache, "Explain.", max_new_tokens=40, loop_guard=False)
    penalised = tiny_engine.ask(cache, "Explain.", max_new_tokens=40, loop_guard=False, repetition_penalty=5.0)
    assert len(set(penalised.completion_ids)) > len(set(plain.completion_ids))


def test_without_the_guard_greedy_answers_equal_a_stock_generate(tiny_engine, document_text):
    from semanticache_rag.prompts import Turn

    cache = tiny_engine.read(document_text, progress=False)
    answer = tiny_engine.ask(cache, "What may the licensee do?", max_new_tokens=24, loop_guard=False)
    stock = tiny_engine.generate_uncached(cache, [Turn("What may the licensee do?")], max_new_tokens=24)
    assert answer.answer == stock


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.2}, "repetition_penalty must be > 0"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be an integer >= 0"),
        ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size must be an integer >= 0"),
    ],
)
def test_bad_repetition_options_say_what_is_allowed(bad, message):
    with pytest.raises(ConfigError, match=message):
        GenerationOptions(**bad)


def test_cli_rejects_a_bad_penalty(tiny_model_dir, tmp_path, capsys):
    document = tmp_path / "doc.txt"
    document.write_text("A short document. It has two sentences.")
    args = ["ask", str(document), "-q", "What?", "--model", str(tiny_model_dir), "--repetition-penalty", "0"]
    assert main([*args, "--no-store"]) == 2
    assert "repetition_penalty must be > 0" in capsys.readouterr().err


def test_sampler_history_is_the_answer_only(tiny_engine):
    from semanticache_rag.generation import Sampler

    sampler = Sampler(GenerationOptions(repetition_penalty=2.0))
    logits = torch.zeros(len(tiny_engine.tokenizer))
    logits[7], logits[8] = 2.0, 1.5
    assert sampler(logits, []) == 7 and sampler(logits, [7]) == 8  # 2.0 / 2 < 1.5


def test_an_answer_that_goes_on_with_an_earlier_answer_ends_there():
    """The reported chat: every later answer went on with the first answer's sentence."""
    guard = LoopGuard(said=(LOOP,))
    text = f"The latest version of the LH fonts is 3.20.\n\n{LOOP}\n\n"
    assert guard.repeated_sentence(text) == len("The latest version of the LH fonts is 3.20.\n\n")
    assert guard.repeated_sentence(f"{LOOP}\n") is None  # asked again, an answer may say it again first
    wrapped = (
        "koi8-r is a variant of koi8-u that is\nused in the fonts. "
        "koi8-r is a variant of koi8-u that is used in the\nfonts."
    )
    assert LoopGuard().repeated_sentence(wrapped + "\n") == len(
        "koi8-r is a variant of koi8-u that is\nused in the fonts."
    )
