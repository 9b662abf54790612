"""Kara-style decode-time compression of what a conversation appends after the document.

In a long document chat the appended turns (questions, answers) grow the working cache without
bound. Kara (2026) compresses at decode time, over a sliding window of appended entries: each
window entry is scored by the attention it receives inside the window, bidirectionally (from
earlier and later window entries alike, no causal mask), the best are kept, and Token2Chunk expands kept
tokens into contiguous chunks so that phrases stay whole. Compression runs in batches (a whole
window at a time, once the appended entries exceed ``budget_tokens + window_tokens``), so
decoding is not slowed down token by token, and every window keeps at least one entry.

Queries are not cached, so in-window attention is computed from the keys (``softmax(K Kᵀ/√d)``),
per layer and KV head; each head keeps its own entries (the same count per head and layer).
The document cache is whatever the ``inner`` compressor made of it; Kara never touches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from semanticache_rag.compressors.base import CompressionContext, Compressor
from semanticache_rag.errors import ConfigError


@dataclass(frozen=True)
class KaraCompressor(Compressor):
    """Compress appended conversation tokens over a sliding window; the document by ``inner``.

    Attributes
    ----------
    compression_ratio : float
        Ratio of the ``inner`` document compressor when it is given by name (0 with ``inner="none"``).
    inner : Compressor or str
        The document cache's compressor: an instance (``SemantiCacheCompressor(0.5)``), or a
        registered name (``"none"``, ``"semanticache"``, ...) built with ``compression_ratio``.
        Not SeKV: its conversations rebuild the question's spans in front of the appended turns
        and compute those turns again every time, so there is nothing for Kara to keep compressed.
    budget_tokens : int
        Appended entries per head kept before a window is compressed.
    window_tokens : int
        Entries compressed at once (the oldest window not compressed yet, else the oldest).
    keep_share : float
        Share of a window's entries kept, in (0, 1).
    chunk_tokens : int
        Token2Chunk radius: a kept token brings this many neighbours on each side.
    recent_tokens : int
        The newest appended entries are never compressed (the question being answered).
    """

    name: ClassVar[str] = "kara"
    compression_ratio: float = 0.0
    inner: Compressor | str = "none"
    budget_tokens: int = 512
    window_tokens: int = 128
    keep_share: float = 0.5
    chunk_tokens: int = 1
    recent_tokens: int = 64

    def __post_init__(self):
        super().__post_init__()
        from semanticache_rag.compressors import COMPRESSORS

        allowed = sorted(set(COMPRESSORS) - {self.name, "sekv"})
        name = self.inner.name if isinstance(self.inner, Compressor) else self.inner
        if name not in allowed:
            raise ConfigError(
                f"Kara's inner compressor must be one of {allowed}, got {name!r} (SeKV rebuilds every turn)"
            )
        if isinstance(self.inner, Compressor) and self.compression_ratio:
            raise ConfigError("set the ratio on the inner compressor instance, not on KaraCompressor")
        if self.budget_tokens < 1 or self.window_tokens < 2 or self.chunk_tokens < 0 or self.recent_tokens < 0:
            raise ConfigError(
                f"budget_tokens >= 1, window_tokens >= 2, chunk_tokens and recent_tokens >= 0 are needed, got "
                f"{self.budget_tokens}, {self.window_tokens}, {self.chunk_tokens}, {self.recent_tokens}"
            )
        if not 0 < self.keep_share < 1:
            raise ConfigError(f"keep_share must be in (0, 1), got {self.keep_share!r}")
        self.document_compressor()  # validates compression_ratio against the inner compressor

    def document_compressor(self) -> Compressor:
        if isinstance(self.inner, Compressor):
            return self.inner
        from semanticache_rag.compressors import make_compressor

        return make_compressor(self.inner, self.compression_ratio)

    @property
    def needs_surprisal(self) -> bool:  # type: ignore[override]
        return self.document_compressor().needs_surprisal

    def compress_cache(self, keys_values, context: CompressionContext):
        return self.document_compressor().compress_cache(keys_values, context)

    @property
    def kept_per_window(self) -> int:
        return max(1, round(self.keep_share * self.window_tokens))

    def select(self, keys: torch.Tensor) -> torch.Tensor:
        """Entries to keep of one window: keys (H, W, D) -> sorted indices (H, k)."""
        heads, width, dim = keys.shape
        k = self.kept_per_window
        probs = torch.softmax((keys.float() @ keys.float().transpose(-1, -2)) * dim**-0.5, dim=-1)  # (H, W, W)
        score = probs.sum(1)  # attention each entry receives from the whole window, no causal mask
        # -- Token2Chunk: seeds (the best tokens) grow into chunks of 2 * chunk_tokens + 1
        seeds = torch.zeros(heads, width)
        seeds.scatter_(1, score.topk(max(1, k // (2 * self.chunk_tokens + 1)), dim=1).indices, 1.0)
        radius = self.chunk_tokens
        chunks = F.max_pool1d(seeds[:, None], 2 * radius + 1, stride=1, padding=radius)[:, 0]
        priority = chunks * (score.max() + 1) + score  # chunk members first, then the best others
        return priority.topk(k, dim=1).indices.sort(dim=1).values

    def compress_window(self, layers, start: int) -> int:
        """Compress entries ``[start, start + window_tokens)`` of every appended layer in place.

        Returns the number of entries removed per head.
        """
        with torch.inference_mode():  # the buffers were written under inference mode
            for layer in layers:
                self._compress_layer(layer, start)
        return self.window_tokens - self.kept_per_window

    def _compress_layer(self, layer, start: int) -> None:
        width, removed = self.window_tokens, self.window_tokens - self.kept_per_window
        end = layer.length
        index = self.select(layer.keys[0, :, start : start + width])[..., None]  # (H, k, 1)
        for name in ("keys", "values"):
            buffer = getattr(layer, name)
            window = buffer[0, :, start : start + width]  # (H, W, D)
            kept = window.gather(1, index.expand(-1, -1, window.shape[-1]))
            rest = buffer[:, :, start + width : end].clone()
            buffer[0, :, start : start + kept.shape[1]] = kept
            buffer[:, :, start + kept.shape[1] : end - removed] = rest
        layer.length = end - removed
