"""Inter-stage fusion: generation + scoring time with long-tail migration on vs off.

    python -m fusedrl.bench.fusion [--json] [--repeats N] [--trace-dir DIR]

(a) Real: 2 ranks (gloo, one thread each), ``debug`` Actor / Reference / Reward / Critic, a batch with
    LMSYS-shaped forced response lengths (scaled to ``--max-new``); the stage with fusion off and on
    (``auto`` threshold, costs fitted to the unfused run of the same repeat), interleaved, ``--repeats``
    times; medians count. Migration stats: when, how many requests, bytes.
(b) The stage simulator at paper scale (batch 512, max length 2048, 8-64 instances, roofline costs of
    H100 instances; see ``StageCosts.for_models``), best threshold per configuration.
(c) The simulator fed with (a)'s measured costs (decode steps, scoring micro-batches, transfers, checks),
    predicting (a)'s fused time with (a)'s threshold: ``real_vs_sim_error`` is its relative error.

With ``--json`` the last line is {"real_speedup", "sim_speedup", "real_vs_sim_error", "migration"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.generation.migration import MigrationController, StageResult
from fusedrl.generation.stage_sim import (
    SimRequest,
    StageConfig,
    StageCosts,
    best_threshold,
    fit_transfers,
    simulate_stage,
    split_round_robin,
)
from fusedrl.generation.workload import lmsys_lengths
from fusedrl.models import build_model
from fusedrl.rlhf import Scorer, ScoringModels
from fusedrl.testing import run_multirank

PAPER_BATCH, PAPER_MAX_LEN, PAPER_PROMPT = 512, 2048, 70  # LMSYS-Chat-1M: 69.5 prompt tokens on average
# (name, actor params, Reference + Reward + Critic params, KV bytes per token of the Actor)
PAPER_MODELS = [
    ("7B actor, 7B ref/reward/critic", 7e9, 3 * 7e9, 32 * 2 * 4096 * 2),
    ("13B actor+ref, 33B reward/critic", 13e9, 13e9 + 2 * 33e9, 40 * 2 * 5120 * 2),
]
PRIMARY = (1, 32)  # (model row, instances) reported as sim_speedup


# ---------------------------------------------------------------------------------------------- (a) real
def _real_rank(batch: int, prompt_len: int, max_new: int, repeats: int, check_interval: int, seed: int) -> dict:
    torch.manual_seed(0)
    actor = build_model("debug", "policy").eval()
    scoring = ScoringModels(build_model("debug", "policy").eval(), build_model("debug", "value").eval(),
                            build_model("debug", "value").eval())
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = lmsys_lengths(batch, seed=seed, max_len=max_new)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 512, (batch, prompt_len), generator=g).tolist()
    params = [SamplingParams(temperature=1.0, target_len=n) for n in lengths]
    mine = [Request(i, prompts[i], params[i]) for i in range(batch) if i % world == rank]

    def stage(fusion: bool, costs: StageCosts | None) -> StageResult:
        engine = GenerationEngine(actor, max_slots=batch, max_len=prompt_len + max_new, seed=seed)
        ctl = MigrationController(engine, Scorer(scoring, micro_batch_size=8), fusion=fusion, threshold="auto",
                                  mode="kv", check_interval=check_interval, costs=costs)
        return ctl.run(mine)

    def gathered(res: StageResult, name: str) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, getattr(res.measurements, name))
        return [x for part in out for x in part]

    stage(False, None)  # warm-up
    off, on, fits, fused_meas = [], [], [], []
    for _ in range(repeats):
        r_off = stage(False, None)
        costs = StageCosts.fit(gathered(r_off, "decode"), gathered(r_off, "score"), gathered(r_off, "prefill"))
        r_on = stage(True, costs)
        off.append(r_off)
        on.append(r_on)
        fits.append(costs)
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, r_on.measurements.checks)
        # At a check the last rank to arrive waits only for the collective itself: its time is the cost.
        fused_meas.append({"transfers": gathered(r_on, "transfers"), "checks": [min(c) for c in zip(*per_rank)]})
    if rank != 0:
        return {}
    return {
        "lengths": lengths,
        "kv_bytes_per_token": _kv_bytes_per_token(actor),
        "prompt_len": prompt_len,
        "off": [(r.stage_s, r.decode_end_s, r.scoring_exposed_s) for r in off],
        "on": [(r.stage_s, r.decode_end_s, r.scoring_exposed_s) for r in on],
        "migration": [None if r.migration is None else r.migration.as_dict() for r in on],
        "costs": [c.__dict__ for c in fits],
        "fused_meas": fused_meas,
        "trace_off": off[-1].trace.events,
        "trace_on": on[-1].trace.events,
    }


def _kv_bytes_per_token(model) -> int:
    attn = model.layers[0].attn
    return len(model.layers) * 2 * attn.num_kv_heads * attn.head_dim * model.tok_embeddings.weight.element_size()


# ---------------------------------------------------------------------------------------------- (b) paper
def paper_scale() -> list[dict]:
    lengths = lmsys_lengths(PAPER_BATCH, seed=0, max_len=PAPER_MAX_LEN)
    config = StageConfig(max_slots=256, kv_capacity_tokens=256 * (PAPER_MAX_LEN + 256), check_interval=8, micro_batch_size=8)
    rows = []
    for mi, (name, actor, scorer, kvb) in enumerate(PAPER_MODELS):
        costs = StageCosts.for_models(actor_params=actor, scorer_params=scorer, kv_bytes_per_token=kvb)
        for n in (8, 16, 32, 64):
            instances = split_round_robin(lengths, PAPER_PROMPT, n)
            unfused = simulate_stage(instances, costs, config, fused=False)
            threshold, fused = best_threshold(instances, costs, config, batch_size=PAPER_BATCH)
            rows.append(dict(models=name, instances=n, unfused_s=unfused.total_s, fused_s=fused.total_s,
                             speedup=unfused.total_s / fused.total_s, threshold=threshold, kept=len(fused.kept),
                             moved=fused.moved, primary=(mi, n) == PRIMARY))
    return rows


# ---------------------------------------------------------------------------------------------- (c) model check
def model_check(real: dict, rep: int, world: int, check_interval: int) -> dict:
    """Predict repeat ``rep``'s stages from the costs measured in that repeat (and its threshold)."""
    base = dict(real["costs"][rep])
    meas = real["fused_meas"][rep]
    base["transfer_latency_s"], base["transfer_bytes_per_s"] = fit_transfers(meas["transfers"])
    base["check_s"] = statistics.median(meas["checks"]) if meas["checks"] else 0.0
    base["kv_bytes_per_token"] = real["kv_bytes_per_token"]
    costs = StageCosts(**base)
    batch = len(real["lengths"])
    instances = [[SimRequest(real["prompt_len"], real["lengths"][i]) for i in range(batch) if i % world == r] for r in range(world)]
    config = StageConfig(max_slots=batch, kv_capacity_tokens=batch * (real["prompt_len"] + max(real["lengths"])),
                         check_interval=check_interval, micro_batch_size=8)
    mig = real["migration"][rep]
    threshold = mig["threshold"] if mig else 0
    fused = simulate_stage(instances, costs, config, fused=True, threshold=threshold)
    unfused = simulate_stage(instances, costs, config, fused=False)
    measured = real["on"][rep][0]
    return dict(costs=costs, threshold=threshold, fused=fused, unfused=unfused, measured=measured,
                error=abs(fused.total_s - measured) / measured)


# ---------------------------------------------------------------------------------------------- trace picture
def save_trace_png(events: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"decode": "#4c8bd6", "migrate": "#d64c4c", "score": "#f0a04b"}
    spans = [e for e in events if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in spans})
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(ranks) + 1.3))
    for e in spans:
        ax.barh(e["pid"], e["dur"] / 1e3, left=e["ts"] / 1e3, height=0.7, color=colors.get(e["name"], "gray"))
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], list(colors), ncol=3,
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title, loc="left", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--batch", type=int, default=128, help="global batch of the real run (2 ranks)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=448, help="response length cap of the real run (prompt + cap <= 512)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check-interval", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", type=Path, default=None, help="write Chrome traces and PNG timelines here")
    args = ap.parse_args()
    world = 2

    real = run_multirank(_real_rank, world, args.batch, args.prompt_len, args.max_new, args.repeats,
                         args.check_interval, args.seed, timeout_s=1800)[0]
    speedups = [a[0] / b[0] for a, b in zip(real["off"], real["on"])]
    rep = sorted(range(args.repeats), key=lambda i: speedups[i])[args.repeats // 2]  # the median pair
    off, on, real_speedup = real["off"][rep], real["on"][rep], speedups[rep]
    mig = real["migration"][rep]
    lengths = torch.tensor(real["lengths"], dtype=torch.float64)
    print(f"(a) real: 2 ranks x 1 thread, debug models, batch {args.batch}, prompt {args.prompt_len}, LMSYS-shaped "
          f"lengths (median {lengths.median():.0f}, p99.9 {torch.quantile(lengths, 0.999):.0f}, max {lengths.max():.0f}), "
          f"k={args.check_interval}, median of {args.repeats} off/on pairs (speedups {', '.join(f'{x:.2f}' for x in speedups)})")
    print(f"    fusion off: stage {off[0]:.3f}s (decode ends {off[1]:.3f}s, scoring exposed {off[2]:.3f}s)")
    print(f"    fusion on : stage {on[0]:.3f}s (decode ends {on[1]:.3f}s, scoring exposed {on[2]:.3f}s)")
    print(f"    real_speedup {real_speedup:.3f}x")
    if mig:
        print(f"    migration: step {mig['step']} at {mig['time_s']:.3f}s, threshold {mig['threshold']} (auto), "
              f"{mig['unfinished']} unfinished, moved {mig['moved']} requests / {mig['moved_bytes']} B KV+state, "
              f"{mig['sample_bytes']} B finished samples, kept ranks {mig['kept']}, transfers {mig['duration_s'] * 1e3:.1f} ms")
    else:
        print("    migration: none (auto found no threshold worth migrating at)")

    rows = paper_scale()
    print(f"(b) simulator at paper scale: batch {PAPER_BATCH}, max length {PAPER_MAX_LEN}, prompt {PAPER_PROMPT}, "
          "H100 roofline costs (decode 60% of HBM bandwidth, scoring 40% MFU), best threshold")
    print(f"    {'models':34s} {'inst':>4s} {'unfused s':>10s} {'fused s':>9s} {'speedup':>8s} {'thresh':>6s} {'kept':>4s} {'moved':>5s}")
    for r in rows:
        mark = " <- sim_speedup" if r["primary"] else ""
        print(f"    {r['models']:34s} {r['instances']:4d} {r['unfused_s']:10.2f} {r['fused_s']:9.2f} {r['speedup']:7.3f}x "
              f"{r['threshold']:6d} {r['kept']:4d} {r['moved']:5d}{mark}")
    sim_speedup = next(r["speedup"] for r in rows if r["primary"])

    if args.trace_dir is not None:
        raw = {k: v for k, v in real.items() if not k.startswith("trace")}
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        (args.trace_dir / "fusion_raw.json").write_text(json.dumps(raw, default=float))
    checks = [model_check(real, i, world, args.check_interval) for i in range(args.repeats)]
    errors = [c["error"] for c in checks]
    err = sorted(errors)[len(errors) // 2]
    check = checks[errors.index(err)]
    c = check["costs"]
    print(f"(c) simulator with each pair's measured costs (median pair shown): decode {c.decode_base_s * 1e3:.2f} ms + "
          f"{c.decode_per_seq_s * 1e6:.1f} us/seq + {c.decode_per_ctx_token_s * 1e9:.2f} ns/ctx token, scoring "
          f"{c.score_base_s * 1e3:.2f} ms + {c.score_per_token_s * 1e6:.2f} us/token, check {c.check_s * 1e3:.2f} ms")
    print(f"    unfused: predicted {check['unfused'].total_s:.3f}s; fused (threshold {check['threshold']}): predicted "
          f"{check['fused'].total_s:.3f}s vs measured {check['measured']:.3f}s")
    print(f"    real_vs_sim_error per pair {', '.join(f'{e:.1%}' for e in errors)} -> median {err:.1%}")

    if args.trace_dir is not None:
        from fusedrl.components.metrics import ChromeTrace

        for name, events in (("off", real["trace_off"]), ("on", real["trace_on"])):
            trace = ChromeTrace()
            trace.extend(events)
            trace.save(args.trace_dir / f"fusion_{name}.json")
            save_trace_png(events, args.trace_dir / f"fusion_{name}.png", f"generation + scoring, fusion {name} (2 ranks)")
        print(f"    traces: {args.trace_dir}/fusion_{{off,on}}.json and .png")

    if args.json:
        print(json.dumps({"real_speedup": round(real_speedup, 4), "sim_speedup": round(sim_speedup, 4),
                          "real_vs_sim_error": round(err, 4), "migration": mig}))


if __name__ == "__main__":
    main()
