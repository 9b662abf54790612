"""Every entry kept, each layer's keys and values stored in 16 bits: half the bytes of an fp32 cache.

What llama.cpp keeps by default (``--cache-type-k f16``). No entry is merged or dropped, so the
answers are the full cache's up to the rounding of each key and value to fp16 (11 significant bits);
a decoding step reads half the cache's bytes, which on a CPU is most of a long document's step time
with int4 weights (benchmarks/followup_latency.py). A layer's keys or values with an element beyond fp16's range
are stored in bf16 instead (its range is fp32's); a cache that already has 16 bits is kept as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from semanticache_rag.compressors.base import CompressionContext, Compressor
from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import CodedLayerKV, LayerKV
from semanticache_rag.tensor_codes import HalfTensor


def half_code(x: torch.Tensor) -> HalfTensor:
    """``x`` stored in fp16, or in bf16 where an element is beyond fp16's range (the rows are read back
    into fp32 arithmetic, so only the elements themselves must be finite)."""
    half = x.to(torch.float16)
    return HalfTensor(half if bool(half.isfinite().all()) else x.to(torch.bfloat16), x.dtype)


@dataclass(frozen=True)
class HalfCompressor(Compressor):
    """Keep every entry; store keys and values in 16 bits (fp16; bf16 for a layer's keys or values beyond its range).

    Attributes
    ----------
    compression_ratio : float
        Fraction of entries removed: 0, the only value (the bytes removed are half of an fp32 cache's).
    """

    name: ClassVar[str] = "fp16"

    def __post_init__(self):
        super().__post_init__()
        if self.compression_ratio != 0:
            raise ConfigError(
                f"fp16 keeps every entry in half the bytes; compression_ratio must be 0, got "
                f"{self.compression_ratio!r}: omit --ratio / compression_ratio (for fewer entries as well: "
                "--compression auto --ratio R, or make_compressor('kaizen+semanticache', R, options=('fp16',)) for "
                "merged entries in 16 bits)"
            )

    def compress(self, keys, values, context: CompressionContext, plan):
        if keys.element_size() <= 2:  # already 16 bits: nothing to halve
            return LayerKV(keys, values)
        return CodedLayerKV(half_code(keys), half_code(values))
