"""Needle in a haystack over Paul Graham essays: full cache vs StreamingLLM vs SemantiCache.

RULER's needle ("One of the special magic numbers for {key} is: {value}.") is planted at a
depth of the haystack; the question is asked after the cache is compressed (question-agnostic).
Each haystack is prefilled once and compressed by every method and ratio.

    python -m benchmarks.niah [--lengths 2000 4000 7000] [--depths 10 50 90] [--samples 1] [--weights auto] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks.data import paul_graham_essays
from benchmarks.report import environment, heatmap, markdown_table
from semanticache_rag import Engine, NoCompression, SemantiCacheCompressor, StreamingLLMCompressor

RESULTS = Path(__file__).parent / "results"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
KEYS = ("quiet-lantern", "amber-river", "silver-orchard", "hollow-comet", "brave-willow", "frozen-meadow")


def haystack(engine: Engine, tokens: int, depth: int, rng: random.Random) -> tuple[str, str, str]:
    """(document, question, expected value) of about ``tokens`` tokens with the needle at ``depth`` %."""
    essays = paul_graham_essays()
    start = rng.randrange(0, len(essays) // 2)
    ids = engine.tokenizer(essays[start : start + tokens * 6], add_special_tokens=False)["input_ids"][:tokens]
    text = engine.tokenizer.decode(ids)
    cut = text.find(". ", int(len(text) * depth / 100)) + 2
    key, value = rng.choice(KEYS), str(rng.randrange(1_000_000, 10_000_000))
    return text[:cut] + NEEDLE.format(key=key, value=value) + " " + text[cut:], QUESTION.format(key=key), value


def methods(ratios):
    yield "full", 0.0, NoCompression()
    for ratio in ratios:
        yield "streaming_llm", ratio, StreamingLLMCompressor(ratio)
        yield "semanticache", ratio, SemantiCacheCompressor(ratio)


def run(args) -> list[dict]:
    engine = Engine.from_pretrained(weights=args.weights)
    rng, rows = random.Random(args.seed), []
    for tokens in args.lengths:
        for depth in args.depths:
            for sample in range(args.samples):
                text, question, value = haystack(engine, tokens, depth, rng)
                prefill = engine.prefill(text, surprisal=True, progress=False)
                for method, ratio, compressor in methods(args.ratios):
                    cache = engine.compress(prefill, compressor)
                    answer = engine.ask(cache, question, max_new_tokens=32)
                    rows.append(
                        {
                            "method": method,
                            "ratio": ratio,
                            "tokens": tokens,
                            "depth": depth,
                            "sample": sample,
                            "score": float(value in answer.answer),
                            "answer": answer.answer,
                            "document_tokens": cache.length,
                            "achieved_ratio": round(cache.entries_removed, 4),
                            "kv_bytes": cache.nbytes,
                            "full_kv_bytes": cache.full_nbytes,
                            "prefill_s": round(prefill.seconds, 3),
                            "compress_s": round(cache.compress_s, 3),
                            "decode_ms_per_token": round(1000 / answer.tokens_per_s, 1)
                            if answer.tokens_per_s
                            else None,
                        }
                    )
                    print(
                        json.dumps({k: rows[-1][k] for k in ("method", "ratio", "tokens", "depth", "score")}),
                        flush=True,
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 7000])
    parser.add_argument("--depths", type=int, nargs="+", default=[10, 50, 90])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", default="auto", help="weight format (semanticache_rag.weights; default: auto)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: %(default)s)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "niah.jsonl", "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    table = markdown_table(rows, ["tokens"])
    (args.out / "niah.md").write_text(f"# NIAH (score %, by haystack tokens)\n\n{table}\n\n{environment(started)}\n")
    heatmap(rows, args.out / "niah.png")
    print(table)


if __name__ == "__main__":
    main()
