"""Inter-stage fusion: generation + scoring time with long-tail migration on vs off.

    python -m fusedrl.bench.fusion [--json] [--repeats N] [--trace-dir DIR]

(a) Real: 2 ranks (gloo, one thread each), ``debug`` Actor / Reference / Reward / Critic, a batch with
    LMSYS-shaped forced response lengths (scaled to ``--max-new``); rollouts with fusion off and on
    (``auto`` threshold) run off, on, off, ..., off, and each fused run is compared with the mean of its
    two unfused neighbours; medians count. Migration stats: when, how many requests, bytes.
(b) The rollout simulator at paper scale (batch 512, max length 2048, 32 GPUs as tensor-parallel instances
    of 1-8 GPUs, H100 and A100 roofline costs; see ``RolloutCosts.for_models`` and docs/fusion.md for every
    parameter), best threshold per configuration; ``sim_speedup`` compares the unfused and the fused rollout
    each at its fastest instance size (13B/33B models on H100s). Each PPO scoring mix (Reference, Reward model,
    Critic) runs next to the GRPO mix of the same Actor (the Reference alone: no Critic, and a rule-based reward
    that costs no model time), on the same lengths; each mix's share of its possible gain is printed side by side.
(c) The simulator fed with (a)'s measured costs (decode steps with the engine's buckets, scoring
    micro-batches and prefill from the unfused runs around each fused run; transfers and checks from the
    fused run), predicting the fused time at (a)'s threshold: ``real_vs_sim_error`` is its relative error.

With ``--json`` the last line is {"real_speedup", "sim_speedup", "sim_bound", "real_vs_sim_error", "migration",
"sim_gain_share", "sim_speedup_grpo", "sim_bound_grpo", "sim_gain_share_grpo", "sim_settings"} (``sim_bound``: the most
a fusion whose tail decodes no faster could reach in ``sim_speedup``'s setting, ``1 + scoring / decoding``;
``sim_gain_share``: ``(sim_speedup - 1) / (sim_bound - 1)``; ``*_grpo``: the same for that setting's GRPO mix;
``sim_settings``: every setting's best-vs-best figures, each PPO mix with its GRPO mix).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.hardware import A100_SXM_80GB, H100_SXM
from fusedrl.models import FLAVORS, ModelFlavor, build_model
from fusedrl.models.figures import kv_bytes_per_token
from fusedrl.rlhf import Scorer, ScoringModels
from fusedrl.rollout_fusion import MigrationController, RolloutResult
from fusedrl.rollout_fusion.simulator import (
    RolloutConfig,
    RolloutCosts,
    RolloutTimes,
    SimRequest,
    best_migration,
    fit_transfers,
    simulate_rollout,
    split_round_robin,
)
from fusedrl.rollout_fusion.workload import lmsys_lengths
from fusedrl.testing import run_multirank

PAPER_BATCH, PAPER_MAX_LEN, PAPER_PROMPT = 512, 2048, 70  # LMSYS-Chat-1M: 69.5 prompt tokens on average
PAPER_GPUS = 32
GPU_MEMORY_FOR_MODELS = 0.9  # of HBM; the rest is activations and allocator slack
HARDWARE = (H100_SXM, A100_SXM_80GB)
BF16 = 2  # bytes


def _llama1(name: str, layers: int, heads: int, dim: int, ffn: int) -> ModelFlavor:
    return ModelFlavor("llama", 32_000, layers, heads, heads, dim, ffn, 2048, norm_eps=1e-6, name=name)


# LLaMA-1: layers, heads and hidden size from the LLaMA paper (Table 2), FFN width from the released configs.
LLAMA1 = {
    f.name: f
    for f in (
        _llama1("7B", 32, 32, 4096, 11_008),
        _llama1("13B", 40, 40, 5120, 13_824),
        _llama1("33B", 60, 52, 6656, 17_920),
        _llama1("65B", 80, 64, 8192, 22_016),
    )
}
# (name, Actor params, scoring models' params, Actor KV bytes per token, Actor layers): the paper's nominal sizes,
# the KV cache of the LLaMA-1 architecture in bf16. PPO scores with the Reference, the Reward model and the Critic;
# GRPO with the Reference alone (no Critic; a rule-based reward costs no model time).
PAPER_MODELS = [
    ("7B actor, 7B ref/reward/critic", 7e9, 3 * 7e9, kv_bytes_per_token(LLAMA1["7B"], BF16), LLAMA1["7B"].num_layers),
    ("7B actor, 7B ref (GRPO)", 7e9, 7e9, kv_bytes_per_token(LLAMA1["7B"], BF16), LLAMA1["7B"].num_layers),
    (
        "13B actor+ref, 33B reward/critic",
        13e9,
        13e9 + 2 * 33e9,
        kv_bytes_per_token(LLAMA1["13B"], BF16),
        LLAMA1["13B"].num_layers,
    ),
    ("13B actor+ref (GRPO)", 13e9, 13e9, kv_bytes_per_token(LLAMA1["13B"], BF16), LLAMA1["13B"].num_layers),
]
GRPO_MIX = {
    "7B actor, 7B ref/reward/critic": "7B actor, 7B ref (GRPO)",
    "13B actor+ref, 33B reward/critic": "13B actor+ref (GRPO)",
}
"""Each PPO scoring mix of :data:`PAPER_MODELS` -> the GRPO mix of the same Actor."""
TRACE_COLORS = {"decode": "#4c8bd6", "migrate": "#d64c4c", "score": "#f0a04b"}  # the rollout's spans in --trace-dir's charts
PAPER_TP = (1, 2, 4, 8)  # GPUs per generation instance (tensor parallel); instances = PAPER_GPUS / TP
PRIMARY = ("H100 SXM", "13B actor+ref, 33B reward/critic")  # sim_speedup: best unfused TP vs best fused TP


# ---------------------------------------------------------------------------------------------- (a) real
def _real_rank(batch: int, prompt_len: int, max_new: int, repeats: int, check_interval: int, seed: int) -> dict:
    torch.manual_seed(0)
    actor = build_model("debug", "policy").eval()
    scoring = ScoringModels(
        build_model("debug", "policy").eval(), build_model("debug", "value").eval(), build_model("debug", "value").eval()
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = lmsys_lengths(batch, seed=seed, max_len=max_new)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 512, (batch, prompt_len), generator=g).tolist()
    params = [SamplingParams(temperature=1.0, target_len=n) for n in lengths]
    mine = [Request(i, prompts[i], params[i]) for i in range(batch) if i % world == rank]

    def rollout(fusion: bool, costs: RolloutCosts | None) -> RolloutResult:
        engine = GenerationEngine(actor, max_slots=batch, max_len=prompt_len + max_new, seed=seed)
        ctl = MigrationController(
            engine,
            Scorer(scoring).score,
            micro_batch_size=8,
            fusion=fusion,
            threshold="auto",
            mode="kv",
            check_interval=check_interval,
            costs=costs,
        )
        return ctl.run(mine)

    def gathered(res: RolloutResult, name: str) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, getattr(res.measurements, name))
        return [x for part in out for x in part]

    def fitted(runs: list[RolloutResult], engine: GenerationEngine, check_s: float = 0.0) -> RolloutCosts:
        decode, score, prefill = (sum((gathered(r, name) for r in runs), []) for name in ("decode", "score", "prefill"))
        return RolloutCosts.fit(
            decode, score, prefill, check_s=check_s, batch_buckets=engine.batch_buckets, len_buckets=engine.len_buckets
        )

    def check_cost(res: RolloutResult) -> float:
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, _check_gaps(res, rank, check_interval))
        return min(per_rank)

    shapes = GenerationEngine(actor, max_slots=batch, max_len=prompt_len + max_new)  # rollout()'s buckets, for the fits
    warm_off = rollout(False, None)  # warm-up, and the first check cost for "auto"
    check_s = check_cost(rollout(True, fitted([warm_off], shapes)))
    # off_0, on_0, off_1, on_1, ..., off_R: each fused run lies between two unfused runs, so that load drift
    # on this shared machine hits both sides of its comparison alike.
    off, on, fused_meas = [rollout(False, None)], [], []
    for _ in range(repeats):
        # "auto" gets what a controller knows before the run: the preceding unfused run's costs and the
        # previous fused run's check cost.
        r_on = rollout(True, fitted(off[-1:], shapes, check_s))
        off.append(rollout(False, None))
        on.append(r_on)
        check_s = check_cost(r_on)
        fused_meas.append({"transfers": gathered(r_on, "transfers"), "check_s": check_s})
    fits = [fitted(off[i : i + 2], shapes) for i in range(repeats)]  # both neighbours of fused run i
    if rank != 0:
        return {}
    return {
        "lengths": lengths,
        "kv_bytes_per_token": kv_bytes_per_token(FLAVORS["debug"], actor.tok_embeddings.weight.element_size()),
        "prompt_len": prompt_len,
        "off": [(r.rollout_s, r.decode_end_s, r.scoring_exposed_s) for r in off],
        "on": [(r.rollout_s, r.decode_end_s, r.scoring_exposed_s) for r in on],
        "migration": [None if r.migration is None else r.migration.as_dict() for r in on],
        "costs": [c.__dict__ for c in fits],
        "fused_meas": fused_meas,
        "trace_off": off[-1].trace.events,
        "trace_on": on[-1].trace.events,
    }


def _check_gaps(res: RolloutResult, rank: int, check_interval: int) -> float:
    """This rank's mean time per statistics check before the migration, from its trace: the wall time
    between its decode spans (the all-gather, and with ``auto`` the threshold simulation rank 0 runs and
    broadcasts). At a check the last rank to arrive waits least: the minimum over ranks is the check cost."""
    spans = sorted((e for e in res.trace.events if e.get("ph") == "X" and e["pid"] == rank), key=lambda e: e["ts"])
    end_us = next((e["ts"] for e in spans if e["name"] == "migrate"), None)
    checks = (res.migration.step if res.migration else 0) // check_interval
    if end_us is None or checks == 0:
        return 0.0
    decode = [e for e in spans if e["name"] == "decode" and e["ts"] < end_us]
    return (end_us - decode[0]["ts"] - sum(e["dur"] for e in decode)) / 1e6 / checks


# ---------------------------------------------------------------------------------------------- (b) paper
def paper_scale(batch: int = PAPER_BATCH, baseline: Literal["own", "balanced"] = "balanced") -> list[dict]:
    lengths = lmsys_lengths(batch, seed=0, max_len=PAPER_MAX_LEN)
    rows = []
    for gpu in HARDWARE:
        for name, actor, scorer, kvb, layers in PAPER_MODELS:
            for tp in PAPER_TP:
                costs = RolloutCosts.for_models(
                    actor_params=actor,
                    scorer_params=scorer,
                    kv_bytes_per_token=kvb,
                    gpus_per_instance=tp,
                    actor_layers=layers,
                    gpu=gpu,
                )
                kv_tokens = int((tp * gpu.hbm_bytes * GPU_MEMORY_FOR_MODELS - 2 * actor) / kvb)
                config = RolloutConfig(
                    max_slots=256, kv_capacity_tokens=kv_tokens, check_interval=8, micro_batch_size=8, unfused_scoring=baseline
                )
                n = PAPER_GPUS // tp
                instances = split_round_robin(lengths, PAPER_PROMPT, n)
                unfused = simulate_rollout(instances, costs, config, fused=False)
                threshold, _, fused = best_migration(instances, costs, config, batch_size=batch)
                rows.append(
                    dict(
                        hardware=gpu.name,
                        models=name,
                        tp=tp,
                        instances=n,
                        unfused_s=unfused.total_s,
                        decode_s=unfused.decode_end_s,
                        last_s=_last_sample_s(instances, unfused, costs, config.micro_batch_size),
                        scoring_s=unfused.total_s - unfused.decode_end_s,
                        fused_s=fused.total_s,
                        speedup=unfused.total_s / fused.total_s,
                        threshold=threshold,
                        kept=len(fused.kept),
                        moved=fused.moved,
                        migration_s=fused.migration_s,
                    )
                )
    return rows


def _last_sample_s(instances: list[list[SimRequest]], unfused: RolloutTimes, costs: RolloutCosts, mbs: int) -> float:
    """Scoring time, alone, of a sample that ends the unfused decoding (the shortest such one). A fusion whose
    tail decodes no faster finishes it no earlier, and its scoring overlaps no decoding."""
    ends = {i: end for i, kind, _, end in unfused.spans if kind == "decode"}
    last = instances[max(ends, key=lambda i: ends[i])]
    longest = max(r.remaining for r in last)
    return min(costs.score_s([r.ctx + r.remaining], mbs) for r in last if r.remaining == longest)


def bounds(rows: list[dict], hardware: str, models: str) -> tuple[float, float]:
    """(bound, tight bound) on a setting's best-vs-best speedup: the fastest unfused rollout over the fastest
    decoding (``1 + scoring / decoding``), and over the fastest decoding plus its last sample's scoring."""
    mine = [r for r in rows if r["hardware"] == hardware and r["models"] == models]
    unfused = min(r["unfused_s"] for r in mine)
    return unfused / min(r["decode_s"] for r in mine), unfused / min(r["decode_s"] + r["last_s"] for r in mine)


def gain_share(speedup: float, bound: float) -> float:
    """Share of the possible gain reached: (speedup - 1) / (bound - 1)."""
    return (speedup - 1) / (bound - 1)


def best_vs_best(rows: list[dict], hardware: str, models: str) -> tuple[dict, dict, float]:
    """(fastest unfused row, fastest fused row, speedup): each variant at its own best instance size."""
    mine = [r for r in rows if r["hardware"] == hardware and r["models"] == models]
    unfused = min(mine, key=lambda r: r["unfused_s"])
    fused = min(mine, key=lambda r: r["fused_s"])
    return unfused, fused, unfused["unfused_s"] / fused["fused_s"]


def setting_figures(rows: list[dict], hardware: str, models: str) -> dict:
    """A setting's best-vs-best speedup, its bounds (:func:`bounds`) and the share of each bound's gain it reaches."""
    unfused, fused, speedup = best_vs_best(rows, hardware, models)
    bound, tight = bounds(rows, hardware, models)
    return dict(
        hardware=hardware,
        models=models,
        unfused_s=unfused["unfused_s"],
        unfused_tp=unfused["tp"],
        fused_s=fused["fused_s"],
        fused_tp=fused["tp"],
        speedup=speedup,
        bound=bound,
        tight=tight,
        gain_share=gain_share(speedup, bound),
        tight_share=gain_share(speedup, tight),
    )


def _print_paper_scale(batch: int, baseline: Literal["own", "balanced"]) -> dict:
    """Print (b) and return its ``--json`` figures (``sim_speedup``, ``sim_bound``, ...: see the module doc)."""
    rows = paper_scale(batch, baseline)
    print(
        f"(b) simulator at paper scale: batch {batch}, max length {PAPER_MAX_LEN}, prompt {PAPER_PROMPT}, "
        f"{PAPER_GPUS} GPUs as {PAPER_GPUS}/TP instances of TP GPUs, roofline costs (decode 60% of HBM bandwidth + 2 ms "
        "per step + 2x15 us all-reduce per layer, prefill/scoring 40% MFU), unfused scoring "
        f"{'balanced over all instances' if baseline == 'balanced' else 'on each instance for its own samples'}, "
        "best threshold and kept count; bound = unfused / decode, the most any fusion can gain while the tail decodes "
        "no faster; tight = unfused / (decode + last), last = the scoring of a sample that ends the decoding, alone"
    )
    print(
        f"    {'GPU':13s} {'models':32s} {'TP':>2s} {'inst':>4s} {'decode s':>8s} {'score s':>7s} {'last s':>6s} "
        f"{'unfused s':>9s} {'fused s':>8s} {'speedup':>8s} {'bound':>6s} {'tight':>6s} {'thresh':>6s} {'kept':>4s} "
        f"{'moved':>5s} {'migr s':>6s}"
    )
    for r in rows:
        print(
            f"    {r['hardware']:13s} {r['models']:32s} {r['tp']:2d} {r['instances']:4d} {r['decode_s']:8.2f} "
            f"{r['scoring_s']:7.2f} {r['last_s']:6.3f} {r['unfused_s']:9.2f} {r['fused_s']:8.2f} {r['speedup']:7.3f}x "
            f"{r['unfused_s'] / r['decode_s']:5.3f}x {r['unfused_s'] / (r['decode_s'] + r['last_s']):5.3f}x "
            f"{r['threshold']:6d} {r['kept']:4d} {r['moved']:5d} {r['migration_s']:6.2f}"
        )
    settings = []
    for hw in (gpu.name for gpu in HARDWARE):
        for ppo_name, grpo_name in GRPO_MIX.items():
            ppo, grpo = setting_figures(rows, hw, ppo_name), setting_figures(rows, hw, grpo_name)
            marks = ("  <- sim_speedup, sim_bound", "  <- *_grpo") if (hw, ppo_name) == PRIMARY else ("", "")
            ppo_shares = f"; PPO's mix {ppo['gain_share']:.0%}, tight {ppo['tight_share']:.0%}"  # next to GRPO's
            for s, tail in ((ppo, marks[0]), (grpo, ppo_shares + marks[1])):
                print(
                    f"    best vs best, {hw}, {s['models']}: unfused {s['unfused_s']:.2f}s (TP {s['unfused_tp']}) / fused "
                    f"{s['fused_s']:.2f}s (TP {s['fused_tp']}) = {s['speedup']:.3f}x; bound {s['bound']:.3f}x "
                    f"({s['gain_share']:.0%} of its gain), tight {s['tight']:.3f}x ({s['tight_share']:.0%}){tail}"
                )
            settings.append({**_rounded(ppo), "grpo": _rounded(grpo)})
    ppo = setting_figures(rows, *PRIMARY)
    grpo = setting_figures(rows, PRIMARY[0], GRPO_MIX[PRIMARY[1]])
    return {
        "sim_speedup": round(ppo["speedup"], 4),
        "sim_bound": round(ppo["bound"], 4),
        "sim_gain_share": round(ppo["gain_share"], 4),
        "sim_speedup_grpo": round(grpo["speedup"], 4),
        "sim_bound_grpo": round(grpo["bound"], 4),
        "sim_gain_share_grpo": round(grpo["gain_share"], 4),
        "sim_settings": settings,
    }


def _rounded(figures: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


# ---------------------------------------------------------------------------------------------- (c) model check
def model_check(real: dict, rep: int, world: int, check_interval: int) -> dict:
    """Predict repeat ``rep``'s rollouts from the costs measured in that repeat (and its threshold)."""
    base = dict(real["costs"][rep])
    meas = real["fused_meas"][rep]
    base["transfer_latency_s"], base["transfer_bytes_per_s"] = fit_transfers(meas["transfers"])
    base["check_s"] = meas["check_s"]
    base["kv_bytes_per_token"] = real["kv_bytes_per_token"]
    costs = RolloutCosts(**base)
    batch = len(real["lengths"])
    instances = [
        [SimRequest(real["prompt_len"], real["lengths"][i]) for i in range(batch) if i % world == r] for r in range(world)
    ]
    config = RolloutConfig(
        max_slots=batch,
        kv_capacity_tokens=batch * (real["prompt_len"] + max(real["lengths"])),
        check_interval=check_interval,
        micro_batch_size=8,
    )
    mig = real["migration"][rep]
    threshold = mig["threshold"] if mig else 0
    fused = simulate_rollout(instances, costs, config, fused=True, threshold=threshold, min_kept=len(mig["kept"]) if mig else 1)
    unfused = simulate_rollout(instances, costs, config, fused=False)
    measured = real["on"][rep][0]
    measured_off = statistics.fmean(real["off"][i][0] for i in (rep, rep + 1))
    return dict(
        costs=costs,
        threshold=threshold,
        fused=fused,
        unfused=unfused,
        measured=measured,
        measured_off=measured_off,
        error=abs(fused.total_s - measured) / measured,
    )


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
    ap.add_argument("--paper-batch", type=int, default=PAPER_BATCH, help="global batch of the paper-scale simulation (b)")
    ap.add_argument("--sim-only", action="store_true", help="run only (b); --json then prints only its sim_* figures")
    ap.add_argument(
        "--baseline",
        choices=("balanced", "own"),
        default="balanced",
        help="(b)'s unfused scoring: all samples balanced over all instances, or each instance its own "
        "(what MigrationController does with fusion off)",
    )
    args = ap.parse_args()
    world = 2
    if args.sim_only:
        sim = _print_paper_scale(args.paper_batch, args.baseline)
        if args.json:
            print(json.dumps(sim))
        return

    real = run_multirank(
        _real_rank, world, args.batch, args.prompt_len, args.max_new, args.repeats, args.check_interval, args.seed, timeout_s=1800
    )[0]
    # Fused run i against the mean of its two neighbouring unfused runs.
    speedups = [statistics.fmean(real["off"][i][0] for i in (r, r + 1)) / real["on"][r][0] for r in range(args.repeats)]
    rep = sorted(range(args.repeats), key=lambda i: speedups[i])[args.repeats // 2]  # the median one
    off = [statistics.fmean(real["off"][i][j] for i in (rep, rep + 1)) for j in range(3)]
    on, real_speedup = real["on"][rep], speedups[rep]
    mig = real["migration"][rep]
    lengths = torch.tensor(real["lengths"], dtype=torch.float64)
    print(
        f"(a) real: 2 ranks x 1 thread, debug models, batch {args.batch}, prompt {args.prompt_len}, LMSYS-shaped "
        f"lengths (median {lengths.median():.0f}, p99.9 {torch.quantile(lengths, 0.999):.0f}, max {lengths.max():.0f}), "
        f"k={args.check_interval}, runs off/on/off/.../off, each fused run vs the mean of its two unfused neighbours, "
        f"median of {args.repeats} (speedups {', '.join(f'{x:.2f}' for x in speedups)})"
    )
    print(f"    fusion off: rollout {off[0]:.3f}s (decode ends {off[1]:.3f}s, scoring exposed {off[2]:.3f}s)")
    print(f"    fusion on : rollout {on[0]:.3f}s (decode ends {on[1]:.3f}s, scoring exposed {on[2]:.3f}s)")
    print(f"    real_speedup {real_speedup:.3f}x")
    if mig:
        print(
            f"    migration: step {mig['step']} at {mig['time_s']:.3f}s, threshold {mig['threshold']} (auto), "
            f"{mig['unfinished']} unfinished, moved {mig['moved']} requests / {mig['moved_bytes']} B KV+state, "
            f"{mig['sample_bytes']} B finished samples, kept ranks {mig['kept']}, transfers {mig['duration_s'] * 1e3:.1f} ms"
        )
    else:
        print("    migration: none (auto found no threshold worth migrating at)")

    sim = _print_paper_scale(args.paper_batch, args.baseline)

    if args.trace_dir is not None:
        raw = {k: v for k, v in real.items() if not k.startswith("trace")}
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        (args.trace_dir / "fusion_raw.json").write_text(json.dumps(raw, default=float))
    checks = [model_check(real, i, world, args.check_interval) for i in range(args.repeats)]
    errors = [c["error"] for c in checks]
    err = sorted(errors)[len(errors) // 2]
    check = checks[errors.index(err)]
    c = check["costs"]
    m = real["migration"][checks.index(check)]
    print(
        f"(c) simulator with costs fitted to the two unfused runs around each fused run (median shown): decode "
        f"{c.decode_base_s * 1e3:.2f} ms + {c.decode_per_seq_s * 1e6:.1f} us/seq + {c.decode_per_row_s * 1e6:.1f} us/padded row "
        f"+ {c.decode_per_ctx_token_s * 1e9:.2f} ns/attended token (engine buckets), scoring {c.score_base_s * 1e3:.2f} ms + "
        f"{c.score_per_token_s * 1e6:.2f} us/token, check {c.check_s * 1e3:.2f} ms (trace gaps of the fused run)"
    )
    print(
        f"    unfused: predicted {check['unfused'].total_s:.3f}s vs measured {check['measured_off']:.3f}s; fused (threshold "
        f"{check['threshold']}): predicted {check['fused'].total_s:.3f}s vs measured {check['measured']:.3f}s"
    )
    if m and check["fused"].migration_start_s is not None:
        print(
            f"    per phase (predicted / measured): migration at {check['fused'].migration_start_s:.3f} / {m['time_s']:.3f}s, "
            f"transfers {check['fused'].migration_s * 1e3:.1f} / {m['duration_s'] * 1e3:.1f} ms"
        )
    print(f"    real_vs_sim_error per fused run {', '.join(f'{e:.1%}' for e in errors)} -> median {err:.1%}")

    if args.trace_dir is not None:
        from fusedrl.components.metrics import ChromeTrace, save_gantt_png

        for name, events in (("off", real["trace_off"]), ("on", real["trace_on"])):
            trace = ChromeTrace()
            trace.extend(events)
            trace.save(args.trace_dir / f"fusion_{name}.json")
            title = f"generation + scoring, fusion {name} (2 ranks)"
            save_gantt_png(trace, args.trace_dir / f"fusion_{name}.png", TRACE_COLORS, title=title)
        print(f"    traces: {args.trace_dir}/fusion_{{off,on}}.json and .png")

    if args.json:
        print(
            json.dumps(
                {
                    "real_speedup": round(real_speedup, 4),
                    "sim_speedup": sim["sim_speedup"],
                    "sim_bound": sim["sim_bound"],
                    "real_vs_sim_error": round(err, 4),
                    "migration": mig,
                    **sim,  # the other sim_* figures (the two above keep their places)
                }
            )
        )


if __name__ == "__main__":
    main()
