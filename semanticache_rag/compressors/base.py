"""The compressor contract: one layer's document keys/values in, a :class:`LayerKV` out.

A compressor is a dataclass that *is* its configuration (the kvpress pattern). The engine calls
:meth:`Compressor.compress` once per layer after the document's prefill; the question is never
seen (question-agnostic), so one compressed cache serves every later question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import LayerKV


@dataclass(frozen=True, eq=False)
class CompressionContext:
    """What a compressor may know about the document besides one layer's keys and values.

    Attributes
    ----------
    layer_idx : int
        Decoder layer being compressed.
    token_ids : Tensor (N,)
        Token ids of the prefilled prefix (template head + document).
    protected : Tensor (N,) bool
        Tokens that must stay as they are (template tokens around the document).
    surprisal : Tensor (N,) or None
        ``-log p`` of each token under the model at prefill, when the compressor asked for it.
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer, to classify vocabulary ids.
    """

    layer_idx: int
    token_ids: torch.Tensor
    protected: torch.Tensor
    surprisal: torch.Tensor | None
    tokenizer: object


@dataclass(frozen=True)
class Compressor:
    """Base class; subclasses set :attr:`name` and implement :meth:`compress`.

    Attributes
    ----------
    compression_ratio : float
        Fraction of KV entries to remove, in [0, 1) (kvpress semantics).
    """

    name: ClassVar[str] = "base"
    needs_surprisal: ClassVar[bool] = False
    compression_ratio: float = 0.0

    def __post_init__(self):
        if not 0 <= self.compression_ratio < 1:
            raise ConfigError(f"compression_ratio must be in [0, 1), got {self.compression_ratio!r}")

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> LayerKV:
        """Compress one layer: ``keys``/``values`` (1, H_kv, N, D) -> :class:`LayerKV`."""
        raise NotImplementedError


@dataclass(frozen=True)
class NoCompression(Compressor):
    """Keep the full cache (the reference every other compressor is measured against)."""

    name: ClassVar[str] = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.compression_ratio != 0:
            raise ConfigError(f"NoCompression keeps every entry; compression_ratio must be 0, got {self.compression_ratio!r}")

    def compress(self, keys, values, context):
        return LayerKV(keys, values)
