"""One recipe in several parallel layouts on the same ranks: which trains fastest here?

    python -m fusedrl.bench.layouts --config train_configs/smollm2_135m_grpo.toml \
        --layout "--parallelism.pp=2 --parallelism.dp_shard=1 --ppo.microbatch_size=4" [--layout ...] \
        [--steps 5] [--warmup 2] [--rounds 2] [--nproc 2] [--json] [-- overrides...]

Runs ``torchrun --nproc_per_node N -m fusedrl.train`` on the config as it is (the baseline, ``config``) and with each
``--layout``'s overrides appended, the variants alternating over ``--rounds``, evaluation and export off, at learning
rates too small to change a sample (:mod:`fusedrl.bench.jobs`), so that every layout generates, scores and trains the
same tokens: the generation instances and their seeds do not depend on the training layout. A layout's string holds
one or more overrides; write ``--layout="--parallelism.pp=2"`` where it holds one (argparse reads a lone ``--...``
value as an option). Per run the mean samples/s and phase times of the iterations after ``--warmup``; per variant the
median over its runs and its ratio to the config's. The recipes' ``[parallelism]`` comments cite these figures
(docs/benchmarks.md, "The recipes' layouts").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from fusedrl.bench.jobs import add_run_arguments, medians, parse_run_arguments, run_variants, same_samples_job, split_overrides
from fusedrl.config import ConfigError, load_config

BASELINE = "config"


def variants_of(config: str, layouts: Sequence[str], steps: int, overrides: Sequence[str]) -> dict[str, list[str]]:
    """The command-line arguments of each variant: the config as is, then each layout's overrides (a space-separated
    string) after the common ones, named by those overrides."""
    job = same_samples_job(config, steps, overrides)
    variants = {BASELINE: job}
    for layout in layouts:
        variant = [*job, *layout.split()]
        load_config(variant)  # a misspelt key fails here, before any run
        variants[layout] = variant
    return variants


def main(argv: Sequence[str] | None = None) -> int:
    own, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.layouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="TOML job config (its layout is the baseline)")
    parser.add_argument("--layout", action="append", required=True, help="another layout: overrides in one string (repeatable)")
    add_run_arguments(parser, steps=5)
    args = parse_run_arguments(parser, own)
    try:
        variants = variants_of(args.config, args.layout, args.steps, overrides)
    except ConfigError as err:
        parser.error(str(err))
    runs = run_variants(variants, args)
    median = medians(runs)
    print(f"{args.config}, {args.nproc} ranks, {args.rounds} alternating runs of {args.steps} iterations each (median)")
    base = median[BASELINE]
    for name, figures in median.items():
        against = f"  (against {BASELINE}: samples/s ratio {figures['samples_per_s'] / base['samples_per_s']:.3f}x)"
        print(f"\n{name}" + ("" if name == BASELINE else against))
        for key, value in figures.items():
            ratio = f"{value / base[key]:.3f}x" if base[key] else "-"
            print(f"  {key:24s} {value:10.3f}   {ratio}")
    if args.json:
        print(json.dumps({"config": args.config, "runs": runs, "median": median}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
