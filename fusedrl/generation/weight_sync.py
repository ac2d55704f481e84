"""Weight sync: a trained model's weights from the training layout into its rollout copy.

Training layout: each pipeline rank holds its stage module(s) (``fusedrl.distributed.split_decoder``), whose
parameters may be DTensors sharded over ``dp_shard`` (FSDP2) and/or ``tp``. Rollout layout: every generation
instance holds a copy of the model, tensor-parallel over its ``gen_tp`` ranks (DTensors) or whole (gen_tp = 1),
in its own dtype. :class:`WeightSync` plans the copy once (:func:`fusedrl.distributed.plan_reshard`: which rank
sends which block of which tensor to which rank) and runs it each iteration, one decoder layer at a time, each
block sent once in the rollout copy's dtype; no rank gathers a full model.

A LoRA stage (``[lora]``) whose rollout copy is a plain model (``lora.rollout_weights = "merged"``) syncs merged
weights: each adapted projection's weight is sent as ``W + scale B A``. Each sync first brings the stage's adapters
whole to every rank that holds a shard of them (they are small: rank x (in + out) per projection; alike ones share one
gather, :func:`whole_tensors`); each rank then
merges its own block of ``W``, one projection at a time, as the plan reads it. A rollout copy that carries the
adapters itself (``"adapters"``) gets every tensor as it is: the first sync sends all of them, later ones only those
that train (the adapters, a value head), the frozen base being unchanged since.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fusedrl.distributed import ReshardPlan, plan_reshard, reshard
from fusedrl.generation.engine import GenerationEngine
from fusedrl.models import adapter_modules, local_indices


def _layer_of(name: str) -> str:
    return name.split(".attn.")[0].split(".mlp.")[0]


class MergedSources(Mapping[str, torch.Tensor]):
    """The training stages' parameters by full-model name, where an adapted projection's weight reads as this rank's
    block of ``W + scale B A`` (float32) between :meth:`gather` and :meth:`release`, and as ``W`` otherwise (planning
    needs only its shape and sharding)."""

    def __init__(self, stages: list[nn.Module]) -> None:
        self.params = {n: p for stage in stages for n, p in stage.named_parameters()}
        self.adapted = {f"{n}.weight": m for stage in stages for n, m in adapter_modules(stage).items()}
        self.whole: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.layer: dict[str, torch.Tensor] = {}  # merged blocks of the layer the plan reads now (one unit per layer)

    @torch.no_grad()
    def gather(self) -> None:
        """Every adapter of the stages whole (collective over the meshes of their shards, in the stages' order)."""
        names = list(self.adapted)
        whole = whole_tensors([t for n in names for t in (self.adapted[n].lora_a, self.adapted[n].lora_b)])
        self.whole = {n: (whole[2 * i], whole[2 * i + 1], self.adapted[n].scale) for i, n in enumerate(names)}

    def release(self) -> None:
        self.whole, self.layer = {}, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.whole:
            return self.params[name]
        if name not in self.layer:
            if self.layer and _layer_of(next(iter(self.layer))) != _layer_of(name):
                self.layer = {}
            weight = self.params[name]
            rows, cols = local_indices(weight)
            a, b, scale = self.whole[name]
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            self.layer[name] = torch.addmm(local.detach().float(), b[rows], a[:, cols], alpha=scale)
        return self.layer[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def whole_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` whole, in float32 (DTensors gathered; collective over their meshes, in the list's order).

    DTensors of one mesh and placements whose sizes agree in every dimension but one that no placement shards go in
    one collective: concatenated along that dimension, each rank's shard of the concatenation is the concatenation of
    its shards. One gather per tensor cost ~0.8 ms each on gloo (a data parallel LoRA SmolLM2: 420, 0.34 s a sync)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            out[i] = t.float()
            continue
        sharded = {p.dim for p in t.placements if isinstance(p, Shard)}
        free = [d for d in range(t.ndim) if d not in sharded]
        if not free or not all(isinstance(p, (Shard, Replicate)) for p in t.placements):
            out[i] = t.full_tensor().float()
            continue
        sizes = tuple(n if d != free[0] else -1 for d, n in enumerate(t.shape))
        groups.setdefault((t.device_mesh, t.placements, t.dtype, free[0], sizes), []).append(i)
    for (mesh, placements, _, dim, _), members in groups.items():
        widths = [tensors[i].shape[dim] for i in members]
        shape = list(tensors[members[0]].shape)
        shape[dim] = sum(widths)
        local = torch.cat([cast(DTensor, tensors[i]).to_local() for i in members], dim=dim)
        joined = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=_strides(shape))
        for i, part in zip(members, joined.full_tensor().float().split(widths, dim=dim)):
            out[i] = part
    return [cast(torch.Tensor, t) for t in out]


def _strides(shape: list[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


@dataclass(frozen=True)
class WeightSyncStats:
    seconds: float
    bytes: int  # bytes this rank received from other ranks


class WeightSync:
    """Copies the training stages' weights into a rollout copy (a module, or a generation engine's model).

    Collective: every rank of ``group`` (default: all ranks) constructs it with its own stage(s) (possibly
    none) and its own rollout copy, in the same order as the other syncs of the job; then every call
    ``sync()`` copies the current weights. Rollout tensors without a training counterpart of the same full
    shape raise ValueError at construction. An engine is told its weights changed (a quantized engine
    re-quantizes).
    """

    def __init__(
        self, stages: nn.Module | list[nn.Module], target: nn.Module | GenerationEngine, group: dist.ProcessGroup | None = None
    ) -> None:
        stages = stages if isinstance(stages, list) else [stages]
        self.engine = target if isinstance(target, GenerationEngine) else None
        module = target.source_model if isinstance(target, GenerationEngine) else target
        # full-model names to this rank's tensors of the training stages and of the rollout copy
        self.targets = dict(module.named_parameters())
        unmerged = bool(adapter_modules(module))  # the rollout copy carries the adapters itself
        self.sources: Mapping[str, torch.Tensor] = (
            {n: p for stage in stages for n, p in stage.named_parameters()} if unmerged else MergedSources(stages)
        )
        self.plan = plan_reshard(self.sources, self.targets, group)
        # unmerged adapters: the plan of every sync after the first
        self.trained_plan = _only(self.plan, _trained_names(self.sources, group)) if unmerged else None
        self.synced = False

    @torch.no_grad()
    def sync(self) -> WeightSyncStats:
        start = time.perf_counter()
        if isinstance(self.sources, MergedSources):
            self.sources.gather()
        try:
            plan = self.trained_plan if self.synced and self.trained_plan is not None else self.plan
            received = reshard(plan, self.sources, self.targets)
        finally:
            if isinstance(self.sources, MergedSources):
                self.sources.release()
        self.synced = True
        if self.engine is not None:
            self.engine.weights_updated()
        return WeightSyncStats(seconds=time.perf_counter() - start, bytes=received)


def _trained_names(sources: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None) -> set[str]:
    """The names of the tensors that train on any rank of ``group`` (collective)."""
    mine = {n for n, p in sources.items() if p.requires_grad}
    if not dist.is_initialized():
        return mine
    everyone: list[set[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return set().union(*(names for names in everyone if names))


def _only(plan: ReshardPlan, names: set[str]) -> ReshardPlan:
    """``plan`` restricted to the tensors ``names`` (the same on every rank, as the plan is)."""
    units = [[t for t in unit if t.name in names] for unit in plan.units]
    return ReshardPlan([u for u in units if u], plan.wire_dtype, plan.group, plan.src_boxes, plan.dst_boxes)
