"""PPO losses shaped for a pipeline executor's last stage.

Alignment: a decoder's output at position ``t`` is computed from ``tokens[:, :t+1]`` and predicts
token ``t+1``. Per-token targets are aligned with the tokens they score (see
:mod:`fusedrl.rlhf.experience`), so the log-prob of token ``t`` and the value of the state before
token ``t`` both come from output position ``t - 1``; :func:`shift_to_tokens` does that shift
(column 0, never a response token, gets 0).

Losses are token means over ``response_mask``. By default the mean is per micro-batch; pass a
``loss_denom`` target (``[B]``, each entry the number of response tokens of the whole minibatch)
to get one global token mean when gradients of several micro-batches are accumulated.
The ``stats`` dicts hold detached scalar tensors (no host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedrl.config import PPOSection


def shift_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """Move output-position tensors (``[B, S, ...]``) to token alignment: result[:, t] = input[:, t-1]."""
    return torch.cat([torch.zeros_like(per_position[:, :1]), per_position[:, :-1]], dim=1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, S]`` log-probs of ``tokens`` under ``logits`` ``[B, S, V]`` (token-aligned; column 0 is 0)."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, S]`` entropy of the distribution that sampled each token (token-aligned; column 0 is 0)."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return F.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of ``x`` over ``mask`` divided by the mask's sum (or by ``denom[0]`` when given)."""
    total = (x * mask).sum()
    if denom is not None:
        return total / denom.reshape(-1)[0].to(x.dtype)
    return total / mask.sum().clamp_min(1)


def _require(targets: dict[str, torch.Tensor], names: tuple[str, ...], fn: str) -> None:
    missing = [n for n in names if n not in targets]
    if missing:
        raise ValueError(f"{fn} targets lack {missing}; pass {list(names)} (e.g. Experience.targets(...))")


def policy_loss(
    logits: torch.Tensor,
    targets: dict[str, torch.Tensor],
    clip_eps: float = 0.2,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate (plus ``-entropy_coef * entropy``) from Actor ``logits`` ``[B, S, V]``.

    ``targets``: ``tokens``, ``response_mask``, ``logprobs`` (old), ``advantages`` (all ``[B, S]``),
    optional ``loss_denom``. ``temperature`` must be the sampling temperature the old log-probs used.
    """
    _require(targets, ("tokens", "response_mask", "logprobs", "advantages"), "policy_loss")
    mask = targets["response_mask"].float()
    denom = targets.get("loss_denom")
    logp = token_logprobs(logits, targets["tokens"], temperature)
    log_ratio = (logp - targets["logprobs"].float()) * mask
    ratio = log_ratio.exp()
    adv = targets["advantages"].float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg_loss = masked_mean(torch.maximum(unclipped, clipped), mask, denom)
    loss = pg_loss
    entropy = None
    if entropy_coef != 0.0:
        entropy = masked_mean(token_entropy(logits, temperature), mask, denom)
        loss = loss - entropy_coef * entropy
    with torch.no_grad():
        stats = {
            "policy_loss": pg_loss.detach(),
            "clip_frac": masked_mean((clipped > unclipped).float(), mask),
            # k3 estimate of KL(old || new) on the sampled tokens
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "entropy": (entropy if entropy is not None else masked_mean(token_entropy(logits, temperature), mask)).detach(),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor, targets: dict[str, torch.Tensor], value_clip_eps: float | None = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` from Critic output ``[B, S, 1]`` or ``[B, S]``.

    ``targets``: ``response_mask``, ``values`` (old), ``returns`` (all ``[B, S]``), optional
    ``loss_denom``. ``V_clip = V_old + clamp(V - V_old, -eps, eps)``; ``value_clip_eps=None`` disables it.
    """
    _require(targets, ("response_mask", "values", "returns"), "value_loss")
    if values.dim() == 3:
        values = values.squeeze(-1)
    mask = targets["response_mask"].float()
    v = shift_to_tokens(values.float())
    ret = targets["returns"].float()
    err = (v - ret) ** 2
    if value_clip_eps is None:
        per_token = err
        clip_frac = torch.zeros((), device=v.device)
    else:
        old = targets["values"].float()
        v_clipped = old + (v - old).clamp(-value_clip_eps, value_clip_eps)
        err_clipped = (v_clipped - ret) ** 2
        per_token = torch.maximum(err, err_clipped)
        clip_frac = masked_mean((err_clipped > err).float(), mask).detach()
    loss = 0.5 * masked_mean(per_token, mask, targets.get("loss_denom"))
    with torch.no_grad():
        stats = {
            "value_loss": loss.detach(),
            "value_clip_frac": clip_frac,
            "value_mean": masked_mean(v, mask),
            "explained_variance": explained_variance(v, ret, mask),
        }
    return loss, stats


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[target - pred] / Var[target]`` over masked entries (NaN when the target is constant)."""
    mask = mask.float()

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = masked_mean(x, mask)
        return masked_mean((x - mean) ** 2, mask)

    return 1.0 - var(target - pred) / var(target)


class PolicyLoss:
    """``policy_loss`` with fixed hyper-parameters: ``PolicyLoss(0.2, 0.01)(logits, targets) -> (loss, stats)``."""

    target_names = ("tokens", "response_mask", "logprobs", "advantages")

    def __init__(self, clip_eps: float = 0.2, entropy_coef: float = 0.0, temperature: float = 1.0) -> None:
        if clip_eps <= 0:
            raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.clip_eps, self.entropy_coef, self.temperature = clip_eps, entropy_coef, temperature

    @classmethod
    def from_config(cls, section: PPOSection) -> PolicyLoss:
        """``clip_eps`` and ``entropy_coef`` of ``[ppo]``, at temperature 1 (the engine's log-probs are taken there)."""
        return cls(section.clip_eps, section.entropy_coef, temperature=1.0)

    def __call__(self, logits: torch.Tensor, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_loss(logits, targets, self.clip_eps, self.entropy_coef, self.temperature)


class ValueLoss:
    """``value_loss`` with fixed hyper-parameters: ``ValueLoss(0.2)(values, targets) -> (loss, stats)``."""

    target_names = ("response_mask", "values", "returns")

    def __init__(self, value_clip_eps: float | None = 0.2) -> None:
        if value_clip_eps is not None and value_clip_eps <= 0:
            raise ValueError(f"value_clip_eps must be > 0 or None (no clipping), got {value_clip_eps}")
        self.value_clip_eps = value_clip_eps

    @classmethod
    def from_config(cls, section: PPOSection) -> ValueLoss:
        """``value_clip_eps`` of ``[ppo]`` (0: no clipping)."""
        return cls(section.value_clip_eps if section.value_clip_eps > 0 else None)

    def __call__(self, values: torch.Tensor, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return value_loss(values, targets, self.value_clip_eps)
