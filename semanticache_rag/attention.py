"""The attention function that serves questions from a (compressed) document cache.

It is registered with transformers' public ``AttentionInterface`` under :data:`ATTENTION_NAME`,
explicitly (:func:`register_attention`), never on import. It only takes over when the forward
call carries a :class:`~semanticache_rag.kv.ConversationKV` in the ``semanticache_kv`` keyword;
any other call (``model.generate`` by a user, say) is served by transformers' own SDPA function,
so a model loaded by this package still behaves as a stock model elsewhere.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from semanticache_rag.kernels.dispatch import proportional_attention

ATTENTION_NAME = "semanticache_rag"
_lock = threading.Lock()


def semanticache_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function: proportional attention over document + appended tokens.

    ``key``/``value`` are what ``ConversationKV.update`` returned: the appended tokens only.
    """
    state = kwargs.get("semanticache_kv")
    if state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    document = state.layers[module.layer_idx].document
    observe = getattr(state, "observe", None)
    if observe is not None and document is not None:  # e.g. SeKV scoring spans against a question
        observe(module.layer_idx, query, document, scaling)
    if document is None:
        return proportional_attention(query, key, value, scaling=scaling), None
    out = None if observe is not None else _kernel_step(module.layer_idx, state, query, key, value, scaling)
    if out is None:
        doc_keys, doc_values, doc_log_sizes = state.document_tensors(module.layer_idx)
        out = proportional_attention(query, key, value, doc_keys, doc_values, doc_log_sizes, scaling=scaling)
    return out, None


def _kernel_step(index: int, state, query, key, value, scaling) -> torch.Tensor | None:
    """One CPU token's attention over layer ``index``'s document as stored, through the C++ kernel
    (:mod:`semanticache_rag.kernels.cpu_ops`), as the converted-weights step makes it;
    ``None`` where that does not apply (a GPU, several tokens, a batch, low-rank sides, no kernel)."""
    from semanticache_rag import scripted_step
    from semanticache_rag.kernels import cpu_ops

    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if batch != 1 or length != 1 or query.device.type != "cpu" or query.dtype != torch.float32:
        return None
    if not cpu_ops.supports(dim, heads // kv_heads) or not cpu_ops.available():
        return None
    inputs = scripted_step.kept_step_inputs(state)
    if inputs is None or "low_rank" in (inputs[1][index], inputs[3][index]):
        return None
    keys, key_kinds, values, value_kinds, biases, _ = inputs
    scale = dim**-0.5 if scaling is None else scaling
    grouped = (query[0, :, 0] * scale).view(kv_heads, heads // kv_heads, dim)
    out = scripted_step.kernel_attention(
        grouped, keys[index], key_kinds[index], values[index], value_kinds[index], biases[index], key[0], value[0],
        False,  # q8_query: the model's own weights, the query as it is
    )  # fmt: skip
    return out.view(1, 1, heads, dim)


def register_attention() -> str:
    """Register :func:`semanticache_attention` with transformers (idempotent); return its name."""
    with _lock:
        if ATTENTION_NAME not in AttentionInterface._global_mapping:
            AttentionInterface.register(ATTENTION_NAME, semanticache_attention)
            # Masks for the fallback path are SDPA's; our path builds its own causal mask.
            AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def use_semanticache_attention(model: torch.nn.Module) -> None:
    """Route ``model``'s attention through :func:`semanticache_attention`."""
    model.set_attn_implementation(register_attention())  # type: ignore[operator]  # a PreTrainedModel method
