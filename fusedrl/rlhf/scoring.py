"""Scoring of finished samples: Reference log-probs, Reward scores and Critic values, micro-batched.

Runs on any instance that holds the three models (the Reference and Reward are frozen and loaded
once; the Critic is refreshed by the same weight sync as the Actor). Samples are sorted by length
and cut into micro-batches, each right-padded to its own longest sample; causal attention keeps the
padding from reaching real tokens, so no mask is needed. Output follows the
:class:`~fusedrl.rlhf.Experience` layout (per-token tensors aligned with ``tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from fusedrl.generation import RequestResult
from fusedrl.rlhf.advantages import last_token_index
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.losses import shift_to_tokens, token_logprobs


@dataclass
class ScoringModels:
    """``reference``: policy role (LM head); ``reward`` and ``critic``: value role (scalar head)."""

    reference: nn.Module
    reward: nn.Module
    critic: nn.Module


@dataclass
class Scorer:
    """Scores finished samples (the generation engine's results) in micro-batches of ``micro_batch_size``.

    ``temperature`` divides the Reference logits (use the sampling temperature the Actor's log-probs
    were taken at; the generation engine reports them at 1.0).
    """

    models: ScoringModels
    micro_batch_size: int = 8
    pad_id: int = 0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @torch.no_grad()
    def score(self, samples: Sequence[RequestResult]) -> Experience:
        """An :class:`Experience` with ``tokens``, ``response_mask``, ``logprobs`` (the samples' own),
        ``ref_logprobs``, ``values``, ``scores`` and ``sample_ids``, rows in the order of ``samples``."""
        if not samples:
            raise ValueError("Scorer.score got no samples; skip the call for an empty set")
        for s in samples:
            if not s.tokens:
                raise ValueError(f"sample {s.id} has an empty response; every scored sample needs >= 1 response token")
            if s.logprobs and len(s.logprobs) != len(s.tokens):
                raise ValueError(f"sample {s.id} has {len(s.logprobs)} log-probs for {len(s.tokens)} response tokens")
        order = sorted(range(len(samples)), key=lambda i: (samples[i].num_tokens, i))
        parts = [
            self._score_micro_batch([samples[i] for i in order[j : j + self.micro_batch_size]])
            for j in range(0, len(order), self.micro_batch_size)
        ]
        merged = Experience.concat(parts, pad_token_id=self.pad_id)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return merged.select(inverse)

    def _score_micro_batch(self, samples: list[RequestResult]) -> Experience:
        device = next(self.models.reference.parameters()).device
        width = max(s.num_tokens for s in samples)
        tokens = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(samples), width)
        logprobs = torch.zeros(len(samples), width)
        for row, s in enumerate(samples):
            p, n = len(s.prompt), s.num_tokens
            tokens[row, :n] = torch.tensor([*s.prompt, *s.tokens])
            mask[row, p:n] = 1.0
            if s.logprobs:
                logprobs[row, p:n] = torch.tensor(list(s.logprobs))
        dev_tokens, dev_mask = tokens.to(device), mask.to(device)
        ref = token_logprobs(self.models.reference(dev_tokens), dev_tokens, self.temperature) * dev_mask
        values = shift_to_tokens(self.models.critic(dev_tokens).squeeze(-1).float()) * dev_mask
        reward = self.models.reward(dev_tokens).squeeze(-1).float()
        scores = reward.gather(1, last_token_index(dev_mask)[:, None]).squeeze(1)
        exp = Experience(
            tokens=tokens,
            response_mask=mask,
            logprobs=logprobs,
            ref_logprobs=ref.cpu(),
            values=values.cpu(),
            scores=scores.cpu(),
            sample_ids=torch.tensor([s.id for s in samples], dtype=torch.long),
        )
        return exp
