"""The training program of one PPO minibatch: the planner's costs for the job's layout, the fused schedule search
or sequential 1F1B, and the executor (with the PPO losses) built from the program planned on rank 0 and shared.
Without a Critic (a critic-free estimator) the program trains the Actor alone."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from fusedrl.config import ConfigError, JobConfig
from fusedrl.config.loader import source_of
from fusedrl.layouts import DTYPES, TrainingLayout, model_flavor
from fusedrl.pipelining import (
    ACTOR,
    CRITIC,
    CostModel,
    FusedPipelineSchedule,
    LocalSchedule,
    LoweredProgram,
    Placement,
    PlanResult,
    Schedule,
    StageModule,
    fused_schedule,
    lower,
    plan_and_share,
    sequential_1f1b,
    simulate,
)
from fusedrl.rlhf.losses import PolicyLoss, ValueLoss

log = logging.getLogger("fusedrl.rlhf.program")


def recompute_enabled(cfg: JobConfig) -> bool:
    """``ppo.recompute_logprobs``; "auto": whenever the engine's weights or arithmetic may differ from the training
    forward's (a bf16 rollout copy or bf16 compute, or a quantized engine), not for the all-float32 CPU configs,
    where they agree to float32 rounding."""
    setting, t = cfg.ppo.recompute_logprobs, cfg.training
    if setting != "auto":
        return bool(setting)
    return t.rollout_dtype != "float32" or t.mixed_precision_param != "float32" or cfg.generation.quantize != "none"


def old_logprobs_from_forward(cfg: JobConfig) -> bool:
    """Whether the old log-probs that :func:`recompute_enabled` asks for are the training forward's own, detached,
    instead of a separate forward pass: with one update per iteration (``ppo.epochs`` = 1, ``ppo.minibatch_size`` =
    ``ppo.batch_size``) that forward runs the weights that sampled, so it computes the same log-probs (the ratio is 1,
    the gradient the policy gradient's). Not with ``ppo.tis_cap``, whose weights are taken before the forward."""
    p = cfg.ppo
    return recompute_enabled(cfg) and p.epochs == 1 and p.minibatch_size == p.batch_size and p.tis_cap == 0


def pipeline_costs(cfg: JobConfig, seq_len: int) -> tuple[Placement, CostModel, dict[str, int]]:
    """The planner's placement, cost model (times in seconds, activation memory in GiB: what the memory estimate
    counts per micro-batch, :func:`fusedrl.models.figures.stage_activation_bytes`) and micro-batches per model
    for one minibatch of sequences of ``seq_len`` tokens on each data-parallel shard (the Critic's: per replica, an
    equal share of the Actor's count)."""
    par = cfg.parallelism
    placement = Placement(par.pp, par.critic_stages)
    costs = CostModel.from_flavors(
        placement,
        model_flavor(cfg, "actor"),
        model_flavor(cfg, "critic"),
        tokens_per_microbatch=cfg.ppo.microbatch_size * seq_len,
        seq_len=seq_len,
        bytes_per_activation=DTYPES[cfg.training.mixed_precision_param].itemsize,
        tp=par.tp,
        recompute=cfg.training.activation_checkpointing == "full",
    )
    critic = 0 if cfg.ppo.critic_free else cfg.microbatches // par.critic_replicas
    return placement, costs, {ACTOR: cfg.microbatches, CRITIC: critic}


def schedule_memory_limit(cfg: JobConfig, seq_len: int) -> float | None:
    """``fusion.schedule_memory_gib``, refused (ConfigError) below the peak stored activations of sequential 1F1B: the
    search falls back to that schedule whatever its peak, so no smaller cap can be kept. None when unset."""
    cap = cfg.fusion.schedule_memory_gib
    if cap is None or cfg.parallelism.pp < 2:
        return cap
    placement, costs, counts = pipeline_costs(cfg, seq_len)
    ma, mc = counts[ACTOR], counts[CRITIC]
    need = simulate(sequential_1f1b(placement, ma, mc), placement, costs, ma, mc).max_peak_memory
    if cap < need:
        raise ConfigError(
            f"fusion.schedule_memory_gib = {cap} ({source_of(cfg, 'fusion.schedule_memory_gib')}): below the {need:.3g} "
            f"GiB of activations per pipeline rank that sequential 1F1B stores ({ma} micro-batches of "
            f"{cfg.ppo.microbatch_size} x {seq_len} tokens, pp = {cfg.parallelism.pp}); raise it, lower "
            "ppo.microbatch_size, or unset it"
        )
    return cap


AUTO_MIN_GAIN = 0.02
"""``fusion.intra_stage = "auto"`` takes the fused schedule where its simulated makespan is at least this fraction
shorter than sequential 1F1B's."""


def _plan(cfg: JobConfig, seq_len: int) -> PlanResult | Schedule:
    """The schedule of one minibatch: the fused schedule search (intra_stage; without a Critic it schedules the Actor
    alone, with split backwards when ``fusion.split_backward``) or sequential 1F1B (intra_stage off, or "auto" where
    fusing is not predicted to pay: the decision is logged)."""
    placement, costs, counts = pipeline_costs(cfg, seq_len)
    setting = cfg.fusion.intra_stage
    if setting is False:
        return sequential_1f1b(placement, counts[ACTOR], counts[CRITIC])
    if setting == "auto" and counts[CRITIC] == 0 and not cfg.fusion.split_backward:
        log.info('fusion.intra_stage = "auto": off, no Critic to fuse with the Actor (fusion.split_backward is off)')
        return sequential_1f1b(placement, counts[ACTOR], counts[CRITIC])
    found = fused_schedule(
        placement,
        costs,
        counts[ACTOR],
        counts[CRITIC],
        budget_s=cfg.fusion.schedule_search_budget_s,
        seed=cfg.job.seed,
        memory_limit=schedule_memory_limit(cfg, seq_len),
        split_backward=cfg.fusion.split_backward,
    )
    gain = found.sequential_1f1b_makespan / found.makespan
    if setting == "auto":
        on = found.makespan <= (1 - AUTO_MIN_GAIN) * found.sequential_1f1b_makespan
        log.info(
            'fusion.intra_stage = "auto": %s, the %s schedule simulates %.3fx sequential 1F1B\'s speed (at least %.2fx '
            "turns it on)",
            "on" if on else "off",
            found.method,
            gain,
            1 / (1 - AUTO_MIN_GAIN),
        )
        if not on:
            return sequential_1f1b(placement, counts[ACTOR], counts[CRITIC])
    return found


def plan_program(cfg: JobConfig, seq_len: int) -> tuple[LoweredProgram, str]:
    """The lowered program of one minibatch and how it was planned, on the caller's rank only (a process without
    peers: ``bench.memory``); :func:`build_executor` plans it on rank 0 and shares it (``plan_and_share``)."""
    placement, _, counts = pipeline_costs(cfg, seq_len)
    plan = _plan(cfg, seq_len)
    if isinstance(plan, PlanResult):
        return lower(plan.schedule, placement, counts), plan.method
    return lower(plan, placement, counts), "sequential_1f1b"


@dataclass(frozen=True)
class TrainingExecutor:
    """What runs one minibatch of ``layout``'s stages (:func:`build_executor`): its schedule, how that was planned, and
    the Actor micro-batches per minibatch on each data-parallel shard (``cfg.microbatches``)."""

    schedule: FusedPipelineSchedule | LocalSchedule
    plan_method: str
    microbatches: int


def build_executor(cfg: JobConfig, layout: TrainingLayout, device: torch.device) -> TrainingExecutor:
    """The executor of ``layout`` (collective). pp >= 2: plan one program for every minibatch (the cost model uses
    the longest sequence) on rank 0, share it with every rank (``plan_and_share``), and run it with the fused
    executor over the pipeline group. pp = 1: the models train one after the other (``fusion.intra_stage`` has
    nothing to fuse)."""
    compute = DTYPES[cfg.training.mixed_precision_param]
    # the Actor's last stage returns hidden states; its loss applies the LM head in chunks
    # cast: the stage's `output` is its nn.Linear LM head (None off the last stage), seen by mypy as Tensor | Module
    head = cast("torch.nn.Linear | None", layout.actor_stage.output)
    policy_loss = PolicyLoss.from_config(
        cfg.ppo, head=head, temperature=cfg.generation.temperature, old_from_forward=old_logprobs_from_forward(cfg)
    )
    actor_spec = StageModule(layout.actor_stage, policy_loss, compute)
    critic_spec = None
    if layout.critic_stage is not None:
        critic_spec = StageModule(layout.critic_stage, ValueLoss.from_config(cfg.ppo), compute)
    if layout.pp == 1:
        counts = {ACTOR: cfg.microbatches, CRITIC: cfg.microbatches if critic_spec is not None else 0}
        local = LocalSchedule(actor_spec, critic_spec, counts, group=layout.pp_group, device=device)
        if critic_spec is None:
            return TrainingExecutor(local, "none: pp = 1, the Actor alone", cfg.microbatches)
        if cfg.fusion.intra_stage is True and dist.get_rank() == 0:
            log.info(
                "fusion.intra_stage = true has nothing to fuse with parallelism.pp = 1 (no pipeline bubbles): "
                "the Actor and the Critic train one after the other"
            )
        return TrainingExecutor(local, "none: pp = 1, Actor then Critic", cfg.microbatches)
    # shared by the whole job: every data-parallel replica runs the same program (their FSDP2 collectives follow it)
    placement, _, counts = pipeline_costs(cfg, cfg.sequence_budget)
    program, found = plan_and_share(lambda: _plan(cfg, cfg.sequence_budget), placement, counts)
    fused = FusedPipelineSchedule(program, actor_spec, critic_spec, group=layout.pp_group, device=device)
    return TrainingExecutor(fused, found.method if found is not None else "sequential_1f1b", program.microbatches[ACTOR])
