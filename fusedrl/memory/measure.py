"""The estimate against the real trainer: a config runs through :class:`fusedrl.trainer.Trainer` on CPU ranks and
each rank counts what it really holds, from the tensors themselves, through public seams only (the executor's
:class:`fusedrl.pipelining.StepObserver`, ``saved_tensors_hooks``, optimizer step hooks, ``reshard``'s ``on_unit``,
the engine's and the scorer's public calls; the few torch internals read sit in ``fusedrl.distributed.compat``).

Every counted figure depends on the ops run, not on thread scheduling: bytes of tensors alive or saved, and the
transient tensors of a region (:class:`fusedrl.distributed.compat.TransientTensors`: storages that torch ops create
and free inside it). Allocator scratch and other threads' buffers (gloo's per-collective copies) are not tensors
and are not counted; the estimate does not count them either."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from fusedrl.config import JobConfig, load_config
from fusedrl.distributed import reshard
from fusedrl.distributed.compat import TransientTensors, fsdp_unsharded_grads, stage_receive_buffers, tensor_storage
from fusedrl.generation import Request, SamplingParams
from fusedrl.layouts import model_flavor
from fusedrl.memory.estimate import Estimate
from fusedrl.memory.formulas import (
    ROLLOUT_MODELS,
    decode_step_bytes,
    itemsize,
    micro_batch_scoring_bytes,
    prefill_bytes,
)
from fusedrl.models import scoring_flavors
from fusedrl.pipelining import ACTOR, CRITIC, FusedPipelineSchedule, StepObserver
from fusedrl.rlhf import build_scorer
from fusedrl.tasks import task_reward_fn
from fusedrl.trainer import Trainer

TOLERANCE = 0.10
"""A compared category fails when measured / estimated is off 1 by more than this."""
ITERATIONS = 2
"""Trainer iterations of a measured run: the second one runs with every stage, buffer and state already built."""


def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = None if t is None else tensor_storage(t)
        if storage is None or storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {s.data_ptr() for t in tensors if (s := tensor_storage(t)) is not None}


class _TrainingObserver(StepObserver):
    """Per executor step: autograd's saved tensors charged to the micro-batch whose forward (and loss) saved them,
    plus the stage outputs ``PipelineStage`` holds, released at the micro-batch's last backward action; the
    all-gathered parameters and FSDP2's accumulated unsharded gradients before each model's reduction; and (from
    the second step on) the step's transient tensors."""

    def __init__(self) -> None:
        self.steps = 0
        self.activations: dict[str, Any] = {"peak": 0, "per_microbatch": {ACTOR: 0, CRITIC: 0}}
        self.unsharded: dict[str, dict[str, int]] = {}
        self.transient = 0
        self._tracker = TransientTensors()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._current: tuple[str, int] | None = None
        self._saved: dict[tuple[str, int], dict[int, int]] = {}  # micro-batch -> {storage pointer: bytes}
        self._events: list[tuple[str, tuple[str, int]]] = []
        self._excluded: set[int] = set()  # parameters, buffers and receive buffers: not the micro-batch's

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._current is not None and (s := tensor_storage(t)) is not None:
            self._saved.setdefault(self._current, {})[s.data_ptr()] = s.nbytes()
        return t

    def step_started(self) -> None:
        self.steps += 1
        self._saved, self._events, self._excluded, self._current = {}, [], set(), None
        self._hooks.__enter__()
        if self.steps > 1:
            self._tracker.__enter__()

    def forward_started(self, model: str, microbatch: int) -> None:
        self._current = (model, microbatch)

    def forward_finished(self, model: str, microbatch: int, stage: PipelineStage, output: Any) -> None:
        key = (model, microbatch)
        held = self._saved.setdefault(key, {})
        for o in output if isinstance(output, tuple) else (output,):
            if isinstance(o, torch.Tensor) and (s := tensor_storage(o)) is not None:
                held[s.data_ptr()] = s.nbytes()
        self._events.append(("F", key))
        module = stage.submod
        self._excluded |= _ptrs(module.parameters()) | _ptrs(module.buffers()) | _ptrs(stage_receive_buffers(stage))
        self._current = None

    def backward_finished(self, model: str, microbatch: int, released: bool) -> None:
        if released:
            self._events.append(("B", (model, microbatch)))

    def reduce_started(self, model: str, stage: PipelineStage) -> None:
        # all-gathered: plain tensors, or DTensors left on the TP mesh only
        params = [
            p
            for p in stage.submod.parameters()
            if not isinstance(p, DTensor) or "dp_shard" not in (p.device_mesh.mesh_dim_names or ())
        ]
        figures = {"params": _storage_bytes(params), "grads": _storage_bytes(fsdp_unsharded_grads(stage.submod))}
        old = self.unsharded.get(model, {"params": 0, "grads": 0})
        self.unsharded[model] = {k: max(old[k], v) for k, v in figures.items()}

    def step_finished(self) -> None:
        if self.steps > 1:
            self._tracker.__exit__(None, None, None)
            self.transient = max(self.transient, self._tracker.peak)
        self._hooks.__exit__(None, None, None)
        sizes = {k: sum(n for p, n in v.items() if p not in self._excluded) for k, v in self._saved.items()}
        live: set[tuple[str, int]] = set()
        peak = 0
        for kind, key in self._events:
            (live.add if kind == "F" else live.discard)(key)
            peak = max(peak, sum(sizes[k] for k in live))
        if peak > self.activations["peak"]:
            largest = {m: max((v for (model, _), v in sizes.items() if model == m), default=0) for m in (ACTOR, CRITIC)}
            self.activations = {"peak": peak, "per_microbatch": largest}


def _weight_sync(trainer: Trainer) -> dict[str, int]:
    """Each model's sync once more through ``reshard``'s public hook (collective): per model the bytes of the largest
    unit's new P2P tensors (receive buffers and send copies; a send of a slice that needs no copy is a view of its
    source shard), and the whole sync's transient tensors."""
    got = {"unit": 0, "transient": 0}
    for sync in trainer.syncs:
        sources = _ptrs(sync.sources.values())

        def unit(tensors: list[torch.Tensor], sources: set[int] = sources) -> None:
            fresh = (t for t in tensors if (s := tensor_storage(t)) is not None and s.data_ptr() not in sources)
            got["unit"] = max(got["unit"], _storage_bytes(fresh))

        with TransientTensors() as whole:
            reshard(sync.plan, sync.sources, sync.targets, on_unit=unit)
        got["transient"] = max(got["transient"], whole.peak)
    return got


def _rollout(cfg: JobConfig, trainer: Trainer) -> dict[str, Any]:
    """The rollout's transients through the engine's and the scorer's public calls (every rank of a generation
    instance runs the same requests): ``max_slots`` prompts of ``data.max_prompt_len`` tokens, their first engine
    step (the prefill and one decode step), a later decode step, and the scoring of one micro-batch of the results."""
    engine, gen = trainer.engine, cfg.generation
    prompt_len, new = cfg.data.max_prompt_len, gen.max_new_tokens
    sampling = SamplingParams(temperature=gen.temperature, max_new_tokens=new, target_len=new)
    for i in range(engine.max_slots):
        engine.add_request(Request(2**40 + i, [(7 * i + j) % engine.vocab_size for j in range(prompt_len)], sampling))
    got: dict[str, Any] = {"prefill_shape": (engine.max_slots, prompt_len), "decode_rows": engine.max_slots}
    with TransientTensors() as first:
        results = engine.step()
    with TransientTensors() as decode:
        results += engine.step()
    got["prefill"], got["decode"] = first.peak, decode.peak
    while engine.has_work():
        results += engine.step()
    scorer = build_scorer(cfg, trainer.rollout, trainer.tokenizer, task_reward_fn(cfg, trainer.task))
    if scorer.models.reward is not None:  # the rule-based reward is no scoring model's transient
        scorer = dataclasses.replace(scorer, reward_fn=None)
    width = max(r.num_tokens for r in results)
    rows = max(1, min(len(results), scorer.micro_batch_size, (scorer.max_tokens or width * len(results)) // width))
    with TransientTensors() as scoring:
        scorer.score(results[:rows])  # one micro-batch
    got["scoring"], got["scoring_shape"] = scoring.peak, (rows, width)
    return got


def measure_rank(argv: list[str], out: str) -> dict[str, Any]:
    """On every rank of a job (collective): run the config (``argv``: ``--job.config_file ...`` and overrides) through
    the trainer for ``ITERATIONS`` iterations, writing to ``out``, then count each category's bytes."""
    cfg = load_config([*argv, f"--job.output_dir={out}"])
    trainer = Trainer(cfg)
    layout, rollout, engine = trainer.layout, trainer.rollout, trainer.engine
    schedule = trainer.executor.schedule
    # LocalSchedule (pp = 1) has no lowered program or pipeline stages to measure
    if not isinstance(schedule, FusedPipelineSchedule):
        raise ValueError("memory --measure needs a pipelined config (parallelism.pp >= 2)")
    observer = _TrainingObserver()
    schedule.observer = observer
    # the trained models: the Actor alone with a critic-free estimator
    stage_modules = {m: s for m, s in ((ACTOR, layout.actor_stage), (CRITIC, layout.critic_stage)) if s is not None}
    optimizers = {m: o for m, o in ((ACTOR, trainer.opt.actor), (CRITIC, trainer.opt.critic)) if o is not None}
    got: dict[str, Any] = {}
    for model, opt in optimizers.items():

        def gradients(optimizer: Any, args: Any, kwargs: Any, key: str = f"gradients_{model}") -> None:
            grads = (p.grad for group in optimizer.param_groups for p in group["params"])
            got[key] = max(got.get(key, 0), _storage_bytes(grads))

        opt.register_step_pre_hook(gradients)
    for step in range(1, ITERATIONS + 1):
        trainer.train_step(step)
    schedule.observer = None

    persistent = {}
    for model, module in stage_modules.items():
        persistent[f"train_params_{model}"] = _storage_bytes(module.parameters())
    for model, opt in optimizers.items():
        persistent[f"optimizer_{model}"] = _storage_bytes(
            v for s in opt.state.values() for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor)
        )
    rollout_models = {name: m for name in ROLLOUT_MODELS if (m := getattr(rollout, name)) is not None}
    for name, copy in rollout_models.items():  # the copies the job builds
        persistent[f"rollout_{name}"] = _storage_bytes(copy.parameters())
    persistent["kv_cache"] = _storage_bytes(t for pair in engine.kv_cache for t in pair)
    models = (*stage_modules.values(), *rollout_models.values())
    persistent["rope_buffers"] = _storage_bytes(b for m in models for b in m.buffers())
    stages = schedule.stages
    persistent["pipeline_buffers"] = _storage_bytes(b for st in stages.values() for b in stage_receive_buffers(st))
    got["pipeline_seqs"] = sorted({key[2][1] for key in stages})
    got["persistent"] = persistent  # after training: offloaded frozen models are in host memory
    got["host"] = trainer.frozen.host_bytes if trainer.frozen is not None else 0
    got["activations"], got["unsharded"] = observer.activations, observer.unsharded
    got["training_step"] = observer.transient
    got["weight_sync"] = _weight_sync(trainer)
    if trainer.frozen is not None:
        trainer.frozen.restore()  # the Reference and the Reward score on the device
    got["rollout"] = _rollout(cfg, trainer)
    got["program"] = schedule.program
    got["rank"] = dist.get_rank()
    return got


@dataclass
class Comparison:
    rank: int
    category: str
    measured: int
    estimated: int
    gated: bool

    @property
    def ratio(self) -> float:
        return self.measured / self.estimated if self.estimated else (1.0 if not self.measured else float("inf"))

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE


def compare(cfg: JobConfig, measured: list[dict[str, Any]], est: Estimate) -> list[Comparison]:
    """Measured vs estimated per rank and category (gated: must agree within ``TOLERANCE``; else informational)."""
    out: list[Comparison] = []
    t = cfg.training
    r, g = itemsize(t.rollout_dtype), cfg.parallelism.gen_tp
    scored = max(r, itemsize(t.frozen_dtype))  # the Reference's and the Reward's dtype may differ (as in the estimate)
    actor = model_flavor(cfg, "actor")
    for m, e in zip(measured, est.ranks):
        for name, value in m["persistent"].items():
            offloaded = name in e.details["host"]  # freed on the device outside the rollout: 0 expected
            category = f"{name} (device, after training)" if offloaded else name
            out.append(Comparison(e.rank, category, value, e.persistent.get(name, 0), True))
        if e.details["host"]:
            out.append(Comparison(e.rank, "host copies (training.offload_frozen)", m["host"], e.host_total, True))
        for key, estimated in e.details["gradients"].items():
            out.append(Comparison(e.rank, key, m.get(key, 0), estimated, True))
        unsharded = {k: sum(v[k] for v in m["unsharded"].values()) for k in ("params", "grads")}
        out.append(Comparison(e.rank, "unsharded_params", unsharded["params"], e.transients["unsharded_params"], True))
        out.append(Comparison(e.rank, "unsharded_grads", unsharded["grads"], e.transients["unsharded_grads"], True))
        activations = m["activations"]["peak"]
        out.append(Comparison(e.rank, "activations (+ logits), in-flight peak", activations, e.details["activation_peak"], True))
        sync = m["weight_sync"]
        unit = e.details["weight_sync_unit"]["unit"]
        out.append(Comparison(e.rank, "weight sync: largest unit's send+recv", sync["unit"], unit, True))
        tr = e.transients
        step = max(
            sum(e.details["training_compute_peak"].values()),
            tr["unsharded_params"] + tr["unsharded_grads"] + tr["reduce_scatter"],
        )
        # FSDP2 all-gathers into storages it keeps and resizes (no new tensors): the measured parameters join
        out.append(Comparison(e.rank, "training step (transient tensors)", m["training_step"] + unsharded["params"], step, True))
        roll = m["rollout"]
        rows, width = roll["prefill_shape"]
        prefill = prefill_bytes(actor, rows, width, r, g)
        out.append(Comparison(e.rank, f"prefill {rows}x{width} + decode step (transient)", roll["prefill"], prefill, True))
        rows = roll["decode_rows"]
        decode = decode_step_bytes(actor, rows, r, g)
        out.append(Comparison(e.rank, f"decode step, {rows} rows (transient)", roll["decode"], decode, True))
        rows, width = roll["scoring_shape"]
        body, head = micro_batch_scoring_bytes(*scoring_flavors(cfg), rows, width, scored, g, cfg.response_budget)
        out.append(Comparison(e.rank, f"scoring micro-batch {rows}x{width} (transient)", roll["scoring"], max(body, head), True))
        whole = sync["transient"]
        out.append(Comparison(e.rank, "weight sync (transient tensors)", whole, e.transients["weight_sync_buffers"], False))
    return out


def format_comparison(rows: list[Comparison]) -> str:
    lines = [f"{'rank':>4}  {'category':<48}{'measured MiB':>14}{'estimated MiB':>15}{'ratio':>8}  check"]
    for c in rows:
        check = ("ok" if c.ok else f"OFF BY >{TOLERANCE:.0%}") if c.gated else "informational"
        lines.append(
            f"{c.rank:>4}  {c.category:<48}{c.measured / 2**20:>14.3f}{c.estimated / 2**20:>15.3f}{c.ratio:>8.3f}  {check}"
        )
    return "\n".join(lines)
