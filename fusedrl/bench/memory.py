"""Memory per rank of an RL job (PPO, or critic-free): ``python -m fusedrl.bench.memory --config CONFIG [--world N]
[--json] [--measure [--critic-free]] [--device-gib G] [--pipeline-shapes K] [--section.key=value ...]``.

The command line of :mod:`fusedrl.memory` (the estimate from the layouts built on the meta device, and with
``--measure`` the real trainer on CPU ranks against it); ``docs/memory.md`` derives the figures and tells how to read
the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

from fusedrl.bench import NO_OUTPUT_OVERRIDES
from fusedrl.config import ConfigError, load_config
from fusedrl.distributed import check_dims
from fusedrl.memory import TOLERANCE, compare, estimate, format_comparison, format_table, measure_rank, to_json
from fusedrl.memory.measure import ITERATIONS
from fusedrl.pipelining import STAGE_CACHE_SIZE
from fusedrl.testing import MultiRankPool, run_on_ranks

MEASURE_CONFIG = "train_configs/debug_ppo.toml"
_MEASURE_SIZE: tuple[str, ...] = (  # a small batch: 4 CPU ranks take a few seconds
    "--ppo.batch_size=8",
    "--ppo.minibatch_size=8",
    "--ppo.microbatch_size=2",
    "--ppo.epochs=1",
    "--data.max_prompt_len=32",
    "--generation.max_new_tokens=24",
    "--generation.max_slots=4",
    "--generation.stop_token_ids=[]",
    "--fusion.schedule_search_budget_s=0.2",
)
MEASURE_OVERRIDES: tuple[str, ...] = (
    "--model.actor=debug_large",
    "--model.critic=debug_large",
    "--model.reward=debug_large",
    "--model.actor_path=",
    "--model.critic_path=",
    "--model.reward_path=",
    "--model.reference_path=",
    *_MEASURE_SIZE,
)
CRITIC_FREE_MEASURE_CONFIG = "train_configs/debug_grpo.toml"
"""``--measure --critic-free``: GRPO (no Critic; the task's rule scores, the Reference for the KL loss term; the Actor
alone on split-backward schedules)."""
CRITIC_FREE_MEASURE_OVERRIDES: tuple[str, ...] = (
    "--model.actor=debug_large",
    "--model.actor_path=",
    "--model.reference_path=",
    "--generation.n=2",  # 4 prompts: one per generation instance
    "--fusion.split_backward=true",  # the Actor alone on split-backward schedules
    *_MEASURE_SIZE,
)
_RUN_OVERRIDES: tuple[str, ...] = (
    f"--training.steps={ITERATIONS}",
    *NO_OUTPUT_OVERRIDES,
    "--metrics.timeline_interval=0",
    "--training.device=cpu",
)


def measure(argv: list[str], world: int, pool: MultiRankPool | None = None) -> list[dict[str, Any]]:
    """Run the config (``argv``: ``--job.config_file ...`` and overrides) through the real trainer on ``world`` CPU
    ranks (:func:`fusedrl.memory.measure_rank`), ``pool``'s if given; per rank what it measured, in rank order."""
    with tempfile.TemporaryDirectory() as out:
        ranks = run_on_ranks(pool, measure_rank, world, argv, out, timeout_s=1800.0)
        return sorted(ranks, key=lambda m: m["rank"])


def main(argv: list[str] | None = None, pool: MultiRankPool | None = None) -> int:
    """The command line; ``pool``: the ranks ``--measure`` runs on (default: fresh processes)."""
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=None, help=f"TOML job config (default with --measure: a debug_large run of {MEASURE_CONFIG})"
    )
    parser.add_argument("--world", type=int, default=None, help="ranks (default pp * dp_shard * tp; 4 with --measure)")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="run the config through the real trainer on CPU ranks and compare with the estimate",
    )
    parser.add_argument(
        "--critic-free",
        action="store_true",
        help=f"with --measure and no --config: a debug_large GRPO run of {CRITIC_FREE_MEASURE_CONFIG} (no Critic)",
    )
    parser.add_argument("--device-gib", type=float, default=80.0, help="device memory to check the peak against")
    parser.add_argument(
        "--pipeline-shapes",
        type=int,
        default=None,
        help="sequence buckets a run visits, the longest first (default: every bucket); the executor keeps the stages "
        f"(and buffers) of {STAGE_CACHE_SIZE} of them",
    )
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--") or "." not in o.split("=")[0]]
    if bad:
        parser.error(f"unexpected arguments {bad}; config overrides look like --section.key=value")
    if args.critic_free and (not args.measure or args.config is not None):
        parser.error("--critic-free picks the default config of --measure; with --config set ppo.advantage_estimator there")
    if args.measure:
        return _main_measure(args, overrides, pool)
    if args.config is None:
        parser.error("--config is required (or --measure)")
    try:
        cfg = load_config(["--job.config_file", args.config, *overrides])
        est = estimate(cfg, args.world, config_name=args.config, pipeline_shapes=args.pipeline_shapes)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(est, args.device_gib))
    if args.json:
        print(json.dumps(to_json(est, args.device_gib)))
    return 0


def _main_measure(args: argparse.Namespace, overrides: list[str], pool: MultiRankPool | None) -> int:
    defaults: tuple[str, ...] = ()
    if args.config is not None:
        config = args.config
    elif args.critic_free:
        config, defaults = CRITIC_FREE_MEASURE_CONFIG, CRITIC_FREE_MEASURE_OVERRIDES
    else:
        config, defaults = MEASURE_CONFIG, MEASURE_OVERRIDES
    argv = ["--job.config_file", config, *defaults, *overrides, *_RUN_OVERRIDES]
    try:
        cfg = load_config(argv)
        world = args.world or cfg.parallelism.pp * cfg.parallelism.dp_shard * cfg.parallelism.tp
        check_dims(cfg, world)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[memory] running {config} through the trainer on {world} CPU ranks ({ITERATIONS} iterations)", file=sys.stderr)
    measured = measure(argv, world, pool)
    est = estimate(
        cfg,
        world,
        config_name=config,
        ranks=list(range(world)),
        program=measured[0]["program"],
        pipeline_seqs=measured[0]["pipeline_seqs"],
        seq_len=max(measured[0]["pipeline_seqs"]),
    )
    rows = compare(cfg, measured, est)
    print(format_table(est, args.device_gib))
    print()
    print(f"measured (real trainer, {world} CPU ranks, {ITERATIONS} iterations) vs estimated, per rank and category:")
    print(format_comparison(rows))
    gated = [c for c in rows if c.gated]
    failed = [c for c in gated if not c.ok]
    print(
        f"{len(gated) - len(failed)}/{len(gated)} compared categories within {TOLERANCE:.0%}"
        + ("" if not failed else f"; off: {', '.join(sorted({c.category for c in failed}))}")
    )
    if args.json:
        result = to_json(est, args.device_gib)
        result["comparison"] = [
            {
                "rank": c.rank,
                "category": c.category,
                "measured": c.measured,
                "estimated": c.estimated,
                "ratio": round(c.ratio, 4),
                "gated": c.gated,
            }
            for c in rows
        ]
        result["comparison_ok"] = not failed
        print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
