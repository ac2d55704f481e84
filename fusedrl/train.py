"""PPO trainer: ``torchrun --nproc_per_node 4 -m fusedrl.train --job.config_file train_configs/debug_ppo.toml``.

One iteration (every rank runs the same program):

1. weight sync: the Actor's and Critic's training stages (pipeline-split, FSDP2-sharded) are gathered
   into full replicas: the generation engine's Actor and the scoring Critic;
2. rollout: each rank is one generation instance that decodes its share of the prompts; finished
   samples are scored (Actor/Reference log-probs, Reward score, Critic values). With
   ``[fusion] inter_stage`` the migration controller moves the long tail onto a few instances and
   the freed ones score at once; without it every instance finishes decoding before any scoring;
3. advantages: the experience of all ranks is gathered (every rank then holds the whole batch in
   sample-id order), KL-shaped rewards, GAE and global whitening;
4. training: PPO epochs x minibatches; each minibatch runs the Actor's policy loss and the Critic's
   value loss through one :class:`~fusedrl.pipelining.FusedPipelineSchedule` program, the planner's
   fused schedule (``[fusion] intra_stage``) or sequential 1F1B; gradients are clipped and both
   optimizers step.

Bad configs are refused with a one-line ``error: ...`` and exit status 2 before any process group starts.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LRScheduler

from fusedrl.components import (
    ChromeTrace,
    CheckpointManager,
    MetricsLogger,
    PromptBatch,
    PromptLoader,
    StageTimers,
    Tokenizer,
    build_lr_scheduler,
    build_optimizer,
    check_vocab,
    clip_grad_norm,
    drop_steps_after,
    export_hf,
    grad_norm,
    length_stats,
    load_prompts,
    load_tokenizer,
    peak_memory_gib,
)
from fusedrl.config import ConfigError, JobConfig, load_config, validate_paths, validate_world_size
from fusedrl.distributed import (
    Heartbeat,
    ParallelDims,
    apply_fsdp,
    describe_failure,
    gather_full_state_dict,
    init_distributed,
    split_decoder,
)
from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.generation.migration import MigrationController, StageResult
from fusedrl.generation.weight_sync import sync_weights as sync_engine_weights
from fusedrl.models import FLAVORS, CheckpointError, build_model, load_hf_checkpoint
from fusedrl.pipelining import (
    ACTOR,
    CRITIC,
    CostModel,
    FusedPipelineSchedule,
    LoweredProgram,
    Placement,
    StageModule,
    bucket_length,
    fused_schedule,
    lower,
    sequential_1f1b,
)
from fusedrl.rlhf import (
    Experience,
    PolicyLoss,
    Scorer,
    ScoringModels,
    ValueLoss,
    gae,
    kl_shaped_rewards,
    masked_mean_var,
    whiten,
)
from fusedrl.rlhf.debug_task import build as build_debug_assets
from fusedrl.rlhf.debug_task import true_score

log = logging.getLogger("fusedrl.train")

POLICY_STATS = ("policy_loss", "clip_frac", "approx_kl", "ratio_mean", "entropy")
VALUE_STATS = ("value_loss", "value_clip_frac", "value_mean", "explained_variance")
STAGES = ("weight_sync", "generation", "scoring", "scoring_exposed", "advantages", "training", "step")
STDOUT_KEYS = (
    "true_score", "reward_mean", "kl", "policy_loss", "value_loss", "clip_frac", "entropy", "response_len_mean",
    "samples_per_s", "bubble_ratio", "time_generation", "time_scoring_exposed", "time_training", "time_step",
)
DEBUG_ASSET_PARTS = ("actor", "reward")


# ---------------------------------------------------------------------------------------------- config checks


def check_config(cfg: JobConfig, world_size: int) -> None:
    """Everything about the config that can be refused before a process group exists (raises ConfigError)."""
    validate_world_size(cfg, world_size)
    par, gen = cfg.parallelism, cfg.generation
    if par.pp < 2:
        raise ConfigError(f"parallelism.pp = {par.pp}: the trainer's fused pipeline executor needs pp >= 2 "
                          "(Actor and Critic share the pipeline ranks); launch >= 2 processes with --parallelism.pp=2")
    if par.tp != 1:
        raise ConfigError(f"parallelism.tp = {par.tp}: tensor-parallel training is not supported by the trainer yet; "
                          "set --parallelism.tp=1 and use pp x dp_shard")
    if par.gen_tp != 1:
        raise ConfigError(f"parallelism.gen_tp = {par.gen_tp}: tensor-parallel generation instances are not implemented; "
                          "set --parallelism.gen_tp=1 (each rank holds a full Actor replica)")
    if cfg.ppo.batch_size % world_size:
        raise ConfigError(f"ppo.batch_size = {cfg.ppo.batch_size}: must be a multiple of the world size {world_size} "
                          "(each rank generates an equal share of the prompts)")
    for key in ("actor", "critic", "reward"):
        flavor = getattr(cfg.model, key)
        if flavor not in FLAVORS:
            raise ConfigError(f"model.{key} = {flavor!r}: unknown flavor; valid flavors: {', '.join(sorted(FLAVORS))}")
        layers = FLAVORS[flavor].num_layers
        if key != "reward" and layers < par.pp:
            raise ConfigError(f"model.{key} = {flavor!r} has {layers} layers, fewer than parallelism.pp = {par.pp} stages; "
                              "lower pp or pick a deeper flavor")
    actor = FLAVORS[cfg.model.actor]
    if FLAVORS[cfg.model.critic].vocab_size != actor.vocab_size or FLAVORS[cfg.model.reward].vocab_size != actor.vocab_size:
        raise ConfigError(f"model.critic / model.reward: vocabulary sizes differ from the Actor's ({actor.vocab_size}); "
                          "all four models must share the tokenizer")
    longest = cfg.data.max_prompt_len + gen.max_new_tokens
    limit = min(FLAVORS[getattr(cfg.model, k)].max_seq_len for k in ("actor", "critic", "reward"))
    if longest > limit:
        raise ConfigError(f"data.max_prompt_len + generation.max_new_tokens = {cfg.data.max_prompt_len} + {gen.max_new_tokens} "
                          f"= {longest}: exceeds the models' max_seq_len {limit}; lower one of them")
    if cfg.training.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = \"cuda\": no CUDA device is available; use --training.device=cpu (or auto)")
    device_is_cuda = cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available())
    if cfg.training.float8 and not device_is_cuda:
        raise ConfigError("training.float8 = true: float8 training needs CUDA; set --training.float8=false on CPU")
    if cfg.training.float8:
        raise ConfigError("training.float8 = true: float8 training is not wired into the trainer yet; set --training.float8=false")


def debug_assets_folder(cfg: JobConfig) -> Path | None:
    """The debug-asset folder to build on first run: the synthetic task names ``<folder>/actor`` or
    ``<folder>/reward`` that do not exist yet."""
    if cfg.data.format != "synthetic":
        return None
    for key in ("actor_path", "reward_path", "critic_path", "reference_path"):
        path = getattr(cfg.model, key)
        if path is not None and Path(path).name in DEBUG_ASSET_PARTS and not Path(path).is_dir():
            return Path(path).parent
    return None


def ensure_debug_assets(cfg: JobConfig) -> None:
    """Build the embedded debug task's SFT Actor and Reward model when the config names missing ones.

    Runs on local rank 0 only, before the process group starts; other ranks wait for its ``info.json``.
    """
    folder = debug_assets_folder(cfg)
    if folder is None:
        return
    info = folder / "info.json"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"fusedrl: building the debug task assets in {folder} (SFT Actor + Reward model; a few minutes on CPU, "
              "once) ...", flush=True)
        start = time.perf_counter()
        torch.set_num_threads(os.cpu_count() or 1)  # the other local ranks only wait
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(30.0):
                print(f"fusedrl: ... still building the debug assets ({time.perf_counter() - start:.0f}s)", flush=True)

        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            figures = build_debug_assets(folder)
        finally:
            done.set()
        print(f"fusedrl: debug assets ready in {time.perf_counter() - start:.0f}s: SFT true score "
              f"{figures['actor_true_score_mean']:.3f}, reward/true-score correlation "
              f"{figures['reward_true_corr_on_actor_samples']:.2f}", flush=True)
    else:
        while debug_assets_folder(cfg) is not None or not info.is_file():
            time.sleep(1.0)


# ---------------------------------------------------------------------------------------------- models


@dataclass
class PPOModels:
    """The four PPO models of one rank, as full (unsplit) modules; the trainer splits Actor and Critic later.

    ``actor_replica`` and ``critic_replica`` are the generation/scoring copies that weight sync refreshes.
    """

    actor: nn.Module | None  # released once split into training stages
    critic: nn.Module | None
    reference: nn.Module
    reward: nn.Module
    actor_replica: nn.Module
    critic_replica: nn.Module


def _load_value_model(model: nn.Module, path: str, flavor: str) -> None:
    """Load a value-head checkpoint, or start the value head fresh from an LM checkpoint."""
    try:
        load_hf_checkpoint(model, path, flavor, "value")
    except CheckpointError as value_error:
        try:
            load_hf_checkpoint(model, path, flavor, "value", init_value_head_from_lm=True)
        except CheckpointError:
            raise value_error from None


def build_models(cfg: JobConfig, device: torch.device) -> PPOModels:
    """Build and load the four models (identically on every rank: random inits are seeded by job.seed)."""
    m = cfg.model

    def fresh(flavor: str, role: str, offset: int) -> nn.Module:
        torch.manual_seed(cfg.job.seed * 7919 + offset)
        return build_model(flavor, role)

    actor = fresh(m.actor, "policy", 0)
    if m.actor_path:
        load_hf_checkpoint(actor, m.actor_path, m.actor, "policy")
    reference = copy.deepcopy(actor)
    if m.reference_path:
        load_hf_checkpoint(reference, m.reference_path, m.actor, "policy")
    critic = fresh(m.critic, "value", 1)
    if m.critic_path:
        _load_value_model(critic, m.critic_path, m.critic)
    reward = fresh(m.reward, "value", 2)
    if m.reward_path:
        _load_value_model(reward, m.reward_path, m.reward)
    for frozen in (reference, reward):
        frozen.requires_grad_(False).eval()
    models = PPOModels(actor, critic, reference, reward, copy.deepcopy(actor).eval(), copy.deepcopy(critic).eval())
    for name in ("actor_replica", "critic_replica"):
        getattr(models, name).requires_grad_(False)
    for name in ("actor", "critic", "reference", "reward", "actor_replica", "critic_replica"):
        setattr(models, name, getattr(models, name).to(device))
    return models


# ---------------------------------------------------------------------------------------------- training layout


@dataclass
class TrainingLayout:
    """This rank's place in the (pp, dp_shard) mesh and its training stages of both models."""

    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    pp_rank: int
    dp_rank: int
    pp: int
    dp: int
    actor_stage: nn.Module
    critic_stage: nn.Module
    schedule: FusedPipelineSchedule
    plan_method: str
    microbatches: int


def plan_program(cfg: JobConfig, seq_len: int) -> tuple[LoweredProgram, str]:
    """The lowered program of one minibatch: the fused schedule search (intra_stage) or sequential 1F1B.

    Planned on the caller's rank only; broadcast it so that every pipeline rank runs the same program.
    """
    placement = Placement(cfg.parallelism.pp)
    n_mb = cfg.ppo.minibatch_size // cfg.parallelism.dp_shard // cfg.ppo.microbatch_size
    if cfg.fusion.intra_stage:
        costs = CostModel.from_flavors(placement, cfg.model.actor, cfg.model.critic,
                                       tokens_per_microbatch=cfg.ppo.microbatch_size * seq_len, seq_len=seq_len)
        budget = cfg.fusion.schedule_search_budget_s
        plan = fused_schedule(placement, costs, n_mb, n_mb, budget_s=budget if budget > 0 else 1e-3, seed=cfg.job.seed)
        schedule, method = plan.schedule, plan.method
    else:
        schedule, method = sequential_1f1b(placement, n_mb, n_mb), "sequential_1f1b"
    return lower(schedule, placement, {ACTOR: n_mb, CRITIC: n_mb}), method


def build_training_layout(cfg: JobConfig, models: PPOModels, device: torch.device) -> TrainingLayout:
    """Split Actor and Critic into pipeline stages (Actor stage i on pp rank i, Critic stage j on rank pp-1-j),
    shard them with FSDP2 over dp_shard, and build the fused executor with the planned program."""
    par = cfg.parallelism
    dims = ParallelDims(pp=par.pp, dp_shard=par.dp_shard, tp=par.tp, gen_tp=par.gen_tp, world_size=dist.get_world_size())
    mesh = dims.build_mesh(device.type)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    dim_actor = models.actor.tok_embeddings.embedding_dim
    dim_critic = models.critic.tok_embeddings.embedding_dim
    vocab = models.actor.tok_embeddings.num_embeddings
    actor_stage = split_decoder(models.actor, par.pp)[pp_rank]
    critic_stage = split_decoder(models.critic, par.pp)[par.pp - 1 - pp_rank]
    if par.dp_shard > 1:
        for stage in (actor_stage, critic_stage):
            # unsharded between a micro-batch's forward and backward: one all-gather per stage and step
            apply_fsdp(stage, mesh["dp_shard"], reshard_after_forward=False)
    models.actor = models.critic = None  # keep only this rank's stages of the trained models
    dp_group = mesh.get_group("dp_shard") if par.dp_shard > 1 else None
    pp_group = mesh.get_group("pp")

    # One program for every minibatch (the cost model uses the longest sequence); plan on rank 0, broadcast.
    holder: list[Any] = [None]
    if dist.get_rank() == 0:
        holder[0] = plan_program(cfg, cfg.data.max_prompt_len + cfg.generation.max_new_tokens)
    dist.broadcast_object_list(holder, src=0)
    program, method = holder[0]
    actor_loss = PolicyLoss(cfg.ppo.clip_eps, cfg.ppo.entropy_coef, temperature=1.0)  # as the engine's log-probs
    critic_loss = ValueLoss(cfg.ppo.value_clip_eps if cfg.ppo.value_clip_eps > 0 else None)
    schedule = FusedPipelineSchedule(
        program,
        StageModule(actor_stage, actor_loss, dim_actor, vocab),
        StageModule(critic_stage, critic_loss, dim_critic, 1),
        group=pp_group,
        device=device,
        record_timeline=True,
    )
    return TrainingLayout(mesh, pp_group, dp_group, pp_rank, dp_rank, par.pp, par.dp_shard, actor_stage, critic_stage,
                          schedule, method, program.microbatches["actor"])


def sync_weights(layout: TrainingLayout, models: PPOModels, engine: GenerationEngine) -> None:
    """Training layout -> full replicas: the engine's Actor and the scoring Critic (collective)."""
    sync_engine_weights(engine, layout.actor_stage, layout.pp_group)
    critic_state = gather_full_state_dict(layout.critic_stage, layout.pp_group)
    models.critic_replica.load_state_dict({k: v.to(next(models.critic_replica.parameters()).device)
                                           for k, v in critic_state.items()})


# ---------------------------------------------------------------------------------------------- rollout + scoring


def build_requests(cfg: JobConfig, batch: PromptBatch, step: int, stop_ids: tuple[int, ...]) -> list[Request]:
    """One request per prompt; ids are global sample ids, sampling seeded by (job.seed, step, id)."""
    g = cfg.generation
    params = SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, max_new_tokens=g.max_new_tokens,
                            stop_token_ids=tuple(dict.fromkeys((*stop_ids, *g.stop_token_ids))))
    seed = cfg.job.seed * 1_000_003 + step
    return [Request(sid, ids, params, seed=seed) for sid, ids in zip(batch.sample_ids, batch.token_ids)]


def build_scorer(cfg: JobConfig, models: PPOModels, pad_id: int) -> Scorer:
    """Reference log-probs, Reward scores and Critic values of finished samples, on every rank.

    Log-probs are those of the model distribution (temperature 1), as the engine reports the sampled
    tokens' log-probs; the policy loss uses the same convention.
    """
    return Scorer(ScoringModels(models.reference, models.reward, models.critic_replica),
                  micro_batch_size=cfg.generation.max_slots, pad_id=pad_id, temperature=1.0)


def build_controller(cfg: JobConfig, engine: GenerationEngine, scorer: Scorer) -> MigrationController:
    """Generation + scoring of this rank's requests; ``fusion.inter_stage`` switches tail migration on/off.

    The controller's messages (statistics, request states, finished samples) are CPU tensors with tags and
    receives from any source, which NCCL does not do: under NCCL they get a gloo group of all ranks
    (collective: every rank builds its controller)."""
    f = cfg.fusion
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return MigrationController(engine, scorer, fusion=f.inter_stage, threshold=f.migration_threshold,
                               mode=f.migration_mode, check_interval=f.migration_check_interval, group=group)


def rollout(controller: MigrationController, requests: list[Request]) -> StageResult:
    """Generate and score this rank's requests (collective); every rank receives the whole scored batch
    in sample-id order."""
    return controller.run(requests, gather=True)


def migration_metrics(stage: StageResult) -> dict[str, float]:
    """Inter-stage fusion figures of one rollout (zeros when nothing migrated; identical on every rank)."""
    m = stage.migration
    if m is None:
        return {"migration_moved": 0, "migration_bytes": 0, "migration_kept": 0, "migration_at_unfinished": 0,
                "migration_at_s": 0.0, "migration_s": 0.0}
    return {"migration_moved": m.moved, "migration_bytes": m.moved_bytes + m.sample_bytes,
            "migration_kept": len(m.kept), "migration_at_unfinished": m.unfinished, "migration_at_s": m.time_s,
            "migration_s": m.duration_s}


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(cfg: JobConfig, exp: Experience) -> tuple[Experience, dict[str, float]]:
    """KL-shaped per-token rewards, GAE, and whitening over the whole batch (every rank holds it)."""
    ppo = cfg.ppo
    mask = exp.response_mask
    exp.token_rewards, kl = kl_shaped_rewards(exp.scores, exp.logprobs, exp.ref_logprobs, mask, ppo.kl_coef, ppo.kl_estimator)
    exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        exp.advantages = whiten(exp.advantages, mask)
    ret_mean, ret_var, _ = masked_mean_var(exp.returns, mask)
    stats = {
        "kl": (kl.sum(1)).mean().item(),  # per-sample KL to the Reference
        "kl_per_token": (kl.sum() / mask.sum()).item(),
        "reward_mean": exp.scores.mean().item(),
        "reward_std": exp.scores.std(unbiased=False).item(),
        "return_mean": ret_mean.item(),
        "return_std": ret_var.sqrt().item(),
    }
    return exp, stats


def pad_to_bucket(exp: Experience, max_len: int, pad_id: int) -> Experience:
    """Right-pad the batch to one of a few lengths so the executor builds few stage shapes."""
    step = max(16, -(-max_len // 8))
    return exp.pad_to(bucket_length(exp.seq_len, list(range(step, max_len + step, step))), pad_id)


# ---------------------------------------------------------------------------------------------- training


@dataclass
class Optimizers:
    actor: torch.optim.Optimizer
    critic: torch.optim.Optimizer
    actor_lr: LRScheduler
    critic_lr: LRScheduler


def build_optimizers(cfg: JobConfig, layout: TrainingLayout, updates_per_step: int) -> Optimizers:
    o, s = cfg.optimizer, cfg.lr_scheduler
    actor = build_optimizer(layout.actor_stage, o.actor_lr, o.weight_decay)
    critic = build_optimizer(layout.critic_stage, o.critic_lr, o.weight_decay)
    total = cfg.training.steps * updates_per_step

    def schedule(opt: torch.optim.Optimizer) -> LRScheduler:
        return build_lr_scheduler(opt, s.warmup_steps * updates_per_step, total, s.decay, s.min_ratio)

    return Optimizers(actor, critic, schedule(actor), schedule(critic))


def train_minibatch(layout: TrainingLayout, mb: Experience) -> dict[str, float]:
    """Forward/backward of one global minibatch for both models through the fused executor.

    Returns this rank's partial sums of the last-stage stats (reduced over ranks by the caller). The losses
    use ``loss_denom`` so that the accumulated gradient is the token mean over the whole minibatch.
    """
    shard = mb.split(mb.batch_size // layout.dp)[layout.dp_rank]
    tokens_total = mb.response_mask.sum()
    # The executor divides gradients by the micro-batch count and FSDP2 averages over dp_shard.
    denom = (tokens_total / (layout.microbatches * layout.dp)).expand(shard.batch_size).contiguous()
    actor_targets = {**shard.targets("tokens", "response_mask", "logprobs", "advantages"), "loss_denom": denom}
    critic_targets = {**shard.targets("response_mask", "values", "returns"), "loss_denom": denom}
    result = layout.schedule.step(shard.tokens, shard.tokens, actor_targets, critic_targets)
    out: dict[str, float] = {}
    for model, keys in (("actor", POLICY_STATS), ("critic", VALUE_STATS)):
        r = result[model]
        out.update({k: (r.stats[k] if r.loss is not None else 0.0) for k in keys})
    return out


def _all_reduce_mean(values: dict[str, float], divisor: int) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / divisor for k, v in zip(keys, t.tolist())}


def ppo_update(cfg: JobConfig, layout: TrainingLayout, opt: Optimizers, exp: Experience, step: int) -> dict[str, float]:
    """PPO epochs x minibatches with gradient clipping and one optimizer step per minibatch per model."""
    totals: dict[str, float] = {}
    bubbles, skipped, updates = [], 0, 0
    norms = {"actor": [], "critic": []}
    for epoch in range(cfg.ppo.epochs):
        g = torch.Generator().manual_seed(cfg.job.seed * 1_000_003 + step * 1009 + epoch)
        for mb in exp.minibatches(cfg.ppo.minibatch_size, generator=g):
            stats = train_minibatch(layout, mb)
            stats = _all_reduce_mean(stats, layout.dp)  # each dp shard's last stage contributed once
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            timeline = layout.schedule.timeline.gather(layout.pp_group)
            bubbles.append(timeline.bubble_ratio())
            finite = True
            for name, stage in (("actor", layout.actor_stage), ("critic", layout.critic_stage)):
                params = list(stage.parameters())
                if cfg.optimizer.grad_clip > 0:
                    norm = clip_grad_norm(params, cfg.optimizer.grad_clip, layout.pp_group)
                else:
                    norm = grad_norm(params, pp_group=layout.pp_group)
                norms[name].append(float(norm))
                finite = finite and math.isfinite(float(norm))
            loss_ok = math.isfinite(stats["policy_loss"]) and math.isfinite(stats["value_loss"])
            if finite and loss_ok:
                for optimizer in (opt.actor, opt.critic):
                    optimizer.step()
            elif cfg.training.nan_policy == "stop":
                raise FloatingPointError(f"step {step}: non-finite loss or gradient norm (actor {norms['actor'][-1]}, "
                                         f"critic {norms['critic'][-1]}); stopping (training.nan_policy = \"stop\")")
            else:
                skipped += 1
                if dist.get_rank() == 0:
                    log.warning("step %d: skipped an update: non-finite loss or gradient norm", step)
            for optimizer, sched in ((opt.actor, opt.actor_lr), (opt.critic, opt.critic_lr)):
                optimizer.zero_grad(set_to_none=True)
                sched.step()
            updates += 1
    out = {k: v / updates for k, v in totals.items()}
    out.update({
        "bubble_ratio": sum(bubbles) / len(bubbles),
        "grad_norm_actor": sum(norms["actor"]) / updates,
        "grad_norm_critic": sum(norms["critic"]) / updates,
        "skipped_updates": skipped,
        "lr_actor": opt.actor_lr.get_last_lr()[0],
        "lr_critic": opt.critic_lr.get_last_lr()[0],
    })
    return out


# ---------------------------------------------------------------------------------------------- the loop


def true_scores(exp: Experience, tokenizer: Tokenizer) -> list[float] | None:
    """Rule-based scores of the embedded debug task per sample (None unless every prompt is a debug-task prompt).

    A response counts as finished when it ends with a stop token (which is not part of the scored text).
    """
    stops = set(tokenizer.stop_token_ids)
    out = []
    for tokens, mask in zip(exp.tokens.tolist(), exp.response_mask.bool().tolist()):
        start = mask.index(True)
        prompt = tokenizer.decode(tokens[:start])
        response = [t for t, m in zip(tokens, mask) if m]
        finished = response[-1] in stops
        try:
            out.append(true_score(prompt, tokenizer.decode(response[:-1] if finished else response), finished))
        except ValueError:  # not a debug-task prompt
            return None
    return out


class Trainer:
    """The PPO trainer; ``Trainer(cfg).train()`` on every rank after the process group is initialised."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = _device(cfg)
        self.out = Path(cfg.job.output_dir)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        self.models = build_models(cfg, self.device)
        check_vocab(self.tokenizer, self.models.actor_replica.tok_embeddings.num_embeddings)
        self.layout = build_training_layout(cfg, self.models, self.device)
        d = cfg.data
        template = None
        if d.chat_template:
            template = getattr(self.tokenizer, "chat_template", None)
        self.dataset = load_prompts(d.path, self.tokenizer, format=d.format, prompt_key=d.prompt_key,
                                    max_prompt_len=d.max_prompt_len, overlong=d.on_long_prompt, chat_template=template,
                                    vocab_size=self.models.actor_replica.tok_embeddings.num_embeddings, seed=cfg.job.seed)
        if self.rank == 0:
            print(f"fusedrl: prompts {self.dataset.report.summary()}", flush=True)
        self.loader = PromptLoader(self.dataset, cfg.ppo.batch_size // self.world, rank=self.rank, world_size=self.world,
                                   seed=cfg.job.seed, shuffle=d.shuffle)
        g = cfg.generation
        self.max_len = d.max_prompt_len + g.max_new_tokens
        self.engine = GenerationEngine(self.models.actor_replica, max_slots=g.max_slots, max_len=self.max_len,
                                       seed=cfg.job.seed, compile=g.compile, backend=g.backend,
                                       mode=None if g.compile_mode == "default" else g.compile_mode,
                                       quantize=None if g.quantize == "none" else g.quantize)
        self.controller = build_controller(cfg, self.engine, build_scorer(cfg, self.models, self.tokenizer.pad_id))
        self.updates_per_step = cfg.ppo.epochs * (cfg.ppo.batch_size // cfg.ppo.minibatch_size)
        self.opt = build_optimizers(cfg, self.layout, self.updates_per_step)
        folder = Path(cfg.checkpoint.folder)
        # One name per pipeline stage: DCP keeps one copy of each non-tensor entry (e.g. optimizer param
        # groups), so ranks holding different stages must not share names.
        actor_name = f"actor_stage{self.layout.pp_rank}"
        critic_name = f"critic_stage{self.layout.pp - 1 - self.layout.pp_rank}"
        self.ckpt = CheckpointManager(
            folder if folder.is_absolute() else self.out / folder,
            {actor_name: self.layout.actor_stage, critic_name: self.layout.critic_stage},
            {actor_name: self.opt.actor, critic_name: self.opt.critic},
            {actor_name: self.opt.actor_lr, critic_name: self.opt.critic_lr},
            {"data": self.loader},
            interval=cfg.checkpoint.interval,
            keep_last=cfg.checkpoint.keep or None,
        )
        m = cfg.metrics
        resume_step = self.ckpt.latest_step() if cfg.checkpoint.resume else None
        old = self.out / "metrics.jsonl"
        if self.rank == 0 and m.jsonl and old.exists():
            if resume_step is None:  # a fresh run starts a fresh file
                kept = old.with_name(f"metrics.jsonl.{time.strftime('%Y%m%d-%H%M%S')}")
                old.rename(kept)
                print(f"fusedrl: fresh run: the previous metrics were moved to {kept}", flush=True)
            elif dropped := drop_steps_after(old, resume_step):  # steps after the checkpoint run again
                print(f"fusedrl: resuming from step {resume_step}: dropped {dropped} metrics records of later steps "
                      "from metrics.jsonl (those steps run again)", flush=True)
        self.metrics = MetricsLogger(self.out, rank=self.rank, log_freq=m.log_freq, jsonl=m.jsonl,
                                     tensorboard=m.tensorboard, stdout_keys=STDOUT_KEYS)
        self.step = 0

    def train(self) -> list[dict[str, float]]:
        """Run (or resume) training to ``training.steps``; returns the metrics of the steps run here (identical on every rank)."""
        cfg = self.cfg
        if cfg.checkpoint.resume:
            loaded = self.ckpt.load()
            if loaded is not None:
                self.step = loaded
                if self.rank == 0:
                    print(f"fusedrl: resumed from {self.ckpt.path(loaded)} (step {loaded})", flush=True)
        if self.rank == 0:
            print(f"fusedrl: {cfg.job.name}: {self.world} ranks (pp={self.layout.pp} x dp_shard={self.layout.dp}), "
                  f"inter_stage={cfg.fusion.inter_stage}, intra_stage={cfg.fusion.intra_stage} "
                  f"(schedule: {self.layout.plan_method}), steps {self.step + 1}..{cfg.training.steps}", flush=True)
        history = []
        while self.step < cfg.training.steps:
            self.step += 1
            record = self.train_step(self.step)
            history.append(record)
            self.metrics.log(self.step, record)
            self.ckpt.save(self.step)
        if cfg.checkpoint.export_hf:
            self.export()
        self.metrics.close()
        return history

    def train_step(self, step: int) -> dict[str, float]:
        """One PPO iteration; returns its metrics (identical on every rank)."""
        cfg = self.cfg
        trace = ChromeTrace() if step in cfg.metrics.trace else None
        timers = StageTimers(sync_cuda=self.device.type == "cuda", trace=trace, pid=self.rank)
        step_start = time.perf_counter()
        with timers("weight_sync"):
            sync_weights(self.layout, self.models, self.engine)
        batch = self.loader.next_batch()
        requests = build_requests(cfg, batch, step, tuple(self.tokenizer.stop_token_ids))
        rollout_start = time.perf_counter()
        stage = rollout(self.controller, requests)
        timers.add("generation", stage.decode_end_s)
        timers.add("scoring", stage.scoring_s)
        timers.add("scoring_exposed", stage.scoring_exposed_s)
        with timers("advantages"):
            lengths = stage.experience.response_mask.sum(1)
            scores = true_scores(stage.experience, self.tokenizer)
            exp, adv_stats = compute_advantages(cfg, stage.experience)
            exp = pad_to_bucket(exp, self.max_len, self.tokenizer.pad_id)
        with timers("training"):
            train_stats = ppo_update(cfg, self.layout, self.opt, exp, step)
        timers.add("step", time.perf_counter() - step_start)

        # Stage times as the slowest rank's; per-sample figures are of the whole batch (every rank holds it).
        stage_times = timers.pop()
        times = torch.tensor([stage_times.get(s, 0.0) for s in STAGES], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        record: dict[str, float] = {f"time_{s}": t for s, t in zip(STAGES, times.tolist())}
        step_s = record["time_step"]
        record["samples_per_s"] = cfg.ppo.batch_size / step_s
        record["tokens_per_s"] = lengths.sum().item() / step_s
        record.update(length_stats(lengths))
        if scores is not None:
            record["true_score"] = sum(scores) / len(scores)
        record.update(adv_stats)
        record.update(train_stats)
        record.update(migration_metrics(stage))
        mem = torch.tensor([peak_memory_gib(self.device)], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        record["peak_memory_gib"] = mem.item()
        if trace is not None:
            self._save_trace(step, trace, stage.trace, rollout_start)
        return record

    def _save_trace(self, step: int, trace: ChromeTrace, rollout_trace: ChromeTrace, rollout_start: float) -> None:
        """One Chrome trace of the step: every rank's stage spans, the rollout's decode/migrate/score spans and
        the last minibatch's measured pipeline timeline, on rank 0's clock (exact on one host)."""
        timeline = self.layout.schedule.timeline.gather(self.layout.pp_group)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, trace.events)
        if self.rank != 0:
            return
        t0 = min(e["ts"] for e in parts[0] if "ts" in e)
        merged = ChromeTrace()
        for r, events in enumerate(parts):
            merged.name_process(f"stages {r}", f"rank {r}: iteration stages")
            merged.extend([{**e, "pid": f"stages {r}", "ts": e["ts"] - t0} for e in events if "ts" in e])
        offset = rollout_start * 1e6 - t0  # rollout spans count from the rollout's start
        for e in rollout_trace.events:
            shifted = {**e, "ts": e["ts"] + offset} if "ts" in e else dict(e)
            merged.extend([{**shifted, "pid": f"rollout {e['pid']}"}])
        for e in timeline.events:
            merged.complete(f"{e.action.model} {e.action.kind}{e.action.microbatch}", e.start - t0 / 1e6,
                            e.end - e.start, pid="training (last minibatch)", tid=f"pp rank {e.rank}")
        path = merged.save(self.out / "traces" / f"step_{step:06d}.json")
        print(f"fusedrl: trace of step {step} written to {path}", flush=True)

    def export(self) -> Path | None:
        """Write the Actor as an HF-format safetensors folder ``<output_dir>/actor_hf`` (collective; rank 0 writes)."""
        folder = self.out / "actor_hf"
        path = export_hf(self.layout.actor_stage, folder, self.cfg.model.actor, "policy", self.layout.pp_group)
        if path is None:
            return None
        if hasattr(self.tokenizer, "save"):
            self.tokenizer.save(folder)
        print(f"fusedrl: Actor exported to {path}", flush=True)
        return path


def _device(cfg: JobConfig) -> torch.device:
    if cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------- entry point


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train with an already initialised default process group (what torchrun and tests call)."""
    device = _device(cfg)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // dist.get_world_size())))
    else:
        torch.cuda.set_device(device)
    return Trainer(cfg).train()


def prepare(argv: list[str], world_size: int | None = None) -> JobConfig:
    """Load and check the config for ``world_size`` ranks (default: $WORLD_SIZE, else 1) and build missing
    debug assets; raises ConfigError. Needs no process group."""
    cfg = load_config(argv)
    check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    ensure_debug_assets(cfg)
    validate_paths(cfg)
    if cfg.data.chat_template:
        if getattr(load_tokenizer(cfg.model.tokenizer_path), "chat_template", None) is None:
            raise ConfigError(f"data.chat_template = true: the tokenizer {cfg.model.tokenizer_path!r} has no chat template; "
                              "set --data.chat_template=false or use a tokenizer folder that defines one")
    return cfg


USAGE = """\
usage: torchrun --nproc_per_node N -m fusedrl.train --job.config_file FILE [--section.key=VALUE ...]

Trains PPO as the config says (N = parallelism.pp * dp_shard * tp). Every config key follows; docs/ppo.md
explains how the trainer uses them.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        from fusedrl.config.__main__ import USAGE as CONFIG_USAGE
        from fusedrl.config.__main__ import help_text

        print(USAGE + help_text().removeprefix(CONFIG_USAGE))
        return 0
    try:
        cfg = prepare(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = _device(cfg)
    init_distributed(device.type, timeout_s=cfg.training.collective_timeout_s)
    heartbeat = Heartbeat.from_env()
    try:
        run(cfg)
        dist.barrier()
    except Exception as e:
        print(f"error: {describe_failure(e, dist.get_rank(), heartbeat)}; restart with --checkpoint.resume=true to "
              "continue from the last complete checkpoint", file=sys.stderr, flush=True)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
