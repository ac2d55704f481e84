"""Accelerator data-sheet figures and the utilisations the roofline estimates assume, one definition each: the
rollout simulator's costs (``RolloutCosts.for_models``) and the paper-scale benchmarks read them here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    """One GPU: HBM bandwidth and size, dense bf16 FLOP/s, and the bytes/s it gets on the network between nodes
    (half of one NIC per GPU: two GPUs share each NIC)."""

    name: str
    hbm_bytes_per_s: float
    flops_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float


# Vendor data sheets; the link is half of one 400 Gb/s (H100, H200) or 200 Gb/s (A100) NIC per GPU.
H100_SXM = Accelerator("H100 SXM", 3.35e12, 989e12, 80e9, 25e9)
H200_SXM = Accelerator("H200 SXM", 4.8e12, 989e12, 141e9, 25e9)
A100_SXM_80GB = Accelerator("A100 SXM 80GB", 2.039e12, 312e12, 80e9, 12.5e9)

MFU = 0.4  # share of peak FLOP/s that compute-bound work (prefill, scoring, training) reaches
DECODE_BW_UTIL = 0.6  # share of HBM bandwidth that memory-bound work (decode steps, the optimizer step) reaches
