"""PPO losses shaped for a pipeline executor's last stage.

Alignment: a decoder's output at position ``t`` is computed from ``tokens[:, :t+1]`` and predicts
token ``t+1``. Per-token targets are aligned with the tokens they score (see
:mod:`fusedrl.rlhf.experience`), so the log-prob of token ``t`` and the value of the state before
token ``t`` both come from output position ``t - 1``; :func:`shift_to_tokens` does that shift
(column 0, never a response token, gets 0).

Losses are token means over ``response_mask``. By default the mean is per micro-batch; pass a
``loss_denom`` target (``[B]``, each entry the number of response tokens of the whole minibatch)
to get one global token mean when gradients of several micro-batches are accumulated. The ``stats`` dicts
hold detached scalar tensors (no host sync); their means use the same denominator, so averaging them over the
micro-batches gives token-weighted means of the minibatch (``*_max`` stats are maxima).

Chunked head: :func:`chunked_token_logprobs`, :func:`chunked_token_logprobs_entropy` and
:func:`chunked_policy_loss` take the decoder's final hidden states ``[B, S, D]`` and its LM head
instead of logits ``[B, S, V]``. They apply the head to a few output positions at a time (as many as
keep one float32 logits chunk ``positions x B x V x 4`` bytes within ``budget_bytes``), keep only the
per-token log-prob (and entropy) of each chunk and move on, so full-vocabulary logits of the whole
batch never exist. Under autograd each chunk is wrapped in :func:`torch.utils.checkpoint.checkpoint`,
so backward recomputes one chunk's logits at a time instead of keeping every chunk's alive. Results
equal the unchunked functions on ``model(tokens)`` up to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedrl.config import PPOSection

DEFAULT_LOGITS_BUDGET_BYTES = 256 * 2**20
"""Default bound of one float32 logits chunk (positions x rows x vocab x 4 bytes) of the chunked head.

Transient peak per chunk is a small multiple of it: the logits, their log-softmax, and (for the
entropy) the probabilities; under autograd also their gradients during that chunk's backward."""

ClipRange = float | tuple[float, float]
"""A policy-ratio clip range: ``eps`` (ratios in ``[1 - eps, 1 + eps]``) or ``(low, high)`` (``[1 - low, 1 + high]``)."""


@dataclass(frozen=True)
class KLLoss:
    """A KL-to-the-Reference term of the policy loss: ``coef`` x the aggregated per-token ``estimator`` (k1/k2/k3)."""

    coef: float
    estimator: str = "k3"


Head = Callable[[torch.Tensor], torch.Tensor]
"""An LM head: ``model.output`` of a decoder (``nn.Linear``, torchtune ``TiedLinear`` or any module
mapping ``[..., D]`` to ``[..., V]``)."""


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


def head_vocab_size(head: Head) -> int:
    """Output width ``V`` of an LM head: ``weight.shape[0]`` of an ``nn.Linear`` or of a ``TiedLinear``'s tied module."""
    module = getattr(head, "tied_module", head)  # torchtune TiedLinear keeps the embedding it shares
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"cannot read the vocabulary size of LM head {type(head).__name__}; pass an nn.Linear, a torchtune "
            "TiedLinear, or chunk_positions= explicitly"
        )
    return weight.shape[0]


def logits_chunk_positions(rows: int, vocab_size: int, budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES) -> int:
    """Most output positions per chunk with ``positions * rows * vocab_size * 4 <= budget_bytes`` (at least 1).

    A single position always forms a chunk, even when ``rows * vocab_size * 4`` alone exceeds the budget.
    """
    if rows < 1 or vocab_size < 1:
        raise ValueError(f"rows and vocab_size must be >= 1, got rows={rows}, vocab_size={vocab_size}")
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    return max(1, budget_bytes // (rows * vocab_size * 4))


def _chunk_logprobs_entropy(
    head: Head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: float32 log-softmax of ``head(hidden) / temperature`` gathered at ``targets`` (+ entropy)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else picked.new_zeros(())
    return picked, ent


def _chunked(
    hidden: torch.Tensor,
    head: Head,
    tokens: torch.Tensor,
    temperature: float,
    entropy: bool,
    budget_bytes: int,
    chunk_positions: int | None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if hidden.dim() != 3 or tokens.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, S, D] and tokens [B, S]; got {tuple(hidden.shape)} and {tuple(tokens.shape)}")
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError(f"mask must be [B, S] like tokens {tuple(tokens.shape)}, got {tuple(mask.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows, seq = tokens.shape
    if chunk_positions is None:
        chunk_positions = logits_chunk_positions(rows, head_vocab_size(head), budget_bytes)
    elif chunk_positions < 1:
        raise ValueError(f"chunk_positions must be >= 1, got {chunk_positions}")
    # Output position t predicts token t + 1: positions 0 .. S-2 score tokens 1 .. S-1. The scored positions are
    # flattened into one token axis (only those of masked tokens with a mask), so the head's matmul and softmax run on
    # scored tokens alone; a chunk holds at most chunk_positions x rows of them (the budget's logits).
    out_hidden, targets = hidden[:, :-1], tokens[:, 1:]
    scored = None if mask is None else mask[:, 1:] != 0
    if scored is None:
        flat_hidden, flat_targets = out_hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    else:
        flat_hidden, flat_targets = out_hidden[scored], targets[scored]
    grad = torch.is_grad_enabled()
    step = chunk_positions * rows
    picked, ents = [], []
    for start in range(0, flat_targets.shape[0], step):
        args = (head, flat_hidden[start : start + step], flat_targets[start : start + step], temperature, entropy)
        if grad:  # recompute this chunk's logits in backward instead of saving them
            p, e = checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False)
        else:
            p, e = _chunk_logprobs_entropy(*args)
        picked.append(p)
        ents.append(e)

    def place(values: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(values) if values else hidden.new_zeros(0, dtype=torch.float32)
        if scored is None:
            full = flat.reshape(rows, seq - 1)
        else:
            full = hidden.new_zeros(rows, seq - 1, dtype=torch.float32).index_put((scored,), flat)
        return F.pad(full, (1, 0))

    return place(picked), (place(ents) if entropy else None)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: Head,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    chunk_positions: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``token_logprobs(head(hidden).float(), tokens, temperature)`` (``[B, S]`` float32, token-aligned, column
    0 is 0) computed ``chunk_positions`` output positions at a time (default: as many as fit one float32 logits
    chunk in ``budget_bytes``, see :func:`logits_chunk_positions`).

    ``hidden``: the decoder's final normed hidden states ``[B, S, D]`` (its output just before the head);
    ``head``: ``model.output``. With grad mode on each chunk is checkpointed: only one chunk's logits are
    alive at a time in forward and in backward, and gradients reach ``hidden`` and the head's weight.

    ``mask`` (``[B, S]``, e.g. the response mask): score only the tokens where it is nonzero (the others get 0), so the
    head's matmul and softmax never run on prompt or padding positions.
    """
    return _chunked(hidden, head, tokens, temperature, False, budget_bytes, chunk_positions, mask)[0]


def chunked_token_logprobs_entropy(
    hidden: torch.Tensor,
    head: Head,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    chunk_positions: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_token_logprobs` and ``token_entropy(head(hidden).float(), temperature)`` in one pass
    (both ``[B, S]``, token-aligned, column 0 is 0; with ``mask``, both 0 where it is 0)."""
    logp, entropy = _chunked(hidden, head, tokens, temperature, True, budget_bytes, chunk_positions, mask)
    assert entropy is not None
    return logp, entropy


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
    clip_eps: ClipRange = 0.2,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    kl: KLLoss | None = None,
    old_from_forward: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate (plus ``-entropy_coef * entropy`` and ``kl``'s term) from Actor ``logits`` ``[B, S, V]``.

    ``targets``: ``tokens``, ``response_mask``, ``logprobs`` (old), ``advantages`` (all ``[B, S]``),
    optional ``loss_denom``, ``loss_weight`` (per-token weights of the aggregation: the loss is their weighted sum
    instead of the token mean; :func:`fusedrl.rlhf.loss_weights`), ``tis_weight`` (a per-token factor on the
    surrogate: truncated importance sampling) and, with ``kl``, ``ref_logprobs``. ``clip_eps``: one range or
    ``(low, high)`` (ratios clipped to ``[1 - low, 1 + high]``). ``temperature`` must be the sampling temperature the
    old log-probs used. ``old_from_forward``: the old log-probs are this forward's own, detached (on-policy: one
    update with the weights that sampled; no separate recompute pass), and ``logprobs`` are the engine's, compared
    by the stats ``logprob_diff``, ``logprob_diff_max`` and ``importance_ratio``. See :func:`chunked_policy_loss` for
    the same loss from hidden states without full logits.
    """
    _require(targets, ("tokens", "response_mask", "logprobs", "advantages"), "policy_loss")
    logp = token_logprobs(logits, targets["tokens"], temperature)
    if entropy_coef != 0.0:
        entropy = token_entropy(logits, temperature)
    else:
        with torch.no_grad():
            entropy = token_entropy(logits, temperature)
    return _surrogate(logp, entropy, targets, clip_eps, entropy_coef, kl, old_from_forward)


def chunked_policy_loss(
    hidden: torch.Tensor,
    head: Head,
    targets: dict[str, torch.Tensor],
    clip_eps: ClipRange = 0.2,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    kl: KLLoss | None = None,
    *,
    budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    chunk_positions: int | None = None,
    old_from_forward: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` of ``logits = head(hidden)`` without materialising those logits.

    ``hidden``: the Actor's final (normed) hidden states ``[B, S, D]``; ``head``: its LM head. Loss,
    stats and gradients (w.r.t. ``hidden`` and the head's weight) equal ``policy_loss(head(hidden).float(),
    ...)`` up to float32 rounding; only one chunk's logits are alive at a time in forward and backward
    (see :func:`chunked_token_logprobs_entropy` for ``budget_bytes`` / ``chunk_positions``).
    """
    _require(targets, ("tokens", "response_mask", "logprobs", "advantages"), "chunked_policy_loss")
    # every term of the loss and its stats is masked to response tokens: the head runs on those alone
    logp, entropy = chunked_token_logprobs_entropy(
        hidden,
        head,
        targets["tokens"],
        temperature,
        budget_bytes=budget_bytes,
        chunk_positions=chunk_positions,
        mask=targets["response_mask"],
    )
    if entropy_coef == 0.0:
        entropy = entropy.detach()
    return _surrogate(logp, entropy, targets, clip_eps, entropy_coef, kl, old_from_forward)


def _surrogate(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    targets: dict[str, torch.Tensor],
    clip_eps: ClipRange,
    entropy_coef: float,
    kl: KLLoss | None,
    old_from_forward: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate from token-aligned new log-probs and entropies ``[B, S]``. ``old_from_forward``: the old
    log-probs are this forward's own, detached (on-policy: the weights that sampled are the ones training), and the
    targets' ``logprobs`` are the engine's, which the gap stats (``logprob_diff*``, ``importance_ratio``) compare."""
    low, high = (clip_eps, clip_eps) if isinstance(clip_eps, float | int) else clip_eps
    mask = targets["response_mask"].float()
    denom = targets.get("loss_denom")
    weight = targets.get("loss_weight")

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:  # the loss's aggregation (stats stay token means)
        return (per_token * weight.float()).sum() if weight is not None else masked_mean(per_token, mask, denom)

    given = (logp.detach() - targets["logprobs"].float()) * mask  # the forward against the targets' log-probs
    log_ratio = (logp - logp.detach()) * mask if old_from_forward else (logp - targets["logprobs"].float()) * mask
    ratio = log_ratio.exp()
    adv = targets["advantages"].float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if "tis_weight" in targets:
        per_token = per_token * targets["tis_weight"].float()
    pg_loss = aggregate(per_token)
    loss = pg_loss
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * aggregate(entropy)
    kl_tokens = None
    if kl is not None:
        _require(targets, ("ref_logprobs",), "policy_loss with a KL loss")
        kl_tokens = kl_estimate(logp, targets["ref_logprobs"].float(), kl.estimator) * mask
        loss = loss + kl.coef * aggregate(kl_tokens)
    with torch.no_grad():
        stats = {
            "policy_loss": pg_loss.detach(),
            "clip_frac": masked_mean((clipped > unclipped).float(), mask, denom),
            # the clipped tokens on each side: ratio below 1 - low with a negative advantage, above 1 + high with a positive
            "clip_frac_low": masked_mean(((ratio < 1.0 - low) & (adv < 0)).float(), mask, denom),
            "clip_frac_high": masked_mean(((ratio > 1.0 + high) & (adv > 0)).float(), mask, denom),
            # k3 estimate of KL(old || new) on the sampled tokens
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask, denom),
            "ratio_mean": masked_mean(ratio, mask, denom),
            "entropy": masked_mean(entropy, mask, denom).detach(),
            # how far the new log-probs are from the given ones (before the first update: trainer vs engine)
            "logprob_diff": masked_mean(given.abs(), mask, denom),
            "logprob_diff_max": given.abs().amax(),
        }
        if old_from_forward:  # pi_train / pi_engine, which a separate recompute pass would have logged
            stats["importance_ratio"] = masked_mean(given.exp(), mask, denom)
        if kl_tokens is not None:
            stats["kl_loss"] = masked_mean(kl_tokens, mask, denom)
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
        clip_frac = masked_mean((err_clipped > err).float(), mask, targets.get("loss_denom")).detach()
    loss = 0.5 * masked_mean(per_token, mask, targets.get("loss_denom"))
    with torch.no_grad():
        stats = {
            "value_loss": loss.detach(),
            "value_clip_frac": clip_frac,
            "value_mean": masked_mean(v, mask, targets.get("loss_denom")),
            "explained_variance": explained_variance(v, ret, mask),
        }
    return loss, stats


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[target - pred] / Var[target]`` over masked entries; 0 when the target is constant (nothing to
    explain: e.g. every return 0 in a batch of failed samples), never NaN."""
    mask = mask.float()

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = masked_mean(x, mask)
        return masked_mean((x - mean) ** 2, mask)

    target_var = var(target)
    explained = 1.0 - var(target - pred) / target_var.clamp_min(torch.finfo(target_var.dtype).tiny)
    return torch.where(target_var > 0, explained, torch.zeros_like(explained))  # no host sync


class PolicyLoss:
    """``policy_loss`` with fixed hyper-parameters: ``PolicyLoss(0.2, 0.01)(logits, targets) -> (loss, stats)``.

    With ``head`` (the LM head of the pipeline's last stage, whose forward then returns final hidden states
    instead of logits) the loss takes hidden states and applies the head itself in checkpointed chunks of
    positions (:func:`chunked_policy_loss`): no full-vocabulary logits of the micro-batch ever exist.
    """

    target_names = ("tokens", "response_mask", "logprobs", "advantages")

    def __init__(
        self,
        clip_eps: ClipRange = 0.2,
        entropy_coef: float = 0.0,
        temperature: float = 1.0,
        *,
        kl: KLLoss | None = None,
        head: nn.Linear | None = None,
        chunk_positions: int | None = None,
        old_from_forward: bool = False,
    ) -> None:
        if min((clip_eps,) if isinstance(clip_eps, float | int) else clip_eps) <= 0:
            raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.clip_eps, self.entropy_coef, self.temperature, self.head = clip_eps, entropy_coef, temperature, head
        self.kl = kl
        self.chunk_positions = chunk_positions  # None: sized by DEFAULT_LOGITS_BUDGET_BYTES
        self.old_from_forward = old_from_forward

    @classmethod
    def from_config(
        cls, section: PPOSection, head: nn.Linear | None = None, *, temperature: float = 1.0, old_from_forward: bool = False
    ) -> PolicyLoss:
        """The clip range, ``entropy_coef`` and KL loss (``kl_loss_coef`` > 0) of ``[ppo]`` at the sampling
        ``temperature`` (``generation.temperature``: the engine's old log-probs and the Reference's are of that
        distribution); ``old_from_forward`` as in :func:`policy_loss`."""
        kl = KLLoss(section.kl_loss_coef, section.kl_estimator) if section.kl_loss_coef > 0 else None
        return cls(
            section.clip_range, section.entropy_coef, temperature=temperature, kl=kl, head=head, old_from_forward=old_from_forward
        )

    def __call__(self, output: torch.Tensor, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.head is None:
            return policy_loss(
                output, targets, self.clip_eps, self.entropy_coef, self.temperature, self.kl, self.old_from_forward
            )
        hidden = output.to(self.head.weight.dtype)  # a float32 stage output into a bf16 (mixed-precision) head
        return chunked_policy_loss(
            hidden,
            self.head,
            targets,
            self.clip_eps,
            self.entropy_coef,
            self.temperature,
            self.kl,
            chunk_positions=self.chunk_positions,
            old_from_forward=self.old_from_forward,
        )


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
