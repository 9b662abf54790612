"""Follow-up question latency: cached document vs re-reading the whole prompt.

(a) what a stock LangChain "stuff" chain does: the whole prompt (document + question) through
``model.generate`` from scratch, for every question; (b) a follow-up question answered from the
document cache that :meth:`Engine.read` built once. Same model, prompt, greedy decoding and
answer length for both. With weight-only formats (``--weights``) also the full cache with its rows in fp16
(the ``fp16`` compressor: every entry kept, half the bytes), which the decoding step reads in half the time.

    python -m benchmarks.followup_latency [--tokens 6000] [--repeats 3] [--weights int4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from semanticache_rag import Engine, HalfCompressor, NoCompression, SemantiCacheCompressor
from semanticache_rag.prompts import Turn

RESULTS = Path(__file__).parent / "results"
QUESTIONS = (
    "What is the special magic number for the blue harbor mentioned in the document?",
    "What does the license say about warranties?",
    "Who may distribute copies of the program?",
)


def real_document(tokenizer, tokens: int) -> str:
    """GPL-3 text (repeated if needed) cut to ``tokens`` tokens, with one planted fact."""
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += "\n\n" + text
    text = tokenizer.decode(tokenizer(text)["input_ids"][:tokens])
    cut = text.rfind("\n", 0, len(text) // 2) + 1
    return text[:cut] + "The special magic number for the blue harbor is 7351946.\n" + text[cut:]


def stock_generate(engine: Engine, cache, question: str, max_new_tokens: int) -> tuple[float, str]:
    """Seconds for a full-prompt ``model.generate`` answer (no reuse of any cache), and the answer."""
    started = time.perf_counter()
    text = engine.generate_uncached(cache, [Turn(question)], max_new_tokens)
    return time.perf_counter() - started, text


def timed_followups(engine: Engine, cache, args, stock_texts=None) -> dict:
    """Median follow-up latency from ``cache`` over the benchmark questions."""
    answers = [
        engine.ask(cache, QUESTIONS[i % len(QUESTIONS)], max_new_tokens=args.max_new_tokens)
        for i in range(args.repeats)
    ]
    row = {
        "followup_s": round(statistics.median(a.prefill_s + a.decode_s for a in answers), 3),
        "time_to_first_token_s": round(statistics.median(a.prefill_s for a in answers), 3),
        "decode_ms_per_token": round(statistics.median(1000 / a.tokens_per_s for a in answers), 1),
        "answer_tokens": [a.completion_tokens for a in answers],
        "kv_bytes": cache.nbytes,
    }
    if stock_texts is not None:  # greedy answers must be identical to the stock pipeline's
        row["same_answers_as_stock"] = [t.strip() == a.answer for t, a in zip(stock_texts, answers)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "followup_latency.json", help="results file")
    parser.add_argument(
        "--weights", nargs="*", default=["int4"], help="weight formats to time as well (semanticache_rag.weights)"
    )
    args = parser.parse_args()
    engine = Engine.from_pretrained(weights="model")  # the stock pipeline's fp32 model, as loaded
    prefill = engine.prefill(real_document(engine.tokenizer, args.tokens), surprisal=True)
    full = engine.compress(prefill, NoCompression())
    stock = [
        stock_generate(engine, full, QUESTIONS[i % len(QUESTIONS)], args.max_new_tokens) for i in range(args.repeats)
    ]
    stock_s = statistics.median(s for s, _ in stock)
    rows = {
        "stock_generate": {"followup_s": round(stock_s, 3), "kv_bytes": full.full_nbytes},
        "cached_full": timed_followups(engine, full, args, [t for _, t in stock]),
        "cached_semanticache_0.75": timed_followups(
            engine, engine.compress(prefill, SemantiCacheCompressor(0.75)), args
        ),
    }
    for weights in args.weights:  # the same, with weight-only matrices (the stock pipeline stays as loaded)
        engine = Engine.from_pretrained(weights=weights)
        prefill = engine.prefill(real_document(engine.tokenizer, args.tokens), surprisal=True)
        full = engine.compress(prefill, NoCompression())
        rows[f"cached_full_{weights}_weights"] = timed_followups(engine, full, args, [t for _, t in stock])
        rows[f"cached_semanticache_0.75_{weights}_weights"] = timed_followups(
            engine, engine.compress(prefill, SemantiCacheCompressor(0.75)), args, [t for _, t in stock]
        )
        rows[f"cached_full_fp16_rows_{weights}_weights"] = timed_followups(
            engine, engine.compress(prefill, HalfCompressor()), args, [t for _, t in stock]
        )
    for row in rows.values():
        row["speedup_vs_stock"] = round(stock_s / row["followup_s"], 1)
    result = {
        "document_tokens": full.length,
        "read_s": round(prefill.seconds, 2),
        "max_new_tokens": args.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
