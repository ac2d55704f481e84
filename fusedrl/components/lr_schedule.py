"""Learning-rate warmup followed by linear, cosine or constant decay (a ``LambdaLR``)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

DECAYS = ("linear", "cosine", "constant")


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str = "linear", min_ratio: float = 0.0) -> float:
    """Multiplier of the base LR at ``step`` (0-based): linear warmup to 1 over ``warmup_steps``, then decay to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    decay: str = "linear",
    min_ratio: float = 0.0,
) -> LambdaLR:
    """A ``LambdaLR`` following :func:`lr_factor`; call ``.step()`` once per optimizer step."""
    if decay not in DECAYS:
        raise ValueError(f"unknown lr_scheduler.decay {decay!r}; valid: {', '.join(DECAYS)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total steps >= 1, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, decay, min_ratio))
