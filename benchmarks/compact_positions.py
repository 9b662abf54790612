"""What compact positions cost: a compressed cache turned to ``P`` positions instead of ``N``.

A compressed cache keeps ``P`` entries per head for ``N`` tokens. An engine that pages one slot
per position (vLLM) could hold it in ``P`` slots if the question started at ``P``;
:func:`semanticache_rag.expansion.compact_cache` turns every key by ``P - N`` so that RoPE sees the
same query-key distances. This benchmark asks every RULER question of the same contexts from the
cache as read and from its compact form, and reports how many answers are identical and the KL
between the two (teacher-forced on the answer as read), per compressor and ratio.

    python -m benchmarks.compact_positions                      # 7 tasks x 1 context at 4K
    python -m benchmarks.compact_positions --samples 2 --lengths 4000 7500
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.report import environment, markdown_table, mean_of
from benchmarks.ruler import forced_logprobs, kl, tail_ids
from benchmarks.ruler_tasks import add_context_options, build, score, token_counter
from semanticache_rag import Engine, SemantiCacheCompressor
from semanticache_rag.compressors import make_compressor
from semanticache_rag.expansion import compact_cache

RESULTS = Path(__file__).parent / "results" / "compact_positions"


def compressors(ratios):
    for ratio in ratios:
        yield "semanticache", ratio, SemantiCacheCompressor(ratio)
        yield "auto", ratio, make_compressor("auto", ratio)


def run_context(engine: Engine, context, ratios) -> list[dict]:
    """One row per question, compressor and ratio: the answer as read and at compact positions."""
    prefill = engine.prefill(context.document, surprisal=True, progress=False)
    rows = []
    for method, ratio, compressor in compressors(ratios):
        cache = engine.compress(prefill, compressor)
        compact = compact_cache(cache, engine.rope_frequencies)
        for q in context.questions:
            tail = tail_ids(engine, q.text)
            read = engine.ask(cache, q.text, max_new_tokens=32)
            moved = engine.ask(compact, q.text, max_new_tokens=32)
            reference = forced_logprobs(engine, cache, tail, read.completion_ids)
            rows.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "task": context.task,
                    "length": context.length,
                    "context_id": context.context_id,
                    "qid": q.qid,
                    "positions": cache.length,
                    "compact_positions": compact.positions,
                    "same_answer": float(read.completion_ids == moved.completion_ids),
                    "score": score(read.answer, q.refs, q.metric),
                    "compact_score": score(moved.answer, q.refs, q.metric),
                    "kl": kl(reference, forced_logprobs(engine, compact, tail, read.completion_ids)),
                }
            )
    return rows


METRICS = [  # after the score as read per length and overall ("mean")
    ("score compact", lambda g: f"**{100 * statistics.mean(r['compact_score'] for r in g):.0f}**"),
    ("questions", lambda g: str(len(g))),
    ("same answer", lambda g: f"{sum(r['same_answer'] for r in g):.0f}/{len(g)}"),
    ("KL mean", mean_of("kl", "{:.1e}")),
    ("KL max", lambda g: f"{max(r['kl'] for r in g):.1e}"),
    ("positions", mean_of("positions", "{:.0f}")),
    ("compact positions", mean_of("compact_positions", "{:.0f}")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_context_options(parser, lengths=[4000], samples=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.perf_counter()
    engine = Engine.from_pretrained(args.model)
    contexts = build(args.tasks, args.lengths, args.samples, token_counter(engine.tokenizer))
    rows = []
    for context in tqdm(contexts, desc="contexts", unit="ctx"):
        rows += run_context(engine, context, args.ratios)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compact_positions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = markdown_table(rows, ["length"], METRICS)
    settings = (
        f"Tasks {', '.join(args.tasks)}; lengths {args.lengths}; {args.samples} context(s) per task and length; "
        "greedy, 32 new tokens; KL(as read || compact) on the answer as read, teacher-forced; score = RULER "
        "string match % as read per length, then overall (mean) as read and compact."
    )
    (args.out / "compact_positions.md").write_text(
        f"# Compact positions\n\n{settings}\n\n{table}\n\n{environment(started)}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
