"""The PPO update of one iteration: the optimizers, the iteration's minibatches, one update per minibatch on any
training layout (sharding, loss denominators, the tied embedding's gradient sum, clipping, the non-finite skip), epochs x
minibatches, and the recomputed old log-probs with their gap to the engine's."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from fusedrl.buckets import evenly_spaced, round_up
from fusedrl.components import Progress, build_lr_scheduler, build_optimizer, clip_grad_norm, grad_norm
from fusedrl.config import JobConfig
from fusedrl.layouts import DTYPES, TrainingLayout, model_flavor
from fusedrl.models import switch_adapters
from fusedrl.pipelining import LocalSchedule, Timeline, pipeline_forward
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.losses import chunked_token_logprobs
from fusedrl.rlhf.packing import PackedRows, pack_rows, sequence_lengths
from fusedrl.rlhf.program import TrainingExecutor, old_logprobs_from_forward

log = logging.getLogger("fusedrl.rlhf.update")


POLICY_STATS = ("policy_loss", "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "entropy")


FIRST_MINIBATCH_STATS = ("approx_kl", "clip_frac", "ratio_mean", "logprob_diff", "logprob_diff_max")
"""Policy stats of each iteration's first minibatch, before any update: the gap between the old log-probs (the
engine's, or the recomputed ones) and the training forward's (``<name>_first`` in the metrics)."""


VALUE_STATS = ("value_loss", "value_clip_frac", "value_mean")


def first_minibatch_stats(cfg: JobConfig) -> tuple[str, ...]:
    """:data:`FIRST_MINIBATCH_STATS`, and ``importance_ratio`` (pi_train / pi_engine) when the old log-probs are the
    training forward's own (:func:`~fusedrl.rlhf.program.old_logprobs_from_forward`)."""
    return (*FIRST_MINIBATCH_STATS, *(("importance_ratio",) if old_logprobs_from_forward(cfg) else ()))


def pad_to_bucket(exp: Experience, max_len: int, pad_id: int) -> Experience:
    """Right-pad the batch to one of a few lengths so the executor builds few stage shapes."""
    return exp.pad_to(round_up(exp.seq_len, evenly_spaced(max_len)), pad_id)


@dataclass
class Optimizers:
    actor: torch.optim.Optimizer
    critic: torch.optim.Optimizer | None  # None without a Critic (a critic-free advantage estimator)
    actor_lr: LRScheduler
    critic_lr: LRScheduler | None

    def pairs(self) -> list[tuple[torch.optim.Optimizer, LRScheduler]]:
        """(optimizer, LR schedule) of each trained model: the Actor's, then the Critic's when there is one."""
        out = [(self.actor, self.actor_lr)]
        if self.critic is not None and self.critic_lr is not None:
            out.append((self.critic, self.critic_lr))
        return out

    def learning_rates(self) -> dict[str, float]:
        lr = {"lr_actor": float(self.actor_lr.get_last_lr()[0])}
        if self.critic_lr is not None:
            lr["lr_critic"] = float(self.critic_lr.get_last_lr()[0])
        return lr


def build_optimizers(cfg: JobConfig, layout: TrainingLayout, updates_per_step: int) -> Optimizers:
    """AdamW for the training stages (float32 state on the FSDP2 shards) and their LR schedules."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    total = cfg.training.steps * updates_per_step

    def schedule(opt: torch.optim.Optimizer) -> LRScheduler:
        return build_lr_scheduler(opt, s.warmup_steps * updates_per_step, total, s.decay, s.min_ratio)

    actor = build_optimizer(layout.actor_stage, o.actor_lr, o.weight_decay)
    if layout.critic_stage is None:
        return Optimizers(actor, None, schedule(actor), None)
    critic = build_optimizer(layout.critic_stage, o.critic_lr, o.weight_decay)
    return Optimizers(actor, critic, schedule(actor), schedule(critic))


def loss_weights(mask: torch.Tensor, mode: str, max_new_tokens: int) -> torch.Tensor:
    """Per-token weights ``[B, S]`` whose weighted sum of per-token losses is ``ppo.loss_agg_mode``'s loss of the whole
    batch ``mask`` covers: ``token-mean`` 1 / (its response tokens); ``seq-mean-token-mean`` 1 / (the sequence's
    tokens x the sequences); ``seq-mean-token-sum-norm`` 1 / (max_new_tokens x the sequences). Sequences without a
    response token (masked) count for none. Computed over a whole minibatch, the loss is the same however it is
    split into micro-batches and ranks."""
    mask = mask.to(torch.float32)
    lengths = mask.sum(1, keepdim=True)
    sequences = (lengths > 0).sum().clamp_min(1)
    if mode == "token-mean":
        return mask / lengths.sum().clamp_min(1)
    if mode == "seq-mean-token-mean":
        return mask / lengths.clamp_min(1) / sequences
    if mode == "seq-mean-token-sum-norm":
        return mask / (max_new_tokens * sequences)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm")


def _forward_backward(
    cfg: JobConfig, layout: TrainingLayout, executor: TrainingExecutor, mb: Experience, *, record: bool = False
) -> tuple[dict[str, torch.Tensor], int]:
    """Forward/backward of one global minibatch for the trained models through the layout's executor.

    Returns this rank's last-stage stats as 0-dim device tensors (zeros on ranks without a last stage), and the token
    positions the forward computed over all data-parallel shards (padding included; packed rows with
    ``ppo.microbatch_tokens``). The policy loss
    weighs each token by :func:`loss_weights` of the whole minibatch and the value loss divides by ``loss_denom``, so
    that the accumulated gradient is ``ppo.loss_agg_mode``'s loss (the value loss's token mean) of the whole minibatch.
    ``ppo.tis_cap`` > 0 weights each token's policy loss by ``min(pi_old / pi_engine, tis_cap)`` (needs
    ``mb.engine_logprobs``); ``ppo.kl_loss_coef`` > 0 passes the Reference's log-probs to the policy loss.
    """
    ppo = cfg.ppo
    rows = mb.batch_size // layout.dp
    shards = mb.split(rows)
    shard = shards[layout.dp_rank]  # the TP ranks of a data-parallel shard share its rows
    local = isinstance(executor.schedule, LocalSchedule)  # pp = 1: a packed minibatch sets its own micro-batch count
    count = None if local else executor.microbatches
    packings = packed_shards(shards, cfg.packing_tokens, count) if cfg.packing_tokens else None
    packed = packings[layout.dp_rank] if packings is not None else None
    positions = sum(p.positions for p in packings) if packings is not None else mb.batch_size * mb.seq_len
    microbatches = len(packed.rows) if packed is not None else executor.microbatches
    # The executor divides gradients by the micro-batch count and FSDP2 averages over dp_shard.
    scale = microbatches * layout.dp
    weights = loss_weights(mb.response_mask, ppo.loss_agg_mode, cfg.response_budget) * scale
    denom = (mb.response_mask.sum() / scale).expand(microbatches if packed is not None else shard.batch_size).contiguous()
    actor_targets = {
        **shard.targets("tokens", "response_mask", "logprobs", "advantages"),
        "loss_denom": denom,
        "loss_weight": weights[layout.dp_rank * rows : (layout.dp_rank + 1) * rows],
    }
    if ppo.kl_loss_coef > 0:
        actor_targets["ref_logprobs"] = shard.targets("ref_logprobs")["ref_logprobs"]
    if ppo.tis_cap > 0:
        assert shard.logprobs is not None and shard.engine_logprobs is not None, "tis_cap needs recomputed log-probs"
        actor_targets["tis_weight"] = (shard.logprobs - shard.engine_logprobs).exp().clamp(max=ppo.tis_cap) * shard.response_mask
    critic_targets = None
    if layout.critic_stage is not None:
        critic_targets = {**shard.targets("response_mask", "values", "returns"), "loss_denom": denom}
    if packed is None:
        critic_inputs = shard.tokens if critic_targets is not None else None
        result = executor.schedule.step(shard.tokens, critic_inputs, actor_targets, critic_targets, record=record)
    else:

        def pack(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: v if k == "loss_denom" else packed.pack(v) for k, v in targets.items()}

        tokens = packed.pack(shard.tokens)
        # a pipeline program keeps its own micro-batch count (the rows were packed to it)
        counted = {"microbatches": microbatches} if local else {}
        result = executor.schedule.step(
            tokens,
            tokens if critic_targets is not None else None,
            pack(actor_targets),
            pack(critic_targets) if critic_targets is not None else None,
            record=record,
            documents=packed.documents,
            **counted,
        )
    out: dict[str, torch.Tensor] = {}
    actor_keys = (*POLICY_STATS, *first_minibatch_stats(cfg), *(("kl_loss",) if ppo.kl_loss_coef > 0 else ()))
    for model, keys in (("actor", actor_keys), ("critic", VALUE_STATS)):
        if model not in result:
            continue
        r = result[model]
        out.update({k: r.stats[k] if r.loss is not None else torch.zeros(()) for k in keys})
    # each Critic replica's last stage reports its own micro-batches: a 1/K share of the mean
    if layout.critic_replicas > 1 and "critic" in result:
        out.update({k: out[k] / layout.critic_replicas for k in VALUE_STATS})
    return out, positions


def packed_shards(shards: list[Experience], microbatch_tokens: int, count: int | None = None) -> list[PackedRows]:
    """Each data-parallel shard's packed rows (:mod:`fusedrl.rlhf.packing`), the same row count on every shard (exactly
    ``count`` when given: a pipeline program's micro-batches)."""
    lengths = [sequence_lengths(s.response_mask) for s in shards]
    rows = pack_rows(lengths, microbatch_tokens, count)
    return [PackedRows.of(r, n, microbatch_tokens) for r, n in zip(rows, lengths)]


def _skip_update(norms: list[torch.Tensor], stats: dict[str, torch.Tensor]) -> bool:
    """Whether any rank saw a non-finite gradient norm or loss: one small all-reduce, so that every rank
    takes the same decision (the gradient norms are already global; the losses live on last stages)."""
    device = norms[0].device
    local = torch.stack([*norms, *(stats[k].to(device) for k in ("policy_loss", "value_loss") if k in stats)])
    bad = (~torch.isfinite(local)).any().to(torch.int32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


@dataclass
class MinibatchResult:
    """One update (:func:`train_minibatch`) on this rank."""

    # this rank's last-stage POLICY_STATS, FIRST_MINIBATCH_STATS and VALUE_STATS as 0-dim device tensors, zeros on ranks
    # without a last stage: a figure's minibatch mean is their sum over all ranks / (dp * tp), read once per iteration
    stats: dict[str, torch.Tensor]
    grad_norm_actor: torch.Tensor  # global norms before clipping, identical on every rank
    grad_norm_critic: torch.Tensor | None  # None without a Critic
    skipped: bool  # a non-finite loss or gradient norm: no optimizer stepped (identical on every rank)
    positions: int  # token positions computed over all data-parallel shards, padding included


def ppo_minibatches(cfg: JobConfig, exp: Experience, step: int) -> Iterator[Experience]:
    """The global minibatches of iteration ``step``'s PPO update, in the trainer's order: ``ppo.epochs`` shuffles of
    ``exp`` into ``ppo.minibatch_size`` samples, seeded by (job.seed, step, epoch), without the minibatches whose
    every response is masked (``ppo.truncated = "mask"``: nothing to learn). Every rank gets the same ones."""
    for epoch in range(cfg.ppo.epochs):
        g = torch.Generator().manual_seed(cfg.job.seed * 1_000_003 + step * 1009 + epoch)
        yield from (mb for mb in exp.minibatches(cfg.ppo.minibatch_size, generator=g) if mb.response_mask.any())


def train_minibatch(
    cfg: JobConfig,
    layout: TrainingLayout,
    executor: TrainingExecutor,
    opt: Optimizers,
    mb: Experience,
    *,
    step: int,
    record: bool = False,
) -> MinibatchResult:
    """One PPO update of both models on a global minibatch ``mb`` (every rank passes the same one), on any training
    layout: pp >= 1 (the fused executor, or :class:`~fusedrl.pipelining.LocalSchedule` at pp = 1) x dp_shard x tp,
    tied embeddings, Critic replicas. Collective over every rank of the job. In order:

    1. this rank's data-parallel shard of ``mb`` runs forward and backward through ``executor``
       (:func:`~fusedrl.rlhf.build_executor`), each loss divided so that the gradient is the token mean over the
       whole minibatch (``ppo.tis_cap``: weighted by the truncated importance ratio);
    2. a tied embedding split over pipeline stages gets the sum of its first- and last-stage gradients;
    3. each model's gradients are clipped to ``optimizer.grad_clip`` by their global norm (over pipeline stages and
       shards; the Critic's over one replica; the tied head counted once);
    4. a non-finite loss or gradient norm on any rank skips the optimizer steps on every rank (logged), or raises
       ``FloatingPointError`` under ``training.nan_policy = "stop"``;
    5. both optimizers step, gradients are zeroed, both LR schedules step (also after a skipped update).

    ``step`` is the iteration, for messages; ``record``: record the executor's timeline
    (``executor.schedule.timeline``).
    """
    stats, positions = _forward_backward(cfg, layout, executor, mb, record=record)
    layout.tied.sum_gradients()
    norms = []
    # the Critic's norm over one replica's stages (every replica holds the same averaged gradients)
    trained = [(layout.actor_stage, layout.pp_group, layout.tied.uncounted)]
    if layout.critic_stage is not None:
        trained.append((layout.critic_stage, layout.critic_group, []))
    for stage, group, uncounted in trained:
        params = list(stage.parameters())
        if cfg.optimizer.grad_clip > 0:
            norms.append(clip_grad_norm(params, cfg.optimizer.grad_clip, group, uncounted=uncounted))
        else:
            norms.append(grad_norm([p for p in params if all(p is not q for q in uncounted)], pp_group=group))
    skipped = _skip_update(norms, stats)
    if not skipped:
        for optimizer, _ in opt.pairs():
            optimizer.step()
    elif cfg.training.nan_policy == "stop":
        shown = ", ".join(f"{name} {float(norm)}" for name, norm in zip(("actor", "critic"), norms))
        raise FloatingPointError(
            f'step {step}: non-finite loss or gradient norm ({shown}); stopping (training.nan_policy = "stop")'
        )
    elif dist.get_rank() == 0:
        log.warning("step %d: skipped an update: non-finite loss or gradient norm", step)
    for optimizer, sched in opt.pairs():
        optimizer.zero_grad(set_to_none=True)
        sched.step()
    return MinibatchResult(stats, norms[0], norms[1] if len(norms) > 1 else None, skipped, positions)


@dataclass
class UpdateResult:
    """One iteration's PPO update on this rank."""

    stat_sums: dict[str, torch.Tensor]  # this rank's last-stage stats summed over the updates (reduce over ranks)
    first: dict[str, torch.Tensor]  # this rank's last-stage FIRST_MINIBATCH_STATS (reduce over ranks)
    updates: int
    figures: dict[str, float]  # identical on every rank: gradient norms, skipped updates, learning rates
    timeline: Timeline | None  # the last minibatch's pipeline timeline of all ranks, on recorded iterations
    positions: int  # token positions the training forward computed per epoch, over all data-parallel shards


def ppo_update(
    cfg: JobConfig,
    layout: TrainingLayout,
    executor: TrainingExecutor,
    opt: Optimizers,
    exp: Experience,
    step: int,
    *,
    record: bool = False,
    progress: Progress | None = None,
) -> UpdateResult:
    """PPO epochs x minibatches (:func:`ppo_minibatches`), one :func:`train_minibatch` update each.

    ``record``: record the executor's timeline of every minibatch and gather it over the pipeline group
    (the metrics then carry ``bubble_ratio``). ``progress``: one unit per minibatch updated."""
    sums: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    bubbles: list[float] = []
    timeline: Timeline | None = None
    norms: dict[str, list[torch.Tensor]] = {"actor": [], "critic": []}
    skipped, updates, positions = 0, 0, 0
    for mb in ppo_minibatches(cfg, exp, step):
        result = train_minibatch(cfg, layout, executor, opt, mb, step=step, record=record)
        if not first:
            first = {k: result.stats[k] for k in first_minibatch_stats(cfg)}
        for k in (*POLICY_STATS, *VALUE_STATS, "kl_loss"):
            if k in result.stats:
                sums[k] = sums[k] + result.stats[k] if k in sums else result.stats[k]
        if record:
            assert executor.schedule.timeline is not None  # the step above recorded it
            timeline = executor.schedule.timeline.gather(layout.pp_group)
            bubbles.append(timeline.bubble_ratio())
        norms["actor"].append(result.grad_norm_actor)
        if result.grad_norm_critic is not None:
            norms["critic"].append(result.grad_norm_critic)
        skipped += result.skipped
        positions += result.positions
        updates += 1
        if progress is not None:
            progress.update(1)
    figures: dict[str, float] = {f"grad_norm_{m}": float(torch.stack(v).mean()) for m, v in norms.items() if v}
    figures.update({"skipped_updates": skipped, **opt.learning_rates()})
    if bubbles:
        figures["bubble_ratio"] = sum(bubbles) / len(bubbles)
    return UpdateResult(sums, first, updates, figures, timeline, positions // cfg.ppo.epochs)


def recompute_logprobs(cfg: JobConfig, layout: TrainingLayout, exp: Experience, device: torch.device) -> torch.Tensor:
    """The old Actor log-probs of every sample of ``exp`` (``[B, S]`` on the CPU, 0 outside the response mask) by a
    forward-only pass of the Actor's training stages (pipeline x FSDP2 x TP), at the sampling temperature: each
    data-parallel shard runs its rows in micro-batches through the pipeline, the last stage applies the LM head in
    chunks, the pipeline group receives its rows and the data-parallel shards exchange theirs (collective)."""
    return _training_logprobs(cfg, layout, exp, device, (True,))[0]


def base_reference_logprobs(
    cfg: JobConfig, layout: TrainingLayout, exp: Experience, device: torch.device, max_len: int, pad_id: int, *, with_old: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Reference log-probs of ``exp``'s samples when the Reference is the LoRA Actor's frozen base
    (``lora.reference = "base"``): :func:`recompute_logprobs` with every adapter off, over the samples padded to
    their length bucket (the training forward's shapes); ``[B, S]`` on the CPU (collective). ``with_old``: the same
    pipeline pass also runs the micro-batches with the adapters on and returns those old log-probs, over the padded
    batch (what :func:`recompute_logprobs` gives for it: one pass instead of two), else None."""
    padded = pad_to_bucket(exp, max_len, pad_id)
    reference, *old = _training_logprobs(cfg, layout, padded, device, (False, True) if with_old else (False,))
    return reference[:, : exp.seq_len], old[0] if old else None


def _training_logprobs(
    cfg: JobConfig, layout: TrainingLayout, exp: Experience, device: torch.device, adapters: Sequence[bool]
) -> list[torch.Tensor]:
    """:func:`recompute_logprobs` once per entry of ``adapters`` (the LoRA adapters on or off; a stage without adapters
    computes the same either way), all in one pipeline pass: its micro-batches run once per entry, in that order."""
    rows = exp.batch_size // layout.dp
    shard = exp.select(slice(layout.dp_rank * rows, (layout.dp_rank + 1) * rows))
    inputs = list(shard.tokens.split(cfg.ppo.microbatch_size))
    masks = list(shard.response_mask.split(cfg.ppo.microbatch_size))
    count = len(inputs)
    head = cast("torch.nn.Linear | None", layout.actor_stage.output)  # the LM head, on the last stage

    def logprobs(hidden: torch.Tensor, i: int) -> torch.Tensor:
        assert head is not None  # called on the last stage only
        tokens, mask = inputs[i % count].to(device), masks[i % count].to(device)  # the head runs on response tokens only
        return chunked_token_logprobs(hidden.to(head.weight.dtype), head, tokens, cfg.generation.temperature, mask=mask)

    ranks = [dist.get_global_rank(layout.pp_group, r) for r in range(layout.pp)]
    switching = not all(adapters)  # the plain recompute walks no modules per micro-batch
    try:
        outs = pipeline_forward(
            layout.actor_stage,
            inputs * len(adapters),
            ranks,
            layout.pp_rank,
            hidden_dim=model_flavor(cfg, "actor").embed_dim,
            activation_dtype=DTYPES[cfg.training.mixed_precision_param],
            device=device,
            last=logprobs,
            group=layout.pp_group,
            before=(lambda i: switch_adapters(layout.actor_stage, adapters[i // count])) if switching else None,
        )
    finally:
        if switching:
            switch_adapters(layout.actor_stage, True)
    results = []
    for k in range(len(adapters)):
        local = (
            torch.cat(outs[k * count : (k + 1) * count]) if outs is not None else torch.empty(rows, exp.seq_len, device=device)
        )
        dist.broadcast(local, src=ranks[-1], group=layout.pp_group)
        parts = [torch.empty_like(local) for _ in range(layout.dp)]
        dist.all_gather(parts, local, group=layout.mesh["dp_shard"].get_group())
        results.append(torch.cat(parts).cpu() * exp.response_mask)
    return results


def logprob_gap(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the training forward's, over the response
    tokens (``mask``): mean and largest absolute difference, and the mean, smallest and largest importance ratio
    ``pi_train / pi_engine`` (what ``ppo.tis_cap`` truncates). No response token: zeros and ratios of 1."""
    diff = (trainer - engine)[mask.bool()]
    if diff.numel() == 0:
        diff = torch.zeros(1, dtype=trainer.dtype, device=trainer.device)
    ratio = diff.exp()
    return {
        "logprob_diff_mean": float(diff.abs().mean()),
        "logprob_diff_max": float(diff.abs().max()),
        "importance_ratio_mean": float(ratio.mean()),
        "importance_ratio_min": float(ratio.min()),
        "importance_ratio_max": float(ratio.max()),
    }


class LogprobGapError(RuntimeError):
    """The engine's log-probs are too far from the training forward's (``training.logprob_gap_check = "stop"``)."""


def logprob_gap_limit(dtypes: Sequence[torch.dtype], quantized: bool = False) -> float:
    """A mean absolute engine-vs-training log-prob gap that rounding in ``dtypes`` (the engine's weights and KV cache,
    training's compute) stays far below: 1e-3 when all are float32 (measured ~1e-6), else 0.5 (bf16 SmolLM2-135M
    ~0.05, an int8 engine against bf16 training ~4e-3; docs/ppo.md). Stale rollout weights give gaps of order 1."""
    exact = not quantized and all(d in (torch.float32, torch.float64) for d in dtypes)
    return 1e-3 if exact else 0.5


def check_logprob_gap(mean_gap: float, limit: float, *, stop: bool = False, where: str = "") -> bool:
    """Whether the engine-vs-training gap ``mean_gap`` (``logprob_gap``'s ``logprob_diff_mean``, or the first
    minibatch's ``logprob_diff`` before any update) is within ``limit`` (:func:`logprob_gap_limit`); if not, a one-line
    warning naming stale rollout weights as the likely cause, or :class:`LogprobGapError` with ``stop``. Only samples
    drawn with the weights being trained compare: carried (partial-rollout) samples differ by design."""
    if mean_gap <= limit:
        return True
    message = (
        f"{where}{': ' if where else ''}the engine's log-probs differ from the training forward's by {mean_gap:.3g} on "
        f"average (limit {limit:g}): the engine most likely sampled from stale weights. An engine sharing the trained "
        "model: call engine.weights_updated() after writes through .data or kernels of your own; an engine over a copy: "
        "WeightSync.sync() before each rollout (training.logprob_gap_check / logprob_gap_limit set this check)"
    )
    if stop:
        raise LogprobGapError(message)
    log.warning(message)
    return False
