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
import sys
from collections.abc import Sequence

from fusedrl.bench.jobs import add_run_arguments, medians, parse_run_arguments, run_variants, same_samples_job, split_overrides
from fusedrl.config import load_config
from fusedrl.models import reference_from_base

FULL = "--lora.models=[]"
COPY = "--lora.reference=copy"
UNMERGED = "--lora.rollout_weights=adapters"


def estimated_peak_gib(argv: list[str]) -> float:
    """The memory estimate's largest per-rank peak of the job ``argv`` describes."""
    from fusedrl.memory import estimate

    est = estimate(load_config(argv), progress=None)
    return max(r.peak[0] for r in est.ranks) / 2**30


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"  # a phase one variant does not run (time_reference without a base Reference)


def main(argv: Sequence[str] | None = None) -> int:
    own, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/smollm2_135m_grpo_lora.toml")
    add_run_arguments(parser, steps=8)
    args = parse_run_arguments(parser, own)
    job = same_samples_job(args.config, args.steps, overrides)
    if not load_config(job).lora.enabled:
        parser.error(f"{args.config} (with the overrides) has no [lora] models: nothing to compare; add --lora.models")
    variants = {"lora": job, "full": [*job, FULL]}
    if reference_from_base(load_config(job)):
        variants["lora_copy"] = [*job, COPY]
    if load_config(job).lora.rollout_weights == "merged":
        variants["lora_unmerged"] = [*job, UNMERGED]
    runs = run_variants(variants, args)
    result = medians(runs)
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
