"""KL-shaped rewards, GAE and advantage whitening over masked, right-padded sequences.

All per-token tensors are ``[B, S]`` and aligned with the tokens (see :mod:`fusedrl.rlhf.experience`);
``mask`` is 1 on response tokens. Results are 0 outside the mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fusedrl.config import JobConfig
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.losses import explained_variance

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of the sampled tokens.

    ``k1 = log p - log q`` (unbiased, can be negative); ``k2 = (log p - log q)^2 / 2`` (biased, always >= 0,
    low variance; its gradient is that of the reverse KL's); ``k3 = (r - 1) - log r`` with ``r = q / p``
    (unbiased, always >= 0, lower variance; J. Schulman, "Approximating KL divergence").
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if estimator == "k3":
        log_ratio = ref_logprobs - logprobs
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of ``mask`` ([B]); raises if a row has no response token."""
    m = mask.bool()
    if not m.any(dim=1).all():
        rows = (~m.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} have an empty response mask; every sample needs at least one response token")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(m)
    return torch.where(m, positions, -1).amax(dim=1)


def kl_shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``-kl_coef * kl`` plus the sample's score on its last response token.

    Returns ``(token_rewards, kl)``, both ``[B, S]`` and zero outside ``mask``.
    """
    mask = mask.to(logprobs.dtype)
    kl = kl_estimate(logprobs, ref_logprobs, estimator) * mask
    rewards = -kl_coef * kl
    last = last_token_index(mask)
    rewards = rewards.scatter_add(1, last[:, None], scores.to(rewards.dtype)[:, None])
    return rewards, kl


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation by a backward scan; returns ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where the
    ``t+1`` terms are 0 when token ``t+1`` is not a response token (the episode ended at ``t``).
    ``returns = advantages + values`` on response tokens.
    """
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = (delta + gamma * lam * next_adv) * m
        adv[:, t] = a
        next_value = values[:, t] * m
        next_adv = a
    return adv, (adv + values) * mask


def masked_mean_var(
    x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, (population) variance and count of ``x`` over ``mask``; global over ``group`` when given."""
    mask = mask.to(x.dtype)
    sums = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).to(torch.float64)
    if group is not None:
        dist.all_reduce(sums, group=group)
    total, total_sq, count = sums.unbind()
    if count == 0:
        raise ValueError("cannot compute statistics over an empty mask (no response tokens)")
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0)
    return mean.to(x.dtype), var.to(x.dtype), count


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``) over masked entries.

    With ``group`` the statistics are taken over all ranks of the group (one ``all_reduce``).
    """
    mean, var, _ = masked_mean_var(x, mask, group)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def compute_advantages(cfg: JobConfig, exp: Experience) -> tuple[Experience, dict[str, float]]:
    """KL-shaped per-token rewards, GAE, and whitening over the whole batch (every rank holds it).

    Responses that hit ``max_new_tokens`` follow ``ppo.truncated``: "score" treats them as finished, "penalty"
    subtracts ``ppo.truncation_penalty`` from their score, "mask" keeps them out of every loss (their rewards and
    advantages are computed, then their response mask is cleared; whitening is over the rest). With every
    response masked the batch has no token left: the caller skips the update."""
    ppo = cfg.ppo
    mask = exp.response_mask
    assert exp.scores is not None and exp.logprobs is not None and exp.ref_logprobs is not None and exp.values is not None, (
        "compute_advantages needs a scored batch (Scorer.score sets scores, logprobs, ref_logprobs and values)"
    )
    finished = exp.finished if exp.finished is not None else torch.ones(exp.batch_size, dtype=torch.bool)
    if ppo.truncated == "penalty":
        exp.scores = exp.scores - ppo.truncation_penalty * (~finished).to(exp.scores.dtype)
    exp.token_rewards, kl = kl_shaped_rewards(exp.scores, exp.logprobs, exp.ref_logprobs, mask, ppo.kl_coef, ppo.kl_estimator)
    exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, mask, ppo.gamma, ppo.lam)
    stats = {
        "kl": (kl.sum(1)).mean().item(),  # per-sample KL to the Reference
        "kl_per_token": (kl.sum() / mask.sum()).item(),
        "reward_mean": exp.scores.mean().item(),
        "reward_std": exp.scores.std(unbiased=False).item(),
        "truncated_frac": 1.0 - finished.float().mean().item(),
        # the old values' fit to the returns, over the whole batch (token-weighted; 0 for constant returns)
        "explained_variance": explained_variance(exp.values, exp.returns, mask).item(),
    }
    if ppo.truncated == "mask":
        exp.response_mask = mask = mask * finished[:, None].to(mask.dtype)
        exp.advantages, exp.returns = exp.advantages * mask, exp.returns * mask
    if not mask.any():
        return exp, stats | {"return_mean": 0.0, "return_std": 0.0}
    if ppo.whiten_advantages:
        exp.advantages = whiten(exp.advantages, mask)
    ret_mean, ret_var, _ = masked_mean_var(exp.returns, mask)
    return exp, stats | {"return_mean": ret_mean.item(), "return_std": ret_var.sqrt().item()}
