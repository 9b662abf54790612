"""Each token's surprisal ``-log p`` while a document is read, without its logits whole in memory.

Reading with surprisal (the SemantiCache anchors' signal) needs ``-log p`` of every next token. The
logits of a 512-token chunk over a 49K vocabulary are 100 MB; here they are computed a block of
positions and of vocabulary at a time with a running logsumexp (``-log p = logsumexp - logit``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

# positions whose logits exist at once while reading with surprisal, and how many of their vocabulary's
# logits at a time (2 MB): fewer bytes than a prefill chunk's own temporaries, so that surprisal does not
# raise a read's peak memory (the whole vocabulary at once was 12.6 MB, +8 MiB over an uncompressed read's
# peak at 7K tokens). Many positions by a narrow block, not few by a wide one: the head's products run at
# 167 GFLOP/s with 512 x 1,024 and 88 with 64 x 8,192 (2 cores, the default model's 576 x 49,152 head).
# A head that is a module (no plain weight) gives whole rows of logits: 64 positions at a time there.
SURPRISAL_ROWS = 512
HEAD_ROWS = 64
VOCABULARY_BLOCK = 1024
# causal LMs whose logits are exactly their output head over the final hidden states (no scaling or capping)
PLAIN_HEAD = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def neg_log_probs(rows: torch.Tensor, wanted: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``-log p`` of ``wanted`` (R,) under the logits ``rows @ weight.T`` (or ``rows`` themselves when ``weight``
    is None), :data:`VOCABULARY_BLOCK` logits of each row at a time with a running logsumexp."""
    blocks: Iterable[tuple[int, torch.Tensor]]
    if weight is None:
        blocks = [(0, rows.float())]
    else:
        blocks = (
            (v, F.linear(rows.to(weight.dtype), weight[v : v + VOCABULARY_BLOCK]))
            for v in range(0, weight.shape[0], VOCABULARY_BLOCK)
        )
    top = torch.full((len(wanted),), float("-inf"), device=rows.device)
    total = torch.zeros(len(wanted), device=rows.device)
    picked = torch.zeros(len(wanted), device=rows.device)
    for first, logits in blocks:
        logits = logits.float()
        inside = (wanted >= first) & (wanted < first + logits.shape[1])
        picked += torch.where(
            inside, logits.gather(1, (wanted - first).clamp(0, logits.shape[1] - 1)[:, None])[:, 0], 0
        )
        peak = torch.maximum(top, logits.amax(dim=-1))
        # in place (the block is not needed after): no second (rows, block) tensor
        total = total * (top - peak).exp() + logits.sub_(peak[:, None]).exp_().sum(dim=-1)
        top = peak
    return total.log() + top - picked


def plain_head(model) -> bool:
    """Whether ``model``'s logits are its output head over its final hidden states (then the head is
    applied here, a block at a time): a class in :data:`PLAIN_HEAD`, or a model with the lean pass."""
    return getattr(model, "semanticache_forward", None) is not None or type(model).__name__ in PLAIN_HEAD


def blockwise(hidden: torch.Tensor, targets: torch.Tensor, head) -> torch.Tensor:
    """``-log p`` of ``targets`` (R,) under ``head`` over ``hidden`` (R, hidden size): a head with a plain
    weight matrix :data:`SURPRISAL_ROWS` positions and :data:`VOCABULARY_BLOCK` logits at a time, any other
    head module (a converted layer) :data:`HEAD_ROWS` positions at a time; ``head=None``: ``hidden`` are the
    logits themselves, taken :data:`HEAD_ROWS` positions at a time."""
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point():
        module = None
    else:
        module, weight = head, None
    out = torch.empty(len(targets))
    step = SURPRISAL_ROWS if weight is not None else HEAD_ROWS
    with torch.inference_mode():
        for row in range(0, len(targets), step):
            wanted = targets[row : row + step]
            rows = hidden[row : row + len(wanted)]
            rows = module(rows) if module is not None else rows
            out[row : row + len(wanted)] = neg_log_probs(rows, wanted.to(rows.device), weight).cpu()
    return out
