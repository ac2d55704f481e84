"""Resharding a model's weights between two layouts by point-to-point copies of box intersections.

The training layout holds each trained model as pipeline stages x FSDP2 shards (x TP shards); the rollout
layout holds it as TP shards over each generation instance. A *box* is the part of a full tensor a rank holds:
its offsets and sizes in the full tensor's index space (a DTensor's local chunk, as DCP describes it, or the
whole tensor for a plain one). A :class:`ReshardPlan` pairs every destination box with the source boxes that
intersect it; each intersection travels once, from one of the ranks holding that source box (the destination
itself when it holds one), in the destination's dtype. The plan is built once (a collective exchange of box
metadata) and run every weight sync: one *unit* (one decoder layer, or one tensor outside the layers) at a
time, so a rank never holds more than one layer's worth of transfer buffers beyond its own shards.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fusedrl.models import local_indices


@dataclass(frozen=True)
class Box:
    """A block of a full tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box in the local tensor of ``outer`` (which contains it)."""
        return tuple(slice(o - p, o - p + s) for o, s, p in zip(self.offsets, self.sizes, outer.offsets))


def local_box(t: torch.Tensor) -> Box:
    """The box of the full tensor that this rank holds of ``t`` (:func:`fusedrl.models.local_indices`, which
    DCP's chunk metadata confirms); a shard that is not one block cannot be resharded."""
    idx = local_indices(t)
    for d, i in enumerate(idx):
        if len(i) and not torch.equal(i, torch.arange(int(i[0]), int(i[0]) + len(i))):
            raise ValueError(
                f"the local shard of a tensor with placements {getattr(t, 'placements', None)} is not one "
                f"block along dim {d}; it cannot be resharded"
            )
    return Box(tuple(int(i[0]) if len(i) else 0 for i in idx), tuple(len(i) for i in idx))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class Transfer:
    name: str
    src: int  # ranks of the plan's group
    dst: int
    box: Box


@dataclass
class ReshardPlan:
    """Transfers grouped into units run one after the other; identical on every rank of ``group``."""

    units: list[list[Transfer]]
    wire_dtype: dict[str, torch.dtype]
    group: dist.ProcessGroup | None = None
    src_boxes: dict[str, Box] = field(default_factory=dict)  # this rank's
    dst_boxes: dict[str, Box] = field(default_factory=dict)  # this rank's

    def bytes_received(self, rank: int) -> int:
        """Bytes ``rank`` receives from other ranks in one run of the plan."""
        return sum(
            t.box.numel * self.wire_dtype[t.name].itemsize for unit in self.units for t in unit if t.dst == rank and t.src != rank
        )


def _unit_key(name: str) -> tuple[int, str]:
    m = re.match(r"(?:.*\.)?layers\.(\d+)\.", name)
    return (int(m.group(1)), "") if m else (-1, name)


def plan_reshard(
    src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None = None
) -> ReshardPlan:
    """Plan copying the tensors named in every rank's ``dst`` from the ranks holding them in ``src``.

    Collective over ``group`` (without a process group: a single process copying between layouts it holds).
    ``src`` / ``dst`` map full-model names to this rank's tensors (DTensor shards or
    whole tensors; either may be empty on a rank). Raises ValueError when a destination tensor has no source of
    the same full shape, or when the source boxes do not tile a destination box exactly.
    """
    mine = (
        {n: (tuple(t.shape), local_box(t)) for n, t in src.items() if local_box(t).numel},
        {n: (tuple(t.shape), local_box(t), t.dtype) for n, t in dst.items() if local_box(t).numel},
    )
    everyone: list = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    return plan_from_boxes(everyone, dist.get_rank(group) if dist.is_initialized() else 0, group)


def plan_from_boxes(everyone: Sequence[tuple[dict, dict]], me: int, group: dist.ProcessGroup | None = None) -> ReshardPlan:
    """:func:`plan_reshard` from every rank's boxes, already gathered: per rank ``({name: (shape, box)} of its
    sources, {name: (shape, box, dtype)} of its destinations)``; ``me``: this rank's index in ``everyone`` (the memory
    estimate plans a job's sync from boxes it computed, in one process)."""
    owners: dict[str, dict[Box, list[int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, (sources, _) in enumerate(everyone):
        for name, (shape, box) in sources.items():
            owners.setdefault(name, {}).setdefault(box, []).append(rank)
            shapes[name] = shape
    wire: dict[str, torch.dtype] = {}
    by_unit: dict[tuple[int, str], list[Transfer]] = {}
    problems = []
    for rank, (_, dests) in enumerate(everyone):
        for name, (shape, box, dtype) in sorted(dests.items()):
            if name not in owners or shapes[name] != shape:
                found = f"shape {list(shapes[name])}" if name in shapes else "no tensor of that name"
                problems.append(f"{name}: the destination (rank {rank}) has shape {list(shape)}, the source {found}")
                continue
            wire[name] = dtype
            covered = 0
            for src_box, ranks in sorted(owners[name].items(), key=lambda kv: kv[0].offsets):
                part = box.intersect(src_box)
                if part is None:
                    continue
                covered += part.numel
                sender = rank if rank in ranks else ranks[rank % len(ranks)]
                by_unit.setdefault(_unit_key(name), []).append(Transfer(name, sender, rank, part))
            if covered != box.numel:
                problems.append(f"{name}: the source shards cover {covered} of the {box.numel} elements rank {rank} needs")
    if problems:
        raise ValueError("cannot reshard: " + "; ".join(problems[:5]) + "; both layouts must hold the same model")
    units = [by_unit[k] for k in sorted(by_unit)]
    return ReshardPlan(
        units, wire, group, {n: b for n, (_, b) in everyone[me][0].items()}, {n: b for n, (_, b, _) in everyone[me][1].items()}
    )


@torch.no_grad()
def reshard(
    plan: ReshardPlan,
    src: Mapping[str, torch.Tensor],
    dst: Mapping[str, torch.Tensor],
    on_unit: Callable[[list[torch.Tensor]], None] | None = None,
) -> int:
    """Run ``plan`` (collective over its group): fill this rank's ``dst`` shards from the ranks holding the
    sources. Returns the bytes this rank received from other ranks. ``on_unit``: called with each unit's send
    blocks and receive buffers before they go on the wire (``fusedrl.memory`` measures them)."""
    me = dist.get_rank(plan.group) if dist.is_initialized() else 0
    received = 0
    for unit in plan.units:
        ops: list[dist.P2POp] = []
        incoming: list[tuple[Transfer, torch.Tensor]] = []
        for t in unit:
            if t.src == me:
                block = local_tensor(src[t.name])[t.box.within(plan.src_boxes[t.name])].to(plan.wire_dtype[t.name])
                if t.dst == me:
                    _write(dst[t.name], plan.dst_boxes[t.name], t.box, block)
                else:
                    ops.append(dist.P2POp(dist.isend, block.contiguous(), group=plan.group, group_peer=t.dst))
            elif t.dst == me:
                out = local_tensor(dst[t.name])
                buf = torch.empty(t.box.sizes, dtype=plan.wire_dtype[t.name], device=out.device)
                ops.append(dist.P2POp(dist.irecv, buf, group=plan.group, group_peer=t.src))
                incoming.append((t, buf))
        if on_unit is not None:
            on_unit([op.tensor for op in ops])
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for t, buf in incoming:
            _write(dst[t.name], plan.dst_boxes[t.name], t.box, buf)
            received += buf.numel() * buf.element_size()
    return received


def _write(target: torch.Tensor, target_box: Box, box: Box, block: torch.Tensor) -> None:
    local_tensor(target)[box.within(target_box)].copy_(block)
