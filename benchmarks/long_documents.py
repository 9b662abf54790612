"""Documents longer than the context: section caches vs truncation, text RAG and the gold sections.

RULER-style tasks (NIAH single and multikey, QA-1 SQuAD, QA-2 HotpotQA) built from RULER's own data
at 16K-128K tokens. Each context is read once as sections (one prefill per section, compressed at
every ratio), then every question is answered, on the same token ids with greedy decoding, by:

- ``truncation``: the first tokens that fit the context, prefilled per question (a stock pipeline);
- ``text_rag``: the sections our router picks for an uncompressed splice, pasted as text and
  prefilled per question (what a LangChain retriever + stuff chain computes);
- ``sections``: ours, the routed sections spliced from their caches at each ratio;
- ``gold``: the sections that hold the answer, alone, as text (the ceiling of routing).

    python -m benchmarks.long_documents                          # the README table (hours on 2 cores)
    python -m benchmarks.long_documents --lengths 16000 --samples 1 --tasks qa_1
    python -m benchmarks.long_documents --pdf R-exts.pdf         # one real manual, five questions
    python -m benchmarks.long_documents --report-only            # tables and plot from the rows so far
    python -m benchmarks.long_documents --read-speed --lengths 16000 --tasks qa_1   # reading vs plain prefill

Rows are appended to ``OUT/long_documents.jsonl`` as they are computed; a run started again skips
the contexts already there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.report import environment
from benchmarks.ruler_tasks import Context, build, score, token_counter
from semanticache_rag import Engine, NoCompression, SemantiCacheCompressor
from semanticache_rag.documents import document_from_text, load_document
from semanticache_rag.reading import compress_section, prefill_section, read_head
from semanticache_rag.sections import SectionedCache, character_spans, plan_sections

RESULTS = Path(__file__).parent / "results" / "long_documents"
TASKS = ("niah_single_2", "niah_multikey_1", "qa_1", "qa_2")
NEW_TOKENS = 32


def compressor(ratio: float):
    return NoCompression() if ratio == 0 else SemantiCacheCompressor(ratio)


def read_sectioned(engine: Engine, source, ratios) -> tuple[dict[float, SectionedCache], dict]:
    """One read of ``source`` (text, path or Document) as sections, compressed at every ratio;
    (caches by ratio, timings)."""
    document = load_document(source)
    ids, offsets, pages = engine.tokenize_document(document)
    ranges = plan_sections(document, offsets, engine.section_tokens)
    started = time.perf_counter()
    head, head_logits = read_head(engine, document)
    sections: dict[float, list] = {ratio: [] for ratio in ratios}
    compress_s = dict.fromkeys(ratios, 0.0)
    need = any(compressor(r).needs_surprisal for r in ratios)
    for start, end in ranges:
        prefill = prefill_section(engine, head, head_logits, ids[start:end], need)
        for ratio in ratios:
            section = compress_section(engine, compressor(ratio), head, prefill, ids[start:end], pages[start:end])
            sections[ratio].append(section)
            compress_s[ratio] += section.compress_s
        del prefill
    prefill_s = time.perf_counter() - started - sum(compress_s.values())
    spans = character_spans(document, offsets, ranges)
    caches = {r: SectionedCache(document, head, tuple(sections[r]), spans) for r in ratios}
    timing = {"tokens": len(ids), "sections": len(ranges), "prefill_s": prefill_s, "compress_s": compress_s}
    return caches, timing


def text_answer(engine: Engine, text: str, question: str, read=None) -> dict:
    """Answer from ``text`` prefilled whole for this question, as a stock pipeline does.

    ``read``: (cache, seconds) of the same text read before; its time is counted as this question's.
    """
    started = time.perf_counter()
    cache, read_s = read or (engine.compress(engine.prefill(document_from_text(text), progress=False)), 0.0)
    answer = engine.ask(cache, question, max_new_tokens=NEW_TOKENS)
    ttft = time.perf_counter() - started - answer.decode_s + read_s
    return {"answer": answer.answer, "ttft_s": ttft, "total_s": ttft + answer.decode_s, "kv_bytes": cache.nbytes}


def section_text(cache: SectionedCache, chosen) -> str:
    return "\n\n".join(cache.document.text[a:b] for a, b in (cache.spans[k] for k in sorted(chosen)))


def gold_sections(cache: SectionedCache, evidence: list[str]) -> list[int]:
    """Sections that hold the start of each evidence passage."""
    found = set()
    for passage in evidence:
        at = cache.document.text.find(passage[:200])
        if at >= 0:
            found.update(k for k, (a, b) in enumerate(cache.spans) if a <= at < b)
    return sorted(found)


def truncated_text(engine: Engine, text: str) -> str:
    """The document's first tokens that fit the context with a question and its answer."""
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = engine.read_limit - len(engine.head_ids) - 64
    return engine.tokenizer.decode(ids[:keep])


def _fit_text(engine: Engine, cache: SectionedCache, chosen: list[int], question: str) -> dict:
    """Text RAG over ``chosen`` sections (best first); sections are dropped from the end if the text is longer."""
    chosen = list(chosen)
    while chosen:
        text = section_text(cache, chosen)
        if len(engine.head_ids) + len(engine.tokenizer(text)["input_ids"]) <= engine.read_limit - 64:
            return text_answer(engine, text, question) | {"sections": sorted(chosen)}
        chosen.pop()
    raise RuntimeError("not even one section fits as text")


def run_context(engine: Engine, context: Context, ratios, max_sections_list, positions_list, skip=()) -> list[dict]:
    """Every method (but those in ``skip``) on every question of ``context`` (one read of its sections)."""
    caches, timing = read_sectioned(engine, context.document, ratios)
    base = {"task": context.task, "length": context.length, "context_id": context.context_id}
    base |= {"tokens": timing["tokens"], "sections_total": timing["sections"]}
    truncated = truncated_text(engine, context.document)
    started = time.perf_counter()  # the stock pipeline reads the truncated prompt for every question: time it once
    truncated_read = (engine.compress(engine.prefill(document_from_text(truncated), progress=False)), 0.0)
    truncated_read = (truncated_read[0], time.perf_counter() - started)
    rows = []
    for q in context.questions:
        full = caches[0.0]
        gold = gold_sections(full, q.evidence)
        common = base | {"qid": q.qid, "refs": q.refs, "gold_sections": gold}
        if "truncation" not in skip:
            rows.append(_row(common, q, "truncation", 0.0, text_answer(engine, truncated, q.text, truncated_read)))
        if "gold" not in skip:
            gold_answer = text_answer(engine, section_text(full, gold), q.text) | {"sections": gold}
            rows.append(_row(common, q, "gold", 0.0, gold_answer))
        for max_sections in max_sections_list:
            engine.max_sections = max_sections or None
            for positions in positions_list:
                engine.positions = positions
                for ratio in ratios:
                    if ratio == 0 and positions != positions_list[0]:
                        continue  # uncompressed sections take their full extent either way
                    result, extra = _ours(engine, caches[ratio], q, timing, ratio, max_sections)
                    rows.append(_row(common, q, "sections", ratio, result, extra))
            if "text_rag" not in skip:
                chosen = full.select(engine, q.text, _room(engine, q)).sections  # what fits uncompressed
                rag = _fit_text(engine, full, _by_rank(full, q.text, chosen), q.text)
                rows.append(_row(common, q, "text_rag", 0.0, rag, {"max_sections": max_sections}))
        engine.max_sections, engine.positions = None, "compact"
    return rows


def _row(common: dict, q, method: str, ratio: float, result: dict, extra: dict | None = None) -> dict:
    gold = common["gold_sections"]
    routed = bool(gold) and set(gold) <= set(result.get("sections", ()))
    return common | {
        "method": method,
        "ratio": ratio,
        "answer": result["answer"],
        "score": score(result["answer"], q.refs, q.metric),
        "gold_routed": routed,
        **{k: v for k, v in result.items() if k != "answer"},
        **(extra or {}),
    }


def _ours(engine: Engine, cache: SectionedCache, q, timing: dict, ratio: float, max_sections: int):
    answer = engine.ask(cache, q.text, max_new_tokens=NEW_TOKENS)
    result = {
        "answer": answer.answer,
        "ttft_s": answer.prefill_s,
        "total_s": answer.prefill_s + answer.decode_s,
        "kv_bytes": answer.cache_bytes,
        "sections": list(answer.sections),
        "matched": answer.routing_matched,
    }
    extra = {
        "max_sections": max_sections,
        "positions": engine.positions,
        "read_s": timing["prefill_s"] + timing["compress_s"][ratio],
        "compress_s": timing["compress_s"][ratio],
        "stored_bytes": cache.nbytes,
        "full_bytes": cache.full_nbytes,
    }
    return result, extra


def _room(engine: Engine, q) -> int:
    from semanticache_rag.prompts import Turn

    tail = engine.tokenizer(engine.prompt.tail([Turn(q.text)]), add_special_tokens=False)["input_ids"]
    return engine.context_length - len(tail) - min(NEW_TOKENS, engine.answer_reserve)


def _by_rank(cache: SectionedCache, question: str, chosen: list[int]) -> list[int]:
    from semanticache_rag.routing import ranking

    order = ranking(cache.router.scores(question))
    return [k for k in order if k in chosen]


# -- reporting --------------------------------------------------------------------------------


def label(row: dict) -> str:
    """Name of a row's method in the tables: ``sections 0.75``, ``text RAG``, with variants spelled out."""
    name = {"truncation": "truncation", "gold": "gold sections (ceiling)", "text_rag": "text RAG"}.get(row["method"])
    if name is None:
        name = f"sections, ratio {row['ratio']:g}"
        if row.get("positions", "compact") != "compact":
            name += f", {row['positions']}"
    if row.get("max_sections") and row["method"] in ("sections", "text_rag"):
        name += f" (≤{row['max_sections']} sections)"
    return name


def _mean(values, fmt="{:.1f}") -> str:
    values = [v for v in values if v is not None]
    return fmt.format(statistics.mean(values)) if values else "-"


def tables(rows: list[dict]) -> str:
    """Accuracy by length (questions per cell in brackets), then time and memory per method."""
    lengths = sorted({r["length"] for r in rows})
    labels = list(dict.fromkeys(label(r) for r in sorted(rows, key=_order)))
    head = ["method", *[f"{n // 1000}K" for n in lengths], "all", "gold routed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in labels:
        group = [r for r in rows if label(r) == name]
        cells = [name]
        for n in lengths:
            scores = [r["score"] for r in group if r["length"] == n]
            cells.append(f"{100 * statistics.mean(scores):.0f} ({len(scores)})" if scores else "-")
        cells.append(f"**{100 * statistics.mean(r['score'] for r in group):.0f}** ({len(group)})")
        routed = [r["gold_routed"] for r in group if r["method"] in ("sections", "text_rag")]
        cells.append(f"{100 * statistics.mean(routed):.0f}%" if routed else "-")
        lines.append("| " + " | ".join(cells) + " |")
    cost = [
        "| method | length | time to first token (s) | per question (s) | read (tok/s) | kept (MiB per 1K tokens) "
        "| working KV (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in labels:
        for n in lengths:
            group = [r for r in rows if label(r) == name and r["length"] == n]
            if not group:
                continue
            rate = _mean([r["tokens"] / r["read_s"] for r in group if r.get("read_s")], "{:.0f}")
            kept = _mean(
                [r["stored_bytes"] / 2**20 / r["tokens"] * 1000 for r in group if r.get("stored_bytes")], "{:.1f}"
            )
            ttft, total = _mean(r["ttft_s"] for r in group), _mean(r["total_s"] for r in group)
            working = _mean(r["kv_bytes"] / 2**20 for r in group)
            cost.append(f"| {name} | {n // 1000}K | {ttft} | {total} | {rate} | {kept} | {working} |")
    return "\n".join(lines) + "\n\n" + "\n".join(cost)


def _order(row: dict):
    rank = {"truncation": 0, "text_rag": 1, "sections": 2, "gold": 3}[row["method"]]
    return rank, row.get("max_sections") or 0, row.get("positions", "compact") != "compact", row["ratio"]


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy against ratio per length (our sections), with text RAG and truncation as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(3.2 * len(lengths), 3.2), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], lengths):
        mine = [r for r in rows if r["length"] == n and r["method"] == "sections" and r.get("positions") == "compact"]
        for limit in sorted({r.get("max_sections") or 0 for r in mine}):
            group = [r for r in mine if (r.get("max_sections") or 0) == limit]
            ratios = sorted({r["ratio"] for r in group})
            means = [100 * statistics.mean(r["score"] for r in group if r["ratio"] == x) for x in ratios]
            ax.plot(ratios, means, marker="o", label=f"sections{f' ≤{limit}' if limit else ''}")
        lines = [("text_rag", 0, "--", "tab:green", "text RAG"), ("text_rag", 2, ":", "tab:olive", "text RAG ≤2")]
        lines += [("truncation", None, ":", "gray", "truncation"), ("gold", None, "-.", "black", "gold")]
        for method, limit, style, color, name in lines:
            group = [r for r in rows if r["length"] == n and r["method"] == method]
            if limit is not None:
                group = [r for r in group if (r.get("max_sections") or 0) == limit]
            if group:
                mean = 100 * statistics.mean(r["score"] for r in group)
                ax.axhline(mean, linestyle=style, color=color, label=name)
        ax.set_title(f"{n // 1000}K tokens")
        ax.set_xlabel("compression ratio")
    axes[0][0].set_ylabel("score (%)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plain_prefill_rate(engine: Engine, text: str) -> float:
    """Tokens/s of a plain prefill of ``section_tokens`` tokens, warmed up, median of 3 (the reference of
    the read-speed goal)."""
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][: engine.section_tokens]
    document = document_from_text(engine.tokenizer.decode(ids))
    engine.prefill(document, progress=False)  # warm-up: the first call pays one-time costs
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        engine.prefill(document, progress=False)
        rates.append(len(ids) / (time.perf_counter() - started))
    return statistics.median(rates)


def read_speed(engine: Engine, text: str, ratios, out: Path) -> dict:
    """Tokens/s of ``engine.read`` (sections, each compressed as read) at each ratio, against one plain
    prefill of a section's length, in one run (``read_speed.json``); no store, so every read is a read."""

    result = {"plain_prefill_tok_s": plain_prefill_rate(engine, text)}
    store, engine.store = engine.store, None
    try:
        for ratio in ratios:
            engine.compressor = compressor(ratio)
            started = time.perf_counter()
            cache = engine.read(text, progress=False)
            seconds = time.perf_counter() - started
            result[f"read_tok_s_{ratio:g}"] = cache.length / seconds
            result[f"compress_s_{ratio:g}"] = sum(s.compress_s for s in cache.sections)
    finally:
        engine.store = store
    result |= {"tokens": cache.length, "sections": len(cache.sections), "section_tokens": engine.section_tokens}
    result["ratio_of_plain"] = {
        k: v / result["plain_prefill_tok_s"] for k, v in result.items() if k.startswith("read_")
    }
    (out / "read_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[16000, 32000, 64000, 128000])
    parser.add_argument("--samples", type=int, default=3, help="contexts per task and length")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.5, 0.75, 0.9])
    parser.add_argument("--section-tokens", type=int, default=1024)
    parser.add_argument("--max-sections", type=int, nargs="+", default=[2, 0], help="0: as many as fit")
    parser.add_argument("--positions", nargs="+", default=["compact"], choices=["compact", "contiguous"])
    parser.add_argument("--skip", nargs="*", default=[], choices=["truncation", "text_rag", "gold"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--pdf", type=Path, default=None, help="instead: one real PDF, the questions of --questions")
    parser.add_argument("--report-only", action="store_true", help="write the tables and plot from OUT's rows")
    parser.add_argument("--read-speed", action="store_true", help="only: read speed vs a plain prefill (first context)")
    parser.add_argument("--note", default="", help="a line for the report (e.g. whether the machine was quiet)")
    args = parser.parse_args()
    if 0.0 not in args.ratios:
        parser.error("--ratios must include 0 (text RAG and the gold sections use the uncompressed selection)")
    started = time.perf_counter()
    raw = args.out / "long_documents.jsonl"
    if args.report_only:
        report(raw, args, started)
        return
    torch.manual_seed(args.seed)
    engine = Engine.from_pretrained(args.model, section_tokens=args.section_tokens)
    if args.pdf is not None:
        from benchmarks.long_pdf import run_pdf

        run_pdf(engine, args.pdf, args.out, started)
        return
    count = token_counter(engine.tokenizer)
    contexts = sorted(build(args.tasks, args.lengths, args.samples, count, args.seed), key=lambda c: c.length)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.read_speed:
        print(json.dumps(read_speed(engine, contexts[0].document, args.ratios, args.out), indent=1))
        return
    done = {json.loads(line)["context_id"] for line in open(raw)} if raw.exists() else set()
    rate = plain_prefill_rate(engine, contexts[0].document)
    for context in tqdm([c for c in contexts if c.context_id not in done], desc="contexts", unit="ctx"):
        rows = run_context(engine, context, args.ratios, args.max_sections, args.positions, args.skip)
        with open(raw, "a") as handle:
            handle.writelines(json.dumps(r | {"plain_prefill_tok_s": rate}) + "\n" for r in rows)
    report(raw, args, started)


def report(raw: Path, args, started: float) -> None:
    """Tables (``long_documents.md``) and plot (``long_documents.png``) of every row in ``raw``."""
    rows = [json.loads(line) for line in open(raw)]
    contexts = {(r["task"], r["length"], r["context_id"]) for r in rows}
    counts = ", ".join(
        f"{n // 1000}K: {sum(1 for c in contexts if c[1] == n)}" for n in sorted({c[1] for c in contexts})
    )
    rate = statistics.median(r["plain_prefill_tok_s"] for r in rows)
    settings = (
        f"Tasks {', '.join(sorted({r['task'] for r in rows}))}; contexts per length {counts}; sections of at most "
        f"{args.section_tokens} tokens; greedy, {NEW_TOKENS} new tokens; score = RULER string match %, questions "
        f"per cell in brackets. Plain prefill of one section: {rate:.0f} tok/s. {args.note}"
    )
    text = tables(rows)
    ran = environment(started) if not args.report_only else environment(started).split("; ran")[0] + "."
    (args.out / "long_documents.md").write_text(f"# Long documents\n\n{settings}\n\n{text}\n\n{ran}\n")
    plot(rows, args.out / "long_documents.png")
    print(text)


if __name__ == "__main__":
    main()
