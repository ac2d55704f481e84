"""How many tokens a rollout's unfinished requests have left, estimated from the lengths its requests finished at.

The rollout's lengths so far are survival data: a finished request is an event at its length (one cut at its token
budget is censored there, it did not choose to stop), an unfinished one is censored at what it has generated. The
Kaplan-Meier estimate gives the per-token hazard of stopping wherever requests were at risk; past the longest observed
length it is held at its mean over the observed range (stops per token at risk; its mean over the upper half alone,
where a reasoning task's responses end most, left out 18-38% of the tokens left on the reasoning recipe). The previous
rollout's lengths, where the caller has them, join the data: they reach past what this rollout has seen. The unfinished
requests of one (generated, budget) take the quantiles ``(i + 0.5) / n`` of their length given that they are still
running, cut at their budget, dealt to the instances in turn (a snake order: each instance gets a similar share of the
long ones).

Why not one figure for all: every fresh request of a rollout starts at once, so the unfinished ones have all generated
the same count and no finished request is longer; a single estimate (a median of longer lengths, or the budget) has
them all run to their cap, which on the reasoning recipe made the simulated rollout 17% longer than the measured one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch


def _survival(events: Sequence[int], censored: Sequence[int], horizon: int) -> torch.Tensor:
    """``S[t]`` = P(length > t) for t in [0, horizon], float64: Kaplan-Meier up to the longest observed length, then
    the mean hazard over the observed range (stops per token at risk; 0 where none stopped)."""
    size = horizon + 2

    def counts(lengths: Sequence[int]) -> torch.Tensor:
        return torch.bincount(torch.tensor(lengths, dtype=torch.int64).clamp(max=size - 1), minlength=size).double()

    stops = counts(events)
    leaves = stops + counts(censored)  # at risk through t, gone after it (stopped or censored)
    at_risk = len(events) + len(censored) - torch.cumsum(leaves, 0) + leaves  # still running at length t
    hazard = stops / at_risk.clamp(min=1)
    observed = min(max([*events, *censored, 0]), horizon)
    exposure = float(at_risk[1 : observed + 1].sum())
    hazard[observed + 1 :] = float(stops[1 : observed + 1].sum()) / exposure if exposure > 0 else 0.0
    hazard[0] = 0.0  # every request samples at least one token
    return torch.cumprod(1 - hazard, 0)[: horizon + 1]


def remaining_lengths(instances: Sequence[Sequence[tuple[int, int]]], finished: Sequence[tuple[int, bool]]) -> list[list[int]]:
    """Tokens left for each unfinished request ``(generated, budget)`` of each instance (at least 1, at most its budget
    less what it has), from the ``(length, censored)`` of requests that finished (censored: cut at a budget, or
    stopped unfinished at that length)."""
    requests = [(i, j, g, b) for i, reqs in enumerate(instances) for j, (g, b) in enumerate(reqs)]
    out = [[0] * len(reqs) for reqs in instances]
    if not requests:
        return out
    horizon = max(b for _, _, _, b in requests)
    events = [n for n, cut in finished if not cut]
    censored = [n for n, cut in finished if cut] + [g for _, _, g, _ in requests]
    survival = _survival(events, censored, horizon)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for i, j, g, b in requests:
        groups[(g, b)].append((i, j))
    for (g, b), members in groups.items():
        cap = max(1, b - g)
        alive = float(survival[min(g, horizon)])
        # P(length <= g + k | length > g) for k = 1 .. cap
        ended = 1 - survival[g + 1 : g + cap + 1] / alive if alive > 0 else torch.ones(cap, dtype=torch.float64)
        by_instance: dict[int, list[int]] = defaultdict(list)
        for i, j in members:
            by_instance[i].append(j)
        order = _snake(by_instance)
        quantiles = (torch.arange(len(order), dtype=torch.float64) + 0.5) / len(order)
        for (i, j), k in zip(order, (torch.searchsorted(ended, quantiles) + 1).tolist()):
            out[i][j] = min(cap, k)
    return out


def _snake(by_instance: dict[int, list[int]]) -> list[tuple[int, int]]:
    """The members in the order they take ascending quantiles: instances in turn, forwards then backwards each round."""
    queues = {i: list(js) for i, js in sorted(by_instance.items())}
    order: list[tuple[int, int]] = []
    forward = True
    while any(queues.values()):
        for i in list(queues) if forward else list(reversed(queues)):
            if queues[i]:
                order.append((i, queues[i].pop(0)))
        forward = not forward
    return order
