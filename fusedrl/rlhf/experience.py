"""The PPO experience batch.

Layout convention (used by :mod:`fusedrl.rlhf.advantages` and :mod:`fusedrl.rlhf.losses`):
``tokens`` is ``[B, S]``, each row the prompt followed by the response, right-padded. Every
per-token tensor is ``[B, S]`` and aligned with ``tokens``: entry ``t`` belongs to token ``t``
(e.g. ``logprobs[:, t] = log p(tokens[:, t] | tokens[:, :t])``, computed from the model output at
position ``t - 1``). ``response_mask`` is 1 on response tokens and 0 on prompt and padding, so
column 0 is never a response token. Per-sample tensors (``scores``, ``sample_ids``, ``reward_fn_scores``, ``finished``)
are ``[B]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

PER_TOKEN_FIELDS = (
    "response_mask",
    "logprobs",
    "engine_logprobs",
    "ref_logprobs",
    "values",
    "token_rewards",
    "advantages",
    "returns",
)
PER_SAMPLE_FIELDS = ("scores", "sample_ids", "reward_fn_scores", "finished")


@dataclass
class Experience:
    """A batch of rollouts; fields not computed yet are ``None``."""

    tokens: torch.Tensor  # [B, S] long, prompt + response, right-padded
    response_mask: torch.Tensor  # [B, S] float, 1 on response tokens
    logprobs: torch.Tensor | None = None  # [B, S] old Actor log-probs (PPO's ratio is taken against them)
    engine_logprobs: torch.Tensor | None = None  # [B, S] the engine's, when logprobs were recomputed by the trainer
    ref_logprobs: torch.Tensor | None = None  # [B, S] Reference log-probs
    values: torch.Tensor | None = None  # [B, S] old Critic values
    scores: torch.Tensor | None = None  # [B] score per sample: Reward model + weighted reward function
    token_rewards: torch.Tensor | None = None  # [B, S] KL-shaped per-token rewards
    advantages: torch.Tensor | None = None  # [B, S]
    returns: torch.Tensor | None = None  # [B, S]
    sample_ids: torch.Tensor | None = None  # [B] long, global sample ids
    reward_fn_scores: torch.Tensor | None = None  # [B] the reward function's own values; NaN where it failed (skipped)
    finished: torch.Tensor | None = None  # [B] bool: the response ended with a stop token (False: it hit the limit)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"Experience.tokens must be [batch, seq], got shape {tuple(self.tokens.shape)}")
        shape = tuple(self.tokens.shape)
        for name in PER_TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"Experience.{name} has shape {tuple(t.shape)}; it must match tokens {shape}")
        for name in PER_SAMPLE_FIELDS:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape[:1]:
                raise ValueError(f"Experience.{name} has shape {tuple(t.shape)}; it must be [batch] = {shape[:1]}")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Experience:
        # Any: each value is Tensor | None by field name; mypy cannot match ** keys to the required fields
        fields: dict[str, Any] = {
            f.name: (None if (t := getattr(self, f.name)) is None else fn(t)) for f in dataclasses.fields(self)
        }
        return Experience(**fields)

    def to(self, device: torch.device | str) -> Experience:
        return self._map(lambda t: t.to(device))

    def select(self, index: torch.Tensor | slice) -> Experience:
        """Rows ``index`` of every field."""
        return self._map(lambda t: t[index])

    def split(self, size: int) -> list[Experience]:
        """Consecutive chunks of ``size`` samples (e.g. micro-batches of a minibatch)."""
        if size < 1 or self.batch_size % size:
            raise ValueError(f"cannot split a batch of {self.batch_size} into chunks of {size}; pick a divisor of the batch size")
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]

    def minibatches(self, size: int, generator: torch.Generator | None = None) -> list[Experience]:
        """Minibatches of ``size`` samples; shuffled with ``generator`` when one is given."""
        if generator is None:
            return self.split(size)
        if size < 1 or self.batch_size % size:
            raise ValueError(
                f"cannot split a batch of {self.batch_size} into minibatches of {size}; pick a divisor of the batch size"
            )
        perm = torch.randperm(self.batch_size, generator=generator)
        return [self.select(perm[i : i + size].to(self.tokens.device)) for i in range(0, self.batch_size, size)]

    def targets(self, *names: str) -> dict[str, torch.Tensor]:
        """The named fields as a dict (the per-micro-batch targets of a pipeline loss function)."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"Experience fields {missing} are not computed yet; fill them before building loss targets")
        return {n: getattr(self, n) for n in names}

    def pad_to(self, seq_len: int, pad_token_id: int = 0) -> Experience:
        """Right-pad every per-token field to ``seq_len``: tokens with ``pad_token_id``, the rest with 0
        (so padding has mask 0)."""
        extra = seq_len - self.seq_len
        if extra < 0:
            raise ValueError(f"cannot pad a batch of sequence length {self.seq_len} down to {seq_len}")
        if extra == 0:
            return self
        out: dict[str, Any] = {}  # field name -> Tensor | None, passed to Experience(**out) (see _map)
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is not None and f.name not in PER_SAMPLE_FIELDS:
                t = F.pad(t, (0, extra), value=pad_token_id if f.name == "tokens" else 0)
            out[f.name] = t
        return Experience(**out)

    @staticmethod
    def concat(batches: list[Experience], pad_token_id: int = 0) -> Experience:
        """Stack batches along the batch dim, right-padding shorter sequences (padding has mask 0)."""
        if not batches:
            raise ValueError("Experience.concat needs at least one batch")
        seq = max(b.seq_len for b in batches)
        batches = [b.pad_to(seq, pad_token_id) for b in batches]
        out: dict[str, Any] = {}  # field name -> Tensor | None, passed to Experience(**out) (see _map)
        for f in dataclasses.fields(Experience):
            parts = [getattr(b, f.name) for b in batches]
            present = [p is not None for p in parts]
            if not any(present):
                out[f.name] = None
                continue
            if not all(present):
                raise ValueError(f"cannot concat Experience batches: field {f.name!r} is set in some batches and None in others")
            out[f.name] = torch.cat(parts)
        return Experience(**out)
