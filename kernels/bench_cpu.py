"""Time the CPU attention kernel against its torch twin, per storage, at the default model's shapes.

    python -m semanticache_rag.kernels.bench_cpu [--tokens 2000 4000 7000] [--storage fp32 fp16 int4]
        [--layers 30] [--kv-heads 3] [--group 3] [--dim 64] [--threads 2] [--json results.json]

One decoding step's attention over a whole model: ``--layers`` document layers of ``--tokens``
entries (each layer its own tensors, so they come from memory, not from cache, as in a real step),
keys and values stored as ``--storage``, a ``log s`` bias and 16 appended tokens. For each: the
kernel's and the twin's time (median of ``--repeats``), the bytes the document occupies (codes,
scales, minimums, bias), those bytes per second, and the floor: bytes / this machine's read
bandwidth, measured here first (``torch.sum`` of 512 MiB in huge pages with the same threads). ``x floor`` is
time / floor: 1.0 would be a kernel that only waits for memory.

``arithmetic ms`` is the same step's time with the document in cache: the kernel's time per entry on one
layer small enough for the threads' L2 caches (the slope between two lengths, so that a call's fixed cost
drops out), times the entries. A kernel whose loads and arithmetic overlap takes about max(floor,
arithmetic); one where they add up takes floor + arithmetic. ``overlap`` is where the kernel lies between
the two: 1 fully overlapped, 0 added up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from semanticache_rag.kernels import cpu_ops, decode_attention_ref

STORAGES = ("fp32", "fp16", "bf16", "int8", "int4", "int3")
APPENDED = 16


@dataclass
class Row:
    """The attention of one step over every layer, for one storage and length."""

    storage: str
    tokens: int
    mbytes: float
    kernel_ms: float
    twin_ms: float
    kernel_gbps: float
    floor_ms: float
    arithmetic_ms: float

    @property
    def x_floor(self) -> float:
        return self.kernel_ms / self.floor_ms

    @property
    def overlap(self) -> float:
        """1: the kernel takes max(floor, arithmetic); 0: floor + arithmetic."""
        added, overlapped = self.floor_ms + self.arithmetic_ms, max(self.floor_ms, self.arithmetic_ms)
        return (added - self.kernel_ms) / (added - overlapped) if added > overlapped else float("nan")


def bandwidth_sample() -> torch.Tensor:
    """512 MiB of fp32 ones in a block advised for transparent huge pages (:func:`~semanticache_rag.huge_pages.block`),
    as the weights a decoding step streams are kept: in 4 KiB pages the same sum read 20.3-21.1 GB/s where it read
    25.8-26.3 in huge pages (a 2-core Intel Xeon, 2 threads; the hardware prefetchers start over at every page), so
    a floor from ordinary pages let a product of weights in huge pages run under its floor."""
    from semanticache_rag import huge_pages

    count = 128 * 1024 * 1024
    return huge_pages.block(4 * count).view(torch.float32).fill_(1.0)


def read_bandwidth(data: torch.Tensor | None = None) -> float:
    """Bytes per second one ``sum`` over 512 MiB in huge pages (:func:`bandwidth_sample`; or over ``data``, fp32,
    to sample again without allocating) reads, median of 7."""
    if data is None:
        data = bandwidth_sample()
        data.sum()
    return data.numel() * data.element_size() / _median_seconds(data.sum, 7)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def stored(x: torch.Tensor, storage: str, group_size: int = 32) -> tuple:
    """``x`` (H, L, D) as the operator takes it: (data, scales, minimums, bits)."""
    from semanticache_rag.tensor_codes import QuantizedTensor

    if storage == "fp32":
        return x, None, None, 32
    if storage in ("fp16", "bf16"):
        return x.to(torch.float16 if storage == "fp16" else torch.bfloat16), None, None, 16
    code = QuantizedTensor.encode(x[None], int(storage[3:]), min(group_size, x.shape[-1]))
    return code.codes[0], code.scales[0], code.minimums[0], int(storage[3:])


def layer_inputs(kv_heads: int, group: int, dim: int, tokens: int, storage: str, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(kv_heads, group, dim, generator=g) * dim**-0.5
    keys, values = torch.randn(2, kv_heads, tokens, dim, generator=g)
    bias = torch.randint(1, 5, (kv_heads, tokens), generator=g).float().log()
    new = torch.randn(2, kv_heads, APPENDED, dim, generator=g)
    return (query, *stored(keys, storage), *stored(values, storage), bias, new[0], new[1])


def nbytes(args: tuple) -> int:
    """Bytes of the document side: stored keys and values, their scales and minimums, the bias."""
    return sum(t.numel() * t.element_size() for t in (*args[1:4], *args[5:8], args[9]) if t is not None)


def cached_seconds_per_entry(storage: str, group: int, dim: int, repeats: int) -> float:
    """The kernel's seconds per document entry when the entries are in cache, shared by torch's threads: on
    one thread, one kv head's layer of ~240 KiB (within an L2 cache) and one of a fifth of that, called 100
    times each; the slope between the two (so that a call's fixed cost drops out), divided by the threads
    (each has its own arithmetic units)."""
    per_entry = nbytes(layer_inputs(1, group, dim, 64, storage, seed=0)) / 64
    long = max(80, min(4096, int(240 * 1024 / per_entry)))
    threads, seconds = torch.get_num_threads(), []
    torch.set_num_threads(1)
    try:
        for tokens in (long // 5, long):
            args = layer_inputs(1, group, dim, tokens, storage, seed=0)

            def calls(args=args) -> None:
                for _ in range(100):
                    cpu_ops.decode_attention(*args)

            calls()
            seconds.append(min(_median_seconds(calls, 3) for _ in range(max(1, repeats // 5))) / 100)
    finally:
        torch.set_num_threads(threads)
    return max(0.0, (seconds[1] - seconds[0]) / (long - long // 5) / threads)


def measure(storage: str, tokens: int, layers: int, kv_heads: int, group: int, dim: int, repeats: int,
            bandwidth: float) -> Row:  # fmt: skip
    every = [layer_inputs(kv_heads, group, dim, tokens, storage, seed) for seed in range(layers)]

    def step(attend) -> None:
        for args in every:
            attend(*args)

    kernel = _median_seconds(lambda: step(cpu_ops.decode_attention), repeats)
    twin = _median_seconds(lambda: step(decode_attention_ref.decode_attention), max(3, repeats // 3))
    total = sum(nbytes(args) for args in every)
    arithmetic = cached_seconds_per_entry(storage, group, dim, repeats) * layers * kv_heads * tokens
    return Row(storage, tokens, total / 1e6, kernel * 1e3, twin * 1e3, total / kernel / 1e9, total / bandwidth * 1e3,
               arithmetic * 1e3)  # fmt: skip


def markdown(rows: list[Row], bandwidth: float, shape: str, argv: list[str] | None) -> str:
    """The rows as a table, with the command, the shapes, the bandwidth and the machine."""
    import platform
    import sys

    command = " ".join(["python -m semanticache_rag.kernels.bench_cpu", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# The CPU decode kernel against its torch twin",
        "",
        f"`{command}`: one step's attention over {shape}, plus {APPENDED} appended tokens; "
        f"{torch.get_num_threads()} threads, read bandwidth {bandwidth / 1e9:.1f} GB/s "
        "(floor = the document's bytes / that); median times.",
        "",
        "| storage | tokens | MB read | kernel ms | torch twin ms | kernel GB/s | x floor | arithmetic ms | "
        "floor + arithmetic ms | overlap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.storage} | {r.tokens} | {r.mbytes:.1f} | {r.kernel_ms:.2f} | {r.twin_ms:.2f} | "
                     f"{r.kernel_gbps:.1f} | {r.x_floor:.2f} | {r.arithmetic_ms:.2f} | "
                     f"{r.floor_ms + r.arithmetic_ms:.2f} | {r.overlap:.2f} |")  # fmt: skip
    lines += ["", f"Environment: {platform.machine()}, torch {torch.__version__}, Python {platform.python_version()}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 4000, 7000])
    parser.add_argument("--storage", nargs="+", choices=STORAGES, default=list(STORAGES))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per kv head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--markdown", default=None, help="and a table here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_ops.supports(args.dim, args.group):
        parser.error(f"the kernel takes head dims {cpu_ops.DIMS} and groups up to 16")
    if not cpu_ops.available():
        print("the CPU attention kernel did not build here (see the warning); nothing to time")
        return 1
    bandwidth = read_bandwidth()
    shape = f"{args.layers} layers x {args.kv_heads} kv heads x {args.group} query heads each, head dim {args.dim}"
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads; {shape}")
    print(f"{'storage':>8} {'tokens':>7} {'MB':>7} {'kernel ms':>10} {'twin ms':>8} {'GB/s':>6} {'x floor':>8} "
          f"{'arith ms':>9} {'overlap':>8}")  # fmt: skip
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            for storage in args.storage:
                row = measure(
                    storage, tokens, args.layers, args.kv_heads, args.group, args.dim, args.repeats, bandwidth
                )
                rows.append(row)
                print(f"{row.storage:>8} {row.tokens:>7} {row.mbytes:>7.1f} {row.kernel_ms:>10.2f} "
                      f"{row.twin_ms:>8.2f} {row.kernel_gbps:>6.1f} {row.x_floor:>8.2f} "
                      f"{row.arithmetic_ms:>9.2f} {row.overlap:>8.2f}")  # fmt: skip
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, bandwidth, shape, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_gbps": bandwidth / 1e9, "threads": torch.get_num_threads(),
                       "rows": [{**asdict(r), "x_floor": r.x_floor, "overlap": r.overlap} for r in rows]},
                      f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
