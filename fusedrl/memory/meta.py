"""A job's layouts built on the meta device one rank at a time, under torch's fake process group: what each rank
holds (:class:`RankBuild`), read from the real module trees and DTensor shardings, and the weight sync's
transients replayed over the real reshard plan (``docs/memory.md``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fusedrl.config import JobConfig
from fusedrl.distributed.compat import init_fake_process_group
from fusedrl.distributed.reshard import Box, ReshardPlan, local_box
from fusedrl.layouts import DTYPES, build_rollout_layout, build_training_layout
from fusedrl.memory.formulas import ROLLOUT_MODELS, rope_bytes
from fusedrl.models.weights import shard_indices
from fusedrl.pipelining import ACTOR, CRITIC


@dataclass(frozen=True)
class TensorInfo:
    """One parameter of a built module: its full shape, this rank's share, and how it is sharded."""

    name: str
    shape: tuple[int, ...]
    local_numel: int
    itemsize: int
    placements: tuple = ()
    mesh_dims: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    box: Box | None = None  # this rank's box (fusedrl.distributed.reshard.local_box)
    trainable: bool = True  # has gradients and optimizer state (a LoRA base weight does not)

    @property
    def local_bytes(self) -> int:
        return self.local_numel * self.itemsize

    def unsharded_numel(self) -> int:
        """Numel once FSDP2 all-gathers it (its TP share)."""
        n = 1
        for s in self.shape:
            n *= s
        for dim, size, p in zip(self.mesh_dims, self.mesh_shape, self.placements):
            if dim != "dp_shard" and not p.is_replicate():
                n //= size
        return n


def grad_numel(x: TensorInfo) -> int:
    """Numel of the unsharded gradient FSDP2 accumulates for ``x``: its TP share, except for a vocabulary-parallel
    embedding, whose gradient DTensor's backward produces at full size (measured by ``--measure`` at tp = 2)."""
    if x.name.endswith("tok_embeddings.weight"):
        return x.shape[0] * x.shape[1]
    return x.unsharded_numel()


def describe(module: nn.Module) -> list[TensorInfo]:
    """The parameters of ``module`` (meta DTensors or plain tensors) as :class:`TensorInfo`."""
    out = []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            assert mesh.mesh_dim_names is not None  # fusedrl's meshes name their dimensions
            out.append(
                TensorInfo(
                    name,
                    tuple(p.shape),
                    p.to_local().numel(),
                    p.element_size(),
                    tuple(p.placements),
                    tuple(mesh.mesh_dim_names),
                    tuple(mesh.shape),
                    local_box(p),
                    p.requires_grad,
                )
            )
        else:
            out.append(TensorInfo(name, tuple(p.shape), p.numel(), p.element_size(), box=local_box(p), trainable=p.requires_grad))
    return out


@dataclass
class StageInfo:
    model: str  # actor | critic
    index: int
    layers: int
    first: bool
    last: bool
    tensors: list[TensorInfo]
    rope: int
    head_in_loss: bool  # a last stage that returns hidden states (the loss applies the LM head in chunks)


@dataclass
class RankBuild:
    """What one rank's layouts hold, read from the modules built on meta."""

    rank: int
    coords: dict[str, int]
    stages: dict[str, StageInfo]  # the trained models' stages: no Critic with a critic-free estimator
    rollout: dict[str, list[TensorInfo]]  # the rollout copies the job has
    rollout_rope: dict[str, int]
    kv_heads: int  # the engine's KV heads on this rank


def rank_coords(cfg: JobConfig, rank: int) -> dict[str, int]:
    """Coordinates of ``rank`` in the training mesh ``(pp, dp_shard, tp)``, the Critic's replica mesh
    ``(critic_replica, critic_pp, dp_shard, tp)`` and the generation mesh ``(gen_dp, gen_tp)`` (all row-major over
    the ranks, as ``init_device_mesh`` lays them out)."""
    p = cfg.parallelism
    pp = rank // (p.dp_shard * p.tp)
    return {
        "pp": pp,
        "critic_replica": pp // p.critic_stages,
        "critic_pp": pp % p.critic_stages,
        "dp_shard": rank // p.tp % p.dp_shard,
        "tp": rank % p.tp,
        "gen_dp": rank // p.gen_tp,
        "gen_tp": rank % p.gen_tp,
    }


def distinct_ranks(cfg: JobConfig) -> list[int]:
    """Every pipeline rank with its first and last dp_shard rank, TP rank 0: the other ranks of a stage differ only
    by uneven FSDP2 chunks (the last dp rank holds the short ones), TP ranks hold equal shares (``apply_tp`` refuses
    uneven ones) and every rank holds the same rollout shares."""
    p = cfg.parallelism
    return sorted({(pp * p.dp_shard + d) * p.tp for pp in range(p.pp) for d in (0, p.dp_shard - 1)})


def build_rank(cfg: JobConfig, rank: int, world: int) -> RankBuild:
    """Build rank ``rank``'s training and rollout layouts on meta under a fake process group and describe them."""
    init_fake_process_group(rank, world)
    try:
        device = torch.device("cpu")  # the mesh's device type; with materialize=False nothing is allocated
        training = build_training_layout(cfg, device, materialize=False)
        rollout = build_rollout_layout(cfg, device, materialize=False)
        stages = {}
        for model, module, index in (
            (ACTOR, training.actor_stage, training.pp_rank),
            (CRITIC, training.critic_stage, training.critic_index),
        ):
            if module is None:  # no Critic with a critic-free advantage estimator
                continue
            last = module.output is not None
            stages[model] = StageInfo(
                model,
                index,
                len(module.layers),
                module.tok_embeddings is not None,
                last,
                describe(module),
                rope_bytes(module),
                last and not getattr(module, "apply_head", True),
            )
        models = {name: m for name in ROLLOUT_MODELS if (m := getattr(rollout, name)) is not None}
        kv_heads = models["actor"].layers[0].attn.num_kv_heads  # apply_tp divided it by gen_tp
        return RankBuild(
            rank,
            rank_coords(cfg, rank),
            stages,
            {n: describe(m) for n, m in models.items()},
            {n: rope_bytes(m) for n, m in models.items()},
            kv_heads,
        )
    finally:
        dist.destroy_process_group()


# weight sync: every rank's shard boxes, computed from the built ranks' placements

_BOX_CACHE: dict[tuple, Box | None] = {}


def _box_at(t: TensorInfo, coords: dict[str, int]) -> Box | None:
    """The box of ``t`` held at the mesh coordinates ``coords`` (None when empty)."""
    if not t.placements:
        return Box(tuple(0 for _ in t.shape), t.shape)
    coordinate = tuple(coords[d] for d in t.mesh_dims)
    key = (t.shape, repr(t.placements), t.mesh_shape, coordinate)
    if key not in _BOX_CACHE:
        idx = shard_indices(t.shape, t.placements, t.mesh_shape, coordinate)
        if any(len(i) == 0 for i in idx):
            _BOX_CACHE[key] = None
        else:
            for d, i in enumerate(idx):
                if int(i[-1]) - int(i[0]) + 1 != len(i):
                    raise ValueError(f"{t.name}: the shard at {coordinate} is not one block along dim {d}")
            _BOX_CACHE[key] = Box(tuple(int(i[0]) for i in idx), tuple(len(i) for i in idx))
    return _BOX_CACHE[key]


def all_rank_boxes(
    cfg: JobConfig,
    world: int,
    builds: dict[int, RankBuild],
    model: str,
) -> list[tuple[dict, dict]]:
    """Per rank, ``({name: (shape, box)} of its training stage of ``model``, {name: (shape, box, dtype)} of its
    rollout copy)``: what :func:`fusedrl.distributed.plan_reshard` gathers from every rank."""
    by_pp: dict[int, RankBuild] = {}
    for b in builds.values():
        by_pp.setdefault(b.coords["pp"], b)
    reference = next(iter(builds.values()))
    dtype = DTYPES[cfg.training.rollout_dtype]
    everyone = []
    for rank in range(world):
        coords = rank_coords(cfg, rank)
        stage = by_pp[coords["pp"]].stages[model]
        src = {t.name: (t.shape, box) for t in stage.tensors if (box := _box_at(t, coords)) is not None}
        dst = {t.name: (t.shape, box, dtype) for t in reference.rollout[model] if (box := _box_at(t, coords)) is not None}
        everyone.append((src, dst))
    for b in builds.values():  # the arithmetic must agree with the DTensors the built ranks hold
        mine_src, mine_dst = everyone[b.rank]
        for t in b.stages[model].tensors:
            if t.local_numel and mine_src[t.name][1] != t.box:
                raise RuntimeError(f"rank {b.rank} {t.name}: computed box {mine_src[t.name][1]} != built {t.box}")
        for t in b.rollout[model]:
            if t.local_numel and mine_dst[t.name][1] != t.box:
                raise RuntimeError(f"rank {b.rank} rollout {t.name}: computed box {mine_dst[t.name][1]} != built {t.box}")
    return everyone


def _contiguous_within(box: Box, outer: Box) -> bool:
    """Whether ``box`` is one contiguous run of the row-major local tensor of ``outer``."""
    partial = [d for d, (a, b) in enumerate(zip(box.sizes, outer.sizes)) if a < b]
    return not partial or all(box.sizes[d] == 1 for d in range(partial[-1]))


def sync_transients(
    plan: ReshardPlan, everyone: list[tuple[dict, dict]], src_itemsize: int, ranks: Iterable[int]
) -> dict[int, dict[str, int]]:
    """Per rank in ``ranks``: the largest bytes :func:`fusedrl.distributed.reshard` holds at once beyond the two
    layouts' own tensors, replaying its loop over ``plan``: receive buffers and send blocks (a cast, or the
    ``contiguous()`` copy of a strided slice) live until the next unit starts, a block the rank keeps itself until
    the next block replaces it, and the loop variables ``buf`` / ``block`` keep the last receive buffer and block of
    a unit alive into the next one. Returns ``{"total": peak, "recv": ..., "send": ...}`` (the unit's receive and
    send bytes at the peak) and ``"unit"``: the largest receive + send bytes of one unit."""
    best = {}
    for r in ranks:
        peak = {"total": 0, "recv": 0, "send": 0}
        largest = 0
        buf = block = 0  # bytes the loop variables hold (0: nothing, or a view of a source shard)
        block_in_ops = buf_in_incoming = False
        for unit in plan.units:
            # ``ops = []`` / ``incoming = []``: the previous unit's tensors go, but for what buf / block still hold
            live = buf + block
            recv = send = 0
            buf_in_incoming = block_in_ops = False
            for t in unit:
                if r not in (t.src, t.dst):
                    continue
                wire = plan.wire_dtype[t.name].itemsize
                nbytes = t.box.numel * wire
                if t.src == r:
                    cast = wire != src_itemsize
                    strided = not _contiguous_within(t.box, everyone[t.src][0][t.name][1])
                    new = nbytes if cast else 0
                    live += new + (nbytes if t.dst != r and strided and not cast else 0)
                    if not block_in_ops:
                        live -= block  # the previous block is dropped unless a send still holds it
                    block, block_in_ops = new, t.dst != r
                    if t.dst != r:
                        send += nbytes if cast or strided else 0
                else:
                    live += nbytes
                    recv += nbytes
                    if not buf_in_incoming:
                        live -= buf
                    buf, buf_in_incoming = nbytes, True
                if live > peak["total"]:
                    peak = {"total": live, "recv": recv, "send": send}
            largest = max(largest, recv + send)
        best[r] = {**peak, "unit": largest}
    return best
