"""Key/value storage: the immutable per-document cache and the per-question working cache.

``LayerKV`` holds one layer of a document's (possibly compressed) cache. ``ConversationKV`` is a
transformers ``Cache`` whose layers keep a reference to the document's ``LayerKV`` and append
the question, answer and chat tokens in a buffer of their own, so that many questions share one
document cache and none of them can change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True, eq=False)
class LayerKV:
    """One layer of a document cache.

    Attributes
    ----------
    keys, values : Tensor (1, H_kv, L, D)
        Post-RoPE keys and values of the ``L`` entries (padded to the longest head).
    sizes : Tensor (1, H_kv, L) int16/int32, or None
        Original tokens each entry stands for (0 marks padding); ``None`` when every entry is one
        token. Integers, so the bias is exact and costs 2 bytes per entry.
    """

    keys: torch.Tensor
    values: torch.Tensor
    sizes: torch.Tensor | None = None

    @property
    def log_sizes(self) -> torch.Tensor | None:
        """``log s`` per entry, ``-inf`` for padding (the proportional-attention bias)."""
        return None if self.sizes is None else self.sizes.float().log()

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor of this layer, padding and bookkeeping included."""
        tensors = [self.keys, self.values] + ([self.sizes] if self.sizes is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_entries(self) -> int:
        """Real (non-padding) entries summed over the KV heads."""
        if self.sizes is None:
            return self.keys.shape[1] * self.keys.shape[2]
        return int((self.sizes > 0).sum())


class _AppendLayer(CacheLayerMixin):
    """A document layer (read-only) followed by a growable buffer of appended tokens."""

    is_sliding = False
    is_croppable = True

    def __init__(self, document: LayerKV | None = None, capacity: int = 0):
        super().__init__()
        self.document = document
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (*key_states.shape[:2], max(self.capacity, 64), key_states.shape[3])
        self.keys = key_states.new_empty(shape)
        self.values = value_states.new_empty(shape[:3] + (value_states.shape[3],))
        self.device = key_states.device
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        if needed <= self.keys.shape[2]:
            return
        size = max(needed, 2 * self.keys.shape[2])  # doubling keeps appends amortised O(1)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_empty((*old.shape[:2], size, old.shape[3]))
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        self._reserve(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, length: int) -> None:
        """Keep the first ``length`` appended tokens."""
        self.length = min(self.length, max(0, length))

    def appended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the appended keys and values, (1, H_kv, length, D)."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class ConversationKV(Cache):
    """Working cache of one question or conversation over a document cache.

    Parameters
    ----------
    document_layers : sequence of LayerKV, or None
        The document's layers; ``None`` when prefilling a document from scratch.
    num_layers : int
        Decoder layers of the model.
    capacity : int
        Appended tokens to allocate room for up front.
    """

    def __init__(self, document_layers=None, num_layers: int = 0, capacity: int = 0):
        if document_layers is not None:
            num_layers = len(document_layers)
        docs = list(document_layers) if document_layers is not None else [None] * num_layers
        super().__init__(layers=[_AppendLayer(d, capacity) for d in docs])
        # Called by the attention function as observe(layer_idx, query, document_layer, scaling)
        # when set: lets a compressor score document entries against a question's queries.
        self.observe = None
        # Appended entries that precede the conversation's tokens (SeKV's rebuilt spans): kept by crop.
        self.prefix_length = 0

    @property
    def appended_length(self) -> int:
        return self.layers[0].length - self.prefix_length

    def crop(self, length: int) -> None:
        """Forget appended tokens after the first ``length``."""
        for layer in self.layers:
            layer.crop(self.prefix_length + length)
