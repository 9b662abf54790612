"""vLLM's CPU attention with SemantiCache's ``+ log s``: stored caches kept compressed inside vLLM.

Tier 2 of the vLLM integration. The connector (:mod:`semanticache_rag.integrations.vllm_connector`)
writes a compressed cache at compact positions (:func:`~semanticache_rag.expansion.compact_cache`):
one paged-cache slot per semantic core instead of one per document token, keys turned so that the
question starts right after the slots. Attention over those slots needs each core's ``log s``
(its size) added to its logit; vLLM's kernels have no such bias, so this backend keeps it in a
side table, one float per slot and KV head, beside the paged cache:

- slots written by vLLM itself (every prompt and generated token) get ``log s = 0``, cores the
  connector wrote get their ``log s`` (:meth:`SemantiCacheAttentionImpl.write_log_sizes`), padding
  ``-inf``; a block handed to another request is written from its first slot again, which clears it;
- requests whose blocks hold no core run vLLM's own kernel untouched; a request that does is
  attended in torch (keys unpacked from the kernel's per-ISA block layout, which is learnt once by
  writing probe keys through vLLM's own cache write, not hard-coded), its rows of the output
  replaced.

Registered over vLLM's ``CPU_ATTN`` backend through the ``vllm.general_plugins`` entry point
(:func:`register`), so stock vLLM loads it; without compact caches it only adds one table lookup
per layer and step. CPU only (x86 and the other CPUs vLLM runs mixed batches on); GPUs keep their
backend and compact requests are refused there by the connector.
"""

from __future__ import annotations

import logging
import math

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

logger = logging.getLogger(__name__)

__all__ = ["SemantiCacheAttentionBackend", "SemantiCacheAttentionImpl", "register"]

BACKEND = "semanticache_rag.integrations.vllm_attention.SemantiCacheAttentionBackend"


def register() -> None:
    """``vllm.general_plugins`` entry point: this backend in place of vLLM's CPU attention (CPU only)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)


class SemantiCacheAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention plus a ``log s`` per slot (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log_sizes: torch.Tensor | None = None  # (slots, H_kv) float32, allocated at the first compact write
        self.biased_blocks: torch.Tensor | None = None  # (blocks,) bool: may hold a slot with log s != 0
        self._unpack: torch.Tensor | None = None  # block-layout gather index of the keys (block_size * D,)

    # -- writes ---------------------------------------------------------------------------

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.log_sizes is not None:  # vLLM's own tokens: plain attention over them
            slots = slot_mapping[slot_mapping >= 0].long()
            self.log_sizes[slots] = 0.0
            block_size = kv_cache.shape[2]
            self.biased_blocks[slots[slots % block_size == 0] // block_size] = False  # a block written anew

    def write_log_sizes(self, kv_cache: torch.Tensor, slots: torch.Tensor, log_sizes: torch.Tensor) -> None:
        """``log s`` (len(slots), H_kv) of the cores just written to ``slots`` (after :meth:`do_kv_cache_update`)."""
        num_blocks, heads, block_size, _ = kv_cache.shape
        if self.log_sizes is None:
            self.log_sizes = torch.zeros(num_blocks * block_size, heads, dtype=torch.float32)
            self.biased_blocks = torch.zeros(num_blocks, dtype=torch.bool)
        self.log_sizes[slots] = log_sizes.float()
        self.biased_blocks[torch.unique(slots // block_size)] = True

    # -- attention ------------------------------------------------------------------------

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is None or self.biased_blocks is None or not bool(self.biased_blocks.any()):
            return output
        block_size = kv_cache.shape[2]
        seq_lens = attn_metadata.seq_lens[: attn_metadata.query_start_loc.numel() - 1]
        table = attn_metadata.block_table[: seq_lens.numel()]
        used = torch.arange(table.shape[1])[None, :] < ((seq_lens + block_size - 1) // block_size)[:, None]
        biased = (self.biased_blocks[table.long().clamp(min=0)] & used).any(1)
        for request in biased.nonzero()[:, 0].tolist():
            self._attend(layer, query, kv_cache, attn_metadata, output, request)
        return output

    def _attend(self, layer, query, kv_cache, attn_metadata, output, request: int) -> None:
        """One request's rows of ``output``: softmax(q k^T * scale + log s) v over its slots, causal."""
        start, end = (int(x) for x in attn_metadata.query_start_loc[request : request + 2])
        seq_len = int(attn_metadata.seq_lens[request])
        num_blocks, heads, block_size, width = kv_cache.shape
        dim = width // 2
        blocks = attn_metadata.block_table[request, : math.ceil(seq_len / block_size)].long()
        pairs = kv_cache.view(num_blocks, heads, 2 * block_size, dim)[blocks]  # (B, H, 2 * bs, D)
        packed = pairs[:, :, :block_size].reshape(len(blocks), heads, block_size * dim)
        keys = packed[:, :, self._key_layout(layer, kv_cache)].view(len(blocks), heads, block_size, dim)
        keys = keys.transpose(0, 1).reshape(heads, -1, dim)[:, :seq_len].float()  # (H, S, D)
        values = pairs[:, :, block_size:].transpose(0, 1).reshape(heads, -1, dim)[:, :seq_len].float()
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
        bias = self.log_sizes[slots].T  # (H, S)
        length, group = end - start, self.num_heads // heads
        q = query[start:end].float().view(length, heads, group, dim).permute(1, 2, 0, 3).reshape(heads, -1, dim)
        logits = torch.bmm(q, keys.transpose(1, 2)).mul_(self.scale).add_(bias[:, None, :])  # (H, G * Q, S)
        position = torch.arange(seq_len - length, seq_len).repeat(group)  # each query row's own position
        logits.masked_fill_(torch.arange(seq_len)[None, None, :] > position[None, :, None], float("-inf"))
        mixed = torch.bmm(torch.softmax(logits, -1), values)  # (H, G * Q, D)
        rows = mixed.view(heads, group, length, dim).permute(2, 0, 1, 3).reshape(length, heads * group, dim)
        target = output[start:end]
        target.copy_(rows.reshape(target.shape).to(target.dtype))

    def _key_layout(self, layer, kv_cache: torch.Tensor) -> torch.Tensor:
        """Where each (token, channel) of a block's keys sits in the kernel's packed block (bs * D,).

        Learnt by writing two probe blocks through :meth:`do_kv_cache_update` (vLLM's own write, which
        packs keys per ISA): one whose keys hold their token index, one their channel index (both
        exact in 16-bit floats for blocks and heads of at most 256).
        """
        if self._unpack is None:
            _, heads, block_size, width = kv_cache.shape
            dim = width // 2
            probe = kv_cache.new_zeros(1, heads, block_size, width)
            slots = torch.arange(block_size)
            found = []
            token, channel = torch.meshgrid(torch.arange(block_size), torch.arange(dim), indexing="ij")  # (bs, D) each
            for fill in (token, channel):
                keys = fill[:, None, :].expand(-1, heads, -1).to(kv_cache.dtype).contiguous()
                CPUAttentionBackendImpl.do_kv_cache_update(self, layer, keys, torch.zeros_like(keys), probe, slots)
                found.append(probe.view(1, heads, 2 * block_size, dim)[0, 0, :block_size].flatten().long())
            token, channel = found  # of each packed position
            layout = torch.empty(block_size * dim, dtype=torch.long)
            layout[token * dim + channel] = torch.arange(block_size * dim)
            self._unpack = layout
        return self._unpack


class SemantiCacheAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with :class:`SemantiCacheAttentionImpl`."""

    @staticmethod
    def get_impl_cls() -> type[SemantiCacheAttentionImpl]:
        return SemantiCacheAttentionImpl
