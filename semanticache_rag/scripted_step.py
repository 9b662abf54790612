"""The decoding step's decoder layers as one TorchScript call (:meth:`~semanticache_rag.fused.FusedLlama.step`).

A decoding step of the default model is ~1,600 small tensor operations; called one by one from
Python, the interpreter's time between them (~7 ms per step on a 2-core CPU) is as large as the
matrix products with fp16 weights. Here the 30 layers run as one scripted function: the same
operations in the same order as the Python loop (``tests/test_weights.py`` holds the answers token
for token), with no Python between them. Document layers may be plain tensors (full, SemantiCache,
SeKV, sections) or KV-Kaizen's coded ones (int8/int4 codes decoded into the conversation's scratch
buffer, 16-bit copies, rank-``r`` factors attended through their factors, shared layers); a cache
with a layer of another kind (codes of another dtype) keeps the Python loop.

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

from semanticache_rag.dequantize import decode_groups_into
from semanticache_rag.kv import CodedLayerKV, LayerKV, SharedLayerKV
from semanticache_rag.tensor_codes import HalfTensor, LowRankTensor, QuantizedTensor

logger = logging.getLogger(__name__)

# How a document layer's keys or values are stored (:func:`step_inputs`), and the tensors passed for them:
# "plain" (H, L, D); "int8" / "int4" / "int3" codes, scales, minimums; "half" data; "low_rank" coefficients, basis.
# (Strings: TorchScript reads no module-level ints.)


def _matrix(kind: str, parts: list[torch.Tensor], scratch: torch.Tensor) -> torch.Tensor:
    """Keys or values (H, L, D) of a layer stored as ``kind``, decoded into ``scratch`` (flat fp32) where
    coded, as :class:`~semanticache_rag.tensor_codes.QuantizedTensor` and ``HalfTensor`` decode them."""
    if kind == "plain":
        return parts[0]
    data = parts[0]
    bits = 4 if kind == "int4" else 3 if kind == "int3" else 8
    columns = data.shape[2] * 8 // bits
    out = scratch[: data.shape[0] * data.shape[1] * columns].view(data.shape[0], data.shape[1], columns)
    if kind == "half":
        return out.copy_(data)
    return decode_groups_into(data, parts[1], parts[2], bits, out)


def kernel_arguments(
    kind: str, parts: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """A side stored as ``kind`` (not ``"low_rank"``) as the attention kernel takes it: rows or codes,
    scales, minimums, bits (:mod:`semanticache_rag.kernels.decode_attention_ref`)."""
    if kind == "plain":
        return parts[0], None, None, 32 if parts[0].dtype == torch.float32 else 16
    if kind == "half":
        return parts[0], None, None, 16
    return parts[0], parts[1], parts[2], 4 if kind == "int4" else 3 if kind == "int3" else 8


def kernel_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    key_kind: str,
    values: list[torch.Tensor],
    value_kind: str,
    bias: torch.Tensor | None,
    appended_keys: torch.Tensor,
    appended_values: torch.Tensor,
    q8_query: bool,
) -> torch.Tensor:
    """One token's attention (H_kv, G, D) over a document layer as stored and the appended (H_kv, T, D),
    by the operator ``semanticache::decode_attention`` (:mod:`semanticache_rag.kernels.cpu_ops`); ``q8_query``:
    coded keys scored against the query rounded to Q8_0 (:func:`rounds_query`)."""
    key, key_scales, key_minimums, key_bits = kernel_arguments(key_kind, keys)
    value, value_scales, value_minimums, value_bits = kernel_arguments(value_kind, values)
    return torch.ops.semanticache.decode_attention(
        query, key, key_scales, key_minimums, key_bits, value, value_scales, value_minimums, value_bits,
        bias, appended_keys, appended_values, q8_query,
    )  # fmt: skip


def rounds_query(layer: Any) -> bool:
    """Whether the kernel scores ``layer``'s coded document keys against its query rounded to Q8_0
    (``kernels/attention_q8.h``): where its products quantise their rows so (``weights="int4"``, llama.cpp's
    arithmetic, which scores a quantised K cache so too)."""
    from semanticache_rag.weights import Int4Linear

    qkv = layer.self_attn.qkv_proj
    return isinstance(qkv, Int4Linear) and not qkv.fp32_rows


class ScriptedLayer(nn.Module):
    """One decoder layer for one new token: what the Python step's loop body computes."""

    def __init__(self, layer: Any, heads: int, kv_heads: int, dim: int, kernel: bool):
        super().__init__()
        self.kernel = kernel  # attend through the C++ kernel (kernels/cpu_ops.py), low-rank layers excepted
        self.q8_query = rounds_query(layer)
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
        keys: list[torch.Tensor],
        key_kind: str,
        values: list[torch.Tensor],
        value_kind: str,
        bias: torch.Tensor | None,
        appended_keys: torch.Tensor,
        appended_values: torch.Tensor,
        length: int,
        scratch_keys: torch.Tensor,
        scratch_values: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` (1, hidden) after this layer; the new key and value are written at ``length`` of the
        appended buffers (1, H_kv, capacity, D); the document's keys and values are stored as their
        kinds say (:func:`step_inputs`), its ``bias`` (``log s``) is (H_kv, L)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.dim
        q_size, kv_size = heads * dim, kv_heads * dim
        qkv = self.qkv.rows(torch.ops.semanticache.rms_norm(x, self.norm1, self.eps1))
        qk = qkv[:, : q_size + kv_size].view(heads + kv_heads, dim)
        qk = torch.addcmul(qk * cos, qk.index_select(1, swap), sin)
        query = qk[:heads].view(kv_heads, heads // kv_heads, dim) * self.scaling
        appended_keys[0, :, length] = qk[heads:]
        appended_values[0, :, length] = qkv[0, q_size + kv_size :].view(kv_heads, dim)
        if self.kernel and key_kind != "low_rank" and value_kind != "low_rank":
            out = kernel_attention(
                query, keys, key_kind, values, value_kind, bias,
                appended_keys[0, :, : length + 1], appended_values[0, :, : length + 1], self.q8_query,
            )  # fmt: skip
            return self._rest(x, out)
        # without the kernel: exact key scores, int4 weights included (as the Python loop's fallback)
        scores = torch.bmm(query, appended_keys[0, :, : length + 1].transpose(1, 2))
        if key_kind == "low_rank":  # (q @ B^T) @ A^T, as semanticache_rag.coded_attention attends factors
            doc_scores = torch.bmm(torch.bmm(query, keys[1].float().transpose(1, 2)), keys[0].float().transpose(1, 2))
        else:
            doc_scores = torch.bmm(query, _matrix(key_kind, keys, scratch_keys).transpose(1, 2))
        if bias is not None:
            doc_scores += bias[:, None]
        probs = torch.softmax(torch.cat([doc_scores, scores], dim=-1), dim=-1)
        num_doc = doc_scores.shape[-1]
        out = torch.bmm(probs[..., num_doc:], appended_values[0, :, : length + 1])
        if value_kind == "low_rank":
            out = torch.baddbmm(out, torch.bmm(probs[..., :num_doc], values[0].float()), values[1].float())
        else:
            out = torch.baddbmm(out, probs[..., :num_doc], _matrix(value_kind, values, scratch_values))
        return self._rest(x, out)

    def _rest(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer after attention: output projection, residual, MLP, residual."""
        x = x + self.o.rows(out.view(1, self.heads * self.dim))
        gate, up = self.gate_up.rows(torch.ops.semanticache.rms_norm(x, self.norm2, self.eps2)).chunk(2, dim=-1)
        return x + self.down.rows(F.silu(gate) * up)


class ScriptedLayers(nn.Module):
    """Every decoder layer of a fused Llama model for one new token (scripted by :func:`script`)."""

    def __init__(self, model: Any, heads: int, kv_heads: int, dim: int, kernel: bool):
        super().__init__()
        layers = [ScriptedLayer(layer, heads, kv_heads, dim, kernel) for layer in model.model.layers]
        self.layers = nn.ModuleList(layers)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        swap: torch.Tensor,
        keys: list[list[torch.Tensor]],
        key_kinds: list[str],
        values: list[list[torch.Tensor]],
        value_kinds: list[str],
        biases: list[torch.Tensor | None],
        appended_keys: list[torch.Tensor],
        appended_values: list[torch.Tensor],
        length: int,
        scratch_keys: torch.Tensor,
        scratch_values: torch.Tensor,
    ) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(
                x, cos, sin, swap, keys[index], key_kinds[index], values[index], value_kinds[index], biases[index],
                appended_keys[index], appended_values[index], length, scratch_keys, scratch_values,
            )  # fmt: skip
        return x


def script(model: Any, heads: int, kv_heads: int, dim: int, kernel: bool) -> torch.jit.ScriptModule | None:
    """The scripted layers of ``model`` (sharing its weights), attending through the C++ kernel where
    ``kernel``, or ``None`` where TorchScript cannot take them."""
    import warnings

    from semanticache_rag.kernels import cpu_ops

    cpu_ops.define()  # the operators the step calls (rms_norm always, decode_attention where ``kernel``)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice: the Python step stays as the fallback
            return torch.jit.script(ScriptedLayers(model, heads, kv_heads, dim, kernel))
    except Exception as exc:  # noqa: BLE001 - any failure to script means the Python step, which computes the same
        logger.info("decoding step not scripted (%s); the Python step runs", f"{exc}".split("\n")[0])
        return None


def _stored(code) -> tuple[str, list[torch.Tensor]] | None:
    """A layer's keys or values as (kind, tensors without the batch dimension), or ``None`` for a
    storage the scripted step does not attend (coded tensors of another dtype)."""
    if isinstance(code, torch.Tensor):
        return "plain", [code[0]]
    if getattr(code, "dtype", None) != torch.float32:
        return None
    if isinstance(code, QuantizedTensor):
        return f"int{code.bits}", [code.codes[0], code.scales[0], code.minimums[0]]
    if isinstance(code, HalfTensor):
        return "half", [code.data[0]]
    if isinstance(code, LowRankTensor):
        return "low_rank", [code.coefficients[0], code.basis[0]]
    return None


def kept_step_inputs(kv) -> tuple | None:
    """:func:`step_inputs` of ``kv``, made at the first call and kept on it (a conversation's document
    layers never change); ``None`` where the step cannot take them."""
    if kv.step_inputs is None:
        kv.step_inputs = step_inputs(kv) or ()
    return kv.step_inputs or None


def kept_step_document(kv):
    """The document of ``kv`` as the C++ step takes it (``torch.classes.semanticache.StepDocument``:
    per layer its rows or codes, scales, minimums and bits, its ``log s``), made at the first call and
    kept on it; ``None`` where the step cannot take it (a low-rank layer, or no :func:`step_inputs`)."""
    if kv.step_document is None:
        document = _step_document(kept_step_inputs(kv))
        kv.step_document = False if document is None else document
    return None if kv.step_document is False else kv.step_document


def _step_document(inputs: tuple | None):
    if inputs is None:
        return None
    keys, key_kinds, values, value_kinds, biases, _ = inputs
    if "low_rank" in key_kinds or "low_rank" in value_kinds:
        return None
    empty = torch.empty(0)
    tensors, bits = [], []
    for layer_keys, key_kind, layer_values, value_kind, bias in zip(keys, key_kinds, values, value_kinds, biases):
        for kind, parts in ((key_kind, layer_keys), (value_kind, layer_values)):
            data, scales, minimums, width = kernel_arguments(kind, parts)
            tensors += [data, empty if scales is None else scales, empty if minimums is None else minimums]
            bits.append(width)
        tensors.append(empty if bias is None else bias)
    return torch.classes.semanticache.StepDocument(tensors, bits)


def step_inputs(kv) -> tuple | None:
    """The document inputs of the scripted step for conversation ``kv`` (``None`` where it cannot take
    them): per layer its keys' and values' kinds and tensors, its ``log s``, and the scratch size."""
    keys, key_kinds, values, value_kinds, biases = [], [], [], [], []
    scratch = 0
    for index, layer in enumerate(kv.layers):
        document = layer.document
        source = document.source if isinstance(document, SharedLayerKV) else document
        if isinstance(source, LayerKV):
            stored = (_stored(source.keys), _stored(source.values))
            shapes = [source.keys.shape, source.values.shape]
        elif isinstance(source, CodedLayerKV):
            stored = (_stored(source.key_code), _stored(source.value_code))
            shapes = [source.key_code.shape, source.value_code.shape]
        else:
            return None
        key, value = stored
        if key is None or value is None:
            return None
        (key_kind, key_parts), (value_kind, value_parts) = key, value
        keys.append(key_parts)
        key_kinds.append(key_kind)
        values.append(value_parts)
        value_kinds.append(value_kind)
        bias = kv.log_sizes(index)
        biases.append(None if bias is None else bias[0])
        scratch = max([scratch] + [shape.numel() for shape in shapes])
    return keys, key_kinds, values, value_kinds, biases, scratch
