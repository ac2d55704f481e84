"""End-to-end PPO iterations with both fusions on vs both off, on the debug config, in one run.

Spawns the config's world size (pp x dp_shard, 4 for debug_ppo.toml) CPU processes with one thread each,
builds a trainer per mode from the same initial weights, and runs ``--warmup`` + ``--steps`` iterations per mode
with the modes taking turns iteration by iteration (off, on, on, off, ...), so that the load of other processes
on the machine hits both alike. Reports samples/s over the measured iterations and the mean seconds per stage.
Both modes sample the same responses (fusion changes when work runs, not what is computed), so the
``true_score`` figures of the two modes agree.

Run: ``python -m fusedrl.bench.e2e [--json] [--config FILE] [--steps N] [--warmup N] [--section.key=value ...]``.
With ``--json`` the last stdout line is ``{"speedup": on/off samples/s, "stages": {"on": {...}, "off": {...}}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from fusedrl.config import ConfigError, load_config
from fusedrl.testing import run_multirank
from fusedrl.train import Trainer, prepare

MODES = {"off": ("false", "false"), "on": ("true", "true")}
STAGES = ("weight_sync", "generation", "scoring", "scoring_exposed", "advantages", "training", "step")


def _bench(argv: list[str], out: str, warmup: int, steps: int) -> dict[str, list[dict]]:
    """Both trainers live side by side and take turns iteration by iteration (order off, on, on, off, ...),
    so that a drifting machine load biases neither mode."""
    trainers = {}
    for mode, (inter, intra) in MODES.items():
        cfg = load_config([*argv, f"--fusion.inter_stage={inter}", f"--fusion.intra_stage={intra}",
                           f"--training.steps={warmup + steps}", f"--job.output_dir={out}/{mode}",
                           "--checkpoint.interval=0", "--checkpoint.resume=false", "--checkpoint.export_hf=false",
                           "--metrics.trace=[]", "--metrics.jsonl=false", "--metrics.tensorboard=false"])
        trainers[mode] = Trainer(cfg)
    histories: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for step in range(1, warmup + steps + 1):
        for mode in (list(MODES) if step % 2 else list(MODES)[::-1]):
            record = trainers[mode].train_step(step)
            if step > warmup:
                histories[mode].append(record)
    return histories


def summarize(histories: dict[str, list[dict]]) -> dict:
    """samples/s over the measured steps (total samples / total step time) and mean seconds per stage."""
    out: dict = {"samples_per_s": {}, "stages": {}, "bubble_ratio": {}, "true_score": {}}
    for mode, records in histories.items():
        total = sum(r["time_step"] for r in records)
        samples = sum(r["samples_per_s"] * r["time_step"] for r in records)
        out["samples_per_s"][mode] = samples / total
        out["stages"][mode] = {s: sum(r[f"time_{s}"] for r in records) / len(records) for s in STAGES}
        out["bubble_ratio"][mode] = sum(r["bubble_ratio"] for r in records) / len(records)
        if all("true_score" in r for r in records):
            out["true_score"][mode] = sum(r["true_score"] for r in records) / len(records)
    out["speedup"] = out["samples_per_s"]["on"] / out["samples_per_s"]["off"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--config", default="train_configs/debug_ppo.toml", help="TOML job config (CPU debug config)")
    parser.add_argument("--steps", type=int, default=6, help="measured iterations per mode")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per mode, before the measured ones")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")

    config_argv = ["--job.config_file", args.config, *overrides, "--training.device=cpu"]
    try:
        par = load_config(config_argv).parallelism
        world = par.pp * par.dp_shard * par.tp
        cfg = prepare(config_argv, world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as out:
        histories = run_multirank(_bench, world, config_argv, out, args.warmup, args.steps, timeout_s=3600.0)[0]
    result = summarize(histories)
    result.update(config=args.config, world_size=world, batch_size=cfg.ppo.batch_size, measured_steps_per_mode=args.steps)

    print(f"end-to-end PPO, {args.config}, {world} CPU ranks, batch {cfg.ppo.batch_size}: {args.warmup} warm-up + "
          f"{args.steps} measured iterations per mode, the modes taking turns (off, on, on, off, ...)")
    print(f"{'stage (s / iteration)':<24}{'fusions off':>14}{'fusions on':>14}{'on/off':>10}")
    for s in STAGES:
        off, on = result["stages"]["off"][s], result["stages"]["on"][s]
        print(f"{s:<24}{off:>14.3f}{on:>14.3f}{(on / off if off else float('nan')):>10.2f}")
    print(f"{'samples/s':<24}{result['samples_per_s']['off']:>14.2f}{result['samples_per_s']['on']:>14.2f}")
    print(f"{'pipeline bubble ratio':<24}{result['bubble_ratio']['off']:>14.3f}{result['bubble_ratio']['on']:>14.3f}")
    print(f"speedup (samples/s, on / off): {result['speedup']:.3f}x")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
