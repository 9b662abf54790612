"""Tensors that every decoding step reads, in blocks of transparent huge pages (one block per dtype).

A decoding step streams every weight of the model once. In 4 KiB pages the default model's int4 weights
and its Q8_0 head (94 MB) are ~24,000 pages a step, each a TLB miss on its first touch, and the hardware
prefetchers start over at every page; the weights of one layer's four products are 0.2-1 MiB each, too
small for the kernel to give any of them huge pages of their own. Copied into blocks advised for huge
pages (``madvise(MADV_HUGEPAGE)``, 2 MiB pages on x86-64), an int4 step took 6.75-7.1 -> 6.3-6.5 ms
(SemantiCache 0.9 at 2K, alternating processes on a 2-core AVX2 CPU), with the same arithmetic.

Where the platform has no ``MADV_HUGEPAGE`` (not Linux) or refuses it (a kernel without huge pages), the
block is ordinary memory: the same tensors, the same results.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable, Iterable

import torch
from torch import nn

PAGE = 2 * 1024 * 1024  # a huge page on x86-64 (and the alignment the block starts at)
ALIGN = 64  # each tensor starts at a cache line


def block(nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8 in anonymous memory advised for transparent huge pages, starting at a 2 MiB
    boundary (ordinary memory where the advice does not exist)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    # private: a shared anonymous map is shmem, whose huge pages are a setting of their own (off by default)
    memory = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it alive
    try:
        memory.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages
        pass
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    start = -whole.data_ptr() % PAGE
    return whole[start : start + nbytes]


def pack(
    tensors: Iterable[torch.Tensor], placed: Callable[[int, torch.Tensor], None] | None = None
) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU) side by side, one :func:`block` per dtype (so that ``torch.save`` takes
    them: it refuses one storage seen as several types), each with its dtype and shape, in their order.

    ``placed(i, copy)`` is called as each copy is made, after which pack holds no reference to the ``i``-th
    tensor: where the caller's iterable held the only other ones (a generator), each original can go as soon
    as ``placed`` lets go of it (:func:`pack_buffers`).

    The copies are views of their block: ``torch.save`` of one of them writes the whole block, and
    safetensors refuses tensors that share a storage; ``.clone()`` one to save it alone."""
    originals = dict(enumerate(tensors))
    layout = {i: (t.dtype, t.shape, t.numel() * t.element_size()) for i, t in originals.items()}
    copies: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(kind for kind, _, _ in layout.values()):
        members = [i for i, (kind, _, _) in layout.items() if kind == dtype]
        offsets = [0]
        for i in members:
            offsets.append(offsets[-1] + -(-layout[i][2] // ALIGN) * ALIGN)
        memory = block(offsets[-1])
        for i, offset in zip(members, offsets):
            _, shape, size = layout[i]
            copies[i] = memory[offset : offset + size].view(dtype).view(shape).copy_(originals.pop(i))
            if placed is not None:
                placed(i, copies[i])
    return [copies[i] for i in range(len(layout))]


#: bytes of buffers :func:`pack_buffers` moves between two :func:`release_freed_memory` calls
TRIM_EVERY = 64 * 1024 * 1024


def pack_buffers(modules: Iterable[nn.Module], skip: frozenset[str] = frozenset()) -> int:
    """Move the buffers of ``modules`` (each module's own, but those named in ``skip``) into blocks
    (:func:`pack`: one per dtype); a buffer shared by several modules stays shared. Returns the bytes moved.

    Each module takes its copy as soon as it is made and the originals' memory goes back to the system every
    :data:`TRIM_EVERY` bytes, so the buffers are not held twice: an fp32 model's 425 MiB of decoder weights
    (the default model's, ``weights="fp32"``) otherwise added their size again to its conversion's peak."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    unique: dict[int, torch.Tensor] = {}
    for module in modules:
        for name, buffer in module.named_buffers(recurse=False):
            if name in skip or buffer is None or buffer.numel() == 0 or buffer.device.type != "cpu":
                continue
            holders.setdefault(id(buffer), []).append((module, name))
            unique.setdefault(id(buffer), buffer)
    order = list(unique)
    moved = untrimmed = 0  # bytes moved in all, and since the last release_freed_memory

    def placed(i: int, copy: torch.Tensor) -> None:
        nonlocal moved, untrimmed
        for module, name in holders[order[i]]:
            module._buffers[name] = copy
        moved += copy.numel() * copy.element_size()
        untrimmed += copy.numel() * copy.element_size()
        if untrimmed >= TRIM_EVERY:
            release_freed_memory()
            untrimmed = 0

    pack((unique.pop(key) for key in order), placed)
    return moved


def release_freed_memory() -> None:
    """Give the C allocator's freed memory back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    Converting the weights frees many small temporaries (and the buffers :func:`pack_buffers` copied),
    which glibc keeps for later allocations: the default model's int4 engine held ~150-190 MB more
    resident memory than it used (820-870 MB against 677 MB after trimming)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols, the C library's among them
    except (OSError, AttributeError, TypeError):  # not glibc (Windows takes no CDLL(None) at all)
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
