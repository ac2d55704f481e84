"""One PPO iteration at paper scale, fusions off vs on: weight sync + rollout + training, in seconds.

    python -m fusedrl.bench.iteration [--json] [--budget-s 2] [--microbatch-samples 4]

Per setting (a LLaMA Actor/Critic pair on a number of H100-class GPUs), one iteration of batch 512 (minibatch 64,
LMSYS-shaped responses up to 2048 tokens, one PPO epoch) is modelled from roofline costs:

- weight sync: the Actor's and Critic's bf16 weights, each GPU's share in the rollout layout, over its inter-node
  link (the part its node does not hold as a training stage);
- rollout (generation + scoring): the rollout simulator, unfused vs fused at the best threshold, each at its fastest
  feasible tensor-parallel instance size (bench.fusion's best vs best);
- training: per minibatch, the Actor+Critic pipeline schedule, sequential 1F1B vs the fused schedule search
  (``--budget-s`` seconds per setting), on per-stage forward/backward times from the model sizes and the sampled
  lengths, plus the data-parallel gradient all-reduce and the optimizer step.

Every parameter and its source: docs/fusion.md, "Whole iteration at paper scale". With ``--json`` the last line is one
JSON object: {"settings": [per-setting figures], "speedup_range": {stage: [min, max]}, "paper": {stage: [low, high]},
"budget_s"}.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fusedrl.bench.fusion import BF16, GPU_MEMORY_FOR_MODELS, LLAMA1, PAPER_BATCH, PAPER_MAX_LEN, PAPER_PROMPT, best_vs_best
from fusedrl.config import microbatch_count
from fusedrl.hardware import DECODE_BW_UTIL, H100_SXM, MFU, Accelerator
from fusedrl.models import ModelFlavor
from fusedrl.models.figures import (
    kv_bytes_per_token,
    stage_activation_bytes,
    stage_forward_flops,
    stage_layer_counts,
)
from fusedrl.pipelining import ACTOR, CRITIC, CostModel, Placement, fused_schedule
from fusedrl.rollout_fusion.simulator import RolloutConfig, RolloutCosts, best_migration, simulate_rollout, split_round_robin
from fusedrl.rollout_fusion.workload import lmsys_lengths

GPUS_PER_NODE = 8
ROLLOUT_TP = (1, 2, 4, 8)  # generation instance sizes tried (within one node), as in bench.fusion
ACTOR_WEIGHT_SHARE = 0.5  # a rollout instance must hold the Actor's weights in this share of its usable memory
STATE_BYTES_PER_PARAM = 16  # trained model: bf16 weights and gradients, fp32 master weights, Adam m and v
MODEL_STATE_SHARE = 0.5  # of HBM the training layout may fill with model state (the rest: activations, KV cache)
ADAM_BYTES_PER_PARAM = 30  # optimizer step traffic: read fp32 master, m, v, grad; write master, m, v, bf16 weights
P2P_LATENCY_S = 50e-6  # per pipeline send, as bench.fusion's transfer latency
# RLHFuse (NSDI'25), over the same system without fusion: whole iteration, generation + inference, training.
PAPER_SPEEDUPS = {"total": (1.2, 1.4), "rollout": (1.2, 1.6), "training": (1.2, 1.3)}
STAGES = ("weight_sync", "rollout", "training", "total")


LLAMA_13B, LLAMA_33B, LLAMA_65B = LLAMA1["13B"], LLAMA1["33B"], LLAMA1["65B"]


@dataclass(frozen=True)
class Setting:
    """Actor (and Reference, same size) and Critic (and Reward, same size) on ``gpus`` GPUs, all four co-located."""

    actor: ModelFlavor
    critic: ModelFlavor
    gpus: int

    @property
    def name(self) -> str:
        return f"{self.actor.name}/{self.critic.name}"


SETTINGS = (
    Setting(LLAMA_13B, LLAMA_33B, 32),
    Setting(LLAMA_33B, LLAMA_33B, 32),
    Setting(LLAMA_65B, LLAMA_33B, 64),
    Setting(LLAMA_65B, LLAMA_65B, 64),
)


@dataclass(frozen=True)
class Workload:
    """One PPO iteration's data: ``batch`` prompts, optimizer steps of ``minibatch`` samples, pipeline micro-batches
    of ``microbatch`` samples per data-parallel replica, ``epochs`` passes; lengths from ``lmsys_lengths``."""

    batch: int = PAPER_BATCH
    minibatch: int = 64
    microbatch: int = 4
    epochs: int = 1
    prompt_len: int = PAPER_PROMPT
    max_len: int = PAPER_MAX_LEN
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.batch, self.minibatch, self.microbatch, self.epochs, self.prompt_len, self.max_len) < 1:
            raise ValueError(f"every workload field must be >= 1, got {self}")
        if self.batch % self.minibatch:
            raise ValueError(f"minibatch {self.minibatch} must divide batch {self.batch}; pick a divisor")

    @property
    def optimizer_steps(self) -> int:
        return self.epochs * self.batch // self.minibatch


@dataclass(frozen=True)
class TrainingLayout:
    """Training parallelism: tensor parallel ``tp`` within a node, ``pp`` pipeline stages (the Critic ``pp_critic``,
    run as pp / pp_critic replicas), ``dp`` data-parallel replicas of the whole pipeline."""

    tp: int
    pp: int
    pp_critic: int
    dp: int


def training_layout(setting: Setting, gpu: Accelerator = H100_SXM) -> TrainingLayout:
    """tp = one node; pp = the fewest stages (a power of two dividing the node count) at which each GPU's share of the
    model state (trained Actor and Critic, frozen Reference and Reward in bf16) fits in ``MODEL_STATE_SHARE`` of its
    memory; the Critic gets the divisor of pp whose stages come closest in size to the Actor's; dp = the rest."""
    a, c = setting.actor.num_params("policy"), setting.critic.num_params("value")
    tp = min(GPUS_PER_NODE, setting.gpus)
    if setting.gpus % tp:
        raise ValueError(f"{setting.name}: {setting.gpus} GPUs is not a whole number of {GPUS_PER_NODE}-GPU nodes")
    nodes = setting.gpus // tp
    per_param = STATE_BYTES_PER_PARAM + BF16
    pp = 1
    while pp <= min(nodes, setting.critic.num_layers, setting.actor.num_layers):
        if nodes % pp == 0:
            pp_critic = min((d for d in range(1, pp + 1) if pp % d == 0), key=lambda d: (abs(c / d - a / pp), -d))
            per_gpu = per_param * (a / (tp * pp) + c / (tp * pp_critic))
            if per_gpu <= MODEL_STATE_SHARE * gpu.hbm_bytes:
                return TrainingLayout(tp, pp, pp_critic, nodes // pp)
        pp *= 2
    raise ValueError(
        f"{setting.name}: the model state does not fit in {MODEL_STATE_SHARE:.0%} of {setting.gpus} GPUs' memory at any "
        "pipeline depth; give the setting more GPUs"
    )


# ---------------------------------------------------------------------------------------------- rollout
def rollout_phase(setting: Setting, gpu: Accelerator, workload: Workload, lengths: Sequence[int]) -> dict:
    """Generation + scoring, unfused vs fused, each at its fastest instance size (bench.fusion's best vs best)."""
    a, c = setting.actor, setting.critic
    a_params, kv_bytes = a.num_params("policy"), kv_bytes_per_token(a, BF16)
    rows: list[dict[str, Any]] = []
    for tp in ROLLOUT_TP:
        usable = tp * gpu.hbm_bytes * GPU_MEMORY_FOR_MODELS
        if tp > GPUS_PER_NODE or setting.gpus % tp or BF16 * a_params > ACTOR_WEIGHT_SHARE * usable:
            continue
        costs = RolloutCosts.for_models(
            actor_params=a_params,
            scorer_params=a_params + 2 * c.num_params("value"),  # Reference + Reward + Critic
            kv_bytes_per_token=kv_bytes,
            gpus_per_instance=tp,
            actor_layers=a.num_layers,
            gpu=gpu,
        )
        config = RolloutConfig(  # bench.fusion's paper-scale settings
            max_slots=256,
            kv_capacity_tokens=int((usable - BF16 * a_params) / kv_bytes),
            check_interval=8,
            micro_batch_size=8,
            unfused_scoring="balanced",
        )
        instances = split_round_robin(lengths, workload.prompt_len, setting.gpus // tp)
        unfused = simulate_rollout(instances, costs, config, fused=False)
        threshold, kept, fused = best_migration(instances, costs, config, batch_size=len(lengths))
        rows.append(
            dict(
                hardware=gpu.name,
                models=setting.name,
                tp=tp,
                unfused_s=unfused.total_s,
                decode_s=unfused.decode_end_s,
                fused_s=fused.total_s,
                threshold=threshold,
                min_kept=kept,
            )
        )
    if not rows:
        raise ValueError(f"{setting.name}: no rollout instance of {ROLLOUT_TP} GPUs holds the Actor; use larger GPUs")
    u, f, speedup = best_vs_best(rows, gpu.name, setting.name)
    decode_floor = min(r["decode_s"] for r in rows)
    return dict(
        unfused_s=u["unfused_s"],
        fused_s=f["fused_s"],
        speedup=speedup,
        bound=u["unfused_s"] / decode_floor,
        decode_floor_s=decode_floor,
        unfused_tp=u["tp"],
        fused_tp=f["tp"],
        threshold=f["threshold"],
        min_kept=f["min_kept"],
        tp_options=[r["tp"] for r in rows],
    )


def weight_sync_s(setting: Setting, layout: TrainingLayout, gpu: Accelerator, rollout_tp: int) -> float:
    """Actor and Critic weights into the rollout layout: each GPU receives its TP shard of every layer its node does not
    hold as a training stage, over its own inter-node link (intra-node resharding over NVLink is left out)."""
    a, c = setting.actor.num_params("policy"), setting.critic.num_params("value")
    remote = a * (layout.pp - 1) / layout.pp + c * (layout.pp_critic - 1) / layout.pp_critic
    return BF16 * remote / rollout_tp / gpu.link_bytes_per_s


# ---------------------------------------------------------------------------------------------- training
def training_costs(
    setting: Setting, layout: TrainingLayout, gpu: Accelerator, workload: Workload, lengths: Sequence[int]
) -> CostModel:
    """Per-stage forward/backward seconds of the iteration's mean micro-batch (tokens and squared lengths averaged over
    all micro-batches, i.e. token-balanced micro-batches): forward FLOPs as ``CostModel.from_flavors`` counts them
    (``stage_forward_flops``) at ``MFU`` over the stage's ``tp`` GPUs, backward = 2 x forward; activation memory as
    ``CostModel.from_flavors`` counts it; P2P = one micro-batch's hidden states per TP rank over its link."""
    seqs = [workload.prompt_len + n for n in lengths]
    microbatches = len(seqs) / workload.microbatch
    tokens = sum(seqs) / microbatches
    squares = sum(s * s for s in seqs) / microbatches
    rate = layout.tp * gpu.flops_per_s * MFU

    def stages(model: ModelFlavor, n: int, role: str) -> dict[str, list[float]]:
        f = [total / rate for total, _ in stage_forward_flops(model, role, n, tokens, squares)]
        mem = [
            stage_activation_bytes(
                model, k, first=s == 0, last=s == n - 1, role=role, tokens=round(tokens), itemsize=BF16, tp=layout.tp
            )
            / 2**30
            for s, k in enumerate(stage_layer_counts(model.num_layers, n))
        ]
        return {"f": f, "b": [2 * x for x in f], "mem": mem}

    hidden = max(setting.actor.embed_dim, setting.critic.embed_dim)
    p2p = P2P_LATENCY_S + tokens * hidden * BF16 / layout.tp / gpu.link_bytes_per_s
    return CostModel.from_profile(
        {ACTOR: stages(setting.actor, layout.pp, "policy"), CRITIC: stages(setting.critic, layout.pp_critic, "value")},
        p2p_latency=p2p,
    )


def optimizer_step_s(setting: Setting, layout: TrainingLayout, gpu: Accelerator) -> float:
    """Per minibatch, the same with or without fusion: ring all-reduce of fp32 gradients over the dp replicas, then
    the Adam step (memory bound) over each GPU's parameters."""
    shard = setting.actor.num_params("policy") / (layout.tp * layout.pp) + setting.critic.num_params("value") / (
        layout.tp * layout.pp_critic
    )
    all_reduce = 2 * (layout.dp - 1) / layout.dp * 4 * shard / gpu.link_bytes_per_s
    return all_reduce + ADAM_BYTES_PER_PARAM * shard / (gpu.hbm_bytes_per_s * DECODE_BW_UTIL)


def microbatches_per_pipeline(setting: Setting, layout: TrainingLayout, workload: Workload) -> int:
    """Actor micro-batches per minibatch on one data-parallel replica (each Critic replica takes its share of them)."""
    replicas = layout.pp // layout.pp_critic
    per_replica = microbatch_count(workload.minibatch, layout.dp, workload.microbatch)
    if workload.minibatch % (layout.dp * workload.microbatch) or per_replica < replicas or per_replica % replicas:
        raise ValueError(
            f"{setting.name}: minibatch {workload.minibatch} does not split into micro-batches of {workload.microbatch} "
            f"samples over {layout.dp} data-parallel replica(s) and {replicas} Critic replica(s); "
            "pick a micro-batch size that divides it"
        )
    return per_replica


def training_phase(
    setting: Setting,
    layout: TrainingLayout,
    gpu: Accelerator,
    workload: Workload,
    lengths: Sequence[int],
    budget_s: float,
    seed: int,
) -> dict:
    """Every optimizer step runs one minibatch through one pipeline schedule (planned once, as the trainer does):
    sequential 1F1B (unfused) vs the fused schedule search; the bound uses the search's lower bound."""
    placement = Placement(layout.pp, layout.pp_critic)
    per_replica = microbatches_per_pipeline(setting, layout, workload)
    costs = training_costs(setting, layout, gpu, workload, lengths)
    plan = fused_schedule(placement, costs, per_replica, per_replica // placement.critic_replicas, budget_s=budget_s, seed=seed)
    steps, fixed = workload.optimizer_steps, optimizer_step_s(setting, layout, gpu)
    unfused, fused = steps * (plan.sequential_1f1b_makespan + fixed), steps * (plan.makespan + fixed)
    floor = steps * (plan.lower_bound + fixed)
    return dict(
        unfused_s=unfused,
        fused_s=fused,
        speedup=unfused / fused,
        bound=unfused / floor,
        lower_bound_s=floor,
        microbatches=per_replica,
        minibatch_sequential_s=plan.sequential_1f1b_makespan,
        minibatch_fused_s=plan.makespan,
        minibatch_lower_bound_s=plan.lower_bound,
        optimizer_step_s=fixed,
        method=plan.method,
    )


# ---------------------------------------------------------------------------------------------- iteration
def iteration(
    setting: Setting,
    workload: Workload = Workload(),
    *,
    gpu: Accelerator = H100_SXM,
    layout: TrainingLayout | None = None,
    budget_s: float = 2.0,
    seed: int = 0,
) -> dict:
    """Per-stage and total seconds of one PPO iteration, unfused vs fused, with each stage's bound."""
    layout = layout if layout is not None else training_layout(setting, gpu)
    microbatches_per_pipeline(setting, layout, workload)  # bad sizes fail before the rollout simulation
    lengths = lmsys_lengths(workload.batch, seed=workload.seed, max_len=workload.max_len)
    rollout = rollout_phase(setting, gpu, workload, lengths)
    training = training_phase(setting, layout, gpu, workload, lengths, budget_s, seed)
    sync_u, sync_f = (weight_sync_s(setting, layout, gpu, rollout[k]) for k in ("unfused_tp", "fused_tp"))
    sync = dict(unfused_s=sync_u, fused_s=sync_f, speedup=sync_u / sync_f if sync_f else 1.0)  # 0 s at pp = 1
    unfused = sync_u + rollout["unfused_s"] + training["unfused_s"]
    fused = sync_f + rollout["fused_s"] + training["fused_s"]
    # Every stage at its bound: the cheapest sync, the rollout at the fastest decode, training at its lower bound.
    floor = min(weight_sync_s(setting, layout, gpu, tp) for tp in rollout["tp_options"])
    floor += rollout["decode_floor_s"] + training["lower_bound_s"]
    return dict(
        setting=setting.name,
        gpus=setting.gpus,
        hardware=gpu.name,
        layout=asdict(layout),
        workload=asdict(workload),
        weight_sync=sync,
        rollout=rollout,
        training=training,
        total=dict(unfused_s=unfused, fused_s=fused, speedup=unfused / fused, bound=unfused / floor),
    )


def _paper(stage: str) -> str:
    lo, hi = PAPER_SPEEDUPS[stage]
    return f"{lo}-{hi}x"


def report(results: Sequence[dict], budget_s: float) -> dict:
    """Print the per-setting tables and return the JSON object."""
    for r in results:
        lay, w, ro, tr = r["layout"], r["workload"], r["rollout"], r["training"]
        print(
            f"{r['setting']} (Actor+Reference / Critic+Reward) on {r['gpus']} {r['hardware']}: training tp {lay['tp']} x pp "
            f"{lay['pp']} (Critic {lay['pp_critic']} stages) x dp {lay['dp']}, {tr['microbatches']} micro-batches of "
            f"{w['microbatch']} samples per minibatch, {w['batch'] // w['minibatch']} minibatches x {w['epochs']} epoch(s); "
            f"rollout TP {ro['unfused_tp']} unfused / TP {ro['fused_tp']} fused"
        )
        print(f"    {'stage':12s} {'unfused s':>9s} {'fused s':>8s} {'speedup':>8s} {'bound':>6s}  paper")
        for stage in STAGES:
            s = r[stage]
            bound = f"{s['bound']:5.3f}x" if "bound" in s else f"{'-':>6s}"
            paper = _paper(stage) if stage in PAPER_SPEEDUPS else "-"
            label = stage.replace("_", " ")
            print(f"    {label:12s} {s['unfused_s']:9.2f} {s['fused_s']:8.2f} {s['speedup']:7.3f}x {bound}  {paper}")
        print(
            f"    training per minibatch: sequential 1F1B {tr['minibatch_sequential_s'] * 1e3:.1f} ms, fused "
            f"{tr['minibatch_fused_s'] * 1e3:.1f} ms ({tr['method']}), lower bound {tr['minibatch_lower_bound_s'] * 1e3:.1f} "
            f"ms, + optimizer {tr['optimizer_step_s'] * 1e3:.1f} ms"
        )
    speedups = {stage: [r[stage]["speedup"] for r in results] for stage in PAPER_SPEEDUPS}
    ranges = {stage: [min(x), max(x)] for stage, x in speedups.items()}
    print(
        "speedup over the settings, model vs paper: "
        + ", ".join(f"{stage} {lo:.3f}-{hi:.3f}x vs {_paper(stage)}" for stage, (lo, hi) in ranges.items())
        + f" (schedule search budget {budget_s:g} s per setting)"
    )
    return {
        "settings": list(results),
        "speedup_range": ranges,
        "paper": {stage: list(r) for stage, r in PAPER_SPEEDUPS.items()},
        "budget_s": budget_s,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fusedrl.bench.iteration", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--budget-s", type=float, default=2.0, help="fused schedule search budget per setting (seconds)")
    ap.add_argument("--microbatch-samples", type=int, default=Workload.microbatch, help="samples per pipeline micro-batch")
    args = ap.parse_args(argv)
    try:
        workload = Workload(microbatch=args.microbatch_samples)
        results = [iteration(s, workload, budget_s=args.budget_s) for s in SETTINGS]
    except ValueError as e:
        ap.error(str(e))
    out = report(results, args.budget_s)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
