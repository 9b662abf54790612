"""Tables, plots and environment notes shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path


def environment(started: float) -> str:
    """One markdown line saying where and how long the benchmark ran."""
    import torch
    import transformers

    # the vector instructions torch's CPU kernels run with (AVX2, AVX512, ...): speeds differ by them
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"Environment: {platform.machine()} CPU ({capability}), {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}; "
        f"ran {time.perf_counter() - started:.0f} s."
    )


def mean_of(key: str, fmt: str):
    """A table metric: the mean of ``key`` over a group's rows that have it."""

    def cell(group: list[dict]) -> str:
        values = [r[key] for r in group if r.get(key) is not None]
        return fmt.format(statistics.mean(values)) if values else ""

    return cell


def bootstrap_interval(scores: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean of ``scores`` by the percentile bootstrap over questions."""
    import random

    if not scores:
        raise ValueError("no scores to bootstrap")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(scores, k=len(scores))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def interval_cell(group: list[dict]) -> str:
    """A table metric: the 95% bootstrap interval of the group's mean score, in %."""
    low, high = bootstrap_interval([r["score"] for r in group])
    return f"{100 * low:.0f}–{100 * high:.0f}"


QUESTIONS_AND_INTERVAL = [("questions", lambda g: str(len(g))), ("95% CI", interval_cell)]

NIAH_METRICS = [
    ("KV bytes", lambda g: f"{statistics.mean(r['kv_bytes'] / r['full_kv_bytes'] for r in g):.1%}"),
    ("compress s", mean_of("compress_s", "{:.2f}")),
    ("decode ms/tok", mean_of("decode_ms_per_token", "{:.0f}")),
]


def markdown_table(rows: list[dict], columns: list[str], metrics=None) -> str:
    """Mean score (%) per method x ratio, one column per value of ``columns``, then ``metrics``."""
    metrics = NIAH_METRICS if metrics is None else metrics
    keys = sorted({tuple(r[c] for c in columns) for r in rows})
    groups = defaultdict(list)
    for r in rows:
        groups[(r["method"], r["ratio"])].append(r)
    head = ["method", "ratio", *[" ".join(map(str, k)) for k in keys], "mean", *[name for name, _ in metrics]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (method, ratio), group in sorted(groups.items(), key=lambda g: (g[0][1], g[0][0])):
        cells = [method, f"{ratio:.2f}"]
        for k in keys:
            scores = [r["score"] for r in group if tuple(r[c] for c in columns) == k]
            cells.append(f"{100 * statistics.mean(scores):.0f}" if scores else "")
        cells.append(f"**{100 * statistics.mean(r['score'] for r in group):.0f}**")
        cells += [fn(group) for _, fn in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def score_vs_ratio_plot(rows: list[dict], path: Path, title: str) -> None:
    """Mean score against compression ratio, one line per method (the full cache as a dashed line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in rows}):
        ratios = sorted({r["ratio"] for r in rows if r["method"] == method})
        means = [
            100 * statistics.mean(r["score"] for r in rows if (r["method"], r["ratio"]) == (method, x)) for x in ratios
        ]
        if method == "full":
            ax.axhline(means[0], color="black", linestyle="--", label="full cache")
        else:
            ax.plot(ratios, means, marker="o", label=method)
    ax.set_xlabel("compression ratio (fraction of KV entries removed)")
    ax.set_ylabel("score (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heatmap(rows: list[dict], path: Path) -> None:
    """Score per (haystack tokens, depth) for each method x ratio, as a PNG grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["method"], r["ratio"]) for r in rows}, key=lambda c: (c[1], c[0]))
    lengths, depths = sorted({r["tokens"] for r in rows}), sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(2.2 * len(configs), 2.8), squeeze=False)
    for ax, (method, ratio) in zip(axes[0], configs):
        grid = [
            [
                statistics.mean(
                    r["score"]
                    for r in rows
                    if (r["method"], r["ratio"], r["tokens"], r["depth"]) == (method, ratio, n, d)
                )
                for n in lengths
            ]
            for d in depths
        ]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(f"{method}\nratio {ratio}", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1000}K" for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=7)
    axes[0][0].set_ylabel("needle depth")
    fig.supxlabel("haystack tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
