"""The C++ CPU operators, built on first use for this machine's CPU.

Each operator in :data:`SCHEMAS` (``torch.ops.semanticache.<name>``, :func:`op`) has the signature of
its torch twin: ``decode_attention`` (``decode_attention_cpu.cpp``) that of :mod:`.decode_attention_ref`,
``unpack_q4_1``, ``q4_1_product`` (``int4_weights_cpu.cpp``), ``q4_1_product_fp32``
(``int4_exact_weights_cpu.cpp``), ``q8_0_product``, ``q8_0_product_fp32`` and ``int8_row_product``
(``q8_0_weights_cpu.cpp``) and ``fp32_row_product`` (``fp32_weights_cpu.cpp``) those of :mod:`.int4_weights_ref`,
``greedy_seeds`` (``gsc_cpu.cpp``) that of :mod:`.gsc_ref`, ``rms_norm`` (``rms_norm_cpu.cpp``) that of
:mod:`.rms_norm_ref`. The operators' schemas are defined here, in
Python, with the torch twins as the default implementations, so the operators exist (and
TorchScript can call them) everywhere; :func:`available` then builds the C++ sources into one library
with ``torch.utils.cpp_extension`` (``-O3 -march=native``, ~2 minutes on 2 cores, once per machine, torch and
source version: the library is kept under :func:`~semanticache_rag.models.home_dir` ``/kernels``, where
other versions' libraries are removed once unused for :data:`KEEP_DAYS` days beyond the
:data:`KEEP_BUILDS` most recently used) and loads it, which registers the C++ kernels for CPU tensors.
:func:`op` (and :func:`decode_attention`) build them at their first call. Where that fails (no C++ compiler, no
ninja), the torch twins run and a warning says why, once.

``decoder_step_cpu.cpp`` adds two classes, ``torch.classes.semanticache.Int4Layers`` and
``StepDocument``: an int4 or fp32 model's decoding step in one call (:mod:`semanticache_rag.fused`). They are C++
only, with no twin: without the library the scripted step runs instead.

Set ``SEMANTICACHE_CPU_KERNEL=0`` to keep the torch twins.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from semanticache_rag.kernels import decode_attention_ref, gsc_ref, int4_weights_ref, rms_norm_ref

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "decode_attention_cpu.cpp",
        "int4_weights_cpu.cpp",
        "int4_exact_weights_cpu.cpp",
        "q8_0_weights_cpu.cpp",
        "fp32_weights_cpu.cpp",
        "gsc_cpu.cpp",
        "rms_norm_cpu.cpp",
        "decoder_step_cpu.cpp",
    )
)
# declarations the sources share, and the attention kernel's parts (part of the library's key)
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
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
SCHEMAS = {
    "decode_attention": (
        "decode_attention(Tensor query, Tensor keys, Tensor? key_scales, Tensor? key_minimums, int key_bits, "
        "Tensor values, Tensor? value_scales, Tensor? value_minimums, int value_bits, Tensor? bias, "
        "Tensor new_keys, Tensor new_values, bool q8_query=False) -> Tensor",
        decode_attention_ref.decode_attention,
    ),
    "unpack_q4_1": (
        "unpack_q4_1(Tensor codes, Tensor scales, Tensor minimums) -> Tensor",
        int4_weights_ref.unpack_q4_1,
    ),
    "q4_1_product": (
        "q4_1_product(Tensor x, Tensor codes, Tensor scales, Tensor minimums) -> Tensor",
        int4_weights_ref.q4_1_product,
    ),
    "q4_1_product_fp32": (
        "q4_1_product_fp32(Tensor x, Tensor codes, Tensor scales, Tensor minimums) -> Tensor",
        int4_weights_ref.q4_1_product_fp32,
    ),
    "int8_row_product": (
        "int8_row_product(Tensor x, Tensor codes, Tensor scales) -> Tensor",
        int4_weights_ref.int8_row_product,
    ),
    "fp32_row_product": ("fp32_row_product(Tensor x, Tensor weight) -> Tensor", int4_weights_ref.fp32_row_product),
    "q8_0_product": ("q8_0_product(Tensor x, Tensor codes, Tensor scales) -> Tensor", int4_weights_ref.q8_0_product),
    "q8_0_product_fp32": (
        "q8_0_product_fp32(Tensor x, Tensor codes, Tensor scales) -> Tensor",
        int4_weights_ref.q8_0_product_fp32,
    ),
    "rms_norm": ("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm_ref.rms_norm),
    "greedy_seeds": (
        "greedy_seeds(Tensor similarity, Tensor chunk_lengths, Tensor free, Tensor tau) -> (Tensor, Tensor)",
        gsc_ref.greedy_seeds,
    ),
}
#: builds of other versions (source, torch, Python, CPU) kept: the most recently used ones, ~5 MiB each,
#: so that switching between environments does not rebuild, and any used in the last KEEP_DAYS days
KEEP_BUILDS = 4
KEEP_DAYS = 7
_BUILD_NAME = re.compile(r"semanticache_cpu_ops_[0-9a-f]{16}")
_USED = "last-used"  # a build's stamp file, touched at each load
#: head dims the kernel is built for (others keep the torch ops)
DIMS = (16, 32, 64, 128, 256)


@functools.cache
def define() -> torch.library.Library:
    """The ``semanticache`` operator library, with each operator's schema and its torch twin as the
    implementation on every device (the C++ kernels, once loaded, take CPU tensors)."""
    library = torch.library.Library("semanticache", "DEF")
    for name, (schema, twin) in SCHEMAS.items():
        library.define(schema)
        library.impl(name, twin, "CompositeExplicitAutograd")
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
    sources = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = "\n".join([*sources, " ".join(FLAGS), torch.__version__, sys.version, _cpu_identity()])
    return "semanticache_cpu_ops_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build() -> None:
    """Compile (or find compiled) and load the C++ kernels; raises whatever the build raises."""
    from torch.utils import cpp_extension

    from semanticache_rag.models import home_dir

    name = _library_name()
    directory = home_dir() / "kernels" / name
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{name}.so").exists():
        logger.warning("building the CPU kernels for this machine (once, ~2 minutes on 2 cores) in %s", directory)
    # cpp_extension locks the directory while it builds (other processes wait) and rebuilds a stale library
    cpp_extension.load(
        name,
        [str(source) for source in SOURCES],
        extra_cflags=list(FLAGS),
        build_directory=str(directory),
        is_python_module=False,
    )
    (directory / _USED).touch()
    _prune_builds(directory.parent, keep=name)


def _last_used(directory: Path) -> float:
    """When a build was last loaded: its stamp, or for one without (an older version's) its newest file."""
    try:
        return (directory / _USED).stat().st_mtime
    except OSError:
        return max((entry.stat().st_mtime for entry in directory.iterdir()), default=directory.stat().st_mtime)


def _prune_builds(kernels: Path, keep: str) -> list[Path]:
    """Remove the libraries of other versions in ``kernels`` (each source, torch, Python or CPU version builds
    its own) that are neither among the :data:`KEEP_BUILDS` most recently used nor used in the last
    :data:`KEEP_DAYS` days; ``keep`` (the one just loaded) stays. Only folders named as :func:`_library_name`
    names them are touched; one that cannot be read or removed is left. Returns the removed folders."""
    builds = []
    for entry in kernels.iterdir():
        if entry.name != keep and _BUILD_NAME.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            try:
                builds.append((_last_used(entry), entry))
            except OSError:
                continue
    builds.sort(reverse=True)
    cutoff = time.time() - KEEP_DAYS * 86400
    removed = []
    for used, entry in builds[KEEP_BUILDS - 1 :]:  # the one just loaded is the other of the KEEP_BUILDS
        if used < cutoff:
            try:
                shutil.rmtree(entry)
            except OSError as exc:
                logger.debug("kept the old CPU kernel build %s: %s", entry, exc)
                continue
            removed.append(entry)
    if removed:
        logger.info("removed %d CPU kernel builds unused for %d days from %s", len(removed), KEEP_DAYS, kernels)
    return removed


@functools.cache
def available() -> bool:
    """Whether the C++ kernels are loaded (built at the first call); ``False`` keeps the torch twins."""
    define()
    if os.environ.get("SEMANTICACHE_CPU_KERNEL", "1") == "0":
        return False
    try:
        _build()
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch ops still work
        reason = f"{exc}".strip().splitlines()[-1] if f"{exc}".strip() else type(exc).__name__
        logger.warning(
            "CPU kernels not built (%s); decoding and reading use torch's ops, which are slower. Install a C++ "
            "compiler and ninja (pip install ninja) to build it.",
            reason,
        )
        return False
    return True


def supports(dim: int, group: int) -> bool:
    """Whether the attention kernel takes heads of ``dim`` channels, ``group`` query heads per kv head."""
    return dim in DIMS and group <= 16


def op(name: str):
    """The operator ``torch.ops.semanticache.<name>`` (one of :data:`SCHEMAS`): its C++ kernel on CPU
    tensors where :func:`available` (which builds them at the first call), else its torch twin."""
    available()
    return getattr(torch.ops.semanticache, name)


def decode_attention(*args: object) -> torch.Tensor:
    """The attention operator (:func:`op`), with the torch twin's signature."""
    return op("decode_attention")(*args)
