"""A long run of a real-model recipe: does memory stay flat, does anything turn NaN, are checkpoints pruned?

    python -m fusedrl.bench.soak [--config train_configs/smollm2_135m_grpo.toml] [--steps 300] [--nproc 2]
        [--checkpoint-interval 50] [--keep 2] [--warmup 20] [--out DIR] [--json] [-- overrides...]

Runs ``torchrun --nproc_per_node N -m fusedrl.train`` on the config at a reduced size (4 prompts x 4 samples per
iteration, 16 new tokens, evaluation off; overrides after ``--`` come last and win), checkpointing every
``--checkpoint-interval`` steps and keeping ``--keep``. From its ``metrics.jsonl``, per iteration, the largest
rank's resident memory (``resident_memory_gib``: the resident set on CPU, allocated memory on CUDA), peak
(``peak_memory_gib``) and, on CPU, the C allocator's bytes in use and free but kept (``host_heap_in_use_gib``,
``host_heap_free_gib``); of each, the least-squares slope over the iterations after ``--warmup`` (MiB per 100
iterations), the end against the first measured iteration as a ratio (the baseline of this run: the same job after
its warm-up), the slope over the second half and the step from which it stays within 16 MiB of its end (a rise that
stops). Also every non-finite figure of the losses, rewards and gradient norms, and the checkpoint folders left.
Prints a line every 10 iterations while it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fusedrl.components import read_jsonl
from fusedrl.components.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
REDUCED = (
    "--ppo.batch_size=16",
    "--ppo.minibatch_size=16",
    "--generation.n=4",
    "--generation.max_new_tokens=16",
    "--eval.interval=0",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
)
ITERATION_LINE = re.compile(r"step (\d+): \w+=")
# the trainer's memory figures (the heap pair on CPU under glibc: in use vs free but kept, a leak vs reuse)
MEMORY_FIGURES = ("resident_memory_gib", "peak_memory_gib", "host_heap_in_use_gib", "host_heap_free_gib")
WATCHED = ("policy_loss", "kl", "kl_loss", "reward_mean", "reward_fn_mean", "entropy", "grad_norm_actor", "value_loss")


def slope_per_100(steps: Sequence[int], values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` over ``steps``, per 100 steps."""
    n = len(steps)
    if n < 2:
        return 0.0
    mx, my = sum(steps) / n, sum(values) / n
    var = sum((x - mx) ** 2 for x in steps)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(steps, values)) / var if var else 0.0


def settled_from(steps: Sequence[int], gib: Sequence[float], within_mib: float = 16.0) -> int:
    """The first step from which every value (GiB) stays within ``within_mib`` of the last one."""
    last, settled = gib[-1], steps[-1]
    for step, value in zip(reversed(steps), reversed(gib)):
        if abs(value - last) * 1024 > within_mib:
            break
        settled = step
    return settled


def summarize(records: list[dict], warmup: int) -> dict:
    """The run's memory trend, non-finite figures and steps, from its metrics records."""
    iterations = [r for r in records if r.get("step", 0) > 0]
    measured = [r for r in iterations if r["step"] > warmup]
    out: dict = {"iterations": len(iterations), "warmup": warmup}
    for key in MEMORY_FIGURES:
        points = [(r["step"], r[key]) for r in measured if key in r]
        if not points:
            continue
        steps, values = [s for s, _ in points], [v for _, v in points]
        out[key] = {
            "first": values[0],
            "last": values[-1],
            "max": max(values),
            "slope_mib_per_100": slope_per_100(steps, [v * 1024 for v in values]),
            "last_over_first": values[-1] / values[0],
            # a rise that stops (caches filling, the allocator's high-water mark) against one that goes on (a leak)
            "slope_second_half_mib_per_100": slope_per_100(
                steps[len(steps) // 2 :], [v * 1024 for v in values[len(values) // 2 :]]
            ),
            "settled_from": settled_from(steps, values),
        }
    out["non_finite"] = [
        f"step {r['step']}: {k} = {r[k]}"
        for r in iterations
        for k in WATCHED
        if isinstance(r.get(k), float) and not math.isfinite(r[k])
    ]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/smollm2_135m_grpo.toml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--checkpoint-interval", type=int, default=50)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20, help="iterations left out of the trend (caches, allocator)")
    parser.add_argument("--out", type=Path, default=None, help="the run's folder (default: a temporary one, removed)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line last")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: the trend needs measured iterations")
    out = args.out or Path(tempfile.mkdtemp(prefix="fusedrl_soak_"))
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "fusedrl.train",
        "--job.config_file",
        args.config,
        *REDUCED,
        f"--training.steps={args.steps}",
        f"--checkpoint.interval={args.checkpoint_interval}",
        f"--checkpoint.keep={args.keep}",
        f"--job.output_dir={out}",
        *overrides,
    ]
    print(f"soak: {args.steps} iterations of {args.config} on {args.nproc} ranks into {out}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with (out / "soak.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("step ") and int(line.split(":")[0].split()[1]) % 10 == 0:
                fields = dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)
                print(
                    f"{line.split(':')[0]}: reward {fields.get('reward_mean')}, time_step {fields.get('time_step')} s", flush=True
                )
        code = proc.wait()
    if code != 0:
        print(f"the run failed (exit {code}); its log: {out / 'soak.log'}", file=sys.stderr)
        return 1
    summary = summarize(read_jsonl(out / "metrics.jsonl"), args.warmup)
    summary["checkpoints"] = CheckpointManager(out / "checkpoints", {}).complete_steps()
    for key in MEMORY_FIGURES:
        m = summary.get(key)
        if m:
            print(
                f"{key}: {m['first']:.3f} (step {args.warmup + 1}) -> {m['last']:.3f} (step {args.steps}), "
                f"end / after warm-up {m['last_over_first']:.3f}x, slope {m['slope_mib_per_100']:+.1f} MiB per 100 iterations "
                f"({m['slope_second_half_mib_per_100']:+.1f} over the second half; within 16 MiB of the end from step "
                f"{m['settled_from']})"
            )
    print(
        f"non-finite figures: {len(summary['non_finite'])}" + (f" ({summary['non_finite'][:3]})" if summary["non_finite"] else "")
    )
    print(f"checkpoints kept: {summary['checkpoints']} (interval {args.checkpoint_interval}, keep {args.keep})")
    if args.json:
        print(json.dumps(summary))
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
