"""How long compression takes against the read it follows, for every compressor the engine offers.

The speed benchmark (``benchmarks/speed.py``) times compression for the caches it decodes; this one
adds SeKV (whose span copies are coded at compression, or factored with ``host_copy="rank"``: the
``sekv-rank`` rows) and times every compressor at each ratio on the same reads: the default model, the
GPL-3 text of the follow-up benchmark cut to each length, one read per length (with token surprisal,
which the anchors need), then each compressor on it.

    python -m benchmarks.compression_share [--lengths 2000 7000] [--weights int4] [--out DIR]

Writes ``compression_share.json`` and ``compression_share.md`` (compress seconds and their share of
the read, per compressor, ratio and length).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.followup_latency import real_document
from benchmarks.report import environment
from semanticache_rag import Engine, make_compressor

RESULTS = Path(__file__).parent / "results" / "speed"
COMPRESSORS = ("semanticache", "kaizen", "kaizen+semanticache", "sekv", "sekv-rank")
# rows that are a registered compressor with other options: SeKV with its own rank-16 host copy
VARIANTS = {"sekv-rank": ("sekv", {"host_copy": "rank"})}
RATIOS = (0.5, 0.75, 0.9)


def measure(lengths: list[int], weights: str) -> list[dict]:
    engine = Engine.from_pretrained(weights=weights)
    rows = []
    for tokens in lengths:
        prefill = engine.prefill(real_document(engine.tokenizer, tokens), surprisal=True)
        for name in COMPRESSORS:
            for ratio in RATIOS:
                registered, options = VARIANTS.get(name, (name, {}))
                cache = engine.compress(prefill, make_compressor(registered, ratio, **options))
                row = {
                    "compressor": name,
                    "ratio": ratio,
                    "tokens": tokens,
                    "read_s": round(prefill.seconds, 2),
                    "compress_s": round(cache.compress_s, 2),
                    "share": round(cache.compress_s / prefill.seconds, 3),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], lengths: list[int]) -> str:
    lines = [
        "| compressor | ratio | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|---|" + "---|" * len(lengths),
    ]
    for name in COMPRESSORS:
        for ratio in RATIOS:
            cells = []
            for n in lengths:
                row = next(r for r in rows if r["compressor"] == name and r["ratio"] == ratio and r["tokens"] == n)
                cells.append(f"{row['compress_s']:.2f} s ({row['share']:.1%})")
            lines.append(f"| {name} | {ratio} | " + " | ".join(cells) + " |")
    reads = [next(r["read_s"] for r in rows if r["tokens"] == n) for n in lengths]
    lines.append("| read | | " + " | ".join(f"{s:.1f} s" for s in reads) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 7000])
    parser.add_argument("--weights", default="int4", help="weight format of the engine (semanticache_rag.weights)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = measure(args.lengths, args.weights)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression_share.json").write_text(json.dumps(rows, indent=1) + "\n")
    command = "python -m benchmarks.compression_share --lengths " + " ".join(map(str, args.lengths))
    text = (
        f"# Compression against the read\n\n`{command} --weights {args.weights}`; compress seconds and "
        f"their share of the read (one read per length, with token surprisal).\n\n"
        f"{table(rows, args.lengths)}\n\n{environment(started)}\n"
    )
    (args.out / "compression_share.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
