"""The search for SemantiCache's threshold: per head, the largest tau whose clustering keeps a budget.

Each round clusters :data:`SEARCH_WAYS` candidates per head at once (the clustering's cost barely grows
with them) and narrows a bracket around the budget; see :func:`search_tau`.
"""

from __future__ import annotations

import math

import torch

SEARCH_WAYS = 4  # tau candidates per head clustered at once in each round of the search
SPREAD = 1 / 8  # share of the bracket either side of an interpolated guess that the search also tries


def seeds_at(cluster, tau: torch.Tensor) -> torch.Tensor:
    """The seeds (H, N) of a clustering (:meth:`~.semanticache.SemantiCacheCompressor._clustering`) at one
    tau per head (H,)."""
    return cluster(tau[None])[1](torch.zeros(tau.numel(), dtype=torch.long))


def search_tau(cluster, heads: int, plan, search_steps: int) -> torch.Tensor:
    """Per head, the clustering (seeds, (H, N)) at the largest tau that keeps at most ``plan.target`` entries.

    Each round clusters :data:`SEARCH_WAYS` candidates per head at once and keeps the bracket
    ``low < tau* <= high`` with the counts at both ends. The first round spreads the candidates
    evenly; later rounds put them where the counts interpolate to the target (the guess and
    :data:`SPREAD` of the bracket either side of it, and the middle of the wider side left), and
    fall back to even spacing for a head whose bracket shrank less than :data:`SEARCH_WAYS` + 1
    times. The search ends once every head keeps its budget to within 0.1% or one entry (at most
    ``plan.target`` entries, at least ``max(1, plan.target // 1000)`` fewer) or its bracket is within
    ``search_steps`` halvings of [-1, 1]. The seeds of the tau found are kept from the round that
    tried it, rather than clustered once more.
    """
    target, slack = plan.target, max(1, plan.target // 1000)
    low, high = torch.full((heads,), -1.0), torch.full((heads,), 1.0 + 1e-6)
    # At tau = -1 each chunk's first free token takes the rest of it; above 1 nothing merges.
    free_chunks = plan.layout.token_chunk[~plan.protected].unique().numel()
    count_low = torch.full((heads,), float(int(plan.protected.sum()) + free_chunks))
    count_high = torch.full((heads,), float(plan.protected.numel()))
    even = torch.arange(1, SEARCH_WAYS + 1, dtype=torch.float32)[:, None] / (SEARCH_WAYS + 1)
    spread = torch.tensor([-SPREAD, 0.0, SPREAD])[:, None]
    uniform = torch.ones(heads, dtype=torch.bool)  # heads whose next candidates are spread evenly
    precision = 2.0 ** (1 - search_steps)
    best: torch.Tensor | None = None  # seeds at `low`, for the heads where a candidate fitted (low > -1)
    for _ in range(2 * math.ceil(search_steps * math.log(2) / math.log(SEARCH_WAYS + 1))):
        width = high - low
        share = ((math.log(target) - count_low.log()) / (count_high.log() - count_low.log()).clamp(min=1e-9)).clamp(
            0, 1
        )
        guess = low + width * share
        wider = torch.where(guess - low > high - guess, (low + guess) / 2, (guess + high) / 2)
        aimed = torch.cat([guess + width * spread, wider[None]]).sort(0).values
        aimed = aimed.clamp(low + width / 64, high - width / 64)
        candidates = torch.where(uniform, low + width * even, aimed)  # (K, H), increasing along K
        counts, pick = cluster(candidates)
        counts = counts.float()
        fits = counts <= target
        # the last candidate that fits, and the first above it (counts grow with tau)
        last = torch.where(fits, torch.arange(SEARCH_WAYS)[:, None], -1).amax(0)
        at, above = last.clamp(min=0)[None], (last + 1).clamp(max=SEARCH_WAYS - 1)[None]
        inside = last < SEARCH_WAYS - 1
        high = torch.where(inside, candidates.gather(0, above)[0], high)
        count_high = torch.where(inside, counts.gather(0, above)[0], count_high)
        low = torch.where(last >= 0, candidates.gather(0, at)[0], low)
        count_low = torch.where(last >= 0, counts.gather(0, at)[0], count_low)
        chosen = pick(at[0])  # (H, N)
        moved = (last >= 0).to(chosen.device)[:, None]
        best = chosen if best is None else torch.where(moved, chosen, best)
        close = (low > -1) & (count_low >= target - slack)
        if bool((close | (high - low <= precision)).all()):
            break
        uniform = (high - low) * (SEARCH_WAYS + 1) > width
    found = low > -1  # candidates lie above -1: low moved exactly where one fitted
    if best is None or not bool(found.all()):  # a head where no candidate fitted keeps tau = -1
        at_low = seeds_at(cluster, low)
        best = at_low if best is None else torch.where(found.to(at_low.device)[:, None], best, at_low)
    return best
