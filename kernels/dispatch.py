"""One entry point per kernel: the torch twin or the Triton kernel, by ``backend``.

``backend="auto"`` runs Triton on CUDA tensors (NVIDIA, compute capability 8.0 or newer) when
triton is installed and torch otherwise, silently; ``"torch"`` always runs the torch twin (the CPU
product path); ``"triton"`` runs the kernel or raises a :class:`~semanticache_rag.errors.ConfigError`
that says why it cannot.
Triton kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` (tests; slow), when forced.

This module never imports triton itself: the ``*_triton`` modules are imported on first use,
so ``import semanticache_rag`` works on machines without triton or a GPU. (transformers may
still import triton, when it is installed, through ``torch._dynamo``.)
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from semanticache_rag.errors import ConfigError
from semanticache_rag.kernels import gsc_ref, proportional_attention_ref

BACKENDS = ("auto", "torch", "triton")


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        return False


@functools.cache
def _supported_gpu(device_index: int) -> bool:
    """NVIDIA, Ampere or newer (bf16 and tf32 dots): where ``"auto"`` picks the Triton kernels."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 0)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"`` for an operation on ``tensor``'s device."""
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        use_triton = tensor.is_cuda and triton_installed() and _supported_gpu(tensor.get_device())
        return "triton" if use_triton else "torch"
    if not triton_installed():
        raise ConfigError('backend="triton" needs the triton package: pip install "semanticache-rag[triton]"')
    if not tensor.is_cuda and not interpreting():
        raise ConfigError(
            f'backend="triton" needs CUDA tensors, got {tensor.device.type} ones; use backend="auto" or "torch" '
            "(or set TRITON_INTERPRET=1 before triton is imported to run the kernels in its slow CPU interpreter)"
        )
    return "triton"


def proportional_attention(
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    doc_keys: torch.Tensor | None = None,
    doc_values: torch.Tensor | None = None,
    doc_log_sizes: torch.Tensor | None = None,
    scaling: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Proportional attention over a document cache plus appended tokens; see the torch twin
    :func:`~semanticache_rag.kernels.proportional_attention_ref.proportional_attention`.

    Without a document, ``"auto"`` keeps torch: that is plain causal attention, SDPA's job.
    """
    args = (query, new_keys, new_values, doc_keys, doc_values, doc_log_sizes, scaling)
    if backend == "auto" and (doc_keys is None or doc_keys.shape[2] == 0):
        backend = "torch"
    if resolve_backend(backend, query) == "torch":
        return proportional_attention_ref.proportional_attention(*args)
    from semanticache_rag.kernels import proportional_attention_triton

    return proportional_attention_triton.proportional_attention(*args)


def cluster_seeds(
    keys: torch.Tensor,
    chunk_ids: torch.Tensor,
    tau: torch.Tensor | float,
    protected: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Greedy Seed-based Clustering of one layer's keys; see :func:`.gsc_ref.cluster_seeds`."""
    if resolve_backend(backend, keys) == "torch":
        return gsc_ref.cluster_seeds(keys, chunk_ids, tau, protected)
    from semanticache_rag.kernels import gsc_triton

    return gsc_triton.cluster_seeds(keys, chunk_ids, tau, protected)


def semantic_cores(
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk_ids: torch.Tensor,
    tau: torch.Tensor | float,
    protected: torch.Tensor | None = None,
    *,
    backend: str = "auto",
):
    """Clustering plus merging into semantic cores; see :func:`.gsc_ref.semantic_cores`."""
    if resolve_backend(backend, keys) == "torch":
        return gsc_ref.semantic_cores(keys, values, chunk_ids, tau, protected)
    from semanticache_rag.kernels import gsc_triton

    return gsc_triton.semantic_cores(keys, values, chunk_ids, tau, protected)
