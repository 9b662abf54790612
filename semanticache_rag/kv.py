"""Key/value storage: the immutable per-document cache and the per-question working cache.

``LayerKV`` holds one layer of a document's (possibly compressed) cache. ``ConversationKV`` is a
transformers ``Cache`` whose layers keep a reference to the document's ``LayerKV`` and append
the question, answer and chat tokens in a buffer of their own, so that many questions share one
document cache and none of them can change it.

``CodedLayerKV`` and ``SharedLayerKV`` are layers whose storage really shrinks (KV-Kaizen): keys
and values kept quantised, low-rank or in half precision (:mod:`semanticache_rag.tensor_codes`), or
not kept at all because the layer attends to its neighbour's cache. They expose the same ``keys``,
``values``, ``sizes``, ``log_sizes``, ``nbytes`` and ``num_entries`` as ``LayerKV``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from semanticache_rag.tensor_codes import TensorCode, nbytes_of


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
        return _log_sizes(self.sizes)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor of this layer, padding and bookkeeping included."""
        tensors = [self.keys, self.values] + ([self.sizes] if self.sizes is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_entries(self) -> int:
        """Real (non-padding) entries summed over the KV heads."""
        return _num_entries(self.sizes, self.keys.shape)

    def tensors(self, scratch: DecodeScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values to attend to (``scratch`` is for coded layers; these are stored as they are)."""
        return self.keys, self.values


class DecodeScratch:
    """Two reusable buffers that coded layers (:class:`CodedLayerKV`) decode into, one layer at a time.

    A decoding step attends to every layer in turn; decoding each coded layer into fresh tensors
    made the allocator hand out (and the kernel fault in) new pages for every layer and step, which
    cost more than the decoding itself. A scratch grows to the largest layer and is reused, so the
    tensors it returns are valid until the next layer is decoded into it: one per conversation.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialised) backed by the buffer ``name``."""
        numel = shape.numel()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)

    def decode(self, name: str, code: TensorCode) -> torch.Tensor:
        """``code`` decoded into the buffer ``name`` (valid until that buffer's next use)."""
        return code.decode_into(self.buffer(name, code.shape, code.dtype, code.device))


def _log_sizes(sizes: torch.Tensor | None) -> torch.Tensor | None:
    return None if sizes is None else sizes.float().log()


def _num_entries(sizes: torch.Tensor | None, shape: torch.Size) -> int:
    return shape[1] * shape[2] if sizes is None else int((sizes > 0).sum())


@dataclass(frozen=True, eq=False)
class CodedLayerKV:
    """One layer of a document cache whose keys and values are stored coded (smaller than ``LayerKV``).

    ``keys`` and ``values`` are decoded on every access: each attention call over the document
    builds one transient full-precision copy of this layer, (1, H_kv, L, D) each, into the
    conversation's :class:`DecodeScratch` (:meth:`tensors`), reused by the next layer. Caching the
    decoded tensors would make later calls faster and give the memory saving back, so they are not
    cached.

    Attributes
    ----------
    key_code, value_code : QuantizedTensor, LowRankTensor or HalfTensor
        The coded keys and values, (1, H_kv, L, D) once decoded.
    sizes : Tensor (1, H_kv, L) int16/int32, or None
        As in :class:`LayerKV` (kept exact).
    """

    key_code: TensorCode
    value_code: TensorCode
    sizes: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor:
        return self.key_code.decode()

    @property
    def values(self) -> torch.Tensor:
        return self.value_code.decode()

    @property
    def log_sizes(self) -> torch.Tensor | None:
        return _log_sizes(self.sizes)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored codes, scales, factors and sizes."""
        return self.key_code.nbytes + self.value_code.nbytes + nbytes_of(self.sizes)

    @property
    def num_entries(self) -> int:
        return _num_entries(self.sizes, self.key_code.shape)

    def tensors(self, scratch: DecodeScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded keys and values, written into ``scratch`` (valid until its next use) when given."""
        if scratch is None:
            return self.keys, self.values
        return scratch.decode("keys", self.key_code), scratch.decode("values", self.value_code)


@dataclass(frozen=True, eq=False)
class SharedLayerKV:
    """A layer that attends to another layer's stored cache (cross-layer sharing) and stores nothing.

    ``nbytes`` is 0, so a document cache's byte count holds the shared storage once, where it is
    owned. Everything else is the ``source`` layer's.
    """

    source: LayerKV | CodedLayerKV

    @property
    def keys(self) -> torch.Tensor:
        return self.source.keys

    @property
    def values(self) -> torch.Tensor:
        return self.source.values

    @property
    def sizes(self) -> torch.Tensor | None:
        return self.source.sizes

    @property
    def log_sizes(self) -> torch.Tensor | None:
        return self.source.log_sizes

    @property
    def nbytes(self) -> int:
        return 0

    def tensors(self, scratch: DecodeScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.tensors(scratch)

    @property
    def num_entries(self) -> int:
        return self.source.num_entries


class _AppendLayer(CacheLayerMixin):
    """A document layer (read-only) followed by a growable buffer of appended tokens."""

    is_sliding = False
    is_croppable = True
    keys: torch.Tensor  # type: ignore[assignment]  # set by lazy_initialization, before any read
    values: torch.Tensor  # type: ignore[assignment]

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

    layers: list[_AppendLayer]  # type: ignore[assignment]

    def __init__(self, document_layers=None, num_layers: int = 0, capacity: int = 0):
        if document_layers is not None:
            num_layers = len(document_layers)
        docs = list(document_layers) if document_layers is not None else [None] * num_layers
        super().__init__(layers=[_AppendLayer(d, capacity) for d in docs])
        # Called by the attention function as observe(layer_idx, query, document_layer, scaling)
        # when set: lets a compressor score document entries against a question's queries.
        self.observe: Callable | None = None
        # Appended entries that precede the conversation's tokens (SeKV's rebuilt spans): kept by crop.
        self.prefix_length = 0
        self.scratch = DecodeScratch()
        # per layer index, its document's log s: a layer's document never changes, so one log per conversation
        self._log_sizes: dict[int, torch.Tensor | None] = {}
        # the scripted decoding step's document inputs, made at its first step (semanticache_rag.fused)
        self.step_inputs: tuple | None = None
        # the same inputs as the C++ step holds them (torch.classes.semanticache.StepDocument), or False
        self.step_document: object = None

    def document_tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer ``layer_idx``'s document keys, values and ``log s`` to attend to (coded layers decoded
        into this conversation's scratch: valid until the next layer's call)."""
        document = self.layers[layer_idx].document
        if document is None:
            raise ValueError(f"layer {layer_idx} of this conversation has no document")
        keys, values = document.tensors(self.scratch)
        return keys, values, self.log_sizes(layer_idx)

    def log_sizes(self, layer_idx: int) -> torch.Tensor | None:
        """Layer ``layer_idx``'s document ``log s`` (computed once per conversation), or ``None``."""
        if layer_idx not in self._log_sizes:
            document = self.layers[layer_idx].document
            self._log_sizes[layer_idx] = None if document is None else document.log_sizes
        return self._log_sizes[layer_idx]

    def buffers(self, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Every layer's appended key and value buffers (1, H_kv, capacity, D), with room for ``count``
        more tokens, and the index where they go: for a step that writes them itself
        (:mod:`semanticache_rag.scripted_step`); :meth:`extend` then counts them."""
        start = self.layers[0].length
        for layer in self.layers:
            layer._reserve(start + count)
        return [layer.keys for layer in self.layers], [layer.values for layer in self.layers], start

    def extend(self, count: int) -> None:
        """Count ``count`` tokens written into :meth:`buffers` as appended, in every layer."""
        for layer in self.layers:
            layer.length += count

    @property
    def appended_length(self) -> int:
        return self.layers[0].length - self.prefix_length

    def crop(self, length: int) -> None:
        """Forget appended tokens after the first ``length``."""
        for layer in self.layers:
            layer.crop(self.prefix_length + length)
