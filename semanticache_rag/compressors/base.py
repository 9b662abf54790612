"""The compressor contract: a document's per-layer keys/values in, one :class:`LayerKV` per layer out.

A compressor is a dataclass that *is* its configuration (the kvpress pattern). After a
document's prefill (or each section's, for a long document) the engine calls
:meth:`Compressor.compress_cache` once; by default it runs :meth:`Compressor.prepare` on what all
layers share (chunks, protected tokens) and then :meth:`Compressor.compress` per layer. The
question is never seen (question-agnostic), so one compressed cache serves every later question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import LayerKV


@dataclass(frozen=True, eq=False)
class CompressionContext:
    """What a compressor may know about the document besides the keys and values.

    Attributes
    ----------
    token_ids : Tensor (N,)
        Token ids of the prefilled prefix (template head + document).
    protected : Tensor (N,) bool
        Tokens that must stay as they are (template tokens around the document).
    surprisal : Tensor (N,) or None
        ``-log p`` of each token under the model at prefill, when the compressor asked for it.
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer, to classify vocabulary ids.
    release_layers : bool
        The caller needs the full keys and values no more: :meth:`Compressor.compress_document` drops
        each layer's from ``keys_values`` once it is compressed, so a read's peak memory holds the full
        cache plus one layer's work, not the full and the compressed caches side by side.
    """

    token_ids: torch.Tensor
    protected: torch.Tensor
    surprisal: torch.Tensor | None
    tokenizer: object
    release_layers: bool = False


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

    def target_entries(self, num_tokens: int) -> int:
        """Entries to keep per KV head for a prefix of ``num_tokens`` tokens."""
        return max(1, round((1 - self.compression_ratio) * num_tokens))

    def prepare(self, context: CompressionContext):
        """Work shared by all layers of one document; its result is passed to :meth:`compress`."""
        return None

    def layer_plans(self, plan, num_layers: int, context: CompressionContext) -> list:
        """The plan each layer is compressed with: :meth:`prepare`'s, the same for every layer by default."""
        return [plan] * num_layers

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext, plan) -> LayerKV:
        """Compress one layer: ``keys``/``values`` (1, H_kv, N, D) -> :class:`LayerKV`."""
        raise NotImplementedError

    def compress_document(self, keys_values, context: CompressionContext) -> tuple[LayerKV, ...]:
        """Compress every layer of a document: ``keys_values`` is a list of (keys, values)."""
        plans = self.layer_plans(self.prepare(context), len(keys_values), context)
        layers = []
        for index, (keys, values) in enumerate(keys_values):
            layers.append(self.compress(keys, values, context, plans[index]))
            if context.release_layers:
                keys_values[index] = None  # the list's reference was the last one to this layer's full KV
        return tuple(layers)

    def compress_cache(self, keys_values, context: CompressionContext):
        """The compressed layers and any host-side state kept beside them (``DocumentCache.zoom``).

        Only compressors that re-expand parts of the document per question keep such state
        (:class:`~semanticache_rag.compressors.sekv.SeKVCompressor`); the rest return ``None``.
        """
        return self.compress_document(keys_values, context), None


@dataclass(frozen=True)
class NoCompression(Compressor):
    """Keep the full cache (the reference every other compressor is measured against)."""

    name: ClassVar[str] = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.compression_ratio != 0:
            raise ConfigError(
                f"NoCompression keeps every entry; compression_ratio must be 0, got {self.compression_ratio!r}"
            )

    def compress(self, keys, values, context, plan):
        return LayerKV(keys, values)
