"""The PPO Trainer (``fusedrl.train`` runs it): one iteration, every rank running the same program, in the phases the
metrics time:

1. weight_sync: the Actor's and Critic's training stages (pipeline-split, FSDP2-sharded) are gathered
   into full replicas: the generation engine's Actor and the scoring Critic;
2. generation + scoring (the rollout): each rank is one generation instance that decodes its share of the
   prompts; finished samples are scored (Actor/Reference log-probs, Reward score, Critic values). With
   ``[fusion] inter_stage`` the migration controller moves the long tail onto a few instances and the freed
   ones score at once; without it every instance finishes decoding before any scoring;
3. advantages: the experience of all ranks is gathered (every rank then holds the whole batch in
   sample-id order), KL-shaped rewards, GAE and global whitening (or a critic-free estimator over groups of
   ``generation.n`` samples per prompt: docs/algorithms.md; with ``ppo.dynamic_sampling`` more rounds of
   generation + scoring first replace groups of equal scores);
4. training: PPO epochs x minibatches; each minibatch runs the Actor's policy loss and the Critic's
   value loss through one :class:`~fusedrl.pipelining.FusedPipelineSchedule` program, the planner's
   fused schedule (``[fusion] intra_stage``) or sequential 1F1B; gradients are clipped and both
   optimizers step.

The task's evaluation (``job.task``; the debug task's ``true_score``) and ``[eval]``'s held-out evaluation (on the
iterations it names, after the engine takes the updated weights) run after the timed phases (``time_eval``). The training phase
adds no synchronization of its own: per-minibatch figures stay on the device and all cross-rank metric
reductions of an iteration are one collective at its end; pipeline timelines are recorded only on the
iterations that ``metrics.trace`` and ``metrics.timeline_interval`` name.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fusedrl.components import (
    CheckpointManager,
    ChromeTrace,
    MetricsLogger,
    PhaseTimers,
    Progress,
    PromptLoader,
    check_vocab,
    drop_steps_after,
    export_hf,
    length_stats,
    load_prompts_from_config,
    load_tokenizer,
    memory_figures,
    resume_step,
)
from fusedrl.config import JobConfig
from fusedrl.distributed import select_device
from fusedrl.distributed.compat import compile_seconds
from fusedrl.generation import GenerationEngine, WeightSync
from fusedrl.hardware import cached_peak, reuse_host_memory
from fusedrl.layouts import DTYPES, HostCopies, build_rollout_layout, build_training_layout, load_initial_weights, model_flavor
from fusedrl.models import lora_spec, reference_from_base, trained_parameters
from fusedrl.pipelining import Timeline
from fusedrl.rlhf import (
    Experience,
    PartialRollouts,
    RolloutPlan,
    UpdateResult,
    base_reference_logprobs,
    build_controller,
    build_episodes,
    build_executor,
    build_optimizers,
    build_requests,
    build_scorer,
    check_logprob_gap,
    compute_advantages,
    episode_metrics,
    generate_and_score,
    logprob_gap,
    logprob_gap_limit,
    migration_metrics,
    old_logprobs_from_forward,
    pad_to_bucket,
    ppo_update,
    recompute_enabled,
    recompute_logprobs,
    reward_fn_metrics,
    sample_groups,
    sequence_lengths,
    speculation_metrics,
    zero_variance_groups,
)
from fusedrl.rollout_fusion import RolloutResult
from fusedrl.tasks import load_task, synthetic_prompts, task_reward_fn
from fusedrl.tasks.evaluation import Evaluator
from fusedrl.trainer.throughput import compute_figures, peak_flops_per_s

log = logging.getLogger("fusedrl.trainer")


PHASES = (
    "weight_sync",
    "generation",
    "scoring",
    "scoring_exposed",
    "reference",
    "advantages",
    "recompute",
    "training",
    "step",
    "outside",
    "compile",
)
"""The timed phases of an iteration (``time_<phase>`` in the metrics; ``step`` is the whole iteration;
``outside`` is the time between the previous iteration and this one: its metrics logging and checkpoint save;
``compile`` is torch.compile's compile time during the iteration, a part of the other phases' times)."""


STDOUT_KEYS = (
    "true_score",
    "eval/accuracy",
    "reward_mean",
    "reward_fn_mean",
    "reward_fn_failures",
    "kl",
    "kl_loss",
    "policy_loss",
    "value_loss",
    "zero_std_groups_frac",
    "clip_frac",
    "entropy",
    "logprob_diff_mean",
    "response_len_mean",
    "samples_per_s",
    "train_mfu",
    "pad_frac",
    "bubble_ratio",
    "time_generation",
    "time_scoring_exposed",
    "time_training",
    "time_step",
)


def samples_digest(exp: Experience) -> int:
    """CRC-32 of a scored batch's sample ids and token ids (rows in sample-id order, each up to its last response
    token): two runs sampled the same batch exactly when their digests agree (e.g. fused against unfused,
    ``bench.e2e --apart``)."""
    assert exp.sample_ids is not None  # the scorer sets them
    crc = zlib.crc32(exp.sample_ids.to(torch.int64).numpy().tobytes())
    ends = (exp.response_mask > 0).cumsum(1).argmax(1)  # each row's last response position
    for row, end in zip(exp.tokens, ends.tolist()):
        crc = zlib.crc32(row[: end + 1].to(torch.int64).numpy().tobytes(), crc)
    return crc


def reduce_iteration(
    sums: dict[str, torch.Tensor],
    phase_times: dict[str, float],
    memory: dict[str, float],
    *,
    divisor: float,
    device: torch.device,
    first: dict[str, torch.Tensor] | None = None,
    first_divisor: float = 1.0,
) -> dict[str, float]:
    """The iteration's one cross-rank metric collective: ``sums`` are added over ranks and divided by
    ``divisor``; ``first`` (the first minibatch's stats, as ``<name>_first``) likewise by ``first_divisor``, its
    ``*_max`` entries maximised; phase times and the ``memory`` figures (e.g. ``peak_memory_gib``) are the slowest /
    largest rank's. One ``all_gather`` of one float64 vector per rank (a sum and a max cannot share one all-reduce)."""
    first = first or {}
    keys, first_keys, gauges = sorted(sums), sorted(first), sorted(memory)
    scalars = [sums[k] for k in keys] + [first[k] for k in first_keys]
    local = torch.cat(
        [
            torch.stack([s.to(device, torch.float64) for s in scalars])
            if scalars
            else torch.zeros(0, dtype=torch.float64, device=device),
            torch.tensor(
                [phase_times.get(p, 0.0) for p in PHASES] + [memory[k] for k in gauges], dtype=torch.float64, device=device
            ),
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
    out.update(zip(gauges, largest[len(PHASES) :]))
    return out


class Trainer:
    """The PPO trainer; ``Trainer(cfg).train()`` on every rank after the process group is initialised.

    Critic-free estimators (``ppo.advantage_estimator`` other than gae) build, sync, train and checkpoint no Critic.
    The task that ``job.task`` names (the same object the startup checks and ``prepare`` read) gives the prompts of
    ``data.format = "synthetic"``, the reward function of ``model.reward_fn = "task"`` and an evaluation, called with each iteration's scored batch (every
    rank holds it) after the timed phases; its figures join the iteration's metrics.
    """

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.device = select_device(cfg.training.device)
        # before the models: every allocation after this reuses freed memory (CPU tensors; a GPU rank's host memory is
        # left to the allocator's defaults)
        self.host_memory_reused = cfg.training.reuse_host_memory and self.device.type == "cpu" and reuse_host_memory()
        self.task = load_task(cfg.job.task)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out = Path(cfg.job.output_dir)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        self.stop_ids = tuple(self.tokenizer.stop_token_ids)
        vocab = model_flavor(cfg, "actor").vocab_size
        check_vocab(self.tokenizer, vocab)
        self.layout = build_training_layout(cfg, self.device)
        self.rollout = build_rollout_layout(cfg, self.device)
        load_initial_weights(cfg, self.layout, self.rollout)
        self.frozen = None
        if cfg.training.offload_frozen:  # in host memory until the first rollout
            self.frozen = HostCopies([m for m in (self.rollout.reference, self.rollout.reward) if m is not None])
            self.frozen.release()
        self.executor = build_executor(cfg, self.layout, self.device)
        texts = synthetic_prompts(cfg, self.task)
        self.dataset = load_prompts_from_config(
            cfg.data, self.tokenizer, vocab_size=vocab, texts=texts, whole_rows=bool(cfg.env.env)
        )
        groups = cfg.ppo.batch_size // cfg.generation.n
        self.partial: PartialRollouts | None = None
        if cfg.rollout.over_provision > 0:  # plans every instance's prompts from the global stream
            self.partial = PartialRollouts(
                cfg,
                PromptLoader(self.dataset, groups, seed=cfg.job.seed, shuffle=cfg.data.shuffle),
                self.stop_ids,
                instance=self.rollout.instance,
                instances=self.rollout.instances,
                pad_id=self.tokenizer.pad_id,
            )
            self.loader = self.partial.loader
        else:  # every rank of an instance generates the same prompts: the loader shards over instances
            self.loader = PromptLoader(
                self.dataset,
                groups // self.rollout.instances,
                rank=self.rollout.instance,
                world_size=self.rollout.instances,
                seed=cfg.job.seed,
                shuffle=cfg.data.shuffle,
            )
        self.max_len = cfg.sequence_budget
        # old log-probs of the training forward: a pass of their own, or the update's forward (on-policy)
        self.recompute = recompute_enabled(cfg) and not old_logprobs_from_forward(cfg)
        t = cfg.training
        self.logprob_gap_limit = t.logprob_gap_limit or logprob_gap_limit(
            [DTYPES[t.rollout_dtype], DTYPES[t.kv_cache_dtype], DTYPES[t.mixed_precision_param]],
            cfg.generation.quantize != "none",
        )
        self.reference_from_base = reference_from_base(cfg)  # a LoRA Actor's Reference: its stages, adapters off
        # one rank's matmul peak, the denominator of train_mfu / score_mfu
        self.peak_flops = peak_flops_per_s(cfg, None if cfg.training.peak_tflops > 0 else cached_peak(self.device))
        self.engine = GenerationEngine.from_config(
            self.rollout.actor,
            cfg.generation,
            max_len=self.max_len,
            seed=cfg.job.seed,
            kv_dtype=DTYPES[cfg.training.kv_cache_dtype],
        )
        self.syncs = [WeightSync(self.layout.actor_stage, self.engine)]
        if self.layout.critic_stage is not None and self.rollout.critic is not None:
            self.syncs.append(WeightSync(self.layout.critic_stage, self.rollout.critic))
        self.episodes = build_episodes(cfg, self.engine, self.tokenizer)  # multi-turn, with an [env] environment
        scorer = build_scorer(cfg, self.rollout, self.tokenizer, task_reward_fn(cfg, self.task))
        self.controller = build_controller(cfg, self.engine, scorer, self.rollout, self.episodes)
        self.evaluator = Evaluator.from_config(cfg, self.task, self.engine, self.tokenizer, self.rollout, vocab_size=vocab)
        self.updates_per_step = cfg.ppo.epochs * (cfg.ppo.batch_size // cfg.ppo.minibatch_size)
        self.opt = build_optimizers(cfg, self.layout, self.updates_per_step)
        # One name per pipeline stage: DCP keeps one copy of each non-tensor entry (e.g. optimizer param
        # groups), so ranks holding different stages must not share names. Critic replicas of a stage share its
        # name: DCP writes one copy of their identical shards and every replica loads it.
        actor_name = f"actor_stage{self.layout.pp_rank}"
        modules, optimizers, schedules = (
            {actor_name: self.layout.actor_stage},
            {actor_name: self.opt.actor},
            {actor_name: self.opt.actor_lr},
        )
        if self.layout.critic_stage is not None and self.opt.critic is not None and self.opt.critic_lr is not None:
            critic_name = f"critic_stage{self.layout.critic_index}"
            modules[critic_name], optimizers[critic_name] = self.layout.critic_stage, self.opt.critic
            schedules[critic_name] = self.opt.critic_lr
        extra = {"data": self.loader, "fusion": self.controller}
        extra |= {"rollout": self.partial} if self.partial is not None else {}
        self.ckpt = CheckpointManager.from_config(cfg.checkpoint, self.out, modules, optimizers, schedules, extra)
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
            self.executor.plan_method,
            self.step + 1,
            cfg.training.steps,
        )
        g = cfg.generation
        if g.speculative != "off":
            log.info(
                "speculative decoding: drafts of up to %d tokens from %s, verified while at most %d requests decode "
                "(generation.speculative_rows: a verify step costs rows x drafted positions of compute; the samples are "
                "those of decoding without it); draft history kept in memory, rebuilt after a resume",
                g.max_draft,
                "group siblings, earlier responses to the prompt and the prompt",
                g.speculative_rows,
            )
        t = cfg.training
        if self.recompute:
            old_logprobs = "recomputed by the training forward (the engine's arithmetic differs from it)"
        elif old_logprobs_from_forward(cfg):
            old_logprobs = "the update's own forward (one on-policy update per iteration; the engine's arithmetic differs)"
        else:
            old_logprobs = "the engine's (ppo.recompute_logprobs: not asked for)"
        log.info(
            "numerics: training computes in %s (float32 master weights and optimizer state, %s gradient reduction); "
            "engine weights %s, KV cache %s; Reference/Reward %s; old log-probs %s; matmul peak %.3g TFLOP/s per rank "
            "in %s (%s); freed host memory %s",
            t.mixed_precision_param,
            t.mixed_precision_reduce,
            t.rollout_dtype,
            t.kv_cache_dtype,
            t.frozen_dtype,
            old_logprobs,
            self.peak_flops[t.mixed_precision_param] / 1e12,
            t.mixed_precision_param,
            "training.peak_tflops" if t.peak_tflops > 0 else "measured, python -m fusedrl.bench.peak",
            "kept for reuse (training.reuse_host_memory)" if self.host_memory_reused else "returned to the system",
        )
        log.info("trained parameters: %s", trained_parameters(cfg))
        try:
            history = self._iterate()
        finally:  # the environments' worker threads end with the run, also when it fails
            for episodes in (self.episodes, self.evaluator.episodes if self.evaluator is not None else None):
                if episodes is not None:
                    episodes.close()
        if cfg.checkpoint.export_hf:
            with self.progress("export of the Actor", 1, "exported") as progress:
                self.export()
                progress.update(1)
        self.metrics.close()
        return history

    def _iterate(self) -> list[dict[str, float]]:
        """The evaluation at the start (a fresh run's) and the iterations up to ``training.steps``; their metrics."""
        cfg, history = self.cfg, []
        if self.evaluator is not None and cfg.eval.at_start and self.step == 0:  # a fresh run's starting Actor
            start = time.perf_counter()
            figures = self.evaluate(0)
            self.metrics.log(0, figures | {"time_eval": time.perf_counter() - start})
        while self.step < cfg.training.steps:
            self.step += 1
            record = self.train_step(self.step)
            history.append(record)
            start = time.perf_counter()
            self.metrics.log(self.step, record)
            if self.ckpt.should_save(self.step):
                with self.progress(f"step {self.step} checkpoint", 1, "saved") as progress:
                    self.ckpt.save(self.step)
                    progress.update(1)
            self.outside_s = time.perf_counter() - start
        return history

    def progress(self, desc: str, total: int, unit: str) -> Progress:
        """A phase's progress, shown on rank 0 when ``metrics.progress`` is on."""
        return Progress(desc, total, unit, enabled=self.rank == 0 and self.cfg.metrics.progress)

    def evaluate(self, step: int) -> dict[str, float]:
        """``[eval]``'s figures of the Actor's current weights, which the engine takes first (collective)."""
        assert self.evaluator is not None
        self.syncs[0].sync()
        with self.progress(f"step {step} evaluation (rank 0's engine)", self.evaluator.requests, "req") as progress:
            return self.evaluator.run(progress)

    def skipped_update(self, step: int) -> UpdateResult:
        """The update of an iteration without a token to train on: nothing steps, the skip is counted."""
        if self.rank == 0:
            log.warning(
                'step %d: every response was truncated (generation.max_new_tokens, or env limits) and ppo.truncated = "mask": '
                "no update",
                step,
            )
        return UpdateResult({}, {}, 0, {"skipped_updates": self.updates_per_step, **self.opt.learning_rates()}, None, 0)

    def rollout_round(self, step: int, timers: PhaseTimers) -> tuple[RolloutResult[Experience], Experience]:
        """Generate and score the next prompt batch (``generation.n`` samples each; collective); adds its phase times.
        With ``[rollout] over_provision`` the rollout follows :class:`PartialRollouts`' plan (carried requests resumed,
        a stop at the batch's worth of whole groups, or a long round of deferred prompts) and returns the batch it
        selects."""
        rows: list[dict] = []
        if self.partial is None:
            batch = self.loader.next_batch()
            plan = RolloutPlan(build_requests(self.cfg, batch, step, self.stop_ids), [], None)
            rows = [self.dataset.rows[i] for i in batch.dataset_indices for _ in range(self.cfg.generation.n)]
        else:
            plan = self.partial.plan(step)
        count = len(plan.requests) + len(plan.resume)
        with self.progress(f"step {step} rollout (rank 0's engine)", count, "req") as progress:
            result, scored = generate_and_score(
                self.controller,
                plan.requests,
                self.tokenizer.pad_id,
                progress,
                resume=plan.resume,
                target=plan.target,
                rows=rows,
            )
        if self.partial is not None:
            scored = self.partial.collect(step, result, scored)
        timers.add("generation", result.decode_end_s)
        timers.add("scoring", result.scoring_s)
        timers.add("scoring_exposed", result.scoring_exposed_s)
        return result, scored

    def dynamic_sampling(self, step: int, first: Experience, timers: PhaseTimers) -> tuple[Experience, dict[str, float]]:
        """DAPO's dynamic sampling: keep the groups whose scores differ, generating more prompt batches until
        ``ppo.batch_size`` samples are kept or ``ppo.dynamic_sampling_max_rounds`` rounds ran; then the dropped
        groups (in their order) fill the rest, counted. Every rank holds the same batches and takes the same
        decisions. Returns the batch to train on and the counts."""
        cfg = self.cfg
        n, size = cfg.generation.n, cfg.ppo.batch_size
        kept: list[Experience] = []
        dropped: list[Experience] = []
        rounds, batch = 1, first
        while True:
            assert batch.scores is not None  # Scorer.score sets scores on every scored batch
            flat = zero_variance_groups(batch.scores, sample_groups(batch, n))
            kept.append(batch.select(~flat))
            dropped.append(batch.select(flat))
            if sum(b.batch_size for b in kept) >= size or rounds == cfg.ppo.dynamic_sampling_max_rounds:
                break
            rounds += 1
            _, batch = self.rollout_round(step, timers)
        dropped_groups = sum(b.batch_size for b in dropped) // n
        missing = max(0, size - sum(b.batch_size for b in kept))
        if missing and self.rank == 0:
            log.warning(
                "step %d: dynamic sampling kept %d of %d samples after %d rounds (ppo.dynamic_sampling_max_rounds); "
                "%d groups of equal scores fill the batch",
                step,
                size - missing,
                size,
                rounds,
                missing // n,
            )
        parts = [b for b in (*kept, *dropped) if b.batch_size]
        merged = Experience.concat(parts, pad_token_id=self.tokenizer.pad_id).select(slice(0, size))
        stats: dict[str, float] = {
            "dynamic_sampling_rounds": rounds,
            "dynamic_sampling_dropped_groups": dropped_groups,
            "dynamic_sampling_filled_groups": missing // n,
        }
        return merged, stats

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
        step_start, compile_start = time.perf_counter(), compile_seconds()
        with timers("weight_sync"):
            for sync in self.syncs:
                sync.sync()
            if self.frozen is not None:
                self.frozen.restore()
        rollout_start = time.perf_counter()
        result, scored = self.rollout_round(step, timers)
        sampling_stats: dict[str, float] = {}
        trained = scored
        if cfg.ppo.dynamic_sampling:
            trained, sampling_stats = self.dynamic_sampling(step, scored, timers)
        if self.frozen is not None:
            self.frozen.release()
        trained_lengths, response_tokens = sequence_lengths(trained.response_mask), int(trained.response_mask.sum())
        old_logprobs = None
        if self.reference_from_base:  # with the old log-probs' recompute in the same pipeline pass (no time_recompute)
            with timers("reference"):
                trained.ref_logprobs, old_logprobs = base_reference_logprobs(
                    cfg, self.layout, trained, self.device, self.max_len, self.tokenizer.pad_id, with_old=self.recompute
                )
        with timers("advantages"):
            exp, adv_stats = compute_advantages(cfg, trained)
            exp = pad_to_bucket(exp, self.max_len, self.tokenizer.pad_id)
        gap = None
        if self.recompute:  # PPO's old log-probs from the training forward; the KL reward keeps the engine's
            if old_logprobs is None:
                with timers("recompute"):
                    old_logprobs = recompute_logprobs(cfg, self.layout, exp, self.device)
            exp.engine_logprobs, exp.logprobs = exp.logprobs, old_logprobs * exp.response_mask  # the mask advantages left
            assert exp.engine_logprobs is not None  # the scored batch's
            gap = logprob_gap(exp.engine_logprobs, exp.logprobs, exp.response_mask)
        if exp.response_mask.any():
            with timers("training"), self.progress(f"step {step} update", self.updates_per_step, "minibatch") as progress:
                update = ppo_update(
                    cfg, self.layout, self.executor, self.opt, exp, step, record=self.records_timeline(step), progress=progress
                )
        else:  # every response was truncated and ppo.truncated = "mask": no token to learn from
            update = self.skipped_update(step)
        timers.add("step", time.perf_counter() - step_start)
        timers.add("outside", self.outside_s)
        timers.add("compile", compile_seconds() - compile_start)

        # Per-sample figures are of the whole batch (every rank holds it); phase times are the slowest rank's.
        record = reduce_iteration(
            update.stat_sums,
            timers.pop(),
            memory_figures(self.device),
            divisor=self.layout.dp * self.layout.tp * max(1, update.updates),
            device=self.device,
            first=update.first,
            first_divisor=self.layout.dp * self.layout.tp,
        )
        if gap is None and "logprob_diff_first" in record:  # without recompute: the first minibatch's forward
            gap = {
                "logprob_diff_mean": record["logprob_diff_first"],
                "logprob_diff_max": record["logprob_diff_max_first"],
                "importance_ratio_mean": record.get("importance_ratio_first", record["ratio_mean_first"]),
            }
        record.update(gap or {})
        lengths = scored.response_mask.sum(1)
        record["samples_per_s"] = cfg.ppo.batch_size / record["time_step"]
        record["tokens_per_s"] = lengths.sum().item() / record["time_step"]
        record.update(length_stats(lengths))
        record["samples_digest"] = samples_digest(scored)
        record.update(
            compute_figures(
                cfg,
                trained_lengths,
                response_tokens,
                update.positions or exp.batch_size * exp.seq_len,
                record,
                self.peak_flops,
                self.world,
            )
        )
        record.update(adv_stats)
        record.update(sampling_stats)
        record.update(update.figures)
        record.update(migration_metrics(result))
        record["rollout_tail_s"] = result.tail_s
        if self.engine.speculator is not None:  # every instance's speculative decoding
            spec: list[Any] = [None] * self.world
            dist.all_gather_object(spec, self.engine.speculator.take_figures())
            record.update(speculation_metrics(spec[:: self.rollout.gen_tp]))  # an instance's ranks decode alike
        if self.episodes is not None:  # every instance's episodes (one rank each: no tensor-parallel instances)
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, (self.episodes.take_figures(), result.env_idle_s))
            record.update(episode_metrics([p for p, _ in parts], sum(idle for _, idle in parts)))
        if self.partial is not None:
            record.update(self.partial.figures())
        check = cfg.training.logprob_gap_check
        if gap is not None and check != "off" and not record.get("rollout_stale_tokens_frac"):  # carried: off-policy
            check_logprob_gap(gap["logprob_diff_mean"], self.logprob_gap_limit, stop=check == "stop", where=f"step {step}")
        record.update(reward_fn_metrics(scored))
        eval_start = time.perf_counter()
        hook = self.task.evaluate if self.task is not None else None
        held_out = self.evaluator is not None and self.evaluator.due(step)
        if hook is not None:
            record.update(hook(scored, self.tokenizer))
        if held_out:  # after the update: the weights it made
            record.update(self.evaluate(step))
        if hook is not None or held_out:
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
        if timeline is not None:
            timeline.to_chrome_trace(merged, t0=t0 / 1e6, pid="training (last minibatch)")
        path = merged.save(self.out / "traces" / f"step_{step:06d}.json")
        log.info("trace of step %d written to %s", step, path)

    def export(self) -> Path | None:
        """Write the Actor as an HF-format safetensors folder ``<output_dir>/actor_hf``, or with ``lora.export =
        "adapter"`` its LoRA adapters as a PEFT folder ``<output_dir>/actor_lora`` (collective; rank 0 writes)."""
        cfg = self.cfg
        lora = lora_spec(cfg, "actor")
        adapter = lora is not None and cfg.lora.export == "adapter"
        path = export_hf(
            self.layout.actor_stage,
            self.out / ("actor_lora" if adapter else "actor_hf"),
            model_flavor(cfg, "actor"),
            "policy",
            self.layout.pp_group,
            tokenizer=self.tokenizer,
            lora=lora,
            adapter_of=str(cfg.model.actor_path or "") if adapter else None,
        )
        if path is None:
            return None
        log.info("Actor %s to %s", "adapters exported" if adapter else "exported", path)
        return path


def use_device(cfg: JobConfig) -> None:
    """Bind this rank to its device (CUDA) or its share of the host's cores (CPU)."""
    device = select_device(cfg.training.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // dist.get_world_size())))
    else:
        torch.cuda.set_device(device)
