"""End-to-end PPO iterations on the debug config: the fusions as configured ("auto" by default) vs both off, or this
tree vs another one.

Fusions (default): runs the config on two layouts of the same cores, one after the other: ``one_rank_per_core`` (pp x tp
x dp ranks, dp the config's dp_shard lowered to what this process's cores hold (:func:`pinned_dp_shard`), rank r pinned
to the r-th core of ``os.sched_getaffinity``, so that a rank idle in a pipeline bubble leaves its core idle, as a GPU
would) and ``oversubscribed`` (dp_shard = 2 x dp: twice as many ranks on the same cores, each allowed on all of them, so
that an idle rank hands its core to another). The global batch is the config's in both layouts. Each layout spawns its
CPU processes with one torch thread each, builds a trainer per mode from the same initial weights, and runs ``--warmup``
+ ``--steps`` iterations per mode with the modes taking turns iteration by iteration (off, on, on, off, ...), so that
the load of other processes on the machine hits both alike. With ``--apart`` each mode runs alone instead, one trainer
per rank in processes of its own, the runs alternating (off, on, on, off, ...) over ``--rounds``: half the memory per
rank (a real model's two trainers per rank may not fit at 2 ranks per core), at the price of slower drifts in the
machine's load hitting the modes unevenly. Reports per layout samples/s over the measured iterations, the mean seconds
per phase and the response lengths the inter-stage fusion saw (p50 / p90 / p99 per iteration, the longest).
``--fusion-layouts one_rank_per_core`` skips the oversubscribed layout (it needs twice the ranks' memory). Both modes
sample the same responses (fusion changes when work runs, not what is computed): the first iteration of every run
compares the same work, checked by the iterations' sample digests (``samples_digest``); later ones may not (bf16 updates
under two schedules round differently). The iteration-1 protocol: ``--apart --warm-cache --warmup 0 --steps 1``
(``inter_stage = "auto"`` runs a run's first rollout unfused and its second fused, to measure both: ``--warmup 2``
measures its choices, ``--fusion.inter_stage=true`` the fused iteration 1). Where
the "auto" threshold simulated a rollout, the simulator's predictions of the rollout and of its last decode step are
printed beside the measured ones. Needs Linux (``os.sched_setaffinity``) and at least pp x tp cores.

Trees (``--baseline TREE``, e.g. a ``git worktree`` of the commit a change started from): the same config with
this tree's code and with TREE's, one trainer run per tree and layout (``--layouts``: world sizes; pp stays, and
dp_shard = world / pp), the runs alternating A B B A ... over ``--rounds``. Reports samples/s, each phase's time and,
at pp > 1, the executor's overhead per pipeline action: (time inside ``FusedPipelineSchedule.step`` - time inside the
stages' forward/backward and the losses) / program entries executed, and the same without the time spent waiting for
messages (see :mod:`fusedrl.bench.tree_worker`).

Run: ``python -m fusedrl.bench.e2e [--json] [--config FILE] [--steps N] [--warmup N] [--fusion-layouts NAMES]
[--apart] [--baseline TREE] [--layouts 4,2] [--rounds R] [--section.key=value ...]``. With ``--json`` the last stdout line is one JSON object
(fusions: ``{"speedup": on/off samples/s one rank per core, "speedup_oversubscribed": the same at twice the ranks,
"layouts": {"one_rank_per_core": {"samples_per_s": {"on": .., "off": ..}, "phases": {...}, ...}, ...}, ...}``;
trees: per layout the samples/s, phase and overhead figures of both trees and their ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from fusedrl.bench import NO_OUTPUT_OVERRIDES
from fusedrl.config import ConfigError, load_config
from fusedrl.testing import run_multirank
from fusedrl.train import prepare
from fusedrl.trainer import PHASES, Trainer

ROOT = Path(__file__).resolve().parents[2]
MODES: dict[str, tuple[str, ...]] = {"off": ("--fusion.inter_stage=false", "--fusion.intra_stage=false"), "on": ()}
"""The fusions benchmark's modes: their config overrides ("on": the fusions as the config and the command line set
them, "auto" by default; ``--fusion.inter_stage=true --fusion.intra_stage=true`` forces them on)."""
LAYOUTS = {"one_rank_per_core": 1, "oversubscribed": 2}
"""The fusions benchmark's layouts, both on the same pp x tp x dp cores, by their ranks per core."""


# ---------------------------------------------------------------------------------------------- fusions on/off
def pick_cores(ranks: int) -> list[int]:
    """The first ``ranks`` cores this process may run on (``os.sched_getaffinity``); raises ConfigError if fewer."""
    if not hasattr(os, "sched_getaffinity"):
        raise ConfigError("bench.e2e pins ranks to cores with os.sched_setaffinity, which this platform lacks; run it on Linux")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ConfigError(
            f"one rank per core needs parallelism.pp * parallelism.tp = {ranks} cores, but this process may run on "
            f"{len(cores)} ({cores}); lower parallelism.pp or run on a machine with {ranks} free cores"
        )
    return cores[:ranks]


def pinned_dp_shard(pp: int, tp: int, dp_shard: int) -> int:
    """The data-parallel degree of one rank per core: the config's ``dp_shard``, lowered to what this process's cores
    hold (pp x tp x dp ranks), at least 1 (:func:`pick_cores` then says how many cores pp x tp needs)."""
    free = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return max(1, min(dp_shard, free // (pp * tp)))


def rank_cores(cores: list[int], per_core: int) -> list[list[int]]:
    """Per rank, the cores it may run on: at one rank per core rank r alone on ``cores[r]``, else every rank on all
    of them (``len(cores) * per_core`` ranks)."""
    if per_core == 1:
        return [[c] for c in cores]
    return [list(cores) for _ in range(len(cores) * per_core)]


def pin_process(cores: list[int]) -> None:
    """Restrict every thread of this process to ``cores``, those already running (gloo's, torch's) too; threads
    started later inherit it. ``os.sched_setaffinity(0, ...)`` alone would pin only the calling thread."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def alternating_runs(
    argv: list[str], out: str, warmup: int, steps: int, cores: list[list[int]], modes: dict[str, tuple[str, ...]] = MODES
) -> dict[str, list[dict]]:
    """Pins the rank to ``cores[rank]``; one trainer per mode (``argv``, no outputs, then the mode's overrides, which
    may turn an evaluation back on), side by side, taking turns iteration by iteration (order a, b, b, a, ...), so
    that a drifting machine load biases no mode. Returns each mode's metrics of the measured iterations (collective;
    run it on every rank)."""
    pin_process(cores[dist.get_rank()])
    trainers = {}
    for mode, overrides in modes.items():
        cfg = load_config(
            [
                *argv,
                f"--training.steps={warmup + steps}",
                f"--job.output_dir={out}/{mode}",
                *NO_OUTPUT_OVERRIDES,
                "--metrics.timeline_interval=1",
                *overrides,
            ]
        )
        trainers[mode] = Trainer(cfg)
    histories: dict[str, list[dict]] = {mode: [] for mode in modes}
    for step in range(1, warmup + steps + 1):
        for mode in list(modes) if step % 2 else list(modes)[::-1]:
            record = trainers[mode].train_step(step)
            if step > warmup:
                histories[mode].append(record)
    return histories


LENGTH_FIGURES = ("p50", "p90", "p99", "max")


def runs_apart(
    argv: list[str],
    out: str,
    warmup: int,
    steps: int,
    cores: list[list[int]],
    rounds: int,
    warm_cache: bool = False,
    modes: dict[str, tuple[str, ...]] = MODES,
) -> dict[str, list[dict]]:
    """Each mode of :data:`MODES` alone (one trainer per rank, fresh processes per run), ``rounds`` runs each in the
    order off, on, on, off, ...; each mode's metrics of the measured iterations of all its runs. ``warm_cache``: one
    unmeasured run of one iteration first (torch.compile's cache then holds the graphs every measured run needs)."""
    histories: dict[str, list[dict]] = {mode: [] for mode in modes}
    if warm_cache:
        run_multirank(alternating_runs, len(cores), argv, out, 0, 1, cores, {"on": modes["on"]}, timeout_s=3600.0)
        print("warm-up run (unmeasured) done", flush=True)
    for r in range(rounds):
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            run = run_multirank(
                alternating_runs, len(cores), argv, out, warmup, steps, cores, {mode: modes[mode]}, timeout_s=3600.0
            )[0]
            histories[mode] += run[mode]
            print(f"run {r + 1}/{rounds}, fusions {mode}: {samples_per_s_of(run[mode]):.3f} samples/s", flush=True)
    return histories


def summarize(histories: dict[str, list[dict]]) -> dict:
    """samples/s over the measured steps (total samples / total step time), mean seconds per phase, the response
    lengths the rollout saw (per iteration p50 / p90 / p99, averaged over iterations, and the longest), and the
    inter-stage fusion's migrations: iterations that migrated, requests moved per iteration, and where the "auto"
    threshold simulated a rollout, the simulator's prediction of its length beside the measured one."""
    out: dict = {"samples_per_s": {}, "phases": {}, "bubble_ratio": {}, "true_score": {}, "response_len": {}, "migration": {}}
    digests = [[r["samples_digest"] for r in histories[mode]] for mode in MODES]
    out["samples_identical"] = sum(len(set(d)) == 1 for d in zip(*digests))
    out["samples_compared"] = min(len(d) for d in digests)
    for mode, records in histories.items():
        out["samples_per_s"][mode] = samples_per_s_of(records)
        out["phases"][mode] = {p: sum(r[f"time_{p}"] for r in records) / len(records) for p in PHASES}
        out["bubble_ratio"][mode] = sum(r["bubble_ratio"] for r in records) / len(records)
        if all("true_score" in r for r in records):
            out["true_score"][mode] = sum(r["true_score"] for r in records) / len(records)
        out["response_len"][mode] = {
            q: (max if q == "max" else statistics.fmean)(r[f"response_len_{q}"] for r in records) for q in LENGTH_FIGURES
        }
        out["migration"][mode] = migration_summary(records)
    out["speedup"] = out["samples_per_s"]["on"] / out["samples_per_s"]["off"]
    return out


def migration_summary(records: list[dict]) -> dict[str, float | None]:
    """Migrations over ``records`` (iteration metrics) and the rollout simulator's prediction errors of the rollout
    and of its last decode step's end (means of |predicted - measured| / measured over the iterations it predicted;
    None when it predicted none)."""
    predicted = [r for r in records if "rollout_predicted_s" in r]
    thresholds = [r["auto_threshold"] for r in records if "auto_threshold" in r]

    def mean(key: str) -> float | None:
        return statistics.fmean(r[key] for r in predicted) if predicted else None

    def error(key: str, measured: str) -> float | None:
        return statistics.fmean(abs(r[key] - r[measured]) / r[measured] for r in predicted) if predicted else None

    return {
        "iterations_fused": sum(r.get("inter_stage_fused", 0) > 0 for r in records),
        "iterations_migrated": sum(r["migration_kept"] > 0 for r in records),
        "moved_per_iteration": statistics.fmean(r["migration_moved"] for r in records),
        "auto_threshold": statistics.fmean(thresholds) if thresholds else None,
        "predicted_iterations": len(predicted),
        "prediction_error": error("rollout_predicted_s", "rollout_s"),
        "decode_end_error": error("decode_end_predicted_s", "decode_end_s"),
        "measured_rollout_s": mean("rollout_s"),
        "predicted_rollout_s": mean("rollout_predicted_s"),
        "predicted_never_s": mean("rollout_predicted_never_s"),
        "measured_decode_end_s": mean("decode_end_s"),
        "predicted_decode_end_s": mean("decode_end_predicted_s"),
    }


def samples_per_s_of(records: list[dict]) -> float:
    total = sum(r["time_step"] for r in records)
    return sum(r["samples_per_s"] * r["time_step"] for r in records) / total


def _fusions(
    config_argv: list[str],
    cores: list[int],
    pp: int,
    dp: int,
    warmup: int,
    steps: int,
    config: str,
    batch: int,
    as_json: bool,
    layouts: dict[str, int] = LAYOUTS,
    apart_rounds: int = 0,
    warm_cache: bool = False,
    modes: dict[str, tuple[str, ...]] = MODES,
) -> None:
    turns = "the modes taking turns (off, on, on, off, ...)"
    if apart_rounds:
        turns = f"each mode in {apart_rounds} runs of its own, alternating (off, on, on, off, ...)"
    print(
        f"end-to-end PPO, {config}, batch {batch}, on cores {cores}: {warmup} warm-up + {steps} measured iterations "
        f"per mode, run and layout, {turns}",
        flush=True,
    )
    result: dict = {"config": config, "batch_size": batch, "measured_steps_per_run": steps, "cores": cores, "layouts": {}}
    for name, per_core in layouts.items():
        per_rank = rank_cores(cores, per_core)
        dp_shard = dp * per_core
        argv = [*config_argv, f"--parallelism.dp_shard={dp_shard}"]
        with tempfile.TemporaryDirectory() as out:
            if apart_rounds:
                histories = runs_apart(argv, out, warmup, steps, per_rank, apart_rounds, warm_cache, modes)
            else:
                ranks = run_multirank(
                    alternating_runs, len(per_rank), argv, out, warmup, steps, per_rank, modes, timeout_s=3600.0
                )
                histories = ranks[0]
        layout = summarize(histories)
        layout.update(world_size=len(per_rank), dp_shard=dp_shard, rank_cores=per_rank, runs_per_mode=apart_rounds or 1)
        result["layouts"][name] = layout
        pinning = f"rank r alone on core r of {cores}" if per_core == 1 else f"every rank on all of {cores}"
        print(f"\n{name}: {len(per_rank)} CPU ranks (pp={pp} x dp_shard={dp_shard}), {pinning}")
        print(f"{'phase (s / iteration)':<24}{'fusions off':>14}{'fusions on':>14}{'on/off':>10}")
        for p in PHASES:
            off, on = layout["phases"]["off"][p], layout["phases"]["on"][p]
            ratio = f"{on / off:.2f}" if off else "-"  # a phase that took no time (outside: no logging or saving)
            print(f"{p:<24}{off:>14.3f}{on:>14.3f}{ratio:>10}")
        print(f"{'samples/s':<24}{layout['samples_per_s']['off']:>14.2f}{layout['samples_per_s']['on']:>14.2f}")
        print(f"{'pipeline bubble ratio':<24}{layout['bubble_ratio']['off']:>14.3f}{layout['bubble_ratio']['on']:>14.3f}")
        for m in MODES:
            lengths = layout["response_len"][m]
            print(f"response tokens, fusions {m}: " + ", ".join(f"{q} {lengths[q]:.1f}" for q in LENGTH_FIGURES))
        moves = layout["migration"]["on"]
        iterations = steps * (apart_rounds or 1)
        line = f"inter-stage fusion on in {moves['iterations_fused']} of {iterations} iterations; "
        line += f"migrations, fusions on: {moves['iterations_migrated']} of {iterations} iterations, "
        line += f"{moves['moved_per_iteration']:.1f} requests moved per iteration"
        if moves["auto_threshold"] is not None:
            line += f", auto threshold {moves['auto_threshold']:.1f} requests (mean; 0: never migrate)"
        if moves["prediction_error"] is not None:
            line += (
                f"; the simulator's rollout length off by {100 * moves['prediction_error']:.1f}%, its last decode "
                f"step's end by {100 * moves['decode_end_error']:.1f}% (means over {moves['predicted_iterations']} "
                "iterations)"
            )
        print(line)
        if moves["predicted_rollout_s"] is not None:
            print(
                f"rollout, fusions on: {moves['measured_rollout_s']:.2f} s measured, the simulator's prediction "
                f"{moves['predicted_rollout_s']:.2f} s, without migrating {moves['predicted_never_s']:.2f} s; its last "
                f"decode step ends at {moves['measured_decode_end_s']:.2f} s, predicted {moves['predicted_decode_end_s']:.2f}"
                " s (means, from the rollout's start)"
            )
        same, compared = layout["samples_identical"], layout["samples_compared"]
        verdict = "identical" if same == compared else f"identical in {same} only (the others compare different work)"
        print(f"samples of the two modes (sample digests, iteration by iteration): {verdict} of {compared} compared")
        print(f"speedup (samples/s, on / off): {layout['speedup']:.3f}x", flush=True)
    pinned, shared = result["layouts"].get("one_rank_per_core"), result["layouts"].get("oversubscribed")
    result["speedup"] = None if pinned is None else pinned["speedup"]
    result["speedup_oversubscribed"] = None if shared is None else shared["speedup"]
    if pinned is not None and shared is not None:
        print(
            f"\nspeedup one rank per core: {pinned['speedup']:.3f}x, oversubscribed: {shared['speedup']:.3f}x; "
            "samples/s one rank per core / oversubscribed: "
            + ", ".join(f"fusions {m} {pinned['samples_per_s'][m] / shared['samples_per_s'][m]:.2f}x" for m in MODES)
        )
    if as_json:
        print(json.dumps(result))


# ---------------------------------------------------------------------------------------------- tree vs tree
def _run_tree(tree: Path, config: str, overrides: list[str], world: int, warmup: int, steps: int) -> list[dict]:
    """One trainer run of ``tree``'s code (its own config file and assets) in a fresh Python; per rank figures."""
    with tempfile.TemporaryDirectory() as out:
        spec = {"config": config, "overrides": overrides, "world": world, "warmup": warmup, "steps": steps, "out": out}
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("tree_worker.py")), json.dumps(spec)],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
    if proc.returncode:
        raise RuntimeError(f"the trainer run of {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tree_figures(ranks: list[dict]) -> dict[str, float]:
    """samples/s of the run, its phase times (means over its iterations) and, where every rank ran a pipeline program
    (pp > 1; pp = 1 runs none), the executor's overhead per program entry averaged over ranks."""
    records = ranks[0]["records"]
    figures = {"samples_per_s": samples_per_s_of(records)}
    figures.update({k: statistics.fmean(r[k] for r in records) for k in records[0] if k.startswith("time_")})
    if all(r["actions"] for r in ranks):
        figures["overhead_us_per_action"] = 1e6 * statistics.fmean(
            (r["executor_s"] - r["compute_s"]) / r["actions"] for r in ranks
        )
        figures["overhead_us_per_action_without_waits"] = 1e6 * statistics.fmean(
            (r["executor_s"] - r["compute_s"] - r["wait_s"]) / r["actions"] for r in ranks
        )
    return figures


def _trees(
    baseline: Path,
    config: str,
    overrides: list[str],
    pp: int,
    layouts: list[int],
    rounds: int,
    warmup: int,
    steps: int,
    as_json: bool,
) -> None:
    trees = {"baseline": baseline.resolve(), "this": ROOT}
    runs: dict[int, dict[str, list[dict]]] = {w: {name: [] for name in trees} for w in layouts}
    order = list(trees)
    for r in range(rounds):
        for world in layouts:
            for name in order if r % 2 == 0 else order[::-1]:
                layout = [f"--parallelism.pp={pp}", f"--parallelism.dp_shard={world // pp}"]
                runs[world][name].append(
                    _tree_figures(_run_tree(trees[name], config, [*overrides, *layout], world, warmup, steps))
                )
                print(f"round {r + 1}/{rounds}, {world} ranks, {name}: {runs[world][name][-1]}", flush=True)
    result: dict = {
        "config": config,
        "baseline": str(trees["baseline"]),
        "rounds": rounds,
        "measured_steps": steps,
        "layouts": {},
    }
    print(
        f"\nend-to-end PPO, {config}: this tree vs {trees['baseline']}, {rounds} runs each (medians), "
        f"{warmup} warm-up + {steps} measured iterations per run"
    )
    print(f"{'layout':<22}{'figure':<36}{'baseline':>12}{'this':>12}{'this/base':>11}")
    for world in layouts:
        row = {}
        for key in (k for k in runs[world]["baseline"][0] if all(k in x for x in runs[world]["this"])):
            base = statistics.median(x[key] for x in runs[world]["baseline"])
            this = statistics.median(x[key] for x in runs[world]["this"])
            row[key] = {"baseline": base, "this": this, "ratio": this / base if base else math.nan}
            shown = f"{this / base:>10.3f}x" if base else f"{'-':>11}"  # a phase the baseline did not run
            print(f"{f'{world} ranks (pp={pp})':<22}{key:<36}{base:>12.3f}{this:>12.3f}{shown}")
        result["layouts"][str(world)] = row
    if as_json:
        print(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--config", default="train_configs/debug_ppo.toml", help="TOML job config (CPU debug config)")
    parser.add_argument("--steps", type=int, default=6, help="measured iterations per mode (per run with --baseline)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per mode, before the measured ones")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another fusedrl source tree (e.g. a git worktree of the starting commit): compare trees",
    )
    parser.add_argument("--layouts", default="4,2", help="with --baseline: world sizes to run (pp as configured)")
    parser.add_argument(
        "--fusion-layouts",
        default=",".join(LAYOUTS),
        help="without --baseline: the layouts to run (one_rank_per_core, oversubscribed: twice the ranks and memory)",
    )
    parser.add_argument(
        "--apart",
        action="store_true",
        help="without --baseline: run each fusion mode alone (one trainer per rank), alternating over --rounds",
    )
    parser.add_argument(
        "--off",
        default=" ".join(MODES["off"]),
        help='the "off" mode\'s overrides (default: both fusions off); e.g. --off="--generation.speculative=off" with '
        "--generation.speculative=history compares speculative decoding instead",
    )
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="with --apart: one unmeasured run of one iteration first, so that no measured run compiles cold",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="with --baseline: runs of each tree per layout; with --apart: of each mode"
    )
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    if args.apart and args.baseline is not None:
        parser.error("--apart runs the fusion modes apart; --baseline compares trees (each run apart already): drop one")

    unknown = set(args.fusion_layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(
            f"--fusion-layouts {args.fusion_layouts}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(LAYOUTS)}"
        )
    layouts = {name: dp for name, dp in LAYOUTS.items() if name in args.fusion_layouts.split(",")}
    config_argv = ["--job.config_file", args.config, *overrides, "--training.device=cpu"]
    try:
        par = load_config(config_argv).parallelism
        if args.baseline is None:
            dp = pinned_dp_shard(par.pp, par.tp, par.dp_shard)
            cores = pick_cores(par.pp * par.tp * dp)
            for name, per_core in layouts.items():  # check every layout before any rank starts
                try:
                    cfg = prepare([*config_argv, f"--parallelism.dp_shard={dp * per_core}"], len(cores) * per_core)
                except ConfigError as e:
                    others = ",".join(n for n in LAYOUTS if n != name)
                    raise ConfigError(f"layout {name} (dp_shard = {dp * per_core}): {e}; or --fusion-layouts {others}") from e
        else:
            prepare(config_argv, par.pp * par.dp_shard * par.tp)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.baseline is None:
        rounds = args.rounds if args.apart else 0
        _fusions(
            config_argv,
            cores,
            par.pp,
            dp,
            args.warmup,
            args.steps,
            args.config,
            cfg.ppo.batch_size,
            args.json,
            layouts,
            rounds,
            args.warm_cache,
            {"off": tuple(args.off.split()), "on": ()},
        )
        return 0
    if not (args.baseline / "fusedrl" / "train.py").is_file():
        parser.error(
            f"--baseline {args.baseline}: not a fusedrl source tree (no fusedrl/train.py); "
            "make one with `git worktree add <dir> <commit>`"
        )
    worlds = [int(w) for w in args.layouts.split(",")]
    if any(w % par.pp for w in worlds):
        parser.error(f"--layouts {args.layouts}: every world size must be a multiple of parallelism.pp = {par.pp}")
    _trees(
        args.baseline,
        args.config,
        [*overrides, "--training.device=cpu"],
        par.pp,
        worlds,
        args.rounds,
        args.warmup,
        args.steps,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
