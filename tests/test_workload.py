"""LMSYS-shaped response lengths: heavy tail, determinism, scaling."""

import pytest
import torch

from fusedrl.rollout_fusion.workload import LengthDistribution, lmsys_lengths


def test_heavy_tail_and_mean():
    x = torch.tensor(lmsys_lengths(100_000, seed=0), dtype=torch.float64)
    median, p999 = x.median().item(), torch.quantile(x, 0.999).item()
    assert p999 > 10 * median  # RLHFuse: p99.9 > 10x the median on LMSYS-Chat-1M
    assert 190 < x.mean().item() < 240  # LMSYS-Chat-1M: 214.5 tokens per response on average
    assert x.min() >= 1 and x.max() <= 2048


def test_deterministic_in_seed():
    assert lmsys_lengths(500, seed=3) == lmsys_lengths(500, seed=3)
    assert lmsys_lengths(500, seed=3) != lmsys_lengths(500, seed=4)


def test_scaled_to_keeps_shape():
    full = torch.tensor(LengthDistribution().sample(50_000, 1), dtype=torch.float64)
    small = torch.tensor(LengthDistribution().scaled_to(256).sample(50_000, 1), dtype=torch.float64)
    assert small.max() <= 256
    assert abs(small.median().item() - full.median().item() * 256 / 2048) <= 2
    assert torch.quantile(small, 0.999).item() > 10 * small.median().item()


def test_bad_parameters():
    with pytest.raises(ValueError, match="min_len"):
        LengthDistribution(min_len=0)
    with pytest.raises(ValueError, match="tail_prob"):
        LengthDistribution(tail_prob=1.5)
    with pytest.raises(ValueError, match="n must be"):
        LengthDistribution().sample(-1)
