"""Synthetic response lengths shaped like LMSYS-Chat-1M, to force per-request lengths in benchmarks.

Facts the shape is built to match (not a fit to the raw data, which is not on this machine):

- LMSYS-Chat-1M (Zheng et al., "LMSYS-Chat-1M: A Large-Scale Real-World LLM Conversation Dataset",
  ICLR 2024, Table 1): 214.5 tokens per response on average (69.5 per prompt).
- RLHFuse (Zhong et al., NSDI'25), on the same data: the 99.9th percentile output length is more than
  10x the median, and the last ~1% of samples can take more than half of the generation time.

Model: a lognormal body (median 120 tokens, sigma 0.9) mixed with a Pareto tail (4% of requests,
scale 512, shape 1.5), clipped to ``max_len``. With ``max_len=2048`` this gives a mean of about 214
tokens, a median near 126, a 99th percentile near 1550 and a 99.9th percentile at the 2048 cap
(16x the median).
These five numbers are our choice of parameters that reproduce the two facts above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

PAPER_MAX_LEN = 2048


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal body + Pareto tail of response lengths in tokens, clipped to [min_len, max_len]."""

    median: float = 120.0
    sigma: float = 0.9
    tail_prob: float = 0.04
    tail_scale: float = 512.0
    tail_alpha: float = 1.5
    max_len: int = PAPER_MAX_LEN
    min_len: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if self.median <= 0 or self.sigma <= 0 or self.tail_scale <= 0 or self.tail_alpha <= 0:
            raise ValueError("median, sigma, tail_scale and tail_alpha must all be > 0")
        if not 0.0 <= self.tail_prob <= 1.0:
            raise ValueError(f"tail_prob must be in [0, 1], got {self.tail_prob}")

    def scaled_to(self, max_len: int) -> LengthDistribution:
        """The same shape with every length scaled by ``max_len / self.max_len`` (e.g. for tiny CPU models)."""
        f = max_len / self.max_len
        return replace(self, median=self.median * f, tail_scale=self.tail_scale * f, max_len=max_len)

    def sample(self, n: int, seed: int = 0) -> list[int]:
        """``n`` lengths, deterministic in ``seed``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        g = torch.Generator().manual_seed(seed)
        body = torch.exp(math.log(self.median) + self.sigma * torch.randn(n, generator=g, dtype=torch.float64))
        u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
        tail = self.tail_scale * u.pow(-1.0 / self.tail_alpha)  # Pareto by inverse CDF
        is_tail = torch.rand(n, generator=g, dtype=torch.float64) < self.tail_prob
        lengths = torch.where(is_tail, tail, body).round().clamp(self.min_len, self.max_len)
        return [int(x) for x in lengths.tolist()]


def lmsys_lengths(n: int, seed: int = 0, max_len: int = PAPER_MAX_LEN) -> list[int]:
    """``n`` LMSYS-Chat-1M-shaped response lengths, scaled so that the cap is ``max_len``."""
    return LengthDistribution().scaled_to(max_len).sample(n, seed)
