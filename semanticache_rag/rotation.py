"""Moving cached keys to other positions: with RoPE a shift of position is a rotation of the key.

Keys are cached after the rotary embedding: the key of a token at position ``p`` is ``R(p) k``.
``R(p + delta) = R(delta) R(p)``, so a cache prefilled at positions ``0..n`` moves to start at
``delta`` by rotating every key by ``R(delta)``; values do not move. The rotation is linear, so a
merged core (a mean of rotated keys) moves the same way, exactly. Done in float32 (kvpress's
``KeyRerotationPress`` and LMCache's CacheBlend re-rotation do the same for the same reason).

Only rotary embeddings whose frequencies do not depend on the sequence length can be shifted
this way; dynamic scaling (``"dynamic"``, ``"longrope"``) is refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch

from semanticache_rag.errors import ConfigError

_STATIC_ROPE = {"default", "linear", "llama3", "yarn", "proportional"}


def _rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "rotary_emb":
            return module
    raise ConfigError(
        f"{type(model).__name__} has no rotary embedding that this package can shift; long documents "
        "(read in sections) need a RoPE model such as Llama, Mistral or Qwen"
    )


def rope_frequencies(model: torch.nn.Module) -> list[torch.Tensor]:
    """Per decoder layer, the rotary inverse frequencies (D / 2,) float32 its keys were rotated with.

    Raises
    ------
    ConfigError
        The model has no rotary embedding, or one whose frequencies change with the length.
    """
    rotary: Any = _rotary_module(model)
    config: Any = model.config
    layers = config.num_hidden_layers
    rope_type = getattr(rotary, "rope_type", "default")
    types = rope_type if isinstance(rope_type, dict) else {None: rope_type}
    dynamic = sorted(str(t) for t in types.values() if t not in _STATIC_ROPE)
    if dynamic:
        raise ConfigError(
            f"{type(model).__name__} uses {', '.join(dynamic)} rotary scaling, whose angles depend on the "
            "sequence length, so a cached section cannot be moved; use a model with static RoPE for long documents"
        )
    if hasattr(rotary, "inv_freq"):
        return [rotary.inv_freq.float()] * layers
    layer_types = getattr(config, "layer_types", None)  # e.g. Gemma 3: sliding and full layers differ
    if layer_types is not None and all(hasattr(rotary, f"{t}_inv_freq") for t in set(layer_types)):
        return [getattr(rotary, f"{t}_inv_freq").float() for t in layer_types]
    raise ConfigError(f"cannot read the rotary frequencies of {type(model).__name__}")


def config_frequencies(config) -> torch.Tensor:
    """The rotary inverse frequencies (D / 2,) float32 of a model with plain RoPE, from its config alone
    (an engine of another framework holds no transformers model: vLLM's workers).

    Raises
    ------
    ConfigError
        Scaled or per-layer rotary embeddings (read those from the model: :func:`rope_frequencies`).
    """
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if rope_type != "default" or theta is None or getattr(config, "layer_types", None) is not None:
        raise ConfigError(
            f"{type(config).__name__} uses {rope_type!r} rotary embeddings with rope_theta={theta!r}; compact "
            "positions are read from the config for plain RoPE only"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    return 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rotate_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``keys`` (1, H, L, D), rotated at positions ``p``, as if they had been at ``p + delta``.

    Uses the ``rotate_half`` layout of transformers' RoPE models; with partial rotary embeddings
    (``2 * len(inv_freq) < D``, e.g. Phi) only the first ``2 * len(inv_freq)`` channels turn, as
    there. Angles, cosines and sines in float64 (exact for large deltas), the rotation in float32,
    returned in ``keys.dtype``. ``delta`` may be negative.
    """
    if delta == 0:
        return keys
    angles = float(delta) * inv_freq.to(keys.device, torch.float64)
    emb = torch.cat((angles, angles))
    cos, sin = emb.cos().float(), emb.sin().float()
    x = keys.float()
    width = emb.numel()
    turned, kept = x[..., :width], x[..., width:]
    half = width // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    return torch.cat((turned * cos + rotated * sin, kept), dim=-1).to(keys.dtype)
