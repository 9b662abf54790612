"""Answers that end: the loop guard and the repetition options, measured.

1. **Recorded answers** (exact, no model run): the guard never changes a token, only where an
   answer ends, so applying it to the greedy answers of earlier runs (the RULER-style ones) gives
   exactly what those runs would have answered with it; every correct answer it would cut is counted.
2. **RULER contexts, full cache**: score, mean answer length and KL(no options || options) of the
   next-token distributions over the unguarded answer (teacher forcing) for each option set.
3. **Document chat** over the bundled PDF (the session the loop was reported on): answer length,
   seconds per answer and repeated sentences, guard off vs on.

    python -m benchmarks.answer_endings            # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources
from pathlib import Path

import torch

from benchmarks.report import environment
from benchmarks.ruler import forced_logprobs, tail_ids
from benchmarks.ruler_tasks import TASKS, build, score, token_counter
from semanticache_rag import Engine
from semanticache_rag.generation import GenerationOptions, LoopGuard, Sampler

RESULTS = Path(__file__).parent / "results" / "answer_endings"
OPTION_SETS = {
    "none": {"loop_guard": False},
    "guard (default)": {},
    "guard + repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "guard + no_repeat_ngram_size 4": {"no_repeat_ngram_size": 4},
}
CHAT = (
    "What is the default font encoding for Russian?",
    "Which RFC specifies koi8-r?",
    "What is the latest version of the LH fonts?",
)


def guarded(tokenizer, answer: str) -> str:
    """``answer`` as the loop guard would have ended it (tokens re-made from the text for the run rule)."""
    guard = LoopGuard()
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end])
        cut = guard.repeated_sentence(text)
        run = guard.repeated_run(ids[:end]) if cut is None else None
        if cut is not None:
            return text[:cut].strip()
        if run is not None:
            return tokenizer.decode(ids[: end - run]).strip()
    cut = guard.repeated_sentence(answer + "\n")
    return (answer[:cut] if cut is not None else answer).strip()


def recorded(tokenizer) -> list[dict]:
    """Part 1: every recorded answer of earlier runs, scored as it was and as the guard would end it."""
    here = Path(__file__).parent / "results"
    rows = []
    for name in ("ruler.jsonl", "sekv/ruler.jsonl", "kaizen/ruler.jsonl", "long_documents/long_documents.jsonl"):
        if not (here / name).is_file():
            continue
        for line in open(here / name):
            r = json.loads(line)
            refs = r["refs"]
            metric = "all" if r["task"].startswith("niah") else "part"
            cut = guarded(tokenizer, r["answer"])
            rows.append(
                {
                    "source": name,
                    "before": score(r["answer"], refs, metric),
                    "after": score(cut, refs, metric),
                    "chars_before": len(r["answer"]),
                    "chars_after": len(cut),
                }
            )
    return rows


def kl_of(engine, cache, question: str, reference: tuple[int, ...], options: dict) -> float:
    """Mean KL(plain || processed) over the reference answer's tokens (what the options change)."""
    plain = forced_logprobs(engine, cache, tail_ids(engine, question), reference)
    if plain is None or not {"repetition_penalty", "no_repeat_ngram_size"} & set(options):
        return 0.0
    processors = Sampler(GenerationOptions(**options)).processors
    total = 0.0
    for i, logp in enumerate(plain):
        scores = logp[None].clone()
        for process in processors:
            scores = process(torch.tensor([list(reference[:i])]), scores)
        processed = torch.log_softmax(scores[0], -1)
        finite = torch.isfinite(processed)
        total += float(
            (logp.exp() * (logp - processed)).where(finite, torch.tensor(float("inf"))).nan_to_num(1e4).sum()
        )
    return total / len(plain)


def ruler_options(engine, contexts) -> list[dict]:
    """Part 2: every option set on every question (full cache)."""
    rows = []
    for context in contexts:
        cache = engine.read(context.document, progress=False)
        for q in context.questions:
            reference = None
            for name, options in OPTION_SETS.items():
                started = time.perf_counter()
                answer = engine.ask(cache, q.text, max_new_tokens=64, **options)
                reference = reference or answer.completion_ids
                rows.append(
                    {
                        "options": name,
                        "task": context.task,
                        "score": score(answer.answer, q.refs, q.metric),
                        "tokens": answer.completion_tokens,
                        "seconds": time.perf_counter() - started,
                        "finish_reason": answer.finish_reason,
                        "kl": kl_of(engine, cache, q.text, reference, options),
                    }
                )
    return rows


def chat_session(engine) -> list[dict]:
    """Part 3: the reported chat, guard off and on."""
    rows = []
    with resources.as_file(resources.files("semanticache_rag") / "data" / "cyrguide.pdf") as pdf:
        cache = engine.read(pdf, progress=False)
    for name in ("none", "guard (default)"):
        chat = engine.conversation(cache, max_new_tokens=256, **OPTION_SETS[name])
        for question in CHAT:
            started = time.perf_counter()
            answer = chat.ask(question)
            sentences = [s.strip() for s in answer.answer.replace("\n", ". ").split(". ") if len(s.strip()) > 11]
            rows.append(
                {
                    "options": name,
                    "question": question,
                    "answer": answer.answer,
                    "tokens": answer.completion_tokens,
                    "seconds": time.perf_counter() - started,
                    "repeated_sentences": len(sentences) - len(set(sentences)),
                    "finish_reason": answer.finish_reason,
                }
            )
    return rows


def report(recorded_rows, ruler_rows, chat_rows) -> str:
    lost = sum(r["before"] > r["after"] for r in recorded_rows)
    part1 = (
        f"Recorded greedy answers of earlier runs ({len(recorded_rows)} answers): correct before "
        f"{sum(r['before'] for r in recorded_rows):.0f}, with the guard {sum(r['after'] for r in recorded_rows):.0f}; "
        f"correct answers cut: {lost}; mean length {statistics.mean(r['chars_before'] for r in recorded_rows):.0f} "
        f"-> {statistics.mean(r['chars_after'] for r in recorded_rows):.0f} characters."
    )
    lines = [
        "| options | score % (questions) | mean answer tokens | s per answer | KL vs none |",
        "|---|---|---|---|---|",
    ]
    for name in OPTION_SETS:
        group = [r for r in ruler_rows if r["options"] == name]
        lines.append(
            f"| {name} | {100 * statistics.mean(r['score'] for r in group):.0f} ({len(group)}) | "
            f"{statistics.mean(r['tokens'] for r in group):.1f} | {statistics.mean(r['seconds'] for r in group):.2f} | "
            f"{statistics.mean(r['kl'] for r in group):.4f} |"
        )
    chat = [
        "| chat | mean answer tokens | s per answer | repeated sentences | finish reasons |",
        "|---|---|---|---|---|",
    ]
    for name in ("none", "guard (default)"):
        group = [r for r in chat_rows if r["options"] == name]
        reasons = ", ".join(sorted({r["finish_reason"] for r in group}))
        chat.append(
            f"| {name} | {statistics.mean(r['tokens'] for r in group):.0f} | "
            f"{statistics.mean(r['seconds'] for r in group):.1f} | "
            f"{sum(r['repeated_sentences'] for r in group)} | {reasons} |"
        )
    return f"{part1}\n\nRULER contexts, full cache, 64 new tokens:\n\n" + "\n".join(lines) + "\n\n" + "\n".join(chat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4000])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.perf_counter()
    engine = Engine.from_pretrained()
    recorded_rows = recorded(engine.tokenizer)
    ruler_rows = ruler_options(engine, build(TASKS, args.lengths, args.samples, token_counter(engine.tokenizer)))
    chat_rows = chat_session(engine)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "answer_endings.jsonl", "w") as out:
        for part, rows in (("recorded", recorded_rows), ("ruler", ruler_rows), ("chat", chat_rows)):
            out.writelines(json.dumps({"part": part, **r}) + "\n" for r in rows)
    text = report(recorded_rows, ruler_rows, chat_rows)
    (args.out / "answer_endings.md").write_text(f"# Answers that end\n\n{text}\n\n{environment(started)}\n")
    print(text)


if __name__ == "__main__":
    main()
