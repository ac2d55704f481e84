"""LoRA against full fine-tuning on one recipe: speed, measured memory and the memory estimate, in one run.

    python -m fusedrl.bench.lora [--config train_configs/smollm2_135m_grpo_lora.toml] [--steps 8] [--warmup 2]
        [--rounds 2] [--nproc 2] [--json] [-- overrides...]

Runs ``torchrun --nproc_per_node N -m fusedrl.train`` on the config as it is (its ``[lora]``) and with
``--lora.models=[]`` (every parameter trains: the baseline), alternating, ``--rounds`` runs of each, evaluation and
export off, at a learning rate too small to change the samples, so that both variants run the same tokens
(overrides after ``--`` come last and win). Per run: the mean samples/s and phase times of the iterations
after ``--warmup``, and the largest ``peak_memory_gib`` of any iteration (the largest rank's). Per variant the median
over its runs, then LoRA / full as ratios; also the memory estimate's per-rank peak of both configs
(:func:`fusedrl.memory.estimate`). A job whose Reference is the LoRA Actor's base (``lora.reference = "base"``, with a
KL term) runs a third variant, ``lora_copy`` (``--lora.reference=copy``: a rollout copy of the Reference), and
reports base / copy too. A job whose engine gets merged weights (``lora.rollout_weights = "merged"``) runs
``lora_unmerged`` too (``--lora.rollout_weights=adapters``: the engine adds the adapters' updates itself, and a weight
sync after the first moves only them), and reports unmerged / merged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fusedrl.components import read_jsonl
from fusedrl.config import load_config
from fusedrl.models import reference_from_base

ROOT = Path(__file__).resolve().parents[2]
OFF = ("--eval.interval=0", "--checkpoint.export_hf=false", "--checkpoint.interval=0", "--metrics.trace=[]")
# A learning rate too small to change any sample: both variants then generate, score and train the same tokens (with
# the recipe's rates full fine-tuning's responses shorten faster, and the lengths, not the method, decide the speed).
SAME_SAMPLES = ("--optimizer.actor_lr=1e-12",)
FULL = "--lora.models=[]"
COPY = "--lora.reference=copy"
UNMERGED = "--lora.rollout_weights=adapters"
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


def run_figures(records: list[dict], warmup: int) -> dict[str, float]:
    """One run's figures: means over the iterations after ``warmup``, the peak memory over all of them."""
    iterations = [r for r in records if r.get("step", 0) > 0]
    measured = [r for r in iterations if r["step"] > warmup]
    if not measured:
        raise ValueError(f"no iteration after the {warmup} warm-up ones; raise --steps")
    out = {k: statistics.fmean(r[k] for r in measured) for k in ("samples_per_s", *TIMES) if k in measured[0]}
    out["peak_memory_gib"] = max(r["peak_memory_gib"] for r in iterations)
    return out


def _run(cmd: list[str], out: Path, env: dict[str, str]) -> list[dict]:
    proc = subprocess.run([*cmd, f"--job.output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return read_jsonl(out / "metrics.jsonl")


def estimated_peak_gib(argv: list[str]) -> float:
    """The memory estimate's largest per-rank peak of the job ``argv`` describes."""
    from fusedrl.memory import estimate

    est = estimate(load_config(argv), progress=None)
    return max(r.peak[0] for r in est.ranks) / 2**30


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"  # a phase one variant does not run (time_reference without a base Reference)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/smollm2_135m_grpo_lora.toml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out of the speed means")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    job = ["--job.config_file", args.config, *OFF, *SAME_SAMPLES, f"--training.steps={args.steps}"]
    if not load_config(job).ppo.critic_free:
        job.append("--optimizer.critic_lr=1e-12")
    job += overrides
    if not load_config(job).lora.enabled:
        parser.error(f"{args.config} (with the overrides) has no [lora] models: nothing to compare; add --lora.models")
    variants = {"lora": job, "full": [*job, FULL]}
    if reference_from_base(load_config(job)):
        variants["lora_copy"] = [*job, COPY]
    if load_config(job).lora.rollout_weights == "merged":
        variants["lora_unmerged"] = [*job, UNMERGED]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="fusedrl_bench_lora_") as tmp:
        for r in range(args.rounds):
            for name, variant in variants.items():
                print(f"round {r + 1}/{args.rounds}: {name}, {args.steps} iterations", file=sys.stderr, flush=True)
                records = _run([*launcher, "-m", "fusedrl.train", *variant], Path(tmp, f"{name}{r}"), env)
                runs[name].append(run_figures(records, args.warmup))
    result = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, variant in variants.items():
        result[name]["estimated_peak_gib"] = estimated_peak_gib(variant)
    print(f"{args.config}, {args.nproc} ranks, {args.rounds} alternating runs of {args.steps} iterations each (median)")
    names = list(variants)
    ratios = [("lora", "full"), *([("lora", "lora_copy")] if "lora_copy" in variants else [])]
    ratios += [("lora_unmerged", "lora")] if "lora_unmerged" in variants else []
    print(f"{'figure':24s} " + " ".join(f"{n:>10s}" for n in names) + "".join(f" {a + '/' + b:>14s}" for a, b in ratios))
    for key in result["lora"]:
        values = " ".join(f"{result[n][key]:10.3f}" for n in names)
        print(f"{key:24s} {values}" + "".join(f" {_ratio(result[a][key], result[b][key]):>14s}" for a, b in ratios))
    if args.json:
        print(json.dumps({"config": args.config, "runs": runs, "median": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
