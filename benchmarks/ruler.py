"""RULER-style long-context QA: our compressors and NVIDIA kvpress's presses, side by side.

Each context is prefilled once and compressed once per method and ratio, *without* the question
(question-agnostic); then all its questions are asked with greedy decoding and scored with RULER's
string match. Fidelity is KL(full || compressed) of the next-token distributions over the
full-cache answer tokens (teacher forcing). kvpress runs in a virtual environment of its own
(it pins transformers < 5.3), on exactly the same token ids.

    python -m benchmarks.ruler                       # default run (~2 h on 2 cores, no kvpress)
    python -m benchmarks.ruler --kvpress             # + kvpress presses (one more prefill per context)
    python -m benchmarks.ruler --kvpress-only        # kvpress alone, resuming an interrupted run
    python -m benchmarks.ruler --quick --model DIR   # CI smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.report import QUESTIONS_AND_INTERVAL, environment, markdown_table, mean_of, score_vs_ratio_plot
from benchmarks.ruler_tasks import add_context_options, build, score, token_counter
from semanticache_rag import (
    Engine,
    KaizenCompressor,
    NoCompression,
    SeKVCompressor,
    SemantiCacheCompressor,
    StreamingLLMCompressor,
    load_document,
)
from semanticache_rag.compressors.kaizen import DEFAULT_OPTIONS
from semanticache_rag.conversation import working_cache
from semanticache_rag.prompts import Turn

RESULTS = Path(__file__).parent / "results"
KVPRESS_PRESSES = ("snapkv", "streaming_llm", "knorm", "expected_attention", "chunkkv")


OUR_METHODS = ("full", "semanticache", "sekv", "streaming_llm", "kaizen", "kaizen+semanticache")
# int4/int8 scales per 64 channels at every ratio, or only where the inner SemantiCache merges; int3 allowed
KAIZEN_ABLATIONS = {
    "kaizen+semanticache-group-64": {"group_size": 64},
    "kaizen+semanticache-merge-64": {"merge_group_size": 64},
    "kaizen+semanticache-int3": {"options": (*DEFAULT_OPTIONS, "int3")},  # 3-bit codes: fewer entries merged
    # merged as if half (a quarter) of the layers took 3-bit codes, the rest 4-bit: the selector picks which
    "kaizen+semanticache-int3-half": {"options": (*DEFAULT_OPTIONS, "int3"), "lowest_share": 0.5},
    "kaizen+semanticache-int3-quarter": {"options": (*DEFAULT_OPTIONS, "int3"), "lowest_share": 0.25},
}
# SemantiCache's fact-keeping parts switched one at a time (the default keeps digit and surprisal
# anchors, each with its whole word)
ABLATIONS = {
    "semanticache-token": {"anchor_unit": "token"},
    "semanticache-names": {"protect_names": True},
    "semanticache-token-no-digits": {"anchor_unit": "token", "protect_digits": False},
    "semanticache-no-anchors": {"protect_digits": False, "anchor_std": None},
    "semanticache-anchors-0.7": {"anchor_share": 0.7},  # anchors may take 70% of the budget (default 50%)
    "semanticache-slope-0.3": {"layer_budget_slope": 0.3},  # 1.3x the mean budget in layer 0, 0.7x in the last
}
# SeKV's span summary (the default before SemantiCache's cores), with its anchors as they were before it
# shared SemantiCache's (single surprising tokens, no digits) and with a larger share of the budget for
# the per-question zoom
SEKV_ABLATIONS = {
    "sekv-token-no-digits": {"summary": "spans", "anchor_unit": "token", "protect_digits": False},
    "sekv-zoom-0.5": {"summary": "spans", "zoom_share": 0.5},  # half the device budget rebuilt per question
    "sekv-spans": {"summary": "spans"},  # one mean entry per surprisal-bounded span (the default before cores)
    "sekv-rank": {"host_copy": "rank"},  # SeKV's own rank-16 host copy (the default before int8 codes)
}
ALL_METHODS = OUR_METHODS + tuple(ABLATIONS) + tuple(SEKV_ABLATIONS) + tuple(KAIZEN_ABLATIONS)


def our_methods(ratios, methods=ALL_METHODS):
    """(method, ratio, compressor) for every compressor of this package.

    ``ratio`` is the device budget for all of them: SeKV's summary and per-question expansion
    together stay within it; Kaizen's is in bytes (alone, and storing SemantiCache's cores).
    """
    yield "full", 0.0, NoCompression()
    makers = {
        "semanticache": SemantiCacheCompressor,
        "sekv": SeKVCompressor,
        "streaming_llm": StreamingLLMCompressor,
        "kaizen": KaizenCompressor,
        "kaizen+semanticache": lambda ratio: KaizenCompressor(ratio, inner="semanticache"),
    }
    for name, options in ABLATIONS.items():
        makers[name] = functools.partial(SemantiCacheCompressor, **options)
    for name, options in SEKV_ABLATIONS.items():
        makers[name] = functools.partial(SeKVCompressor, **options)
    for name, options in KAIZEN_ABLATIONS.items():
        makers[name] = functools.partial(KaizenCompressor, inner="semanticache", **options)
    for ratio in ratios:
        for method in methods:
            if method in makers:
                yield method, ratio, makers[method](ratio)


def tail_ids(engine: Engine, question: str) -> list[int]:
    return engine.tokenizer(engine.prompt.tail([Turn(question)]), add_special_tokens=False)["input_ids"]


def forced_logprobs(engine: Engine, cache, tail: list[int], answer: tuple[int, ...]) -> torch.Tensor | None:
    """Log-distributions (A, V) of each full-cache answer token given the cache (teacher forcing)."""
    if not answer:
        return None
    kv, _ = working_cache(engine, cache, tail)  # SeKV zooms in on the question, as when answering
    logits = engine.forward(kv, tail + list(answer[:-1]), cache.positions, logits_to_keep=len(answer))
    return torch.log_softmax(logits.float(), dim=-1)


def kl(reference: torch.Tensor | None, other: torch.Tensor | None) -> float:
    """Mean over answer tokens of KL(reference || other)."""
    if reference is None or other is None:
        return 0.0
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def run_ours(engine: Engine, contexts, ratios, methods=ALL_METHODS, partial: Path | None = None) -> list[dict]:
    """Our rows for every context, method and ratio. With ``partial``, each context's rows are appended
    to that file as it finishes, and contexts an earlier (interrupted) run finished for exactly these
    methods and ratios are read back from it instead of being run again."""
    wanted = {(m, r) for m, r, _ in our_methods(ratios, methods)}
    finished: dict[str, list[dict]] = {}
    if partial is not None and partial.is_file():
        for line in partial.read_text().splitlines():
            row = json.loads(line)
            finished.setdefault(row["context_id"], []).append(row)
        finished = {c: r for c, r in finished.items() if {(x["method"], x["ratio"]) for x in r} == wanted}
    rows = []
    todo = [c for c in contexts if c.context_id not in finished]
    for context in contexts:
        rows += finished.get(context.context_id, [])
    for context in tqdm(todo, desc="contexts (ours)", unit="ctx"):
        context_rows = _run_context(engine, context, ratios, methods)
        rows += context_rows
        if partial is not None:
            with open(partial, "a") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in context_rows)
    return rows


def _run_context(engine: Engine, context, ratios, methods) -> list[dict]:
    rows = []
    prefill = engine.prefill(context.document, surprisal=True, progress=False)
    reference = {}
    for method, ratio, compressor in our_methods(ratios, methods):
        cache = engine.compress(prefill, compressor)
        for q in context.questions:
            tail = tail_ids(engine, q.text)
            answer = engine.ask(cache, q.text, max_new_tokens=32)
            if method == "full":
                reference[q.qid] = (
                    answer.completion_ids,
                    forced_logprobs(engine, cache, tail, answer.completion_ids),
                )
            ids, ref_logp = reference[q.qid]
            rows.append(
                _row(
                    method,
                    ratio,
                    context,
                    q,
                    answer.answer,
                    answer.cache_bytes,  # device bytes this answer used (SeKV: summary + rebuilt spans)
                    cache.full_nbytes,
                    prefill.seconds + cache.compress_s,
                    answer.tokens_per_s,
                    kl(ref_logp, forced_logprobs(engine, cache, tail, ids)),
                )
            )
    return rows


def _row(method, ratio, context, q, answer, kv_bytes, full_bytes, seconds, tokens_per_s, fidelity) -> dict:
    return {
        "method": method,
        "ratio": ratio,
        "task": context.task,
        "kind": q.kind,
        "length": context.length,
        "context_id": context.context_id,
        "qid": q.qid,
        "answer": answer,
        "refs": q.refs,
        "score": score(answer, q.refs, q.metric),
        "kv_bytes": kv_bytes,
        "full_kv_bytes": full_bytes,
        "prefill_compress_s": round(seconds, 3),
        "kl": round(fidelity, 5),
        "decode_ms_per_token": round(1000 / tokens_per_s, 1) if tokens_per_s else None,
    }


def run_kvpress(engine: Engine, contexts, ratios, model_dir: str, out: Path = RESULTS) -> list[dict]:
    """The same contexts and token ids through kvpress's presses, in kvpress's own venv.

    Resumable: contexts that an earlier (possibly interrupted) run under ``out`` finished for every
    press and ratio are not run again; their rows are read from its ``ruler_kvpress_raw*.tmp``.
    """
    from benchmarks.kvpress_env import run_kvpress as run

    out.mkdir(parents=True, exist_ok=True)
    by_qid = {q.qid: (c, q) for c in contexts for q in c.questions}
    earlier = _earlier_kvpress_rows(out, contexts, ratios)
    finished = {r["context_id"] for r in earlier}
    todo = [c for c in contexts if c.context_id not in finished]
    if not todo:
        return kvpress_rows(earlier, by_qid)
    tasks_path = out / "ruler_kvpress_tasks.tmp"
    with open(tasks_path, "w") as handle:
        for c in todo:
            prefix, _ = engine.tokenize_prefix(load_document(c.document))
            questions = [
                {"qid": q.qid, "tail_ids": tail_ids(engine, q.text), "refs": q.refs, "metric": q.metric}
                for q in c.questions
            ]
            task = {"context_id": c.context_id, "task": c.task, "length": c.length, "prefix_ids": prefix}
            handle.write(json.dumps({**task, "questions": questions}) + "\n")
    raw_path = out / f"ruler_kvpress_raw.{time.strftime('%Y%m%d-%H%M%S')}.tmp"
    raw = run(tasks_path, model_dir, ("none",) + KVPRESS_PRESSES, ratios, raw_path)
    return kvpress_rows(earlier + raw, by_qid)


def _earlier_kvpress_rows(out: Path, contexts, ratios) -> list[dict]:
    """Rows of earlier kvpress runs for the contexts they finished (every press, ratio and question)."""
    wanted = {("kvpress:none", 0.0)} | {(f"kvpress:{p}", r) for p in KVPRESS_PRESSES for r in ratios}
    rows = {}
    for path in sorted(out.glob("ruler_kvpress_raw*.tmp")):
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                if (r["method"], r["ratio"]) in wanted:
                    rows[(r["method"], r["ratio"], r["qid"])] = r
    finished = []
    for c in contexts:
        mine = [rows.get((method, ratio, q.qid)) for method, ratio in wanted for q in c.questions]
        if all(mine):
            finished += mine
    return finished


def kvpress_rows(raw: list[dict], by_qid: dict) -> list[dict]:
    """Score kvpress runner rows like ours (the same string match on the same questions)."""
    rows = []
    for r in raw:
        if r["method"] == "kvpress:none":
            continue
        context, q = by_qid[r["qid"]]
        rows.append(
            _row(
                r["method"],
                r["ratio"],
                context,
                q,
                r["answer"],
                r["kv_bytes"],
                r["full_kv_bytes"],
                r["prefill_compress_s"],
                1000 / r["decode_ms_per_token"] if r["decode_ms_per_token"] else 0,
                r["kl"],
            )
        )
    return rows


METRICS = [
    *QUESTIONS_AND_INTERVAL,
    ("KV bytes", lambda g: f"{statistics.mean(r['kv_bytes'] / r['full_kv_bytes'] for r in g):.1%}"),
    ("KL", lambda g: f"{statistics.mean(r['kl'] for r in g):.3f}"),
    ("prefill+compress s", mean_of("prefill_compress_s", "{:.1f}")),
    ("decode ms/tok", mean_of("decode_ms_per_token", "{:.0f}")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_context_options(parser, lengths=[4000, 7500], samples=2)
    methods = ALL_METHODS
    parser.add_argument("--methods", nargs="+", default=list(methods), choices=methods)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kvpress", action="store_true", help="also run kvpress's presses in their own venv")
    parser.add_argument(
        "--kvpress-lengths",
        type=int,
        nargs="+",
        default=None,
        help="lengths to run kvpress on (default: all)",
    )
    parser.add_argument(
        "--kvpress-only",
        action="store_true",
        help="run only kvpress (resuming an interrupted run) and merge it with our rows in OUT/ruler.jsonl",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 sample, 300 tokens, ratio 0.5")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--reuse-rows",
        type=Path,
        default=None,
        help="add an earlier run's rows (its ruler.jsonl) of methods and ratios this run lacks, on this run's "
        "questions (e.g. kvpress rows of the same contexts), and rewrite the tables of OUT/ruler.jsonl",
    )
    parser.add_argument(
        "--kvpress-raw",
        type=Path,
        default=None,
        help="add the rows of a kvpress runner output (e.g. an interrupted run) to OUT/ruler.jsonl",
    )
    args = parser.parse_args()
    if args.quick:
        args.samples, args.lengths, args.ratios = 1, [300], [0.5]
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    engine = Engine.from_pretrained(args.model, weights="model")  # kvpress's rows run the model as loaded too
    contexts = build(args.tasks, args.lengths, args.samples, token_counter(engine.tokenizer), args.seed)
    if args.reuse_rows:
        if not (args.out / "ruler.jsonl").is_file():
            parser.error(
                f"--reuse-rows adds to {args.out / 'ruler.jsonl'}, which does not exist: run the benchmark first"
            )
        ours = [json.loads(line) for line in open(args.out / "ruler.jsonl")]
        write_results(ours + reused_rows(args.reuse_rows, ours, contexts), args, started)
        return
    if args.kvpress_raw:
        ours = _our_rows(args.out)
        raw = [json.loads(line) for line in open(args.kvpress_raw)]
        by_qid = {q.qid: (c, q) for c in contexts for q in c.questions}
        write_results(ours + kvpress_rows(raw, by_qid), args, started)
        return
    if args.kvpress_only:
        rows = _our_rows(args.out)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = run_ours(engine, contexts, args.ratios, args.methods, partial=args.out / "ruler_ours_partial.tmp")
        write_results(rows, args, started)  # kept even if the kvpress part fails or is interrupted
    if args.kvpress or args.kvpress_only:
        from semanticache_rag.models import resolve_model

        chosen = [c for c in contexts if args.kvpress_lengths is None or c.length in args.kvpress_lengths]
        rows += run_kvpress(engine, chosen, args.ratios, resolve_model(args.model), args.out)
        write_results(rows, args, started)


def reused_rows(path: Path, rows: list[dict], contexts) -> list[dict]:
    """Rows of ``path`` for cells (method, ratio) absent from ``rows``, on questions of ``contexts``, scored again."""
    by_qid = {q.qid: (c, q) for c in contexts for q in c.questions}
    present = {(r["method"], r["ratio"]) for r in rows}
    reused = []
    for line in open(path):
        r = json.loads(line)
        if (r["method"], r["ratio"]) not in present and r["qid"] in by_qid:
            context, q = by_qid[r["qid"]]
            if q.refs == r["refs"]:  # the same question, built again from the same seed
                reused.append({**r, "kind": q.kind, "score": score(r["answer"], q.refs, q.metric)})
    return reused


def _common_contexts(rows: list[dict]) -> list[dict]:
    """The rows of the contexts that every method and ratio was run on."""
    cells = {(r["method"], r["ratio"]) for r in rows}
    ran: dict[str, set] = {}
    for r in rows:
        ran.setdefault(r["context_id"], set()).add((r["method"], r["ratio"]))
    common = {c for c, done in ran.items() if done == cells}
    return [r for r in rows if r["context_id"] in common]


def _our_rows(out: Path) -> list[dict]:
    """The rows of our methods in an earlier run's ``out/ruler.jsonl`` (kvpress rows left out)."""
    with open(out / "ruler.jsonl") as handle:
        return [json.loads(line) for line in handle if '"kvpress:' not in line]


def write_results(rows: list[dict], args, started: float) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "ruler.jsonl", "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    table = markdown_table(rows, ["task"], METRICS)
    by_length = markdown_table(rows, ["length"], QUESTIONS_AND_INTERVAL)
    by_kind = markdown_table([r for r in rows if "kind" in r], ["kind"], QUESTIONS_AND_INTERVAL)
    common = _common_contexts(rows)
    shared = ""
    if common and len(common) < len(rows):
        contexts = len({r["context_id"] for r in common})
        shared = (
            f"Only the {contexts} context(s) every method ran on (a fair comparison when some methods ran "
            f"on fewer):\n\n{markdown_table(common, ['task'], QUESTIONS_AND_INTERVAL)}\n\n"
        )
    settings = (
        f"Tasks {', '.join(args.tasks)}; lengths {args.lengths}; {args.samples} context(s) per task and "
        f"length; ratios {args.ratios}; seed {args.seed}; greedy, 32 new tokens; score = RULER string match %."
    )
    (args.out / "ruler.md").write_text(
        f"# RULER-style QA, question-agnostic\n\n{settings}\n\n{table}\n\nBy length:\n\n{by_length}\n\n"
        f"By what the question asks for (number, uuid, name, city, code; QA answers):\n\n{by_kind}\n\n{shared}"
        f"{environment(started)}\n"
    )
    score_vs_ratio_plot(rows, args.out / "ruler.png", "RULER-style QA (mean over tasks)")
    print(table)


if __name__ == "__main__":
    main()
