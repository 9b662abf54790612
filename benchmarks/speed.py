"""Speed on CPUs: reading and decoding, ours against llama.cpp's ``llama-bench``, on the default model.

For each context length: llama.cpp's prompt processing (tok/s, at depth 0) and token generation at that depth
(ms/token), with the model file we ship (Q4_1 GGUF) and ``llama-bench`` built by ``benchmarks/llama_bench.py``;
then ours, per weight format (``--weights``: fp32 as converted, fp16 through fbgemm's packed product, int8, int4
with the GGUF's own codes and llama.cpp's arithmetic, and int4-exact, the same codes in fp32 arithmetic),
reading the same text once and, per cache (full, full with fp16 rows, SemantiCache 0.5/0.75/0.9, Kaizen 0.75,
Kaizen + SemantiCache 0.9): compression time, decode ms/token (median over ``--steps`` greedy steps after a
question, run as an answer runs them: 8 a call, no logits in Python; ``forward_ms``: a step with its logits
returned to Python, as a sampling answer takes it), the bytes a step reads (weights + document cache) over the
machine's measured read bandwidth (the floor: a sum over 512 MiB in huge pages, as the weights are kept;
ordinary pages read ~20% slower), and the KL divergence of the next-token distributions to the fp32 full
cache's, teacher-forced on its greedy answer.

    python -m benchmarks.speed [--lengths 2000 4000 7000] [--steps 32] [--no-llama-cpp] [--memory-only]

It also measures (first, each in a fresh process) how much one read of the longest document grows the
process's peak memory, uncompressed and compressed (``memory.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.followup_latency import real_document
from benchmarks.report import environment
from semanticache_rag import Engine, make_compressor
from semanticache_rag.conversation import GREEDY_RUN
from semanticache_rag.kernels.bench_cpu import bandwidth_sample, read_bandwidth  # the kernel bench's 512 MiB sum
from semanticache_rag.kv import ConversationKV
from semanticache_rag.models import default_gguf
from semanticache_rag.prompts import Turn

RESULTS = Path(__file__).parent / "results" / "speed"
BANDWIDTH_EVERY = 8  # decode steps between two measurements of the read bandwidth (untimed)
QUESTION = "What is the special magic number for the blue harbor mentioned in the document?"
CACHES = (
    ("full", "none", None),
    ("full, fp16 rows", "fp16", None),
    ("SemantiCache 0.5", "semanticache", 0.5),
    ("SemantiCache 0.75", "semanticache", 0.75),
    ("SemantiCache 0.9", "semanticache", 0.9),
    ("Kaizen 0.75", "kaizen", 0.75),
    ("Kaizen + SemantiCache 0.9", "kaizen+semanticache", 0.9),
)


def weight_bytes(model) -> int:
    """Bytes of weights a decoding step reads: every parameter, buffer and packed matrix (fp16 weights) but
    the input embedding table."""
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and getattr(output, "weight", None) is embedding
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor is embedding and not tied:
            continue
        total += tensor.numel() * tensor.element_size()
    return total + sum(getattr(module, "packed_nbytes", 0) for module in model.modules())


def llama_cpp(lengths: list[int], steps: int) -> list[dict]:
    """llama-bench's prompt processing at depth 0 and generation at each depth, 2 threads."""
    from benchmarks.llama_bench import ensure_llama_bench

    build = ensure_llama_bench(model=default_gguf())
    rows = []
    for args in (
        ["-p", ",".join(map(str, lengths)), "-n", "0"],
        ["-p", "0", "-n", str(steps), "-d", ",".join(map(str, lengths))],
    ):
        command = [
            build["binary"],
            "-m",
            str(default_gguf()),
            "-t",
            str(torch.get_num_threads()),
            "-r",
            "2",
            "-o",
            "json",
            "-fa",  # both: its default (auto) turns flash attention on, which is the slower one on some CPUs
            "0,1",
            *args,
        ]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        for r in json.loads(out):
            row = {"system": "llama.cpp", "cache": f"flash attention {'on' if r['flash_attn'] else 'off'}"}
            if r["n_prompt"]:
                rows.append({**row, "tokens": r["n_prompt"], "read_tok_s": round(r["avg_ts"], 1)})
            else:
                rows.append({**row, "tokens": r["n_depth"], "decode_ms": round(1000 / r["avg_ts"], 1)})
    built = {"build_s": build["build_s"], "version": build["version"], "amx": build.get("amx", "as -march=native")}
    return [{**r, **built} for r in rows]


def decode(
    engine: Engine,
    cache,
    steps: int,
    forced: list[int] | None,
    question: str = QUESTION,
    between: Callable[[], object] | None = None,
):
    """Greedy (or ``forced``) decoding after ``question``: (token ids, log-probs per step, seconds per step,
    where the steps' time went where they run in C++: :meth:`~semanticache_rag.fused.FusedLlama.timed_steps`,
    else ``{}``). ``between``: called, untimed, after every BANDWIDTH_EVERY steps."""
    tail = engine.tokenizer(engine.prompt.tail([Turn(question)]), add_special_tokens=False)["input_ids"]
    kv = ConversationKV(cache.layers)
    logits = engine.forward(kv, tail, cache.positions)[-1]
    ids, logprobs, times = [], [], []
    lean = getattr(engine.model, "semanticache_forward", None)
    with lean.timed_steps() if lean is not None else contextlib.nullcontext({}) as parts:
        for step in range(steps):
            logprobs.append(logits.float().log_softmax(-1))
            token = forced[step] if forced is not None else int(logits.argmax())
            ids.append(token)
            started = time.perf_counter()
            logits = engine.forward(kv, [token], cache.positions + len(tail) + step)[-1]
            times.append(time.perf_counter() - started)
            if between is not None and (step + 1) % BANDWIDTH_EVERY == 0:
                between()
    return ids, torch.stack(logprobs), times, parts


def greedy_decode(
    engine: Engine, cache, steps: int, question: str = QUESTION, between: Callable[[], object] | None = None
):
    """Greedy decoding as an answer runs it (:meth:`~semanticache_rag.engine.Engine.greedy`, calls of
    :data:`~semanticache_rag.conversation.GREEDY_RUN` steps; no logits reach Python), ``steps`` steps timed: the
    tokens (as :func:`decode`'s: the first chosen after the question, then each step's), seconds a step (each call's
    mean, once for each of its steps), and where the timed steps' time went (as :func:`decode`). Before each call
    ``between`` and one more step, untimed: the first step after the bandwidth's 512 MiB sum takes ~1.5x the rest,
    and :func:`decode`'s median leaves it out, where a call's mean would not (so the timed steps sit a few tokens
    deeper than :func:`decode`'s)."""
    tail = engine.tokenizer(engine.prompt.tail([Turn(question)]), add_special_tokens=False)["input_ids"]
    kv = ConversationKV(cache.layers)
    ids = [int(engine.forward(kv, tail, cache.positions)[-1].argmax())]
    position, times, totals = cache.positions + len(tail), [], {}
    lean = getattr(engine.model, "semanticache_forward", None)
    for start in range(0, steps, GREEDY_RUN):
        count = min(GREEDY_RUN, steps - start)
        if between is not None:
            between()
        ids += engine.greedy(kv, ids[-1], position + len(ids) - 1)
        with lean.timed_steps() if lean is not None else contextlib.nullcontext({}) as parts:
            started = time.perf_counter()
            ids += engine.greedy(kv, ids[-1], position + len(ids) - 1, count)
            times += [(time.perf_counter() - started) / count] * count
        for key, value in parts.items():
            totals[key] = totals.get(key, 0) + (value if key == "steps" else value * parts["steps"])
    parts = {key: value if key == "steps" else round(value / totals["steps"], 3) for key, value in totals.items()}
    return ids[:steps], times, parts


def ours(lengths: list[int], steps: int, formats: list[str]) -> list[dict]:
    rows, reference = [], {}
    sample = bandwidth_sample()  # the bandwidth's 512 MiB, allocated once
    for weights in formats:  # "model" first: its full cache is the reference of every KL
        engine = Engine.from_pretrained(weights=weights)
        step_weights = weight_bytes(engine.model)
        # rows of weights="auto" are labelled with the format it resolved to (model.semanticache_weights)
        label = f"auto: {getattr(engine.model, 'semanticache_weights', 'model')}" if weights == "auto" else weights
        for tokens in lengths:
            prefill = engine.prefill(real_document(engine.tokenizer, tokens), progress=False, surprisal=True)
            for name, compression, ratio in CACHES:
                cache = engine.compress(prefill, make_compressor(compression, ratio))
                # Each cell's floor from the bandwidth measured among its own steps (before the first and
                # after every BANDWIDTH_EVERY-th, the median): on a shared machine it moves between 27 and 53
                # GB/s within a run, and one measurement per format and length put cells decoded a minute
                # later against a bandwidth they did not have.
                samples = [read_bandwidth(sample)]
                between = lambda samples=samples: samples.append(read_bandwidth(sample))  # noqa: E731
                # the KL from steps with their logits (the reference's tokens fed); the time from greedy runs
                ids, logprobs, forward_times, _ = decode(
                    engine, cache, steps, reference.get(tokens, (None,))[0], between=between
                )
                _, times, parts = greedy_decode(engine, cache, steps, between=between)
                bandwidth = statistics.median(samples)
                if weights == "model" and compression == "none":
                    reference[tokens] = (ids, logprobs)
                want = reference[tokens][1]
                kl = (want.exp() * (want - logprobs)).sum(-1)
                step_bytes = step_weights + cache.nbytes
                row = {
                    "system": "ours",
                    "weights": label,
                    "cache": name,
                    "tokens": tokens,
                    "context_tokens": cache.length,
                    "read_tok_s": round(cache.length / prefill.seconds, 1),
                    "compress_s": round(cache.compress_s, 2),
                    "compress_share": round(cache.compress_s / prefill.seconds, 3),
                    "decode_ms": round(1000 * statistics.median(times), 1),
                    "forward_ms": round(1000 * statistics.median(forward_times), 1),
                    "step_mib": round(step_bytes / 2**20, 1),
                    "floor_ms": round(1000 * step_bytes / bandwidth, 1),
                    "weights_floor_ms": round(1000 * step_weights / bandwidth, 1),
                    "bandwidth_gb_s": round(bandwidth / 1e9, 1),
                    "bandwidth_samples_gb_s": [round(b / 1e9, 1) for b in samples],
                    "kl_to_fp32_full": round(float(kl.mean()), 5),
                }
                if parts:  # the C++ step's parts (means), and the rest of a step's mean: Python's
                    row["parts_ms"] = {k: v for k, v in parts.items() if k != "steps"}
                    row["parts_ms"]["python"] = round(1000 * statistics.mean(times) - parts["step"], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
        del engine
    return rows


MEMORY_CACHES = (("none", None), ("fp16", None), ("semanticache", 0.75), ("kaizen", 0.75), ("auto", 0.9))


def peak_read(compression: str, ratio: float | None, weights: str, tokens: int) -> dict:
    """In this process: RSS growth during one read of a ``tokens``-token document (Linux: the peak, VmHWM,
    is reset right before the read, after a warm-up read, so only the read's own memory counts)."""
    import gc

    compressor = None if compression == "none" else make_compressor(compression, ratio)
    engine = Engine.from_pretrained(compressor=compressor, weights=weights)
    text = real_document(engine.tokenizer, tokens)
    engine.read(real_document(engine.tokenizer, 600), progress=False)
    gc.collect()

    def status(key: str) -> int:
        return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0]) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    cache = engine.read(text, progress=False)
    return {
        "weights": weights,
        "compression": compression,
        "ratio": ratio,
        "tokens": tokens,
        "read_adds_mib": round((status("VmHWM") - before) / 2**20),
        "cache_mib": round(cache.nbytes / 2**20),
    }


def memory_rows(weights: list[str], tokens: int) -> list[dict]:
    """:func:`peak_read` of each :data:`MEMORY_CACHES` entry, each in a fresh process."""
    import sys

    rows = []
    for fmt in weights:
        for compression, ratio in MEMORY_CACHES:
            command = [
                sys.executable,
                "-m",
                "benchmarks.speed",
                "--peak-read",
                compression,
                str(ratio),
                fmt,
                str(tokens),
            ]
            # glibc then maps every block of 128 KiB or more on its own and unmaps it when freed, so the peak
            # RSS is the peak of live memory, not what the heap kept from the warm-up read (+-30 MiB otherwise)
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def memory_table(rows: list[dict]) -> str:
    lines = ["| weights | cache | read adds (MiB) | cache (MiB) |", "|---|---|---|---|"]
    for r in rows:
        name = r["compression"] if r["ratio"] is None else f"{r['compression']} {r['ratio']}"
        lines.append(f"| {r['weights']} | {name} | {r['read_adds_mib']} | {r['cache_mib']} |")
    return "\n".join(lines)


def table(rows: list[dict], lengths: list[int]) -> str:
    """Decode ms/token (floor) per length, one line per system and cache; then read speeds."""
    head = ["system", *[f"{t} tokens" for t in lengths], "KL to fp32 full", "compress / read (max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cell = {(r["system"], r.get("weights"), r.get("cache"), r["tokens"]): r for r in rows if "decode_ms" in r}
    keys = dict.fromkeys((r["system"], r.get("weights"), r.get("cache")) for r in rows if "decode_ms" in r)
    for key in keys:
        found = [cell.get((*key, t)) for t in lengths]
        decode = [f"{r['decode_ms']}" + (f" ({r['floor_ms']})" if "floor_ms" in r else "") if r else "" for r in found]
        kls = [r["kl_to_fp32_full"] for r in found if r and "kl_to_fp32_full" in r]
        shares = [r["compress_share"] for r in found if r and "compress_share" in r]
        name = f"ours, {key[1]} weights, {key[2]}"
        if key[0] == "llama.cpp":  # key[2]: flash attention on or off (older runs: not recorded)
            name = "llama.cpp, Q4_1 GGUF" + (f", {key[2]}" if key[2] else "")
        if any(r and r.get("amx") == "off" for r in found):
            name += " (built without AMX)"
        kl = f"{statistics.mean(kls):.4f}" if kls else ""
        share = f"{max(shares):.0%}" if shares and key[2] != "full" else ""
        lines.append(f"| {name} | " + " | ".join(decode) + f" | {kl} | {share} |")
    reads = {}
    for r in rows:
        if "read_tok_s" in r and (r["system"] == "llama.cpp" or r["cache"] == "full"):
            if r["system"] == "llama.cpp":
                name = "llama.cpp" + (f", {r['cache']}" if r.get("cache") else "")
            else:
                name = f"ours, {r['weights']} weights"
            reads.setdefault(name, {})[r["tokens"]] = r["read_tok_s"]
    for name, speeds in reads.items():
        lines.append(f"| read tok/s: {name} | " + " | ".join(str(speeds.get(t, "")) for t in lengths) + " | | |")
    return "\n".join(lines)


PARTS = ("attention", "products", "head", "other", "python")


def parts_table(rows: list[dict]) -> str:
    """Where the steps of each cell timed in parts go (means, ms): the layers' attention, the rest of the
    layers (the weight products and the row operations between them), the head, the C++ call's own rest,
    Python's; with the cell's floor (ms at the measured bandwidth) and what the weights alone would take."""
    timed = [r for r in rows if "parts_ms" in r]
    if not timed:
        return ""
    head = ["weights", "cache", "tokens", "step (mean)", *PARTS, "floor", "floor of weights", "step with logits"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in timed:
        p = r["parts_ms"]
        cells = [r["weights"], r["cache"], r["tokens"], round(p["step"] + p["python"], 2)]
        cells += [round(p[k], 2) for k in PARTS] + [
            r["floor_ms"],
            r.get("weights_floor_ms", ""),
            r.get("forward_ms", ""),
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot_parts(rows: list[dict], path: Path) -> None:
    """Stacked bars of :func:`parts_table`, one per timed cell, its floor as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "parts_ms" in r]
    if not timed:
        return
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(timed) + 1.5))
    labels = [f"{r['weights']}, {r['cache']}, {r['tokens']}" for r in timed]
    left = [0.0] * len(timed)
    for part in PARTS:
        widths = [r["parts_ms"][part] for r in timed]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.scatter([r["floor_ms"] for r in timed], labels, color="black", marker="|", s=200, label="floor", zorder=3)
    ax.invert_yaxis()
    ax.set_xlabel("ms a decoding step (mean, 2 threads)")
    ax.legend(fontsize=7, ncol=6, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    llama_rows = [r for r in rows if r["system"] == "llama.cpp" and "decode_ms" in r]
    for setting in dict.fromkeys(r.get("cache") for r in llama_rows):  # flash attention on / off (older: None)
        llama = sorted((r["tokens"], r["decode_ms"]) for r in llama_rows if r.get("cache") == setting)
        style = "--" if setting != "flash attention on" else "-."
        label = "llama.cpp (Q4_1)" + (f", {setting}" if setting else "")
        ax.plot(*zip(*llama), color="black", linestyle=style, marker="s", label=label)
    for key in dict.fromkeys((r["weights"], r["cache"]) for r in rows if r["system"] == "ours"):
        points = sorted(
            (r["tokens"], r["decode_ms"]) for r in rows if r["system"] == "ours" and (r["weights"], r["cache"]) == key
        )
        ax.plot(*zip(*points), marker="o", linestyle="-" if key[0] != "model" else ":", label=f"{key[0]}, {key[1]}")
    ax.set_xlabel("document tokens in context")
    ax.set_ylabel("decode ms / token (2 threads)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 7000])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--weights", nargs="+", default=["model", "fp16", "int4", "int4-exact"])
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: %(default)s)")
    parser.add_argument("--memory-only", action="store_true", help="only the peak memory of reads (longest length)")
    parser.add_argument("--speed-only", action="store_true", help="skip the peak memory of reads")
    parser.add_argument("--peak-read", nargs=4, help=argparse.SUPPRESS)  # one measurement, in a child process
    args = parser.parse_args()
    if args.peak_read:
        compression, ratio, fmt, tokens = args.peak_read
        print(json.dumps(peak_read(compression, None if ratio == "None" else float(ratio), fmt, int(tokens))))
        return
    if args.weights[0] != "model":
        parser.error("--weights must start with 'model': its full cache is the reference of the KL")
    started = time.perf_counter()
    results = args.out
    results.mkdir(parents=True, exist_ok=True)
    if args.memory_only and args.speed_only:
        parser.error("--memory-only and --speed-only exclude each other")
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # it slows every large allocation: timings would not be the usual ones
        parser.error("unset MALLOC_MMAP_THRESHOLD_: the memory rows set it in their own processes")
    memory = [] if args.speed_only else memory_rows(args.weights, max(args.lengths))
    if memory:
        (results / "memory.json").write_text(json.dumps(memory, indent=1) + "\n")
        (results / "memory.md").write_text(
            "# Peak memory of one read\n\n"
            f"`python -m benchmarks.speed --memory-only --lengths {max(args.lengths)}`: how much the "
            "process's peak RSS grows during one read of the document (after a warm-up read; VmHWM reset before it; "
            "glibc mapping each block of 128 KiB or more on its own, MALLOC_MMAP_THRESHOLD_=131072).\n\n"
            + memory_table(memory)
            + f"\n\n{environment(started)}\n"
        )
    if args.memory_only:
        print(memory_table(memory))
        return
    rows = [] if args.no_llama_cpp else llama_cpp(args.lengths, args.steps)
    rows += ours(args.lengths, args.steps, args.weights)
    bandwidths = [r["bandwidth_gb_s"] for r in rows if "bandwidth_gb_s" in r]
    (results / "speed.json").write_text(
        json.dumps({"read_bandwidth_gb_s": [min(bandwidths), max(bandwidths)], "rows": rows}, indent=1) + "\n"
    )
    plot(rows, results / "speed.png")
    plot_parts(rows, results / "parts.png")
    parts = parts_table(rows)
    text = (
        "# Speed on CPUs\n\n"
        f"`python -m benchmarks.speed --lengths {' '.join(map(str, args.lengths))} --steps {args.steps} --weights "
        f"{' '.join(args.weights)}`; measured read bandwidth {min(bandwidths):.1f}-{max(bandwidths):.1f} GB/s (floor = "
        f"bytes a step reads / the median of the bandwidth measured before a cell's first step and after every "
        f"{BANDWIDTH_EVERY}th).\n\n"
        + table(rows, args.lengths)
        + (
            "\n\nWhere the steps that run in one C++ call (int4 weights) go, ms (means; `parts.png`):\n\n" + parts
            if parts
            else ""
        )
        + f"\n\n{environment(started)}\n"
    )
    (results / "speed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
