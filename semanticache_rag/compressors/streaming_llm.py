"""StreamingLLM-style baseline: keep the attention sinks and the most recent tokens.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"
(https://arxiv.org/abs/2309.17453); kvpress's ``StreamingLLMPress`` keeps the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from semanticache_rag.compressors.base import Compressor
from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import LayerKV


@dataclass(frozen=True)
class StreamingLLMCompressor(Compressor):
    """Keep ``sink_tokens`` first tokens and the last tokens that fit the budget.

    Attributes
    ----------
    compression_ratio : float
        Fraction of KV entries to remove, in [0, 1).
    sink_tokens : int
        First tokens always kept.
    """

    name: ClassVar[str] = "streaming_llm"
    compression_ratio: float = 0.5
    sink_tokens: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sink_tokens < 0:
            raise ConfigError(f"sink_tokens must be >= 0, got {self.sink_tokens!r}")

    def compress(self, keys, values, context, plan) -> LayerKV:
        num_tokens = keys.shape[2]
        keep = self.target_entries(num_tokens)
        if keep >= num_tokens:
            return LayerKV(keys, values)
        sinks = min(self.sink_tokens, keep)
        recent = keep - sinks
        index = list(range(sinks)) + list(range(num_tokens - recent, num_tokens))
        return LayerKV(keys[:, :, index].contiguous(), values[:, :, index].contiguous())
