"""Variants of one recipe run as torchrun jobs, alternating, on the same tokens (``bench.lora``, ``bench.layouts``).

Each variant is the recipe's command line plus its own overrides; every job runs with evaluation, checkpoints and
export off, at learning rates too small to change a sample, so that every variant generates, scores and trains the
same tokens and only the variant decides the speed. Per run: the means of the iterations after the warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fusedrl.components import read_jsonl
from fusedrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
OFF = ("--eval.interval=0", "--checkpoint.export_hf=false", "--checkpoint.interval=0", "--metrics.trace=[]")
# A learning rate too small to change any sample: every variant then generates, scores and trains the same tokens
# (with the recipes' rates the responses' lengths drift apart between variants, and the lengths decide the speed).
SAME_SAMPLES = ("--optimizer.actor_lr=1e-12",)
TIMES = (
    "response_len_mean",
    "time_weight_sync",
    "time_generation",
    "time_scoring",
    "time_reference",
    "time_recompute",
    "time_training",
    "time_step",
)
"""The phase times and response length a run reports (means over its measured iterations)."""


def same_samples_job(config: str, steps: int, overrides: Sequence[str]) -> list[str]:
    """The command-line arguments every variant starts from: ``config`` for ``steps`` iterations with :data:`OFF` and
    :data:`SAME_SAMPLES` (the Critic's rate too, where there is one), then ``overrides``."""
    job = ["--job.config_file", config, *OFF, *SAME_SAMPLES, f"--training.steps={steps}"]
    if not load_config(job).ppo.critic_free:
        job.append("--optimizer.critic_lr=1e-12")
    return [*job, *overrides]


def add_run_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The arguments of :func:`run_variants` (and ``--json``)."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out of the means (compiles, first touch)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line last")


def parse_run_arguments(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser``'s arguments (with :func:`add_run_arguments`'), refusing runs too short to leave a measured iteration."""
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def split_overrides(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(the benchmark's own arguments, the job overrides after ``--``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def run_figures(records: list[dict], warmup: int) -> dict[str, float]:
    """One run's figures: means over the iterations after ``warmup``, the peak memory over all of them."""
    iterations = [r for r in records if r.get("step", 0) > 0]
    measured = [r for r in iterations if r["step"] > warmup]
    if not measured:
        raise ValueError(f"no iteration after the {warmup} warm-up ones; raise --steps")
    out = {k: statistics.fmean(r[k] for r in measured) for k in ("samples_per_s", *TIMES) if k in measured[0]}
    out["peak_memory_gib"] = max(r["peak_memory_gib"] for r in iterations)
    return out


def run_job(cmd: list[str], out: Path, env: dict[str, str]) -> list[dict]:
    """Run one job (``cmd`` without its output folder) into ``out``; its metrics records."""
    proc = subprocess.run([*cmd, f"--job.output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return read_jsonl(out / "metrics.jsonl")


def run_variants(variants: dict[str, list[str]], args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Every variant ``args.rounds`` times on ``args.nproc`` ranks, the variants taking turns; each run's figures."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="fusedrl_bench_") as tmp:
        for r in range(args.rounds):
            for i, (name, variant) in enumerate(variants.items()):
                print(f"round {r + 1}/{args.rounds}: {name}, {args.steps} iterations", file=sys.stderr, flush=True)
                records = run_job([*launcher, "-m", "fusedrl.train", *variant], Path(tmp, f"{i}_{r}"), env)
                runs[name].append(run_figures(records, args.warmup))
    return runs


def medians(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per variant, each figure's median over its runs."""
    return {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
