"""Time two versions of the CPU attention kernel in one process, alternating, at the default model's shapes.

    python -m semanticache_rag.kernels.ab_cpu [--base HEAD] [--tokens 4000] [--storage fp32 int8 int4]
        [--rounds 6] [--in-cache] [--q8]

On a shared machine the memory bandwidth moves by tens of percent between runs (and between processes
a minute apart), so two builds timed in turn are compared in one process: ``--base`` (a git revision's
``kernels/decode_attention_cpu.cpp`` with the headers it includes from ``kernels/``) and this checkout's are
each built as a library of their own,
under an operator namespace of their own (``ab_base``, ``ab_work``), and each round times one step of
each: ``--layers`` document layers of ``--tokens`` entries (as :mod:`.bench_cpu` builds them), the
median of 5 calls. The table gives each build's median over the rounds and the largest difference
between their outputs. ``--in-cache``: one layer of 1,000 entries on one thread, called 50 times a
timing, in ns per entry (the arithmetic alone). ``--q8``: both called with ``q8_query`` on (``weights="int4"``'s
arithmetic; the base revision must have the argument).
"""

from __future__ import annotations

import argparse
import ast
import re
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

from semanticache_rag.kernels import cpu_ops
from semanticache_rag.kernels.bench_cpu import STORAGES, _median_seconds, layer_inputs
from semanticache_rag.models import home_dir

SOURCE = Path(__file__).with_name("decode_attention_cpu.cpp")
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.h)"', re.MULTILINE)


def with_headers(source: str, read: Callable[[str], str]) -> dict[str, str]:
    """The kernel's source and every header it includes from its folder (and they include), by file name;
    ``read(name)`` gives a header's text."""
    files = {"kernel.cpp": source}
    pending = _INCLUDE.findall(source)
    while pending:
        name = pending.pop()
        if name not in files:
            files[name] = read(name)
            pending.extend(_INCLUDE.findall(files[name]))
    return files


def build(
    tag: str,
    files: dict[str, str],
    schema: str = cpu_ops.SCHEMAS["decode_attention"][0],
    flags: tuple[str, ...] = cpu_ops.FLAGS,
) -> tuple[torch.library.Library, Callable[..., torch.Tensor]]:
    """The attention kernel (``files``: from :func:`with_headers`; ``schema``: its operator's, as that
    version of ``cpu_ops.py`` defines it) built with its namespace renamed to ``tag``: the library object
    (keep it alive) and the operator ``torch.ops.<tag>.decode_attention``. ``flags``: the compiler's
    (the library's by default; timings mean nothing under others)."""
    directory = home_dir() / "kernels" / "ab" / tag
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():  # side by side: the includes find the headers beside kernel.cpp
        (directory / name).write_text(text.replace("semanticache", tag))
    library = torch.library.Library(tag, "DEF")
    library.define(schema)
    cpp_extension.load(
        f"ab_{tag}",
        [str(directory / "kernel.cpp")],
        extra_cflags=list(flags),
        build_directory=str(directory),
        is_python_module=False,
    )
    return library, getattr(torch.ops, tag).decode_attention


def _show(revision: str, name: str) -> str:
    """A file of the kernels' folder at a git revision of this checkout."""
    root = SOURCE.resolve().parent.parent
    path = f"{SOURCE.resolve().parent.relative_to(root).as_posix()}/{name}"
    try:
        return subprocess.run(
            ["git", "-C", str(root), "show", f"{revision}:{path}"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"cannot read {path} at {revision!r} (is this a git checkout?): {exc}") from exc


def base_files(revision: str) -> dict[str, str]:
    """The kernel's source and headers at a git revision of this checkout."""
    return with_headers(_show(revision, SOURCE.name), lambda name: _show(revision, name))


def base_schema(revision: str) -> str:
    """The operator's schema at a git revision (its arguments change with the kernel's)."""
    return schema_of(_show(revision, "cpu_ops.py"))


def schema_of(source: str) -> str:
    """The ``decode_attention`` schema that a version of ``kernels/cpu_ops.py`` defines (in ``SCHEMAS``)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "decode_attention" and isinstance(value, ast.Tuple):
                    first = value.elts[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        return first.value
    raise SystemExit("no decode_attention schema in that version of kernels/cpu_ops.py")


def work_files() -> dict[str, str]:
    """This checkout's kernel source and headers."""
    return with_headers(SOURCE.read_text(), lambda name: SOURCE.with_name(name).read_text())


def step_seconds(op: Callable[..., torch.Tensor], layers: list[tuple], repeats: int) -> float:
    """The median time of `repeats` steps, each ``op`` over every layer's arguments."""
    return _median_seconds(lambda: [op(*args) for args in layers], repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the kernel to compare against")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--storage", nargs="+", choices=STORAGES, default=["fp32", "int8", "int4"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--in-cache", action="store_true", help="ns per entry on one thread, in cache")
    parser.add_argument("--q8", action="store_true", help='q8_query on (weights="int4"\'s arithmetic), both builds')
    args = parser.parse_args(argv)
    builds = {
        "base": build("ab_base", base_files(args.base), base_schema(args.base)),
        "work": build("ab_work", work_files()),
    }
    if args.in_cache:
        torch.set_num_threads(1)
    unit = "ns/entry (1 thread, in cache)" if args.in_cache else f"ms a step ({torch.get_num_threads()} threads)"
    print(f"{args.base} against this checkout; {unit}")
    print(f"{'storage':>8} {'tokens':>7} {'base':>8} {'work':>8} {'work/base':>10} {'max diff':>9}")
    with torch.inference_mode():
        for storage in args.storage:
            if args.in_cache:
                layers, repeats, scale = [layer_inputs(3, 3, 64, 1000, storage, 0)] * 50, 3, 1e9 / (50 * 3000)
            else:
                layers = [layer_inputs(3, 3, 64, args.tokens, storage, seed) for seed in range(args.layers)]
                repeats, scale = 5, 1e3
            if args.q8:
                layers = [(*layer, True) for layer in layers]
            outputs = {name: [op(*a) for a in layers[:2]] for name, (_, op) in builds.items()}
            difference = max(float((x - y).abs().max()) for x, y in zip(outputs["base"], outputs["work"]))
            times: dict[str, list[float]] = {name: [] for name in builds}
            for _ in range(args.rounds):
                for name, (_, op) in builds.items():
                    times[name].append(scale * step_seconds(op, layers, repeats))
            base, work = (statistics.median(times[name]) for name in ("base", "work"))
            tokens = 1000 if args.in_cache else args.tokens
            print(f"{storage:>8} {tokens:>7} {base:>8.2f} {work:>8.2f} {work / base:>10.3f} {difference:>9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
