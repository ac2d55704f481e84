"""KL-shaped rewards, the advantage estimators (GAE; critic-free GRPO, RLOO, REINFORCE++) and whitening over masked,
right-padded sequences.

All per-token tensors are ``[B, S]`` and aligned with the tokens (see :mod:`fusedrl.rlhf.experience`);
``mask`` is 1 on response tokens. Results are 0 outside the mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fusedrl.config import JobConfig
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.losses import explained_variance, kl_estimate


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

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}`` over each row's response
    tokens, ``t+1`` being the next response token: tokens outside ``mask`` inside a response (a multi-turn sample's
    observations) are skipped, and after the last response token the ``t+1`` terms are 0 (the episode ended).
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
        on = m > 0
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, a, next_adv)
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


def group_advantages(
    scores: torch.Tensor, groups: torch.Tensor, estimator: str, std_norm: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """One advantage per sample ``[B]`` from its score and its group's (``groups``: the group id of each sample).

    ``grpo``: ``(s - mean_g) / (std_g + eps)`` with the group's unbiased std (Bessel-corrected, as GRPO's paper), or
    ``s - mean_g`` without ``std_norm`` (Dr.GRPO); ``rloo``: ``s - mean of the other samples of its group``
    ``= n / (n - 1) * (s - mean_g)``. A group of one sample gets 0."""
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"group_advantages: unknown estimator {estimator!r}; valid: grpo, rloo")
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    s = scores.to(torch.float64)
    total = torch.zeros(len(counts), dtype=s.dtype).index_add_(0, inverse, s)
    n = counts.to(s.dtype)[inverse]
    mean = total[inverse] / n
    centred = s - mean
    if estimator == "rloo":
        adv = torch.where(n > 1, centred * n / (n - 1).clamp_min(1), torch.zeros_like(s))
    else:
        sq = torch.zeros(len(counts), dtype=s.dtype).index_add_(0, inverse, centred * centred)[inverse]
        std = (sq / (n - 1).clamp_min(1)).sqrt()
        adv = centred / (std + eps) if std_norm else centred
        adv = torch.where(n > 1, adv, torch.zeros_like(s))
    return adv.to(scores.dtype)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over each row's response tokens (0 outside ``mask``): :func:`gae` against zero
    values with ``lam = 1``, whose advantages are exactly these returns."""
    return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)[0]


def zero_variance_groups(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the sample's group has all scores equal (no learning signal for grpo / rloo)."""
    _, inverse = torch.unique(groups, return_inverse=True)
    values = scores.to(torch.float64)
    size = int(inverse.max()) + 1
    lo = torch.full((size,), torch.inf, dtype=values.dtype).scatter_reduce(0, inverse, values, "amin")
    hi = torch.full((size,), -torch.inf, dtype=values.dtype).scatter_reduce(0, inverse, values, "amax")
    return (lo == hi)[inverse]


def sample_groups(exp: Experience, n: int) -> torch.Tensor:
    """The group (prompt) of each sample: sample ids are ``prompt id * n + k`` (:func:`fusedrl.rlhf.build_requests`)."""
    assert exp.sample_ids is not None, "grouping needs sample_ids (Scorer.score sets them)"
    return exp.sample_ids // n


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment ``[B]``: 0 up to ``max_new_tokens - buffer`` tokens, then growing linearly to
    ``penalty`` at ``max_new_tokens``."""
    excess = (lengths.to(torch.float32) - (max_new_tokens - buffer)).clamp_min(0)
    return penalty * excess / buffer


def compute_advantages(cfg: JobConfig, exp: Experience) -> tuple[Experience, dict[str, float]]:
    """Per-token advantages of ``ppo.advantage_estimator`` over the whole batch (every rank holds it).

    ``gae``: KL-shaped per-token rewards, GAE on the Critic's values, optional whitening. ``grpo`` / ``rloo``: each
    sample's return (its score minus ``kl_coef`` x its summed KL) against its group's (:func:`group_advantages`), on
    every response token. ``reinforce_pp``: the discounted KL-shaped return of each token, whitened over the batch.
    The score first loses DAPO's soft overlong punishment (``ppo.overlong_buffer``). Responses that hit
    ``max_new_tokens`` follow ``ppo.truncated``: "score" treats them as finished, "penalty" subtracts
    ``ppo.truncation_penalty`` from their score, "mask" keeps them out of every loss (their advantages are computed,
    then their response mask is cleared; whitening is over the rest). With every response masked the batch has no
    token left: the caller skips the update."""
    ppo = cfg.ppo
    mask = exp.response_mask
    assert exp.scores is not None and exp.logprobs is not None, (
        "compute_advantages needs a scored batch (Scorer.score sets scores and logprobs)"
    )
    finished = exp.finished if exp.finished is not None else torch.ones(exp.batch_size, dtype=torch.bool)
    if ppo.truncated == "penalty":
        exp.scores = exp.scores - ppo.truncation_penalty * (~finished).to(exp.scores.dtype)
    if ppo.overlong_buffer > 0:
        lengths = mask.sum(1)
        exp.scores = exp.scores - overlong_penalty(  # a response's sampled tokens (every turn of an episode)
            lengths, cfg.response_budget, ppo.overlong_buffer, ppo.overlong_penalty
        ).to(exp.scores.dtype)
    ref = exp.ref_logprobs if exp.ref_logprobs is not None else exp.logprobs  # no Reference: no KL
    exp.token_rewards, kl = kl_shaped_rewards(exp.scores, exp.logprobs, ref, mask, ppo.kl_coef, ppo.kl_estimator)
    stats = {
        "kl": (kl.sum(1)).mean().item(),  # per-sample KL to the Reference
        "kl_per_token": (kl.sum() / mask.sum()).item(),
        "reward_mean": exp.scores.mean().item(),
        "reward_std": exp.scores.std(unbiased=False).item(),
        "truncated_frac": 1.0 - finished.float().mean().item(),
    }
    estimator = ppo.advantage_estimator
    if estimator == "gae":
        assert exp.values is not None, "gae needs the Critic's values (Scorer.score sets them with a Critic)"
        exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, mask, ppo.gamma, ppo.lam)
        # the old values' fit to the returns, over the whole batch (token-weighted; 0 for constant returns)
        stats["explained_variance"] = explained_variance(exp.values, exp.returns, mask).item()
    elif estimator in ("grpo", "rloo"):
        groups = sample_groups(exp, cfg.generation.n)
        sample_return = exp.token_rewards.sum(1)
        adv = group_advantages(sample_return, groups, estimator, ppo.grpo_std_norm)
        exp.advantages = adv[:, None] * mask.to(adv.dtype)
        exp.returns = sample_return[:, None] * mask.to(adv.dtype)
        stats["zero_std_groups_frac"] = zero_variance_groups(exp.scores, groups).float().mean().item()
    else:  # reinforce_pp
        exp.returns = discounted_returns(exp.token_rewards, mask, ppo.gamma)
        exp.advantages = exp.returns.clone()
    if ppo.truncated == "mask":
        exp.response_mask = mask = mask * finished[:, None].to(mask.dtype)
        exp.advantages, exp.returns = exp.advantages * mask, exp.returns * mask
    if not mask.any():
        return exp, stats | {"return_mean": 0.0, "return_std": 0.0}
    if (estimator == "gae" and ppo.whiten_advantages) or estimator == "reinforce_pp":
        exp.advantages = whiten(exp.advantages, mask)
    ret_mean, ret_var, _ = masked_mean_var(exp.returns, mask)
    adv_mean, adv_var, _ = masked_mean_var(exp.advantages, mask)
    return exp, stats | {
        "return_mean": ret_mean.item(),
        "return_std": ret_var.sqrt().item(),
        "advantage_mean": adv_mean.item(),
        "advantage_std": adv_var.sqrt().item(),
    }
