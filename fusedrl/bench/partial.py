"""Over-provisioned rollouts against the synchronous run: samples/s, phases, staleness and the score over wall time.

Two trainers per rank from the same initial weights take turns iteration by iteration (as ``bench.e2e``'s fusion
modes, one rank per core): ``sync``, both fusions off and no over-provisioning (every iteration decodes its whole
batch before anything else runs); ``partial``, the config's fusions on with ``[rollout] over_provision``,
``unfinished`` (``carry``: partial rollouts; ``defer``: tail batching) and ``max_staleness`` as given. Both take
``ppo.tis_cap`` with recomputed old log-probs (carried stale tokens need it; the other modes get the same loss).
Reports samples/s over the measured iterations and their ratio, the mean seconds per phase, the trained and the
finished response lengths, carried / discarded / wasted / deferred figures, trained tokens per staleness, and per
iteration each mode's cumulative step time with its reward, so that the score after the same wall time can be read
off both curves; with ``--eval`` both modes run the config's held-out evaluation after the last iteration.

Freed host memory goes back to the system (``training.reuse_host_memory = false``) in both modes: two trainers per
rank keeping their high-water marks do not fit a 24 GiB machine with the reasoning recipe.

Run: ``python -m fusedrl.bench.partial --config train_configs/smollm2_135m_reasoning_grpo.toml [--steps N] [--warmup
N] [--over-provision F] [--unfinished carry|defer] [--max-staleness S] [--tis-cap C] [--eval] [--json]
[--section.key=value ...]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from fusedrl.bench.e2e import alternating_runs, migration_summary, pick_cores, pinned_dp_shard, samples_per_s_of
from fusedrl.config import ConfigError, load_config
from fusedrl.testing import run_multirank
from fusedrl.train import prepare
from fusedrl.trainer import PHASES

SHOWN_PHASES = ("generation", "scoring_exposed", "recompute", "training", "step")
ROLLOUT_FIGURES = (
    "rollout_carried_requests",
    "rollout_carried_samples",
    "rollout_discarded_groups",
    "rollout_wasted_tokens",
    "rollout_stale_tokens_frac",
    "rollout_long_rounds",  # tail batching's
    "rollout_deferred_groups",
    "rollout_long_queue",
)


def modes(over_provision: float, unfinished: str, max_staleness: int, tis_cap: float) -> dict[str, tuple[str, ...]]:
    common = (f"--ppo.tis_cap={tis_cap}", "--ppo.recompute_logprobs=true")
    return {
        "sync": (*common, "--fusion.inter_stage=false", "--fusion.intra_stage=false", "--rollout.over_provision=0"),
        "partial": (
            *common,
            "--fusion.inter_stage=true",
            f"--rollout.over_provision={over_provision}",
            f"--rollout.unfinished={unfinished}",
            f"--rollout.max_staleness={max_staleness}",
        ),
    }


def summarize(histories: dict[str, list[dict]], warmup: int) -> dict:
    """Per mode: samples/s and phase means over the measured iterations, length and rollout figures, and the curve
    (every iteration's cumulative step time and reward)."""
    out: dict = {}
    for mode, records in histories.items():
        measured = records[warmup:]
        figures: dict = {
            "samples_per_s": samples_per_s_of(measured),
            "phases": {p: statistics.fmean(r[f"time_{p}"] for r in measured) for p in PHASES},
            "response_len": {q: statistics.fmean(r[f"response_len_{q}"] for r in measured) for q in ("mean", "p50", "p90")},
        }
        if "rollout_finished_len_mean" in measured[0]:
            figures["finished_len"] = {
                q: statistics.fmean(r[f"rollout_finished_len_{q}"] for r in measured) for q in ("mean", "p50", "p90")
            }
            figures["rollout"] = {k: statistics.fmean(r[k] for r in measured) for k in ROLLOUT_FIGURES if k in measured[0]}
            stale = [k for k in measured[0] if k.startswith("rollout_staleness_") and k.endswith("_tokens")]
            figures["trained_tokens_by_staleness"] = {k: sum(r[k] for r in measured) for k in sorted(stale)}
        figures["migration"] = migration_summary(measured)
        elapsed, curve = 0.0, []
        for step, r in enumerate(records, 1):
            elapsed += r["time_step"]
            curve.append({"step": step, "elapsed_s": elapsed, "reward_fn_mean": r.get("reward_fn_mean", r["reward_mean"])})
            curve[-1].update({k: v for k, v in r.items() if k.startswith("eval/")})
        figures["curve"] = curve
        out[mode] = figures
    out["speedup"] = out["partial"]["samples_per_s"] / out["sync"]["samples_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.partial", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="train_configs/smollm2_135m_reasoning_grpo.toml", help="TOML job config")
    parser.add_argument("--steps", type=int, default=8, help="measured iterations per mode")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per mode, before the measured ones")
    parser.add_argument("--over-provision", type=float, default=1.0, help="rollout.over_provision of the partial mode")
    parser.add_argument(
        "--unfinished", choices=("carry", "defer"), default="carry", help="rollout.unfinished of the partial mode"
    )
    parser.add_argument("--max-staleness", type=int, default=2, help="rollout.max_staleness of the partial mode")
    parser.add_argument("--tis-cap", type=float, default=2.0, help="ppo.tis_cap of both modes")
    parser.add_argument("--eval", action="store_true", help="run the config's [eval] after the last iteration")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    total = args.warmup + args.steps
    config_argv = ["--job.config_file", args.config, *overrides, "--training.device=cpu"]
    config_argv.append("--eval.at_start=false")
    # two trainers per rank that each keep their freed memory's high-water mark outgrew 24 GiB with the reasoning
    # recipe (one rank at 15.8 GiB after 7 iterations); returned to the system, each rank stays near 7 GiB
    config_argv.append("--training.reuse_host_memory=false")
    evaluation = (f"--eval.interval={total}",) if args.eval else ()
    chosen = {
        m: (*o, *evaluation) for m, o in modes(args.over_provision, args.unfinished, args.max_staleness, args.tis_cap).items()
    }
    try:
        par = load_config(config_argv).parallelism
        dp = pinned_dp_shard(par.pp, par.tp, par.dp_shard)
        config_argv.append(f"--parallelism.dp_shard={dp}")
        cores = pick_cores(par.pp * par.tp * dp)
        for overrides_of_mode in chosen.values():  # every mode's checks, and the task's assets, before any rank starts
            prepare([*config_argv, *overrides_of_mode], len(cores))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_rank = [[c] for c in cores]
    print(
        f"over-provisioned rollouts vs synchronous, {args.config}: {len(per_rank)} ranks (rank r alone on core r of "
        f"{cores}), {args.warmup} warm-up + {args.steps} measured iterations per mode, taking turns; partial: "
        f"over_provision {args.over_provision}, unfinished {args.unfinished}, max_staleness {args.max_staleness}; both "
        f"tis_cap {args.tis_cap}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out:
        histories = run_multirank(
            alternating_runs, len(per_rank), config_argv, out, 0, total, per_rank, chosen, timeout_s=7200.0
        )[0]
    result = summarize(histories, args.warmup)
    sync, partial = result["sync"], result["partial"]
    print(f"\n{'phase (s / iteration)':<24}{'sync':>12}{'partial':>12}{'partial/sync':>14}")
    for ph in SHOWN_PHASES:
        a, b = sync["phases"][ph], partial["phases"][ph]
        print(f"{ph:<24}{a:>12.3f}{b:>12.3f}{(b / a if a else float('nan')):>14.2f}")
    print(f"{'samples/s':<24}{sync['samples_per_s']:>12.3f}{partial['samples_per_s']:>12.3f}{result['speedup']:>13.3f}x")
    for mode in ("sync", "partial"):
        lengths = result[mode]["response_len"]
        print(f"trained response tokens, {mode}: " + ", ".join(f"{q} {v:.1f}" for q, v in lengths.items()))
    if "finished_len" in partial:
        print("finished response tokens, partial: " + ", ".join(f"{q} {v:.1f}" for q, v in partial["finished_len"].items()))
        print("per iteration, partial: " + ", ".join(f"{k[8:]} {v:.2f}" for k, v in partial["rollout"].items()))
        print("trained tokens by staleness, partial: " + str(partial["trained_tokens_by_staleness"]))
    moves = partial["migration"]
    print(
        f"migrations, partial: {moves['iterations_migrated']} of {args.steps} iterations, "
        f"{moves['moved_per_iteration']:.1f} requests moved per iteration"
    )
    print("\nscore over wall time (cumulative step seconds, reward_fn_mean of the trained batch):")
    for mode in ("sync", "partial"):
        points = [f"{c['elapsed_s']:.1f}s {c['reward_fn_mean']:.3f}" for c in result[mode]["curve"]]
        print(f"{mode:<8}" + " | ".join(points))
    if args.eval:
        for mode in ("sync", "partial"):
            last = result[mode]["curve"][-1]
            shown = {k: round(v, 3) for k, v in last.items() if k.startswith("eval/")}
            print(f"held-out evaluation after iteration {total}, {mode} ({last['elapsed_s']:.0f} s of steps): {shown}")
    print(f"speedup (samples/s, partial / sync): {result['speedup']:.3f}x", flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
