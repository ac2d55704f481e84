"""The memory estimate of a job: per built rank its persistent state, the transients of each phase and what is
live at each phase's peak (:func:`estimate`; ``docs/memory.md`` derives every term and tells how to read it)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from fusedrl.buckets import evenly_spaced
from fusedrl.config import JobConfig
from fusedrl.distributed import check_dims, plan_from_boxes
from fusedrl.layouts import model_flavor
from fusedrl.memory.formulas import (
    CHUNKED_HEAD_MULTIPLE,
    EXPERIENCE_BYTES_PER_TOKEN,
    LOGITS_TRANSIENT_MULTIPLE,
    OFFLOADED,
    PHASES,
    ROLLOUT_MODELS,
    actor_logits_bytes,
    decode_step_bytes,
    itemsize,
    prefill_bytes,
    training_seq_len,
    worst_scoring_bytes,
)
from fusedrl.memory.meta import RankBuild, all_rank_boxes, build_rank, distinct_ranks, grad_numel, rank_coords, sync_transients
from fusedrl.models import reference_from_base, trained_parameters
from fusedrl.models.figures import layer_activation_bytes, stage_activation_bytes
from fusedrl.pipelining import ACTOR, STAGE_CACHE_SIZE, LoweredProgram
from fusedrl.rlhf import plan_program
from fusedrl.rlhf.losses import logits_chunk_positions


def training_walk(
    program: LoweredProgram,
    pp_rank: int,
    per_mb: dict[str, int],
    logits_mb: int,
    params: dict[str, int],
    grads: dict[str, int],
    loss_transient: int,
    recompute: dict[str, int],
    first_unit_grads: dict[str, int],
    gather_unit: dict[str, int],
) -> tuple[dict[str, int], dict[str, int], int]:
    """Walk ``pp_rank``'s lowered program and find its largest training-step moment.

    The models are the keys of ``per_mb`` (the Actor alone with a critic-free estimator). A model's micro-batch holds
    ``per_mb`` bytes (+ ``logits_mb`` for the Actor) from its F to its B (W when the backward is split); the model's
    unsharded parameters (``params``) exist from its first F, its unsharded gradients (``grads``) from its first
    backward; ``loss_transient`` joins during the Actor's F and B on the rank holding its last stage; ``recompute`` (per
    model: one layer's activations rebuilt by activation checkpointing, 0 without it) joins during the model's B and I
    (the larger of the two when both apply: the loss's backward ends first). A backward is charged at its start (the
    micro-batch still held, the model's gradients as they were) or at its end (released, gradients present), whichever
    is larger; the model's first backward that computes weight gradients (B, or W when split) is charged at its start
    with ``first_unit_grads`` more (autograd writes the gradients of the stage's last FSDP2 unit before it frees that
    unit's saved activations); a model's first F with ``gather_unit`` more (FSDP2's all-gather output for its largest
    unit, copied into the unsharded parameters and freed). Returns (per model the most micro-batches held at once, the categories live at the
    largest moment, the largest activations + logits alone)."""
    count = dict.fromkeys(per_mb, 0)
    most = dict(count)
    gathered: set[str] = set()
    graded: set[str] = set()
    split = {m: any(a.kind == "W" for a in program.programs[pp_rank] if a.model == m) for m in count}
    best: dict[str, int] = {}
    held = 0

    def moment(transient: int, rebuilt: int, first: int = 0, gathering: int = 0) -> dict[str, int]:
        return {
            "all_gather": gathering,
            "unsharded_params": sum(params[x] for x in gathered),
            "unsharded_grads": sum(grads[x] for x in graded) + first,
            "activations": sum(count[x] * per_mb[x] for x in count),
            "actor_logits": count[ACTOR] * logits_mb,
            "logits_transient": transient,
            "recompute": rebuilt,
        }

    for a in program.programs[pp_rank]:
        if a.kind not in ("F", "B", "I", "W"):
            continue
        m = a.model
        transient = loss_transient if m == ACTOR and a.kind in ("F", "B", "I") else 0
        rebuilt = recompute[m] if a.kind in ("B", "I") else 0
        if transient and rebuilt:  # the loss's backward ends before the layers' recomputation starts
            transient, rebuilt = (transient, 0) if transient >= rebuilt else (0, rebuilt)
        gathering = gather_unit[m] if a.kind == "F" and m not in gathered else 0
        if a.kind == "F":
            gathered.add(m)
            count[m] += 1
            most[m] = max(most[m], count[m])
        writes_grads = a.kind == ("W" if split[m] else "B")
        candidates = [moment(transient, rebuilt, first_unit_grads[m] if writes_grads and m not in graded else 0, gathering)]
        held = max(held, candidates[0]["activations"] + candidates[0]["actor_logits"])
        if a.kind in ("B", "W"):
            graded.add(m)
            if a.kind == ("W" if split[m] else "B"):
                count[m] -= 1
            candidates.append(moment(0, 0))
        best = max([best, *candidates], key=lambda d: sum(d.values()))
    return most, best, held


@dataclass
class RankEstimate:
    """One rank's figures in bytes: persistent state, transients, and what is live at each phase's peak."""

    rank: int
    coords: dict[str, int]
    persistent: dict[str, int]
    transients: dict[str, int]
    phases: dict[str, dict[str, int]]
    details: dict[str, Any] = field(default_factory=dict)

    def phase_peak(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def host_total(self) -> int:
        """Bytes this rank keeps in host memory between rollouts (``training.offload_frozen``)."""
        return sum(self.details["host"].values())

    @property
    def persistent_total(self) -> int:
        return sum(self.persistent.values())

    @property
    def peak(self) -> tuple[int, str]:
        return max((self.phase_peak(p), p) for p in PHASES)


@dataclass
class Estimate:
    config: str
    world: int
    ranks: list[RankEstimate]
    notes: list[str]

    def max_over_ranks(self, phase: str, category: str) -> tuple[int, int]:
        """(bytes, rank) of the rank with the most of ``category`` at ``phase``'s peak."""
        return max(((r.phases[phase].get(category, 0), r.rank) for r in self.ranks), key=lambda x: (x[0], -x[1]))


def estimate_rank(
    cfg: JobConfig,
    build: RankBuild,
    program: LoweredProgram,
    sync: dict[str, int],
    pipeline_seqs: Sequence[int],
    seq_len: int | None = None,
) -> RankEstimate:
    """The figures of one built rank (``docs/memory.md``); ``seq_len``: the training micro-batch length (default
    :func:`training_seq_len`)."""
    t, par, gen = cfg.training, cfg.parallelism, cfg.generation
    c, r, frozen, kv = (
        itemsize(t.mixed_precision_param),
        itemsize(t.rollout_dtype),
        itemsize(t.frozen_dtype),
        itemsize(t.kv_cache_dtype),
    )
    accum = 4 if t.mixed_precision_reduce != t.mixed_precision_param else c
    # packed micro-batches (ppo.microbatch_tokens): one row of at most that many tokens each
    rows, seq = (1, cfg.packing_tokens) if cfg.packing_tokens else (cfg.ppo.microbatch_size, seq_len or training_seq_len(cfg))
    flavors = {m: model_flavor(cfg, m) for m in build.stages}  # ACTOR / CRITIC name their [model] keys
    actor = flavors[ACTOR]
    n_mb = program.microbatches[ACTOR]

    persistent: dict[str, int] = {}
    for m, st in build.stages.items():
        persistent[f"train_params_{m}"] = sum(x.local_bytes for x in st.tensors)
    for m, st in build.stages.items():
        persistent[f"optimizer_{m}"] = 2 * sum(4 * x.local_numel for x in st.tensors if x.trainable)
    for name in ROLLOUT_MODELS:  # 0: a copy the job does not build (Critic, Reference or Reward model)
        persistent[f"rollout_{name}"] = sum(x.local_bytes for x in build.rollout.get(name, ()))
    longest = cfg.sequence_budget
    positions = longest + 1  # the engine's cache keeps one spare position
    persistent["kv_cache"] = actor.num_layers * 2 * gen.max_slots * positions * build.kv_heads * actor.head_dim * kv
    persistent["rope_buffers"] = sum(st.rope for st in build.stages.values()) + sum(build.rollout_rope.values())
    pipe = 0
    for m, st in build.stages.items():
        kinds = (not st.first) + (not st.last)
        pipe += sum(kinds * program.microbatches[m] * rows * s * flavors[m].embed_dim * c for s in pipeline_seqs)
    persistent["pipeline_buffers"] = pipe

    ac = t.activation_checkpointing == "full"
    per_mb = {
        m: stage_activation_bytes(
            flavors[m],
            st.layers,
            first=st.first,
            last=st.last,
            role="policy" if m == ACTOR else "value",
            tokens=rows * seq,
            itemsize=c,
            tp=par.tp,
            head_in_loss=st.head_in_loss,
            recompute=ac,
        )
        for m, st in build.stages.items()
    }
    recompute = {
        m: layer_activation_bytes(flavors[m], rows * seq, c, par.tp) if ac and st.layers else 0 for m, st in build.stages.items()
    }
    actor_stage = build.stages[ACTOR]
    chunked = actor_stage.last and actor_stage.head_in_loss
    logits_mb = actor_logits_bytes(actor, rows, seq) if actor_stage.last and not chunked else 0
    # the loss's head runs on response tokens only: at most max_new_tokens of each row
    scored = min(seq - 1, cfg.response_budget)
    chunk = rows * min(logits_chunk_positions(rows, actor.vocab_size), scored) * actor.vocab_size * 4
    stage_params = {m: c * sum(x.unsharded_numel() for x in st.tensors) for m, st in build.stages.items()}
    stage_grads = {m: accum * sum(grad_numel(x) for x in st.tensors if x.trainable) for m, st in build.stages.items()}
    loss_transient = (
        CHUNKED_HEAD_MULTIPLE * chunk
        if chunked
        else LOGITS_TRANSIENT_MULTIPLE * 4 * rows * (seq - 1) * actor.vocab_size
        if actor_stage.last
        else 0
    )
    groups: dict[str, int] = {}  # FSDP2 units' gradients: one unit per transformer layer, the root holds the rest
    unit_params: dict[str, int] = {}  # and their all-gathered parameters
    for st in build.stages.values():
        for x in st.tensors:
            key = f"{st.model}.{'.'.join(x.name.split('.')[:2]) if x.name.startswith('layers.') else 'root'}"
            unit_params[key] = unit_params.get(key, 0) + c * x.unsharded_numel()
            if x.trainable:  # a LoRA base weight has no gradient
                groups[key] = groups.get(key, 0) + accum * x.unsharded_numel()
    # the unit whose gradients a first backward writes before freeing anything: the stage's last layer (its root
    # alone when it has no layer)
    layer_units = {m: [k for k in groups if k.startswith(f"{m}.layers.")] for m in build.stages}
    first_unit_grads = {
        m: groups[max(layer_units[m], key=lambda k: int(k.split(".")[2]))] if layer_units[m] else stage_grads[m]
        for m in build.stages
    }
    gather_unit = {m: max(v for k, v in unit_params.items() if k.startswith(f"{m}.")) for m in build.stages}
    most, compute, held = training_walk(
        program,
        build.coords["pp"],
        per_mb,
        logits_mb,
        stage_params,
        stage_grads,
        loss_transient,
        recompute,
        first_unit_grads,
        gather_unit,
    )
    transients = {
        "weight_sync_buffers": sync["total"],
        "unsharded_params": sum(stage_params.values()),
        "unsharded_grads": sum(stage_grads.values()),
        "activations": compute["activations"],
        "actor_logits": compute["actor_logits"],
        "logits_transient": loss_transient,
        "recompute": compute["recompute"],
        "reduce_scatter": max(groups.values()),
        "experience": 2 * cfg.ppo.batch_size * seq * EXPERIENCE_BYTES_PER_TOKEN,
        "optimizer_step": sum(4 * x.local_numel for st in build.stages.values() for x in st.tensors if x.trainable),
    }
    g = par.gen_tp
    # migrated requests re-prefill their prompt and generated tokens in "reprefill" mode
    reprefill = cfg.fusion.inter_stage and cfg.fusion.migration_mode == "reprefill"
    width = longest - 1 if reprefill else cfg.data.max_prompt_len
    transients["prefill_activations"] = prefill_bytes(actor, gen.max_slots, width, r, g)
    transients["decode_step"] = decode_step_bytes(actor, gen.max_slots, r, g)
    # multi-turn: a request waiting for its environment keeps its KV off the slots, and every request of an instance
    # may wait at once; a fused rollout scores while they wait (the controller's gaps)
    instances = par.pp * par.dp_shard * par.tp // g
    parked = -(-cfg.ppo.batch_size // instances) if cfg.env.env else 0
    transients["parked_kv"] = actor.num_layers * 2 * parked * positions * build.kv_heads * actor.head_dim * kv
    body, head, shape = worst_scoring_bytes(cfg, max(r, frozen), g)
    transients["scoring_activations"], transients["scoring_logits"] = body, head
    gradients = {f"gradients_{m}": sum(x.local_bytes for x in st.tensors if x.trainable) for m, st in build.stages.items()}

    def pick(*names: str) -> dict[str, int]:
        return {n: transients[n] for n in names}

    def larger(a: str, b: str) -> dict[str, int]:
        return pick(a if transients[a] >= transients[b] else b)

    moments = [  # compute, gradient reduction, optimizer step
        {**compute, **pick("experience")},
        pick("unsharded_params", "unsharded_grads", "reduce_scatter", "experience"),
        {**gradients, **pick("optimizer_step", "experience")},
    ]
    # training.offload_frozen: the Reference and the Reward are on the device during the rollout only
    offloaded = {k: persistent.pop(k) for k in OFFLOADED if t.offload_frozen}
    training_moment = max(moments, key=lambda d: sum(d.values()))
    gap_parked = pick("parked_kv") if cfg.fusion.inter_stage is not False else {}
    phases = {
        "weight_sync": {**persistent, **pick("weight_sync_buffers")},
        "generation": {**persistent, **offloaded, **pick("parked_kv"), **larger("prefill_activations", "decode_step")},
        "scoring": {**persistent, **offloaded, **gap_parked, **larger("scoring_activations", "scoring_logits")},
        "training": {**persistent, **training_moment},
    }
    details = {
        "in_flight_max": most,
        "training_compute_peak": compute,
        "activation_peak": held,
        "activation_bytes_per_microbatch": per_mb,
        "actor_logits_bytes_per_microbatch": logits_mb,
        "microbatches": n_mb,
        "seq_len": seq,
        "gradients": gradients,
        "weight_sync_unit": sync,
        "scoring_microbatch": list(shape),
        "stage_layers": {m: st.layers for m, st in build.stages.items()},
        "host": offloaded,
    }
    return RankEstimate(build.rank, build.coords, persistent, transients, phases, details)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def estimate(
    cfg: JobConfig,
    world: int | None = None,
    *,
    config_name: str = "",
    ranks: Sequence[int] | None = None,
    program: LoweredProgram | None = None,
    pipeline_seqs: Sequence[int] | None = None,
    pipeline_shapes: int | None = None,
    seq_len: int | None = None,
    progress: Callable[[str], None] | None = _progress,
) -> Estimate:
    """Build the distinct ranks (or ``ranks``) of a ``world``-rank job on meta and estimate their memory.

    ``program``: the lowered training program (default: :func:`fusedrl.rlhf.plan_program`, the schedule search with
    the config's budget); ``pipeline_seqs``: the sequence buckets whose pipeline stages are cached (default: the
    longest ``STAGE_CACHE_SIZE`` of the ``pipeline_shapes`` longest buckets a run visits, every bucket by default);
    ``seq_len``: the training micro-batch length (default: the longest
    bucket)."""
    par = cfg.parallelism
    world = par.pp * par.dp_shard * par.tp if world is None else world
    check_dims(cfg, world)
    if dist.is_initialized():
        raise RuntimeError(
            "the memory estimate plays every rank under its own fake process group; call it in a "
            "process without an initialised default process group"
        )
    say = progress or (lambda _: None)
    wanted = list(ranks) if ranks is not None else distinct_ranks(cfg)
    to_build = sorted(set(wanted) | {(pp * par.dp_shard) * par.tp for pp in range(par.pp)})
    start = time.perf_counter()
    builds: dict[int, RankBuild] = {}
    for i, rank in enumerate(to_build, 1):
        c = rank_coords(cfg, rank)
        say(
            f"[memory] building rank {rank} ({i}/{len(to_build)}: pp={c['pp']} dp_shard={c['dp_shard']} tp={c['tp']}) "
            f"of {world}, {time.perf_counter() - start:.1f}s"
        )
        builds[rank] = build_rank(cfg, rank, world)
    syncs: dict[int, dict[str, Any]] = {r: {"total": 0, "unit": 0} for r in wanted}
    for model in builds[to_build[0]].stages:  # the trained models: the Actor alone with a critic-free estimator
        say(f"[memory] planning the {model} weight sync over {world} ranks, {time.perf_counter() - start:.1f}s")
        everyone = all_rank_boxes(cfg, world, builds, model)
        per_rank = sync_transients(plan_from_boxes(everyone, 0), everyone, 4, wanted)
        for rank, figures in per_rank.items():
            unit = max(figures["unit"], syncs[rank]["unit"])  # the Actor's and the Critic's syncs run in turn
            if figures["total"] > syncs[rank]["total"]:
                syncs[rank] = {**figures, "model": model}
            syncs[rank]["unit"] = unit
    if program is None:
        say(f"[memory] planning the training program (schedule search budget {cfg.fusion.schedule_search_budget_s} s)")
        program, _ = plan_program(cfg, cfg.sequence_budget)
    if pipeline_seqs is None:
        longest = cfg.sequence_budget
        visited = list(evenly_spaced(longest))[-max(1, pipeline_shapes or len(evenly_spaced(longest))) :]
        pipeline_seqs = visited[-STAGE_CACHE_SIZE:]  # what the executor keeps; the last one is training_seq_len
    results = [estimate_rank(cfg, builds[r], program, syncs[r], pipeline_seqs, seq_len) for r in wanted]
    say(f"[memory] done in {time.perf_counter() - start:.1f}s")
    notes = (
        []
        if ranks is not None
        else [
            (
                f"ranks built: {', '.join(map(str, wanted))} (every pipeline rank with its first and last dp_shard rank, TP "
                "rank 0; the other ranks of a stage differ only by uneven FSDP2 chunks, and every rank holds the same rollout "
                "shares)"
            )
        ]
    )
    ppo = cfg.ppo
    absent = [
        *([f"the Critic (ppo.advantage_estimator = {ppo.advantage_estimator!r} is critic-free)"] if ppo.critic_free else []),
        *([] if ppo.uses_reference else ["the Reference (no KL term: ppo.kl_coef = ppo.kl_loss_coef = 0)"]),
        *(
            ["a Reference copy (lora.reference = base: the LoRA Actor's stages, adapters off)"]
            if reference_from_base(cfg)
            else []
        ),
    ]
    if absent:
        notes.append(f"not built, held or counted: {'; '.join(absent)}")
    if cfg.lora.enabled:  # gradients and optimizer state of the trained parameters only
        notes.append(f"trained parameters: {trained_parameters(cfg)}")
    notes.append(
        f"pipeline buffers counted for sequence buckets {list(pipeline_seqs)} (the executor keeps a stage pair per "
        f"trained bucket, at most {STAGE_CACHE_SIZE}, the least recently used evicted)"
    )
    return Estimate(config_name, world, results, notes)
