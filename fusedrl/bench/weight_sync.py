"""Weight sync by resharding vs the full-gather sync it replaced, on 4 CPU ranks.

    python -m fusedrl.bench.weight_sync [--flavor debug_large] [--repeats 5] [--json]

The Actor's training layout is pp=2 x FSDP2 over dp_shard=2 (float32 master weights). Each variant copies it
into a rollout copy on every rank, the variants taking turns (A B C ... then reversed), each timed from a
barrier to a barrier (median of ``--repeats``):

- ``full_gather`` (the previous sync): every rank all-gathers its stage's FSDP shards (``full_tensor``), the
  stages are broadcast over the pipeline group (``gather_full_state_dict``), and a float32 full replica loads
  the whole state dict;
- ``reshard_tp1_bf16``: :class:`fusedrl.generation.WeightSync` into a bf16 full replica per rank (gen_tp = 1);
- ``reshard_tp2_bf16``: the same into bf16 copies tensor-parallel over instances of 2 ranks (gen_tp = 2).

Reported per variant: seconds per sync and bytes each rank received (for ``full_gather``: the bytes of the
full model each rank ends with, as before), and the ratios against ``full_gather``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fusedrl.distributed import ParallelDims, apply_fsdp, apply_tp, gather_full_state_dict, split_decoder
from fusedrl.generation import WeightSync
from fusedrl.models import build_model
from fusedrl.testing import run_multirank

WORLD = 4


def _rank(flavor: str, repeats: int) -> dict:
    torch.manual_seed(0)
    mesh = ParallelDims(pp=2, dp_shard=2, world_size=WORLD).build_mesh("cpu")
    stage = split_decoder(build_model(flavor, "policy"), 2)[mesh["pp"].get_local_rank()]
    apply_fsdp(stage, mesh["dp_shard"])
    replica = build_model(flavor, "policy")
    full_bytes = sum(t.numel() * t.element_size() for t in replica.state_dict().values())

    def full_gather() -> int:
        replica.load_state_dict(gather_full_state_dict(stage, mesh.get_group("pp")))
        return full_bytes

    variants = {"full_gather": full_gather}
    for gen_tp in (1, 2):
        target = build_model(flavor, "policy").to(torch.bfloat16)
        if gen_tp > 1:
            apply_tp(target, ParallelDims(dp_shard=WORLD, gen_tp=gen_tp).build_gen_mesh("cpu")["gen_tp"])
        sync = WeightSync(stage, target)

        def reshard(sync: WeightSync = sync) -> int:
            return sync.sync().bytes

        variants[f"reshard_tp{gen_tp}_bf16"] = reshard
    times: dict[str, list[float]] = {name: [] for name in variants}
    received: dict[str, int] = {}
    for r in range(repeats + 1):  # the first round warms up
        for name in list(variants) if r % 2 else list(variants)[::-1]:
            dist.barrier()
            start = time.perf_counter()
            nbytes = variants[name]()
            dist.barrier()
            if r:
                times[name].append(time.perf_counter() - start)
                received[name] = nbytes
    return {"seconds": {n: statistics.median(t) for n, t in times.items()}, "bytes": received}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.weight_sync", description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="debug_large")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    ranks = run_multirank(_rank, WORLD, args.flavor, args.repeats, timeout_s=1800.0)
    seconds = {n: max(r["seconds"][n] for r in ranks) for n in ranks[0]["seconds"]}
    received = {n: max(r["bytes"][n] for r in ranks) for n in ranks[0]["bytes"]}
    base_s, base_b = seconds["full_gather"], received["full_gather"]
    print(f"weight sync of {args.flavor} from pp=2 x dp_shard=2 (fp32) on {WORLD} CPU ranks, median of {args.repeats}")
    print(f"{'variant':<20}{'s / sync':>10}{'MB / rank':>11}{'time ratio':>12}{'bytes ratio':>13}")
    for n in seconds:
        print(f"{n:<20}{seconds[n]:>10.3f}{received[n] / 1e6:>11.1f}{seconds[n] / base_s:>11.3f}x{received[n] / base_b:>12.3f}x")
    if args.json:
        print(
            json.dumps(
                {
                    "flavor": args.flavor,
                    "seconds": seconds,
                    "bytes_per_rank": received,
                    "time_ratio": {n: s / base_s for n, s in seconds.items()},
                    "bytes_ratio": {n: b / base_b for n, b in received.items()},
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
