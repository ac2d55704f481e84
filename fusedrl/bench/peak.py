"""The machine's limits, measured: matmul FLOP/s in float32 and bfloat16, and memory read bandwidth.

    python -m fusedrl.bench.peak [--device cpu|cuda] [--threads N] [--seconds S] [--json]

The figures a benchmark's achieved FLOP/s and bytes/s are fractions of (``fusedrl.hardware.measure_peak``): the best
of repeated [2048 x 2048] @ [2048 x 2048] and [4096 x 576] @ [576 x 1536] matmuls on CPU ([8192]^3 and
[16384 x 4096] @ [4096 x 14336] on an accelerator), and the sum of a 256 MiB tensor (4 GiB on an accelerator).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fusedrl.hardware import measure_peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.peak", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="host threads (default: torch's current count)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time the timed repeats share")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    peak = measure_peak(args.device, args.threads, args.seconds)
    flops = peak.matmul_flops_per_s
    ratio = flops["bfloat16"] / flops["float32"] if "bfloat16" in flops else None
    print(f"machine limits on {peak.device}, {peak.threads} threads (best of repeats over {args.seconds:g} s)")
    for name, rate in flops.items():
        print(f"{name:<9} matmul {rate / 1e12:>9.3f} TFLOP/s")
    if ratio is not None:
        print(f"bfloat16 / float32 {ratio:>7.2f}x")
    print(f"memory read {peak.memory_read_bytes_per_s / 1e9:>10.1f} GB/s")
    if args.json:
        print(json.dumps({**peak.as_dict(), "bf16_fp32_ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
