"""The C++ twin of :mod:`.decode_attention_ref`, built on first use for this machine's CPU.

``torch.ops.semanticache.decode_attention`` has the torch twin's signature. Its schema is defined
here, in Python, with the torch twin as the default implementation, so the operator exists (and
TorchScript can call it) everywhere; :func:`available` then builds ``decode_attention_cpu.cpp``
with ``torch.utils.cpp_extension`` (``-O3 -march=native``, ~15-30 s, once per machine, torch and
source version: the library is kept under :func:`~semanticache_rag.models.home_dir` ``/kernels``) and
loads it, which registers the one-pass kernel for CPU tensors. Where that fails (no C++ compiler,
no ninja), decoding keeps the torch ops and a warning says why, once.

Set ``SEMANTICACHE_CPU_KERNEL=0`` to keep the torch ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

from semanticache_rag.kernels import decode_attention_ref

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention_cpu.cpp")
# -march=native: the library is built on, and for, the machine that runs it (its CPU is in the key).
# No -ffast-math: the kernel's exp rounds with an add-and-subtract that reassociation would fold away,
# and padding is masked with -inf; its sums are vectorised by hand.
FLAGS = (
    "-O3",
    "-fopenmp",  # at::parallel_for runs on OpenMP (torch's own runtime); without it, one thread
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    "-fno-trapping-math",
)
SCHEMA = (
    "decode_attention(Tensor query, Tensor keys, Tensor? key_scales, Tensor? key_minimums, int key_bits, "
    "Tensor values, Tensor? value_scales, Tensor? value_minimums, int value_bits, Tensor? bias, "
    "Tensor new_keys, Tensor new_values) -> Tensor"
)
#: head dims the kernel is built for (others keep the torch ops)
DIMS = (16, 32, 64, 128, 256)


@functools.cache
def define() -> torch.library.Library:
    """The ``semanticache`` operator library, with ``decode_attention``'s schema and the torch twin
    as its implementation on every device (the C++ kernel, once loaded, takes CPU tensors)."""
    library = torch.library.Library("semanticache", "DEF")
    library.define(SCHEMA)
    library.impl("decode_attention", decode_attention_ref.decode_attention, "CompositeExplicitAutograd")
    return library


def _cpu_identity() -> str:
    """What the compiled library depends on: the CPU's model and flags (-march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    except OSError:
        lines = []
    return "\n".join(lines) or platform.processor() or platform.machine()


def _library_name() -> str:
    key = "\n".join([SOURCE.read_text(), " ".join(FLAGS), torch.__version__, sys.version, _cpu_identity()])
    return "semanticache_decode_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build() -> None:
    """Compile (or find compiled) and load the C++ kernel; raises whatever the build raises."""
    from torch.utils import cpp_extension

    from semanticache_rag.models import home_dir

    name = _library_name()
    directory = home_dir() / "kernels" / name
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{name}.so").exists():
        logger.warning("building the CPU attention kernel for this machine (once, ~15-30 s) in %s", directory)
    # cpp_extension locks the directory while it builds (other processes wait) and rebuilds a stale library
    cpp_extension.load(
        name, [str(SOURCE)], extra_cflags=list(FLAGS), build_directory=str(directory), is_python_module=False
    )


@functools.cache
def available() -> bool:
    """Whether the C++ kernel is loaded (built at the first call); ``False`` keeps the torch twin."""
    define()
    if os.environ.get("SEMANTICACHE_CPU_KERNEL", "1") == "0":
        return False
    try:
        _build()
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch ops still work
        reason = f"{exc}".strip().splitlines()[-1] if f"{exc}".strip() else type(exc).__name__
        logger.warning(
            "CPU attention kernel not built (%s); decoding uses torch's ops, which are slower. Install a C++ "
            "compiler and ninja (pip install ninja) to build it.",
            reason,
        )
        return False
    return True


def supports(dim: int, group: int) -> bool:
    """Whether the kernel takes heads of ``dim`` channels, ``group`` query heads per kv head."""
    return dim in DIMS and group <= 16


def decode_attention(*args: object) -> torch.Tensor:
    """The operator (C++ on CPU tensors once :func:`available`, else the torch twin); the twin's signature."""
    define()
    return torch.ops.semanticache.decode_attention(*args)
