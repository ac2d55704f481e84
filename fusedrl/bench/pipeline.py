"""Fused vs sequential Actor+Critic pipeline training, measured with the fused executor.

(a) real compute: pp=2 on two processes with one thread each; wall time of one minibatch (forward, backward,
    gradient reduction of both models) with the planner's fused program vs ``sequential_1f1b``; the runs of the
    two programs alternate and the fastest of each is reported (robust to background load on a shared machine).
    A second row gives the Critic one stage (``pp_critic=1``): two Critic replicas, each a whole Critic on one
    rank training half of its micro-batches, hybrid-sharded (FSDP2) so that their gradients are averaged.
(b) emulated timing at pp=4 and pp=8, and pp=4 with a 2-stage Critic (2 replicas): every compute action sleeps for
    its cost-model time while all messages really travel, so the executor's ordering and overheads are measured;
    compared with the simulator.
(c) critic-free (GRPO-style: the Actor alone, no Critic to fill its bubbles): the planner's split-backward schedule
    (each backward as an input backward I and a weight backward W, the W's in the bubbles) vs the Actor's 1F1B, as
    a makespan ratio (split / 1F1B, below 1 where 1F1B leaves a bubble): real compute at pp=2 as in (a), the Actor
    alone, with the measured backward compute (I + W over B: torch's split backward can cost more than one B, which
    the simulator does not count); emulated at pp=4 and pp=8 as in (b) (I and W each half of the backward).

Run: ``python -m fusedrl.bench.pipeline [--json] [--trace-dir DIR] [--only {fused,critic_free}]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.executor import FusedPipelineSchedule, StageModule, run_emulated
from fusedrl.pipelining.ir import ACTOR, CRITIC, Placement, Schedule
from fusedrl.pipelining.lowering import LoweredProgram, lower
from fusedrl.pipelining.search import fused_schedule, sequential_1f1b
from fusedrl.pipelining.simulator import simulate

# (a) real compute
REAL_FLAVOR = "debug_large"
REAL_LAYERS = {ACTOR: 8, CRITIC: 4}  # the Critic is a smaller decoder: its bubbles are what the fusion fills
REAL_MICROBATCHES = 4
REAL_MB_SIZE, REAL_SEQ = 1, 128
# (b) emulation, seconds per action (backward = 2 x forward)
EMU_F_ACTOR, EMU_F_CRITIC = 0.050, 0.030
EMU_MESSAGE_NUMEL = 16 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "result.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(fn, world: int, *args):
    """Run ``fn(*args)`` on ``world`` gloo ranks; return rank 0's result."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, _free_port(), fn, d, args), nprocs=world, join=True)
        return torch.load(os.path.join(d, "result.pt"), weights_only=False)


# ---------------------------------------------------------------------------------------------------------
# (a) real compute


def _ppo_actor_loss(logits: torch.Tensor, t: dict[str, torch.Tensor]):
    logp = torch.log_softmax(logits.float(), -1).gather(-1, t["tokens"].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - t["old_logprobs"])
    loss = -torch.min(ratio * t["advantages"], ratio.clamp(0.8, 1.2) * t["advantages"])
    return (loss * t["mask"]).sum() / t["mask"].sum(), {}


def _value_loss(values: torch.Tensor, t: dict[str, torch.Tensor]):
    return (((values.squeeze(-1) - t["returns"]) ** 2) * t["mask"]).sum() / t["mask"].sum(), {}


def _real_worker(programs: dict[str, LoweredProgram], reps: int, trace_dir: str | None):
    """Programs with 0 Critic micro-batches train the Actor alone (no Critic is built)."""
    from fusedrl.distributed import ParallelDims, apply_fsdp, split_decoder
    from fusedrl.models import build_model
    from fusedrl.models.registry import Role

    rank, pp = dist.get_rank(), dist.get_world_size()
    first = next(iter(programs.values()))
    placement, critic_free = first.placement, first.microbatches[CRITIC] == 0
    critic_stages = placement.num_stages(CRITIC)
    torch.manual_seed(0)
    models = {}
    roles: tuple[tuple[str, Role], ...] = ((ACTOR, "policy"),) + (() if critic_free else ((CRITIC, "value"),))
    for m, role in roles:
        model = build_model(REAL_FLAVOR, role)
        del model.layers[REAL_LAYERS[m] :]
        models[m] = model
    vocab = models[ACTOR].tok_embeddings.num_embeddings
    actor_stage = split_decoder(models[ACTOR], pp)[rank]
    critic: StageModule | None = None
    if not critic_free:
        critic_stage = split_decoder(models[CRITIC], critic_stages)[placement.stage_at(CRITIC, rank)[0]]
        if critic_stages < pp:  # replicas: FSDP2's hybrid sharding averages their gradients
            mesh = ParallelDims(pp=pp, world_size=pp, pp_critic=critic_stages).build_critic_mesh("cpu")
            apply_fsdp(critic_stage, mesh["critic_replica", "dp_shard"])
        critic = StageModule(critic_stage, _value_loss)
    batch = REAL_MB_SIZE * REAL_MICROBATCHES
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, REAL_SEQ), generator=g)
    mask = torch.ones(batch, REAL_SEQ)
    actor_t = {
        "tokens": tokens,
        "old_logprobs": torch.full((batch, REAL_SEQ), -6.0),
        "advantages": torch.randn(batch, REAL_SEQ, generator=g),
        "mask": mask,
    }
    critic_t = {"returns": torch.randn(batch, REAL_SEQ, generator=g), "mask": mask}
    executors = {
        name: FusedPipelineSchedule(program, StageModule(actor_stage, _ppo_actor_loss), critic)
        for name, program in programs.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in programs}
    traces = {}
    # Runs of the two programs alternate, so both see the same background load; the first run of each builds
    # the stages and warms up the allocator.
    for i in range(reps + 1):
        for name, ex in executors.items():
            dist.barrier()
            start = time.perf_counter()
            if critic_free:
                ex.step(tokens, None, actor_t, None, record=True)
            else:
                ex.step(tokens, tokens, actor_t, critic_t, record=True)
            dist.barrier()
            elapsed = time.perf_counter() - start
            assert ex.timeline is not None  # step(record=True) records one
            timeline = ex.timeline.gather()  # a collective: every rank gathers every run
            if i:
                samples[name].append(elapsed)
                if elapsed == min(samples[name]):
                    traces[name] = timeline
    times = {name: min(v) for name, v in samples.items()}
    if rank == 0 and trace_dir:
        label = "critic_free" if critic_free else f"critic{critic_stages}"
        for name, tl in traces.items():
            tl.save_chrome_trace(Path(trace_dir) / f"pipeline_real_{label}_{name}.json")
    return {
        "times": times,
        "samples": samples,
        "bubble": {n: t.bubble_ratio() for n, t in traces.items()},
        # compute time of the backward actions (B, or I and W) over all ranks, in the fastest run
        "backward_s": {n: sum(e.end - e.start for e in t.events if e.action.kind != "F") for n, t in traces.items()},
    }


def bench_real(reps: int, trace_dir: str | None, critic_stages: int = 2) -> dict:
    """pp=2; ``critic_stages=1``: the Critic as two replicas of one stage, each with half the micro-batches."""
    placement = Placement(2, critic_stages)
    ma = REAL_MICROBATCHES
    mc = ma // placement.critic_replicas
    # per-stage cost ratio: layers per Critic stage over layers per Actor stage
    ratio = (REAL_LAYERS[CRITIC] / critic_stages) / (REAL_LAYERS[ACTOR] / placement.pp)
    costs = CostModel.uniform(placement, 1.0, ratio)
    schedules = {
        "sequential": sequential_1f1b(placement, ma, mc),
        "fused": fused_schedule(placement, costs, ma, mc, budget_s=2.0).schedule,
    }
    programs = {n: lower(s, placement, {ACTOR: ma, CRITIC: mc}) for n, s in schedules.items()}
    result = _launch(_real_worker, 2, programs, reps, trace_dir)
    sim = {n: simulate(s, placement, costs, ma, mc).makespan for n, s in schedules.items()}
    result["simulated_speedup"] = sim["sequential"] / sim["fused"]
    result["cost_ratio"] = ratio
    return result


# ---------------------------------------------------------------------------------------------------------
# (b) emulation


def _emulated_worker(programs: dict[str, LoweredProgram], costs: CostModel, reps: int):
    def seconds(a):
        c = costs.of(a.model)
        return {"F": c.f, "B": c.b, "I": c.i, "W": c.w}[a.kind][a.stage]

    out = {}
    for name, program in programs.items():
        spans: list[float] = []
        for i in range(reps + 1):
            timeline = run_emulated(program, seconds, message_numel=EMU_MESSAGE_NUMEL).gather()
            if i:
                spans.append(timeline.makespan())
        out[name] = {"makespan": statistics.median(spans), "bubble": timeline.bubble_ratio(), "timeline": timeline}
    return out


def bench_emulated(pp: int, reps: int, trace_dir: str | None, critic_stages: int | None = None) -> dict:
    """``critic_stages`` < pp: the Critic as pp / critic_stages replicas, each with its share of the micro-batches
    (a Critic stage then holds pp / critic_stages times the layers: its actions cost that much more)."""
    placement = Placement(pp, critic_stages)
    k = placement.critic_replicas
    ma, mc = pp, pp // k
    costs = CostModel.uniform(placement, EMU_F_ACTOR, EMU_F_CRITIC * k)
    schedules = {
        "sequential": sequential_1f1b(placement, ma, mc),
        "fused": fused_schedule(placement, costs, ma, mc, budget_s=5.0).schedule,
    }
    programs = {n: lower(s, placement, {ACTOR: ma, CRITIC: mc}) for n, s in schedules.items()}
    measured = _launch(_emulated_worker, pp, programs, costs, reps)
    row: dict = {"pp": pp, "pp_critic": placement.num_stages(CRITIC), "microbatches": ma}
    for name, s in schedules.items():
        row[f"{name}_simulated"] = simulate(s, placement, costs, ma, mc).makespan
        row[f"{name}_measured"] = measured[name]["makespan"]
        row[f"{name}_bubble"] = measured[name]["bubble"]
        if trace_dir:
            path = Path(trace_dir) / f"pipeline_emulated_pp{pp}_critic{row['pp_critic']}_{name}.json"
            measured[name]["timeline"].save_chrome_trace(path)
    row["timelines"] = {n: measured[n]["timeline"] for n in schedules}
    row["measured_speedup"] = row["sequential_measured"] / row["fused_measured"]
    row["simulated_speedup"] = row["sequential_simulated"] / row["fused_simulated"]
    row["max_rel_error"] = max(abs(row[f"{n}_measured"] / row[f"{n}_simulated"] - 1) for n in schedules)
    return row


# ---------------------------------------------------------------------------------------------------------
# (c) critic-free: the Actor alone, split backward vs 1F1B


def _critic_free_schedules(placement: Placement, costs: CostModel, m: int, budget_s: float) -> dict[str, Schedule]:
    """The Actor's 1F1B and the planner's split-backward schedule of the Actor alone (0 Critic micro-batches)."""
    return {
        "1f1b": sequential_1f1b(placement, m, 0),
        "split": fused_schedule(placement, costs, m, 0, budget_s=budget_s, split_backward=True).schedule,
    }


def bench_real_critic_free(reps: int, trace_dir: str | None) -> dict:
    """pp=2, real compute: the Actor of (a) alone (no Critic is built)."""
    placement, m = Placement(2), REAL_MICROBATCHES
    costs = CostModel.uniform(placement, 1.0, 1.0)  # the Critic's costs are unused
    schedules = _critic_free_schedules(placement, costs, m, 2.0)
    programs = {n: lower(s, placement, {ACTOR: m, CRITIC: 0}) for n, s in schedules.items()}
    result = _launch(_real_worker, 2, programs, reps, trace_dir)
    sim = {n: simulate(s, placement, costs, m, 0).makespan for n, s in schedules.items()}
    result["simulated_ratio"] = sim["split"] / sim["1f1b"]
    result["measured_ratio"] = result["times"]["split"] / result["times"]["1f1b"]
    result["backward_ratio"] = result["backward_s"]["split"] / result["backward_s"]["1f1b"]
    return result


def bench_emulated_critic_free(pp: int, reps: int, trace_dir: str | None) -> dict:
    """Emulated as in (b), the Actor alone with ``pp`` micro-batches; I and W each take half of B."""
    placement, m = Placement(pp), pp
    costs = CostModel.uniform(placement, EMU_F_ACTOR, EMU_F_CRITIC)  # the Critic's costs are unused
    schedules = _critic_free_schedules(placement, costs, m, 5.0)
    programs = {n: lower(s, placement, {ACTOR: m, CRITIC: 0}) for n, s in schedules.items()}
    measured = _launch(_emulated_worker, pp, programs, costs, reps)
    row: dict = {"pp": pp, "microbatches": m}
    for name, s in schedules.items():
        row[f"{name}_simulated"] = simulate(s, placement, costs, m, 0).makespan
        row[f"{name}_measured"] = measured[name]["makespan"]
        row[f"{name}_bubble"] = measured[name]["bubble"]
        if trace_dir:
            measured[name]["timeline"].save_chrome_trace(Path(trace_dir) / f"pipeline_emulated_pp{pp}_critic_free_{name}.json")
    row["measured_ratio"] = row["split_measured"] / row["1f1b_measured"]
    row["simulated_ratio"] = row["split_simulated"] / row["1f1b_simulated"]
    row["max_rel_error"] = max(abs(row[f"{n}_measured"] / row[f"{n}_simulated"] - 1) for n in schedules)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    parser.add_argument(
        "--reps", type=int, default=3, help="timed repetitions per program (real: fastest of alternating runs; emulated: median)"
    )
    parser.add_argument("--trace-dir", default=None, help="write Chrome/Perfetto traces of the timelines here")
    parser.add_argument("--png", default=None, help="write a PNG of the measured pp=4 emulated timelines here")
    parser.add_argument(
        "--only",
        choices=("fused", "critic_free"),
        default=None,
        help="run only the Actor+Critic figures (a, b) or only the critic-free ones (c); default: all",
    )
    args = parser.parse_args(argv)
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    figures: dict = {}
    if args.only != "critic_free":
        figures |= _fused_figures(args)
    if args.only != "fused":
        figures |= _critic_free_figures(args)
    if args.json:
        print(json.dumps(figures))


def _fused_figures(args: argparse.Namespace) -> dict:
    """(a) and (b): Actor + Critic, fused vs sequential 1F1B."""
    print(
        f"(a) real compute, pp=2, {REAL_FLAVOR} actor {REAL_LAYERS[ACTOR]} layers / critic {REAL_LAYERS[CRITIC]} layers, "
        f"{REAL_MICROBATCHES} micro-batches of {REAL_MB_SIZE}x{REAL_SEQ} tokens per model"
    )
    real_speedups = {}
    for critic_stages, label in ((2, "critic on 2 stages"), (1, "critic on 1 stage, 2 replicas (pp_critic=1)")):
        real = bench_real(args.reps, args.trace_dir, critic_stages)
        t = real["times"]
        real_speedups[critic_stages] = t["sequential"] / t["fused"]
        print(
            f"    {label}: sequential_1f1b {t['sequential'] * 1e3:8.1f} ms (bubble {real['bubble']['sequential']:.1%})   "
            f"fused {t['fused'] * 1e3:8.1f} ms (bubble {real['bubble']['fused']:.1%})   speedup "
            f"{real_speedups[critic_stages]:.3f}x (simulator with a critic/actor cost ratio of {real['cost_ratio']:g} per "
            f"stage: {real['simulated_speedup']:.3f}x)"
        )

    rows = [bench_emulated(pp, args.reps, args.trace_dir) for pp in (4, 8)]
    rows.append(bench_emulated(4, args.reps, args.trace_dir, critic_stages=2))
    print(
        f"(b) emulated compute (actor f={EMU_F_ACTOR * 1e3:.0f} ms, critic f={EMU_F_CRITIC * 1e3:.0f} ms per stage, x "
        "pp/pp_critic with replicas; b=2f), real gloo messages; makespans in ms"
    )
    print(
        f"    {'pp':>3} {'pp_critic':>9} {'M':>3} {'seq sim':>9} {'seq meas':>9} {'fused sim':>9} {'fused meas':>10} "
        f"{'speedup sim':>11} {'speedup meas':>12} {'max rel err':>11}"
    )
    for r in rows:
        print(
            f"    {r['pp']:>3} {r['pp_critic']:>9} {r['microbatches']:>3} {r['sequential_simulated'] * 1e3:9.1f} "
            f"{r['sequential_measured'] * 1e3:9.1f} {r['fused_simulated'] * 1e3:9.1f} {r['fused_measured'] * 1e3:10.1f} "
            f"{r['simulated_speedup']:11.3f} {r['measured_speedup']:12.3f} {r['max_rel_error']:11.2%}"
        )
    if args.png:
        rows[0]["timelines"]["fused"].save_png(args.png, "measured timeline, fused program, pp=4 (emulated compute)")
    return {
        "real_speedup": round(real_speedups[2], 4),
        "real_speedup_pp_critic1": round(real_speedups[1], 4),
        "emulated": [
            {k: round(r[k], 4) for k in ("measured_speedup", "simulated_speedup", "max_rel_error")}
            | {"pp": r["pp"], "pp_critic": r["pp_critic"]}
            for r in rows
        ],
    }


def _critic_free_figures(args: argparse.Namespace) -> dict:
    """(c): the Actor alone, split backward vs 1F1B; ratios are makespan ratios split / 1F1B (< 1: faster)."""
    real = bench_real_critic_free(args.reps, args.trace_dir)
    t = real["times"]
    print(
        f"(c) critic-free (the Actor alone): split-backward schedule vs 1F1B, makespan ratio split / 1F1B\n"
        f"    real compute, pp=2, {REAL_FLAVOR} actor {REAL_LAYERS[ACTOR]} layers, {REAL_MICROBATCHES} micro-batches of "
        f"{REAL_MB_SIZE}x{REAL_SEQ} tokens: 1f1b {t['1f1b'] * 1e3:8.1f} ms (bubble {real['bubble']['1f1b']:.1%})   split "
        f"{t['split'] * 1e3:8.1f} ms (bubble {real['bubble']['split']:.1%})   ratio {real['measured_ratio']:.3f} "
        f"(simulator with w = b/2: {real['simulated_ratio']:.3f}); backward compute I + W {real['backward_ratio']:.3f}x "
        "that of B (the simulator: 1x)"
    )
    rows = [bench_emulated_critic_free(pp, args.reps, args.trace_dir) for pp in (4, 8)]
    print(
        f"    emulated compute (actor f={EMU_F_ACTOR * 1e3:.0f} ms per stage, b=2f split into i=w=f), real gloo messages; "
        "makespans in ms"
    )
    print(
        f"    {'pp':>3} {'M':>3} {'1f1b sim':>9} {'1f1b meas':>9} {'split sim':>9} {'split meas':>10} "
        f"{'ratio sim':>9} {'ratio meas':>10} {'max rel err':>11}"
    )
    for r in rows:
        print(
            f"    {r['pp']:>3} {r['microbatches']:>3} {r['1f1b_simulated'] * 1e3:9.1f} {r['1f1b_measured'] * 1e3:9.1f} "
            f"{r['split_simulated'] * 1e3:9.1f} {r['split_measured'] * 1e3:10.1f} {r['simulated_ratio']:9.3f} "
            f"{r['measured_ratio']:10.3f} {r['max_rel_error']:11.2%}"
        )
    return {
        "critic_free": {
            "real_ratio": round(real["measured_ratio"], 4),
            "real_simulated_ratio": round(real["simulated_ratio"], 4),
            "real_backward_ratio": round(real["backward_ratio"], 4),
            "emulated": [
                {k: round(r[k], 4) for k in ("measured_ratio", "simulated_ratio", "max_rel_error")} | {"pp": r["pp"]}
                for r in rows
            ],
        }
    }


if __name__ == "__main__":
    main()
