"""Routing long documents: BM25 vs the model's own attention vs both, on RULER-style tasks.

Each context is read once as uncompressed sections; for every question each router ranks the
sections, and we record where the sections holding the answer land (recall at 1, 2 and 4) and the
answer from the 2 best sections (RULER string match).

    python -m benchmarks.routing                  # 16K and 32K, 2 contexts per task (~30 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.long_documents import TASKS, gold_sections, read_sectioned
from benchmarks.report import environment
from benchmarks.ruler_tasks import build, score
from semanticache_rag import Engine
from semanticache_rag.sections import ROUTINGS

RESULTS = Path(__file__).parent / "results" / "routing"


def run(engine: Engine, contexts) -> list[dict]:
    rows = []
    for context in contexts:
        caches, _ = read_sectioned(engine, context.document, [0.0])
        cache = caches[0.0]
        for q in context.questions:
            gold = gold_sections(cache, q.evidence)
            for routing in ROUTINGS:
                engine.routing = routing
                started = time.perf_counter()
                order, _ = cache.ranking(engine, q.text)
                route_s = time.perf_counter() - started
                needed = max(order.index(g) for g in gold) + 1 if gold else None
                answer = engine.ask(cache, q.text, max_new_tokens=32)
                rows.append(
                    {
                        "routing": routing,
                        "task": context.task,
                        "length": context.length,
                        "qid": q.qid,
                        "rank_needed": needed,
                        "route_s": route_s,
                        "score": score(answer.answer, q.refs, q.metric),
                        "answer": answer.answer,
                    }
                )
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        "| routing | recall@1 | recall@2 | recall@4 | score % (2 sections) | routing s | questions |",
        "|---|---|---|---|---|---|---|",
    ]
    for routing in ROUTINGS:
        group = [r for r in rows if r["routing"] == routing and r["rank_needed"] is not None]
        recall = [100 * statistics.mean(r["rank_needed"] <= k for r in group) for k in (1, 2, 4)]
        lines.append(
            f"| {routing} | {recall[0]:.0f}% | {recall[1]:.0f}% | {recall[2]:.0f}% | "
            f"{100 * statistics.mean(r['score'] for r in group):.0f} | "
            f"{statistics.mean(r['route_s'] for r in group):.2f} | {len(group)} |"
        )
    by_task = ["", "recall@2 by task:", "", "| routing | " + " | ".join(TASKS) + " |", "|---|" + "---|" * len(TASKS)]
    for routing in ROUTINGS:
        cells = []
        for task in TASKS:
            group = [r["rank_needed"] <= 2 for r in rows if r["routing"] == routing and r["task"] == task]
            cells.append(f"{100 * statistics.mean(group):.0f}% ({len(group)})" if group else "-")
        by_task.append(f"| {routing} | " + " | ".join(cells) + " |")
    return "\n".join(lines + by_task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16000, 32000])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.perf_counter()
    engine = Engine.from_pretrained(max_sections=2)
    count = lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    contexts = build(TASKS, args.lengths, args.samples, count)
    rows = run(engine, contexts)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "routing.jsonl", "w") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
    text = report(rows)
    (args.out / "routing.md").write_text(f"# Routing long documents\n\n{text}\n\n{environment(started)}\n")
    print(text)


if __name__ == "__main__":
    main()
