"""The decoding step's decoder layers as one TorchScript call (:meth:`~semanticache_rag.fused.FusedLlama.step`).

A decoding step of the default model is ~1,600 small tensor operations; called one by one from
Python, the interpreter's time between them (~7 ms per step on a 2-core CPU) is as large as the
matrix products with fp16 weights. Here the 30 layers run as one scripted function: the same
operations in the same order (``tests/test_weights.py`` holds the answers token for token), with
no Python between them. It covers caches whose document layers are plain tensors (full,
SemantiCache, SeKV, sections); coded layers (Kaizen) decode into a shared scratch buffer per layer
and keep the Python step.

``torch.compile`` was measured instead and was slower (fbgemm's packed products break its graph,
and the growing cache recompiles it). TorchScript is deprecated in torch; if scripting fails, the
Python step runs, so nothing depends on it but speed.

This module has no ``from __future__ import annotations``: TorchScript reads the annotations.
"""

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class ScriptedLayer(nn.Module):
    """One decoder layer for one new token: what the Python step's loop body computes."""

    def __init__(self, layer: Any, heads: int, kv_heads: int, dim: int):
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv, self.o = attention.qkv_proj, attention.o_proj
        self.gate_up, self.down = mlp.gate_up_proj, mlp.down_proj
        self.norm1, self.eps1 = layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon)
        self.norm2 = layer.post_attention_layernorm.weight
        self.eps2 = float(layer.post_attention_layernorm.variance_epsilon)
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.scaling = float(attention.scaling)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        swap: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor | None,
        appended_keys: torch.Tensor,
        appended_values: torch.Tensor,
        length: int,
    ) -> torch.Tensor:
        """``x`` (1, hidden) after this layer; the new key and value are written at ``length`` of the
        appended buffers (1, H_kv, capacity, D), the document's ``keys``/``values`` are (H_kv, L, D)
        and its ``bias`` (``log s``) (H_kv, L)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.dim
        q_size, kv_size = heads * dim, kv_heads * dim
        qkv = self.qkv.rows(F.rms_norm(x, [x.shape[-1]], self.norm1, self.eps1))
        qk = qkv[:, : q_size + kv_size].view(heads + kv_heads, dim)
        qk = torch.addcmul(qk * cos, qk.index_select(1, swap), sin)
        query = qk[:heads].view(kv_heads, heads // kv_heads, dim) * self.scaling
        appended_keys[0, :, length] = qk[heads:]
        appended_values[0, :, length] = qkv[0, q_size + kv_size :].view(kv_heads, dim)
        scores = torch.bmm(query, appended_keys[0, :, : length + 1].transpose(1, 2))
        doc_scores = torch.bmm(query, keys.transpose(1, 2))
        if bias is not None:
            doc_scores += bias[:, None]
        probs = torch.softmax(torch.cat([doc_scores, scores], dim=-1), dim=-1)
        num_doc = doc_scores.shape[-1]
        out = torch.bmm(probs[..., num_doc:], appended_values[0, :, : length + 1])
        out = torch.baddbmm(out, probs[..., :num_doc], values)
        x = x + self.o.rows(out.view(1, q_size))
        gate, up = self.gate_up.rows(F.rms_norm(x, [x.shape[-1]], self.norm2, self.eps2)).chunk(2, dim=-1)
        return x + self.down.rows(F.silu(gate) * up)


class ScriptedLayers(nn.Module):
    """Every decoder layer of a fused Llama model for one new token (scripted by :func:`script`)."""

    def __init__(self, model: Any, heads: int, kv_heads: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList([ScriptedLayer(layer, heads, kv_heads, dim) for layer in model.model.layers])

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        swap: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        appended_keys: list[torch.Tensor],
        appended_values: list[torch.Tensor],
        length: int,
    ) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(
                x, cos, sin, swap, keys[index], values[index], biases[index],
                appended_keys[index], appended_values[index], length,
            )  # fmt: skip
        return x


def script(model: Any, heads: int, kv_heads: int, dim: int) -> torch.jit.ScriptModule | None:
    """The scripted layers of ``model`` (sharing its weights), or ``None`` where TorchScript cannot take them."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice: the Python step stays as the fallback
            return torch.jit.script(ScriptedLayers(model, heads, kv_heads, dim))
    except Exception as exc:  # noqa: BLE001 - any failure to script means the Python step, which computes the same
        logger.info("decoding step not scripted (%s); the Python step runs", f"{exc}".split("\n")[0])
        return None
