"""PPO trainer: ``torchrun --nproc_per_node 4 -m fusedrl.train --job.config_file train_configs/debug_ppo.toml``.

One iteration (every rank runs the same program), in the phases the metrics time:

1. weight_sync: the Actor's and Critic's training stages (pipeline-split, FSDP2-sharded) are gathered
   into full replicas: the generation engine's Actor and the scoring Critic;
2. generation + scoring (the rollout): each rank is one generation instance that decodes its share of the
   prompts; finished samples are scored (Actor/Reference log-probs, Reward score, Critic values). With
   ``[fusion] inter_stage`` the migration controller moves the long tail onto a few instances and the freed
   ones score at once; without it every instance finishes decoding before any scoring;
3. advantages: the experience of all ranks is gathered (every rank then holds the whole batch in
   sample-id order), KL-shaped rewards, GAE and global whitening;
4. training: PPO epochs x minibatches; each minibatch runs the Actor's policy loss and the Critic's
   value loss through one :class:`~fusedrl.pipelining.FusedPipelineSchedule` program, the planner's
   fused schedule (``[fusion] intra_stage``) or sequential 1F1B; gradients are clipped and both
   optimizers step.

Evaluation hooks (the embedded debug task's ``true_score``) run after the timed phases. The training phase
adds no synchronization of its own: per-minibatch figures stay on the device and all cross-rank metric
reductions of an iteration are one collective at its end; pipeline timelines are recorded only on the
iterations that ``metrics.trace`` and ``metrics.timeline_interval`` name.

Bad configs are refused with a one-line ``error: ...`` and exit status 2 before any process group starts.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from fusedrl.buckets import evenly_spaced, round_up
from fusedrl.components import (
    CheckpointManager,
    ChromeTrace,
    MetricsLogger,
    PhaseTimers,
    PromptBatch,
    PromptLoader,
    Tokenizer,
    build_lr_scheduler,
    build_optimizer,
    check_vocab,
    clip_grad_norm,
    drop_steps_after,
    export_hf,
    grad_norm,
    init_logging,
    length_stats,
    load_prompts_from_config,
    load_tokenizer,
    peak_memory_gib,
)
from fusedrl.components.tokenizer import CHAT_TEMPLATE_FIX
from fusedrl.config import ConfigError, InputError, JobConfig, load_config, validate_paths, validate_world_size
from fusedrl.config.loader import source_of
from fusedrl.distributed import Heartbeat, describe_failure, init_distributed, select_device
from fusedrl.fusion import MigrationController, RolloutResult
from fusedrl.generation import GenerationEngine, Request, SamplingParams, WeightSync
from fusedrl.layouts import (
    DTYPES,
    MODEL_ROLES,
    RANDOM_INIT_MAX_PARAMS,
    HostCopies,
    RolloutLayout,
    TrainingLayout,
    build_rollout_layout,
    build_training_layout,
    load_initial_weights,
    model_flavor,
)
from fusedrl.models import ModelFlavor, read_flavor, resolve_flavor
from fusedrl.pipelining import (
    ACTOR,
    CRITIC,
    CostModel,
    FusedPipelineSchedule,
    LocalSchedule,
    LoweredProgram,
    Placement,
    StageModule,
    Timeline,
    fused_schedule,
    lower,
    pipeline_forward,
    sequential_1f1b,
    simulate,
)
from fusedrl.rlhf import (
    Experience,
    PolicyLoss,
    RuleReward,
    Scorer,
    ScoringModels,
    ValueLoss,
    chunked_token_logprobs,
    explained_variance,
    gae,
    kl_shaped_rewards,
    load_reward_fn,
    masked_mean_var,
    reward_fn_metrics,
    whiten,
)
from fusedrl.tasks import EvalHook, debug

log = logging.getLogger("fusedrl.train")

POLICY_STATS = ("policy_loss", "clip_frac", "approx_kl", "ratio_mean", "entropy")
FIRST_MINIBATCH_STATS = ("approx_kl", "clip_frac", "ratio_mean", "logprob_diff", "logprob_diff_max")
"""Policy stats of each iteration's first minibatch, before any update: the gap between the old log-probs (the
engine's, or the recomputed ones) and the training forward's (``<name>_first`` in the metrics)."""
VALUE_STATS = ("value_loss", "value_clip_frac", "value_mean")
PHASES = ("weight_sync", "generation", "scoring", "scoring_exposed", "advantages", "recompute", "training", "step", "outside")
"""The timed phases of an iteration (``time_<phase>`` in the metrics; ``step`` is the whole iteration;
``outside`` is the time between the previous iteration and this one: its metrics logging and checkpoint save)."""
STDOUT_KEYS = (
    "true_score",
    "reward_mean",
    "reward_fn_mean",
    "reward_fn_failures",
    "kl",
    "policy_loss",
    "value_loss",
    "clip_frac",
    "entropy",
    "logprob_diff_mean",
    "response_len_mean",
    "samples_per_s",
    "bubble_ratio",
    "time_generation",
    "time_scoring_exposed",
    "time_training",
    "time_step",
)


# ---------------------------------------------------------------------------------------------- config checks


def check_config(cfg: JobConfig, world_size: int, local_world_size: int | None = None) -> None:
    """Everything about the config that can be refused before a process group exists (raises ConfigError).
    ``local_world_size``: ranks per node (torchrun's LOCAL_WORLD_SIZE); None skips the node checks."""
    validate_world_size(cfg, world_size)
    if local_world_size is not None:
        check_nodes(cfg, world_size, local_world_size)
    if cfg.checkpoint.resume is True:
        ckpt = CheckpointManager.from_config(cfg.checkpoint, cfg.job.output_dir, {})
        resume_step(cfg, ckpt.latest_step(), ckpt.folder)
    check_reward(cfg)
    check_sampling(cfg)
    par, gen = cfg.parallelism, cfg.generation
    instances = world_size // par.gen_tp
    if cfg.ppo.batch_size % instances:
        raise ConfigError(
            f"ppo.batch_size = {cfg.ppo.batch_size}: must be a multiple of the number of generation instances "
            f"{instances} (world size {world_size} / parallelism.gen_tp {par.gen_tp}; each instance generates an "
            "equal share of the prompts)"
        )
    pending = debug.missing_assets(cfg)  # the debug task's assets, built by prepare() after these checks
    validate_paths(cfg, pending)
    flavors = model_flavors(cfg, pending)
    for key, f in flavors.items():
        what = f"model.{key} = {getattr(cfg.model, key)!r}" if getattr(cfg.model, key) else f"model.{key}_path's {f.family} model"
        own = key == "critic" and par.pp_critic is not None
        stages, name = (par.critic_stages, "pp_critic") if own else (par.pp, "pp")
        if key != "reward" and f.num_layers < stages:
            smaller = " (or give the Critic fewer stages: parallelism.pp_critic)" if key == "critic" and not own else ""
            raise ConfigError(
                f"{what} has {f.num_layers} layers, fewer than parallelism.{name} = {stages} stages; "
                f"lower {name}{smaller} or use a deeper model"
            )
        sharded = "gen_tp" if key == "reward" else "tp and gen_tp"
        for option, degree in (("parallelism.tp", par.tp), ("parallelism.gen_tp", par.gen_tp)):
            if option.endswith(".tp") and key == "reward":
                continue
            for part, value in (
                ("attention heads", f.num_heads),
                ("KV heads", f.num_kv_heads),
                ("MLP width", f.intermediate_dim),
            ):
                if value % degree:
                    raise ConfigError(
                        f"{option} = {degree}: does not divide the {part} of {what} ({value}); tensor parallelism "
                        f"({sharded}) splits them evenly: choose a degree dividing it"
                    )
        if not getattr(cfg.model, f"{key}_path") and f.num_params(MODEL_ROLES[key]) > RANDOM_INIT_MAX_PARAMS:
            raise ConfigError(
                f"model.{key}_path is unset: a random initialisation builds the whole {f.name!r} model in host memory "
                f"(allowed up to {RANDOM_INIT_MAX_PARAMS / 1e9:.0f}B parameters); give an HF checkpoint folder"
            )
    actor = flavors["actor"]
    if any(f.vocab_size != actor.vocab_size for f in flavors.values()):
        sizes = ", ".join(f"{key} {f.vocab_size}" for key, f in flavors.items())
        raise ConfigError(
            f"model.critic / model.reward: vocabulary sizes differ from the Actor's ({sizes}); "
            "all four models must share the tokenizer"
        )
    longest = cfg.data.max_prompt_len + gen.max_new_tokens
    key, shortest = min(flavors.items(), key=lambda kv: kv[1].max_seq_len)
    if longest > shortest.max_seq_len:
        raise ConfigError(
            f"data.max_prompt_len + generation.max_new_tokens = {cfg.data.max_prompt_len} + {gen.max_new_tokens} "
            f"= {longest}: exceeds the max_seq_len {shortest.max_seq_len} of model.{key} (its max_position_embeddings, "
            "or a sliding window, within which attention is exact); lower one of them"
        )
    schedule_memory_limit(cfg, longest)
    try:
        device = select_device(cfg.training.device)
    except RuntimeError:
        raise ConfigError('training.device = "cuda": no CUDA device is available; use --training.device=cpu (or auto)') from None
    if cfg.training.float8 and device.type != "cuda":
        raise ConfigError("training.float8 = true: float8 training needs CUDA; set --training.float8=false on CPU")
    if cfg.training.float8 and cfg.parallelism.tp > 1:
        raise ConfigError(
            "training.float8 = true with parallelism.tp > 1: float8 tensor-parallel plans are not built; "
            "use tp = 1 (FSDP2 and pipeline stages work with float8) or --training.float8=false"
        )
    if pending is None or cfg.model.tokenizer_path == "byte" or not Path(cfg.model.tokenizer_path).is_relative_to(pending):
        check_tokenizer(cfg)


def check_nodes(cfg: JobConfig, world_size: int, local_world_size: int) -> None:
    """Node boundaries: torchrun gives node n the global ranks n * local_world_size onwards, and a generation
    instance (gen_tp consecutive ranks) or a training TP group (tp consecutive ranks: the innermost mesh dim) must
    not span two nodes (raises ConfigError). Pipeline stages and FSDP shards may."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE = {local_world_size} (ranks per node): must divide the world size {world_size}; "
            "launch the same number of processes on every node"
        )
    for key, what in (
        ("gen_tp", "a generation instance (gen_tp consecutive ranks)"),
        ("tp", "a tensor-parallel group (tp consecutive ranks)"),
    ):
        degree = getattr(cfg.parallelism, key)
        if local_world_size % degree:
            raise ConfigError(
                f"parallelism.{key} = {degree} ({source_of(cfg, f'parallelism.{key}')}): {what} would span "
                f"nodes (LOCAL_WORLD_SIZE = {local_world_size}: ranks per node); choose a {key} dividing "
                f"{local_world_size}, or launch a multiple of {degree} processes per node"
            )


def resume_step(cfg: JobConfig, latest: int | None, folder: Path) -> int | None:
    """The step a run continues from, given ``latest``, the latest complete checkpoint in ``folder``: that one when
    checkpoint.resume is true or "auto", None for a fresh start (false, or "auto" without one). Raises ConfigError
    for true without one."""
    if cfg.checkpoint.resume is False:
        return None
    if latest is None and cfg.checkpoint.resume is True:
        raise ConfigError(
            f"checkpoint.resume = true ({source_of(cfg, 'checkpoint.resume')}): no complete checkpoint in "
            f"{folder}; check job.output_dir and checkpoint.folder, or set --checkpoint.resume=auto "
            "to start fresh when there is none"
        )
    return latest


def check_tokenizer(cfg: JobConfig) -> None:
    """The tokenizer loads, its ids fit the Actor's vocabulary, and it has a chat template where the config
    asks for one (raises ConfigError)."""
    where = f"model.tokenizer_path = {cfg.model.tokenizer_path!r}"
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        check_vocab(tokenizer, model_flavor(cfg, "actor").vocab_size)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if cfg.data.chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"data.chat_template = true, but the tokenizer ({where}) has no chat template; {CHAT_TEMPLATE_FIX}, "
            "or set --data.chat_template=false"
        )


def model_flavors(cfg: JobConfig, pending: Path | None = None) -> dict[str, ModelFlavor]:
    """The architecture of each built model (:func:`neural_models`) by [model] key; ConfigError naming the key when
    a flavor is unknown or a checkpoint's config.json describes what fusedrl cannot build. A path into ``pending``
    (the debug task's assets, not built yet) has the flavor they are built with. A ``model.reference_path`` with a
    config.json must describe the Actor's architecture (the Reference is built as the Actor)."""
    out = {}
    for key in neural_models(cfg):
        path = getattr(cfg.model, f"{key}_path")
        try:
            if pending is not None and path and not getattr(cfg.model, key) and Path(path).is_relative_to(pending):
                out[key] = resolve_flavor(debug.ASSET_FLAVOR)
            else:
                out[key] = model_flavor(cfg, key)
        except InputError as e:
            raise ConfigError(f"model.{key}: {e}") from None
        except ValueError as e:  # an unknown flavor name
            raise ConfigError(f"model.{key} = {getattr(cfg.model, key)!r}: {e}") from None
    reference = cfg.model.reference_path
    if reference and (Path(reference) / "config.json").is_file():
        try:
            ref = read_flavor(reference)
        except InputError as e:
            raise ConfigError(f"model.reference_path: {e}") from None
        actor = out["actor"]
        differ = [
            f.name
            for f in fields(ModelFlavor)
            if f.name not in ("name", "max_seq_len") and getattr(ref, f.name) != getattr(actor, f.name)
        ]
        if differ:
            raise ConfigError(
                f"model.reference_path = {reference!r}: its config.json describes another architecture than the Actor's "
                f"(it differs in {', '.join(differ)}); the Reference is built as the Actor: give a checkpoint of the "
                "Actor's architecture"
            )
    return out


def neural_models(cfg: JobConfig) -> tuple[str, ...]:
    """The [model] flavor keys whose models are built: actor, critic and reward (unless ``model.reward = "none"``)."""
    return ("actor", "critic", "reward") if cfg.model.uses_reward_model else ("actor", "critic")


def check_sampling(cfg: JobConfig) -> None:
    """PPO needs the log-probs of the distribution that sampled (raises ConfigError): a temperature > 0 (greedy
    decoding has none) and no top-k / top-p filter (the training forward's log-probs would be of the unfiltered
    distribution, whose support differs). A quantized engine's log-probs are not the policy's: it needs
    ``ppo.recompute_logprobs``, as truncated importance sampling does (its weight is trainer / engine)."""
    g, ppo = cfg.generation, cfg.ppo
    if g.quantize != "none" and not recompute_enabled(cfg):
        raise ConfigError(
            f"generation.quantize = {g.quantize!r} with ppo.recompute_logprobs = false: the quantized engine's "
            "log-probs would become PPO's old log-probs; set --ppo.recompute_logprobs=true (or auto)"
        )
    if ppo.tis_cap > 0 and not recompute_enabled(cfg):
        raise ConfigError(
            f"ppo.tis_cap = {ppo.tis_cap} ({source_of(cfg, 'ppo.tis_cap')}): truncated importance sampling weighs the "
            "trainer's old log-probs against the engine's, which needs ppo.recompute_logprobs on; set "
            "--ppo.recompute_logprobs=true or --ppo.tis_cap=0"
        )
    if g.temperature <= 0:
        raise ConfigError(
            f"generation.temperature = {g.temperature} ({source_of(cfg, 'generation.temperature')}): PPO samples from the "
            "policy, and greedy decoding has no sampling distribution; use a temperature > 0 (1.0: the model's own)"
        )
    for key, value, off in (("top_k", g.top_k, 0), ("top_p", g.top_p, 1.0)):
        if value != off:
            raise ConfigError(
                f"generation.{key} = {value} ({source_of(cfg, f'generation.{key}')}): the PPO ratio and KL need the "
                f"log-probs of the distribution that sampled, and a filtered one's support moves with the policy; set "
                f"--generation.{key}={off} (lower generation.temperature to sharpen sampling)"
            )


def check_reward(cfg: JobConfig) -> None:
    """The rule-based reward (raises ConfigError): ``model.reward_fn`` imports and is callable; ``model.reward =
    "none"`` needs it and no ``model.reward_path``; ``model.reward_fn_weight`` needs it."""
    m = cfg.model
    if m.reward_fn is not None:
        try:
            load_reward_fn(m.reward_fn)
        except ValueError as e:
            raise ConfigError(f"model.reward_fn = {m.reward_fn!r}: {e}") from None
    elif not m.uses_reward_model:
        raise ConfigError(
            'model.reward = "none" and model.reward_fn is unset: nothing would score the samples; set '
            "--model.reward_fn=package.module:function or give a Reward model (model.reward_path)"
        )
    elif m.reward_fn_weight != 1.0:
        raise ConfigError(
            f"model.reward_fn_weight = {m.reward_fn_weight} weighs no function: model.reward_fn is unset; set "
            "--model.reward_fn=package.module:function or drop the weight"
        )
    if not m.uses_reward_model and m.reward_path is not None:
        raise ConfigError(
            f'model.reward_path = {m.reward_path!r} is set but model.reward = "none" builds no Reward model; '
            'unset it (--model.reward_path=) or build a Reward model (model.reward = "" reads its config.json)'
        )


# ---------------------------------------------------------------------------------------------- training layout


def pipeline_costs(cfg: JobConfig, seq_len: int) -> tuple[Placement, CostModel, dict[str, int]]:
    """The planner's placement, cost model (times in seconds, activation memory in GiB) and micro-batches per model
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
    )
    n_mb = cfg.ppo.minibatch_size // par.dp_shard // cfg.ppo.microbatch_size
    return placement, costs, {ACTOR: n_mb, CRITIC: n_mb // par.critic_replicas}


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


def plan_program(cfg: JobConfig, seq_len: int) -> tuple[LoweredProgram, str]:
    """The lowered program of one minibatch: the fused schedule search (intra_stage) or sequential 1F1B.

    Planned on the caller's rank only; broadcast it so that every pipeline rank runs the same program.
    """
    placement, costs, counts = pipeline_costs(cfg, seq_len)
    if cfg.fusion.intra_stage:
        plan = fused_schedule(
            placement,
            costs,
            counts[ACTOR],
            counts[CRITIC],
            budget_s=cfg.fusion.schedule_search_budget_s,
            seed=cfg.job.seed,
            memory_limit=schedule_memory_limit(cfg, seq_len),
            split_backward=cfg.fusion.split_backward,
        )
        schedule, method = plan.schedule, plan.method
    else:
        schedule, method = sequential_1f1b(placement, counts[ACTOR], counts[CRITIC]), "sequential_1f1b"
    return lower(schedule, placement, counts), method


def build_executor(cfg: JobConfig, layout: TrainingLayout, device: torch.device) -> None:
    """Give ``layout`` its executor (collective). pp >= 2: plan one program for every minibatch (the cost model
    uses the longest sequence) on rank 0, broadcast it, and run it with the fused executor over the pipeline
    group. pp = 1: the models train one after the other (``fusion.intra_stage`` has nothing to fuse)."""
    actor, critic = model_flavor(cfg, "actor"), model_flavor(cfg, "critic")
    compute = DTYPES[cfg.training.mixed_precision_param]
    # the Actor's last stage returns hidden states; its loss applies the LM head in chunks
    # cast: the stage's `output` is its nn.Linear LM head (None off the last stage), seen by mypy as Tensor | Module
    head = cast("torch.nn.Linear | None", layout.actor_stage.output)
    actor_spec = StageModule(
        layout.actor_stage,
        PolicyLoss.from_config(cfg.ppo, head=head, temperature=cfg.generation.temperature),
        actor.embed_dim,
        actor.embed_dim,
        compute,
    )
    critic_spec = StageModule(layout.critic_stage, ValueLoss.from_config(cfg.ppo), critic.embed_dim, 1, compute)
    if layout.pp == 1:
        layout.microbatches = cfg.ppo.minibatch_size // cfg.parallelism.dp_shard // cfg.ppo.microbatch_size
        layout.schedule = LocalSchedule(
            actor_spec,
            critic_spec,
            {ACTOR: layout.microbatches, CRITIC: layout.microbatches},
            group=layout.pp_group,
            device=device,
        )
        layout.plan_method = "none: pp = 1, Actor then Critic"
        if cfg.fusion.intra_stage and dist.get_rank() == 0:
            log.info(
                "fusion.intra_stage = true has nothing to fuse with parallelism.pp = 1 (no pipeline bubbles): "
                "the Actor and the Critic train one after the other"
            )
        return
    holder: list[Any] = [None]
    if dist.get_rank() == 0:
        holder[0] = plan_program(cfg, cfg.data.max_prompt_len + cfg.generation.max_new_tokens)
    dist.broadcast_object_list(holder, src=0)
    program, layout.plan_method = holder[0]
    layout.schedule = FusedPipelineSchedule(program, actor_spec, critic_spec, group=layout.pp_group, device=device)
    layout.microbatches = program.microbatches["actor"]


# ---------------------------------------------------------------------------------------------- rollout


def build_requests(cfg: JobConfig, batch: PromptBatch, step: int, stop_ids: tuple[int, ...]) -> list[Request]:
    """One request per prompt; ids are global sample ids, sampling seeded by (job.seed, step, id)."""
    g = cfg.generation
    params = SamplingParams(
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        max_new_tokens=g.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys((*stop_ids, *g.stop_token_ids))),
    )
    seed = cfg.job.seed * 1_000_003 + step
    return [Request(sid, ids, params, seed=seed) for sid, ids in zip(batch.sample_ids, batch.token_ids)]


def build_scorer(cfg: JobConfig, rollout: RolloutLayout, tokenizer: Tokenizer) -> Scorer:
    """Reference log-probs, Reward scores and Critic values of finished samples, on this rank's instance.

    Log-probs are those of the sampling distribution, ``log_softmax(logits / generation.temperature)``, as the
    engine reports the sampled tokens' and the policy loss computes them. ``model.reward_fn`` adds its weighted value to
    each score (or scores alone without a Reward model); it runs on each instance's first rank, texts decoded
    with ``tokenizer``, and its failures follow ``training.nan_policy``.
    """
    m = cfg.model
    rule = None
    if m.reward_fn is not None:
        rule = RuleReward(
            load_reward_fn(m.reward_fn),
            tokenizer,
            weight=m.reward_fn_weight,
            on_failure=cfg.training.nan_policy,
            name=m.reward_fn,
            group=rollout.instance_group,
        )
    return Scorer(
        ScoringModels(rollout.reference, rollout.reward, rollout.critic),
        pad_id=tokenizer.pad_id,
        temperature=cfg.generation.temperature,
        max_tokens=cfg.generation.scoring_max_tokens,
        reward_fn=rule,
    )


def build_controller(
    cfg: JobConfig, engine: GenerationEngine, scorer: Scorer, rollout: RolloutLayout
) -> MigrationController[Experience]:
    """Generation + scoring of this instance's requests; ``fusion.inter_stage`` switches tail migration on/off.

    Scoring micro-batches hold at most ``generation.max_slots`` samples. Request states travel over the rollout
    layout's default-backend group, statistics and finished samples over its gloo groups."""
    return MigrationController.from_config(
        engine,
        scorer.score,
        cfg.fusion,
        micro_batch_size=cfg.generation.max_slots,
        group=rollout.group,
        control_group=rollout.control_group,
        instance_group=rollout.instance_group,
    )


def rollout(
    controller: MigrationController[Experience], requests: list[Request], pad_id: int
) -> tuple[RolloutResult[Experience], Experience]:
    """Generate and score this rank's requests (collective); every rank receives the whole scored batch
    in sample-id order."""
    result = controller.run(requests, gather=True)
    exp = Experience.concat(result.scored, pad_token_id=pad_id)
    assert exp.sample_ids is not None  # Scorer.score sets sample_ids on every scored batch
    return result, exp.select(exp.sample_ids.argsort())


def migration_metrics(result: RolloutResult) -> dict[str, float]:
    """Inter-stage fusion figures of one rollout (zeros when nothing migrated; identical on every rank)."""
    m = result.migration
    if m is None:
        return {
            "migration_moved": 0,
            "migration_bytes": 0,
            "migration_kept": 0,
            "migration_at_unfinished": 0,
            "migration_at_s": 0.0,
            "migration_s": 0.0,
        }
    return {
        "migration_moved": m.moved,
        "migration_bytes": m.moved_bytes + m.sample_bytes,
        "migration_kept": len(m.kept),
        "migration_at_unfinished": m.unfinished,
        "migration_at_s": m.time_s,
        "migration_s": m.duration_s,
    }


# ---------------------------------------------------------------------------------------------- advantages


def compute_advantages(cfg: JobConfig, exp: Experience) -> tuple[Experience, dict[str, float]]:
    """KL-shaped per-token rewards, GAE, and whitening over the whole batch (every rank holds it).

    Responses that hit ``max_new_tokens`` follow ``ppo.truncated``: "score" treats them as finished, "penalty"
    subtracts ``ppo.truncation_penalty`` from their score, "mask" keeps them out of every loss (their rewards and
    advantages are computed, then their response mask is cleared; whitening is over the rest). With every
    response masked the batch has no token left: the caller skips the update."""
    ppo = cfg.ppo
    mask = exp.response_mask
    assert exp.scores is not None and exp.logprobs is not None and exp.ref_logprobs is not None and exp.values is not None, (
        "compute_advantages needs a scored batch (Scorer.score sets scores, logprobs, ref_logprobs and values)"
    )
    finished = exp.finished if exp.finished is not None else torch.ones(exp.batch_size, dtype=torch.bool)
    if ppo.truncated == "penalty":
        exp.scores = exp.scores - ppo.truncation_penalty * (~finished).to(exp.scores.dtype)
    exp.token_rewards, kl = kl_shaped_rewards(exp.scores, exp.logprobs, exp.ref_logprobs, mask, ppo.kl_coef, ppo.kl_estimator)
    exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, mask, ppo.gamma, ppo.lam)
    stats = {
        "kl": (kl.sum(1)).mean().item(),  # per-sample KL to the Reference
        "kl_per_token": (kl.sum() / mask.sum()).item(),
        "reward_mean": exp.scores.mean().item(),
        "reward_std": exp.scores.std(unbiased=False).item(),
        "truncated_frac": 1.0 - finished.float().mean().item(),
        # the old values' fit to the returns, over the whole batch (token-weighted; 0 for constant returns)
        "explained_variance": explained_variance(exp.values, exp.returns, mask).item(),
    }
    if ppo.truncated == "mask":
        exp.response_mask = mask = mask * finished[:, None].to(mask.dtype)
        exp.advantages, exp.returns = exp.advantages * mask, exp.returns * mask
    if not mask.any():
        return exp, stats | {"return_mean": 0.0, "return_std": 0.0}
    if ppo.whiten_advantages:
        exp.advantages = whiten(exp.advantages, mask)
    ret_mean, ret_var, _ = masked_mean_var(exp.returns, mask)
    return exp, stats | {"return_mean": ret_mean.item(), "return_std": ret_var.sqrt().item()}


def pad_to_bucket(exp: Experience, max_len: int, pad_id: int) -> Experience:
    """Right-pad the batch to one of a few lengths so the executor builds few stage shapes."""
    return exp.pad_to(round_up(exp.seq_len, evenly_spaced(max_len)), pad_id)


# ---------------------------------------------------------------------------------------------- training


@dataclass
class Optimizers:
    actor: torch.optim.Optimizer
    critic: torch.optim.Optimizer
    actor_lr: LRScheduler
    critic_lr: LRScheduler


def build_optimizers(cfg: JobConfig, layout: TrainingLayout, updates_per_step: int) -> Optimizers:
    """AdamW for both training stages (float32 state on the FSDP2 shards) and their LR schedules."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    actor = build_optimizer(layout.actor_stage, o.actor_lr, o.weight_decay)
    critic = build_optimizer(layout.critic_stage, o.critic_lr, o.weight_decay)
    total = cfg.training.steps * updates_per_step

    def schedule(opt: torch.optim.Optimizer) -> LRScheduler:
        return build_lr_scheduler(opt, s.warmup_steps * updates_per_step, total, s.decay, s.min_ratio)

    return Optimizers(actor, critic, schedule(actor), schedule(critic))


def train_minibatch(
    layout: TrainingLayout, mb: Experience, *, record: bool = False, tis_cap: float = 0.0
) -> dict[str, torch.Tensor]:
    """Forward/backward of one global minibatch for both models through the fused executor.

    Returns this rank's last-stage stats as 0-dim device tensors (zeros on ranks without a last stage; the
    caller sums them over minibatches and reduces them over ranks once per iteration). The losses use
    ``loss_denom`` so that the accumulated gradient is the token mean over the whole minibatch. ``tis_cap`` > 0
    weights each token's policy loss by ``min(pi_old / pi_engine, tis_cap)`` (needs ``mb.engine_logprobs``).
    """
    shard = mb.split(mb.batch_size // layout.dp)[layout.dp_rank]
    tokens_total = mb.response_mask.sum()
    # The executor divides gradients by the micro-batch count and FSDP2 averages over dp_shard.
    denom = (tokens_total / (layout.microbatches * layout.dp)).expand(shard.batch_size).contiguous()
    actor_targets = {**shard.targets("tokens", "response_mask", "logprobs", "advantages"), "loss_denom": denom}
    if tis_cap > 0:
        assert shard.logprobs is not None and shard.engine_logprobs is not None, "tis_cap needs recomputed log-probs"
        actor_targets["tis_weight"] = (shard.logprobs - shard.engine_logprobs).exp().clamp(max=tis_cap) * shard.response_mask
    critic_targets = {**shard.targets("response_mask", "values", "returns"), "loss_denom": denom}
    assert layout.schedule is not None, "train_minibatch needs the layout's executor: call build_executor first"
    result = layout.schedule.step(shard.tokens, shard.tokens, actor_targets, critic_targets, record=record)
    out: dict[str, torch.Tensor] = {}
    for model, keys in (("actor", (*POLICY_STATS, *FIRST_MINIBATCH_STATS)), ("critic", VALUE_STATS)):
        r = result[model]
        out.update({k: r.stats[k] if r.loss is not None else torch.zeros(()) for k in keys})
    if layout.critic_replicas > 1:  # each replica's last stage reports its own micro-batches: a 1/K share of the mean
        out.update({k: out[k] / layout.critic_replicas for k in VALUE_STATS})
    return out


@dataclass
class UpdateResult:
    """One iteration's PPO update on this rank."""

    stat_sums: dict[str, torch.Tensor]  # this rank's last-stage stats summed over the updates (reduce over ranks)
    first: dict[str, torch.Tensor]  # this rank's last-stage FIRST_MINIBATCH_STATS (reduce over ranks)
    updates: int
    figures: dict[str, float]  # identical on every rank: gradient norms, skipped updates, learning rates
    timeline: Timeline | None  # the last minibatch's pipeline timeline of all ranks, on recorded iterations


def _skip_update(norms: list[torch.Tensor], stats: dict[str, torch.Tensor]) -> bool:
    """Whether any rank saw a non-finite gradient norm or loss: one small all-reduce, so that every rank
    takes the same decision (the gradient norms are already global; the losses live on last stages)."""
    device = norms[0].device
    local = torch.stack([*norms, *(stats[k].to(device) for k in ("policy_loss", "value_loss"))])
    bad = (~torch.isfinite(local)).any().to(torch.int32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


def ppo_update(
    cfg: JobConfig, layout: TrainingLayout, opt: Optimizers, exp: Experience, step: int, *, record: bool = False
) -> UpdateResult:
    """PPO epochs x minibatches with gradient clipping and one optimizer step per minibatch per model.

    ``record``: record the executor's timeline of every minibatch and gather it over the pipeline group
    (the metrics then carry ``bubble_ratio``)."""
    sums: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    bubbles: list[float] = []
    timeline: Timeline | None = None
    skipped, updates = 0, 0
    norms: dict[str, list[torch.Tensor]] = {"actor": [], "critic": []}
    # a tied LM head on the last stage holds the first stage's embedding gradient: counted once, on the first stage
    tied_head = [layout.tied.param] if layout.tied.param is not None and layout.actor_stage.output is not None else []
    for epoch in range(cfg.ppo.epochs):
        g = torch.Generator().manual_seed(cfg.job.seed * 1_000_003 + step * 1009 + epoch)
        for mb in exp.minibatches(cfg.ppo.minibatch_size, generator=g):
            if not mb.response_mask.any():  # every sample of it masked (ppo.truncated = "mask"): nothing to learn
                continue
            stats = train_minibatch(layout, mb, record=record, tis_cap=cfg.ppo.tis_cap)
            layout.tied.sum_gradients()
            if not first:
                first = {k: stats[k] for k in FIRST_MINIBATCH_STATS}
            for k in (*POLICY_STATS, *VALUE_STATS):
                sums[k] = sums[k] + stats[k] if k in sums else stats[k]
            if record:
                assert layout.schedule is not None and layout.schedule.timeline is not None  # the step above recorded it
                timeline = layout.schedule.timeline.gather(layout.pp_group)
                bubbles.append(timeline.bubble_ratio())
            # the Critic's norm over one replica's stages (every replica holds the same averaged gradients)
            for name, stage, group, uncounted in (
                ("actor", layout.actor_stage, layout.pp_group, tied_head),
                ("critic", layout.critic_stage, layout.critic_group, []),
            ):
                params = list(stage.parameters())
                if cfg.optimizer.grad_clip > 0:
                    norms[name].append(clip_grad_norm(params, cfg.optimizer.grad_clip, group, uncounted=uncounted))
                else:
                    counted = [p for p in params if all(p is not q for q in uncounted)]
                    norms[name].append(grad_norm(counted, pp_group=group))
            if not _skip_update([norms["actor"][-1], norms["critic"][-1]], stats):
                for optimizer in (opt.actor, opt.critic):
                    optimizer.step()
            elif cfg.training.nan_policy == "stop":
                raise FloatingPointError(
                    f"step {step}: non-finite loss or gradient norm (actor {float(norms['actor'][-1])}, "
                    f'critic {float(norms["critic"][-1])}); stopping (training.nan_policy = "stop")'
                )
            else:
                skipped += 1
                if dist.get_rank() == 0:
                    log.warning("step %d: skipped an update: non-finite loss or gradient norm", step)
            for optimizer, sched in ((opt.actor, opt.actor_lr), (opt.critic, opt.critic_lr)):
                optimizer.zero_grad(set_to_none=True)
                sched.step()
            updates += 1
    figures = {
        "grad_norm_actor": float(torch.stack(norms["actor"]).mean()),
        "grad_norm_critic": float(torch.stack(norms["critic"]).mean()),
        "skipped_updates": skipped,
        "lr_actor": float(opt.actor_lr.get_last_lr()[0]),
        "lr_critic": float(opt.critic_lr.get_last_lr()[0]),
    }
    if bubbles:
        figures["bubble_ratio"] = sum(bubbles) / len(bubbles)
    return UpdateResult(sums, first, updates, figures, timeline)


def reduce_iteration(
    sums: dict[str, torch.Tensor],
    phase_times: dict[str, float],
    peak_memory: float,
    *,
    divisor: float,
    device: torch.device,
    first: dict[str, torch.Tensor] | None = None,
    first_divisor: float = 1.0,
) -> dict[str, float]:
    """The iteration's one cross-rank metric collective: ``sums`` are added over ranks and divided by
    ``divisor``; ``first`` (the first minibatch's stats, as ``<name>_first``) likewise by ``first_divisor``, its
    ``*_max`` entries maximised; phase times and peak memory are the slowest / largest rank's. One ``all_gather``
    of one float64 vector per rank (a sum and a max cannot share one all-reduce)."""
    first = first or {}
    keys, first_keys = sorted(sums), sorted(first)
    scalars = [sums[k] for k in keys] + [first[k] for k in first_keys]
    local = torch.cat(
        [
            torch.stack([s.to(device, torch.float64) for s in scalars])
            if scalars
            else torch.zeros(0, dtype=torch.float64, device=device),
            torch.tensor([phase_times.get(p, 0.0) for p in PHASES] + [peak_memory], dtype=torch.float64, device=device),
        ]
    )
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    gathered = torch.stack(parts)
    n, f = len(keys), len(first_keys)
    out = dict(zip(keys, (gathered[:, :n].sum(0) / divisor).tolist()))
    for i, k in enumerate(first_keys):
        column = gathered[:, n + i]
        out[f"{k}_first"] = float(column.amax() if k.endswith("_max") else column.sum() / first_divisor)
    largest = gathered[:, n + f :].amax(0).tolist()
    out.update({f"time_{p}": v for p, v in zip(PHASES, largest)})
    out["peak_memory_gib"] = largest[-1]
    return out


def recompute_enabled(cfg: JobConfig) -> bool:
    """``ppo.recompute_logprobs``; "auto": whenever the engine's weights or arithmetic may differ from the training
    forward's (a bf16 rollout copy or bf16 compute, or a quantized engine), not for the all-float32 CPU configs,
    where they agree to float32 rounding."""
    setting, t = cfg.ppo.recompute_logprobs, cfg.training
    if setting != "auto":
        return bool(setting)
    return t.rollout_dtype != "float32" or t.mixed_precision_param != "float32" or cfg.generation.quantize != "none"


def recompute_logprobs(cfg: JobConfig, layout: TrainingLayout, exp: Experience, device: torch.device) -> torch.Tensor:
    """The old Actor log-probs of every sample of ``exp`` (``[B, S]`` on the CPU, 0 outside the response mask) by a
    forward-only pass of the Actor's training stages (pipeline x FSDP2 x TP), at the sampling temperature: each
    data-parallel shard runs its rows in micro-batches through the pipeline, the last stage applies the LM head in
    chunks, the pipeline group receives its rows and the data-parallel shards exchange theirs (collective)."""
    rows = exp.batch_size // layout.dp
    shard = exp.select(slice(layout.dp_rank * rows, (layout.dp_rank + 1) * rows))
    inputs = list(shard.tokens.split(cfg.ppo.microbatch_size))
    head = cast("torch.nn.Linear | None", layout.actor_stage.output)  # the LM head, on the last stage

    def logprobs(hidden: torch.Tensor, i: int) -> torch.Tensor:
        assert head is not None  # called on the last stage only
        return chunked_token_logprobs(hidden.to(head.weight.dtype), head, inputs[i].to(device), cfg.generation.temperature)

    ranks = [dist.get_global_rank(layout.pp_group, r) for r in range(layout.pp)]
    outs = pipeline_forward(
        layout.actor_stage,
        inputs,
        ranks,
        layout.pp_rank,
        hidden_dim=model_flavor(cfg, "actor").embed_dim,
        activation_dtype=DTYPES[cfg.training.mixed_precision_param],
        device=device,
        last=logprobs,
        group=layout.pp_group,
    )
    local = torch.cat(outs) if outs is not None else torch.empty(rows, exp.seq_len, device=device)
    dist.broadcast(local, src=ranks[-1], group=layout.pp_group)
    parts = [torch.empty_like(local) for _ in range(layout.dp)]
    dist.all_gather(parts, local, group=layout.mesh["dp_shard"].get_group())
    return torch.cat(parts).cpu() * exp.response_mask


def logprob_gap(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the training forward's, over the response
    tokens: mean and largest absolute difference, and the mean importance ratio ``pi_train / pi_engine``."""
    diff = (trainer - engine) * mask
    tokens = mask.sum().clamp_min(1)
    return {
        "logprob_diff_mean": float(diff.abs().sum() / tokens),
        "logprob_diff_max": float(diff.abs().max()),
        "importance_ratio_mean": float((diff.exp() * mask).sum() / tokens),
    }


# ---------------------------------------------------------------------------------------------- the loop


class Trainer:
    """The PPO trainer; ``Trainer(cfg).train()`` on every rank after the process group is initialised.

    ``evaluators`` are called with each iteration's scored batch (every rank holds it) after the timed phases;
    their figures join the iteration's metrics. Default: the embedded debug task's ``true_score``, which adds
    nothing unless every prompt is a debug-task prompt.
    """

    def __init__(self, cfg: JobConfig, evaluators: Sequence[EvalHook] = (debug.evaluate,)) -> None:
        self.cfg = cfg
        self.evaluators = tuple(evaluators)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = select_device(cfg.training.device)
        self.out = Path(cfg.job.output_dir)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        vocab = model_flavor(cfg, "actor").vocab_size
        check_vocab(self.tokenizer, vocab)
        self.layout = build_training_layout(cfg, self.device)
        self.rollout = build_rollout_layout(cfg, self.device)
        load_initial_weights(cfg, self.layout, self.rollout)
        self.frozen = None
        if cfg.training.offload_frozen:  # in host memory until the first rollout
            self.frozen = HostCopies([m for m in (self.rollout.reference, self.rollout.reward) if m is not None])
            self.frozen.release()
        build_executor(cfg, self.layout, self.device)
        synthetic = debug.sample_prompts(1024, cfg.job.seed) if cfg.data.format == "synthetic" else None
        self.dataset = load_prompts_from_config(cfg.data, self.tokenizer, vocab_size=vocab, texts=synthetic)
        # every rank of an instance generates the same prompts: the loader shards over instances
        self.loader = PromptLoader(
            self.dataset,
            cfg.ppo.batch_size // self.rollout.instances,
            rank=self.rollout.instance,
            world_size=self.rollout.instances,
            seed=cfg.job.seed,
            shuffle=cfg.data.shuffle,
        )
        self.max_len = cfg.data.max_prompt_len + cfg.generation.max_new_tokens
        self.recompute = recompute_enabled(cfg)
        self.engine = GenerationEngine.from_config(
            self.rollout.actor,
            cfg.generation,
            max_len=self.max_len,
            seed=cfg.job.seed,
            kv_dtype=DTYPES[cfg.training.kv_cache_dtype],
        )
        self.syncs = (WeightSync(self.layout.actor_stage, self.engine), WeightSync(self.layout.critic_stage, self.rollout.critic))
        self.controller = build_controller(cfg, self.engine, build_scorer(cfg, self.rollout, self.tokenizer), self.rollout)
        self.updates_per_step = cfg.ppo.epochs * (cfg.ppo.batch_size // cfg.ppo.minibatch_size)
        self.opt = build_optimizers(cfg, self.layout, self.updates_per_step)
        # One name per pipeline stage: DCP keeps one copy of each non-tensor entry (e.g. optimizer param
        # groups), so ranks holding different stages must not share names. Critic replicas of a stage share its
        # name: DCP writes one copy of their identical shards and every replica loads it.
        actor_name = f"actor_stage{self.layout.pp_rank}"
        critic_name = f"critic_stage{self.layout.critic_index}"
        self.ckpt = CheckpointManager.from_config(
            cfg.checkpoint,
            self.out,
            {actor_name: self.layout.actor_stage, critic_name: self.layout.critic_stage},
            {actor_name: self.opt.actor, critic_name: self.opt.critic},
            {actor_name: self.opt.actor_lr, critic_name: self.opt.critic_lr},
            {"data": self.loader},
        )
        # rank 0 reads the folder once and its view decides: every rank resumes (or not) from the same step
        found = [self.ckpt.latest_step() if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        latest = found[0]
        self.resume_from: int | None = resume_step(cfg, latest, self.ckpt.folder)
        if cfg.checkpoint.resume == "auto" and self.resume_from is None:
            log.info('checkpoint.resume = "auto": no complete checkpoint in %s; starting fresh', self.ckpt.folder)
        elif cfg.checkpoint.resume is False and self.rank == 0 and latest is not None:
            log.warning(
                "fresh run (checkpoint.resume = false), but %s holds checkpoints of an earlier run (latest: step %d): "
                "a later resume would take the newest of either run; use another job.output_dir or remove them",
                self.ckpt.folder,
                latest,
            )
        old = self.out / "metrics.jsonl"
        if self.rank == 0 and cfg.metrics.jsonl and old.exists():
            if self.resume_from is None:  # a fresh run starts a fresh file
                kept = old.with_name(f"metrics.jsonl.{time.strftime('%Y%m%d-%H%M%S')}")
                old.rename(kept)
                log.info("fresh run: the previous metrics were moved to %s", kept)
            elif dropped := drop_steps_after(old, self.resume_from):  # steps after the checkpoint run again
                log.info(
                    "resuming from step %d: dropped %d metrics records of later steps from metrics.jsonl (those steps run again)",
                    self.resume_from,
                    dropped,
                )
        self.metrics = MetricsLogger.from_config(cfg.metrics, self.out, rank=self.rank, stdout_keys=STDOUT_KEYS)
        self.step = 0
        self.outside_s = 0.0  # the last iteration's logging and checkpointing, reported by the next one

    def train(self) -> list[dict[str, float]]:
        """Run (or resume) training to ``training.steps``; returns the metrics of the steps run here (identical on every rank)."""
        cfg = self.cfg
        if self.resume_from is not None:
            self.ckpt.load(self.resume_from)
            self.step = self.resume_from
            log.info("resumed from %s (step %d)", self.ckpt.path(self.step), self.step)
        log.info(
            "%s: %d ranks (training pp=%d x dp_shard=%d x tp=%d; %d generation instances of gen_tp=%d), "
            "inter_stage=%s, intra_stage=%s (schedule: %s), steps %d..%d",
            cfg.job.name,
            self.world,
            self.layout.pp,
            self.layout.dp,
            self.layout.tp,
            self.rollout.instances,
            self.rollout.gen_tp,
            cfg.fusion.inter_stage,
            cfg.fusion.intra_stage,
            self.layout.plan_method,
            self.step + 1,
            cfg.training.steps,
        )
        history = []
        while self.step < cfg.training.steps:
            self.step += 1
            record = self.train_step(self.step)
            history.append(record)
            start = time.perf_counter()
            self.metrics.log(self.step, record)
            self.ckpt.save(self.step)
            self.outside_s = time.perf_counter() - start
        if cfg.checkpoint.export_hf:
            self.export()
        self.metrics.close()
        return history

    def skipped_update(self, step: int) -> UpdateResult:
        """The update of an iteration without a token to train on: nothing steps, the skip is counted."""
        if self.rank == 0:
            log.warning('step %d: every response hit generation.max_new_tokens and ppo.truncated = "mask": no update', step)
        updates = self.cfg.ppo.epochs * (self.cfg.ppo.batch_size // self.cfg.ppo.minibatch_size)
        lr = {"lr_actor": float(self.opt.actor_lr.get_last_lr()[0]), "lr_critic": float(self.opt.critic_lr.get_last_lr()[0])}
        return UpdateResult({}, {}, 0, {"skipped_updates": updates, **lr}, None)

    def records_timeline(self, step: int) -> bool:
        """Whether iteration ``step`` records pipeline timelines: traced steps and every
        ``metrics.timeline_interval``-th step (0: traced steps only)."""
        interval = self.cfg.metrics.timeline_interval
        return step in self.cfg.metrics.trace or (interval > 0 and step % interval == 0)

    def train_step(self, step: int) -> dict[str, float]:
        """One PPO iteration; returns its metrics (identical on every rank)."""
        cfg = self.cfg
        trace = ChromeTrace() if step in cfg.metrics.trace else None
        timers = PhaseTimers(sync_cuda=self.device.type == "cuda", trace=trace, pid=self.rank)
        step_start = time.perf_counter()
        with timers("weight_sync"):
            for sync in self.syncs:
                sync.sync()
            if self.frozen is not None:
                self.frozen.restore()
        batch = self.loader.next_batch()
        requests = build_requests(cfg, batch, step, tuple(self.tokenizer.stop_token_ids))
        rollout_start = time.perf_counter()
        result, scored = rollout(self.controller, requests, self.tokenizer.pad_id)
        if self.frozen is not None:
            self.frozen.release()
        timers.add("generation", result.decode_end_s)
        timers.add("scoring", result.scoring_s)
        timers.add("scoring_exposed", result.scoring_exposed_s)
        with timers("advantages"):
            exp, adv_stats = compute_advantages(cfg, scored)
            exp = pad_to_bucket(exp, self.max_len, self.tokenizer.pad_id)
        gap = None
        if self.recompute:  # PPO's old log-probs from the training forward; the KL reward keeps the engine's
            with timers("recompute"):
                exp.engine_logprobs, exp.logprobs = exp.logprobs, recompute_logprobs(cfg, self.layout, exp, self.device)
            assert exp.engine_logprobs is not None  # the scored batch's
            gap = logprob_gap(exp.engine_logprobs, exp.logprobs, exp.response_mask)
        if exp.response_mask.any():
            with timers("training"):
                update = ppo_update(cfg, self.layout, self.opt, exp, step, record=self.records_timeline(step))
        else:  # every response hit max_new_tokens and ppo.truncated = "mask": no token to learn from
            update = self.skipped_update(step)
        timers.add("step", time.perf_counter() - step_start)
        timers.add("outside", self.outside_s)

        # Per-sample figures are of the whole batch (every rank holds it); phase times are the slowest rank's.
        record = reduce_iteration(
            update.stat_sums,
            timers.pop(),
            peak_memory_gib(self.device),
            divisor=self.layout.dp * self.layout.tp * max(1, update.updates),
            device=self.device,
            first=update.first,
            first_divisor=self.layout.dp * self.layout.tp,
        )
        if gap is None and "logprob_diff_first" in record:  # without recompute: the first minibatch's forward
            gap = {
                "logprob_diff_mean": record["logprob_diff_first"],
                "logprob_diff_max": record["logprob_diff_max_first"],
                "importance_ratio_mean": record["ratio_mean_first"],
            }
        record.update(gap or {})
        lengths = scored.response_mask.sum(1)
        record["samples_per_s"] = cfg.ppo.batch_size / record["time_step"]
        record["tokens_per_s"] = lengths.sum().item() / record["time_step"]
        record.update(length_stats(lengths))
        record.update(adv_stats)
        record.update(update.figures)
        record.update(migration_metrics(result))
        record.update(reward_fn_metrics(scored))
        eval_start = time.perf_counter()
        for evaluate in self.evaluators:
            record.update(evaluate(scored, self.tokenizer))
        if self.evaluators:
            record["time_eval"] = time.perf_counter() - eval_start
        if trace is not None:
            self._save_trace(step, trace, result.trace, rollout_start, update.timeline)
        return record

    def _save_trace(
        self, step: int, trace: ChromeTrace, rollout_trace: ChromeTrace, rollout_start: float, timeline: Timeline | None
    ) -> None:
        """One Chrome trace of the step: every rank's phase spans, the rollout's decode/migrate/score spans and
        the last minibatch's measured pipeline timeline, on rank 0's clock (exact on one host)."""
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, trace.events)
        if self.rank != 0:
            return
        t0 = min(e["ts"] for e in parts[0] if "ts" in e)
        merged = ChromeTrace()
        for r, events in enumerate(parts):
            merged.name_process(f"phases {r}", f"rank {r}: iteration phases")
            merged.extend([{**e, "pid": f"phases {r}", "ts": e["ts"] - t0} for e in events if "ts" in e])
        offset = rollout_start * 1e6 - t0  # rollout spans count from the rollout's start
        for e in rollout_trace.events:
            shifted = {**e, "ts": e["ts"] + offset} if "ts" in e else dict(e)
            merged.extend([{**shifted, "pid": f"rollout {e['pid']}"}])
        for a in timeline.events if timeline is not None else ():
            merged.complete(
                f"{a.action.model} {a.action.kind}{a.action.microbatch}",
                a.start - t0 / 1e6,
                a.end - a.start,
                pid="training (last minibatch)",
                tid=f"pp rank {a.rank}",
            )
        path = merged.save(self.out / "traces" / f"step_{step:06d}.json")
        log.info("trace of step %d written to %s", step, path)

    def export(self) -> Path | None:
        """Write the Actor as an HF-format safetensors folder ``<output_dir>/actor_hf`` (collective; rank 0 writes)."""
        folder = self.out / "actor_hf"
        path = export_hf(
            self.layout.actor_stage,
            folder,
            model_flavor(self.cfg, "actor"),
            "policy",
            self.layout.pp_group,
            tokenizer=self.tokenizer,
        )
        if path is None:
            return None
        log.info("Actor exported to %s", path)
        return path


# ---------------------------------------------------------------------------------------------- entry point


def use_device(cfg: JobConfig) -> None:
    """Bind this rank to its device (CUDA) or its share of the host's cores (CPU)."""
    device = select_device(cfg.training.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // dist.get_world_size())))
    else:
        torch.cuda.set_device(device)


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train with an already initialised default process group (what torchrun and tests call)."""
    use_device(cfg)
    return Trainer(cfg).train()


def prepare(argv: list[str], world_size: int | None = None) -> JobConfig:
    """Load and check the config for ``world_size`` ranks (default: $WORLD_SIZE, else 1; then the node checks use
    $LOCAL_WORLD_SIZE when set) and build missing debug assets; raises ConfigError. Needs no process group."""
    cfg = load_config(argv)
    local_world_size = None
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    check_config(cfg, world_size, local_world_size)  # before building anything
    if debug.missing_assets(cfg) is not None:
        debug.ensure_assets(cfg)
        check_config(cfg, world_size, local_world_size)  # now the built assets' paths and tokenizer too
    return cfg


USAGE = """\
usage: torchrun --nproc_per_node N -m fusedrl.train --job.config_file FILE [--section.key=VALUE ...]

Trains PPO as the config says (N = parallelism.pp * dp_shard * tp). Every config key follows; docs/ppo.md
explains how the trainer uses them.
"""


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 when training finished, 2 on bad input (config, checkpoint, dataset: one line from one
    rank, no traceback); any other failure prints one line per rank and raises."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        from fusedrl.config.__main__ import USAGE as CONFIG_USAGE
        from fusedrl.config.__main__ import help_text

        print(USAGE + help_text().removeprefix(CONFIG_USAGE))
        return 0
    init_logging()
    try:
        cfg = prepare(argv)
    except InputError as e:  # every rank finds the same problem: rank 0 says it
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    init_distributed(cfg.training.device, timeout_s=cfg.training.collective_timeout_s)
    heartbeat = Heartbeat.from_env()
    trainer = None
    try:
        use_device(cfg)
        trainer = Trainer(cfg)
        trainer.train()
        dist.barrier()
    except InputError as e:  # found while loading checkpoints or data, maybe by some ranks only: the first says it
        # one claim per launch attempt: the store of a torchrun agent outlives a restart of its workers
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if heartbeat is None or heartbeat.claim(f"input_error/{attempt}"):
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        advice = ""
        if trainer is not None and trainer.step > 0 and trainer.ckpt.latest_step() is not None:
            advice = (
                '; rerunning the same command (checkpoint.resume = "auto") continues from the last complete checkpoint'
                if cfg.checkpoint.resume == "auto"
                else "; restart with --checkpoint.resume=true to continue from the last complete checkpoint"
            )
        print(f"error: {describe_failure(e, dist.get_rank(), heartbeat)}{advice}", file=sys.stderr, flush=True)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
