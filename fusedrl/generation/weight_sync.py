"""Weight sync: Actor weights from the training layout to a full replica in every generation engine.

Training layout: each pipeline rank holds its stage module(s) (``fusedrl.distributed.split_decoder``),
whose parameters may be DTensors sharded over ``dp_shard`` (FSDP2) and/or ``tp``. Steps:

1. every rank turns its stage's DTensors into full tensors (``DTensor.full_tensor()``: an all-gather over
   the dp_shard / tp mesh dimensions, collective within each (dp_shard, tp) group);
2. the stages' full tensors are broadcast over the ``pp`` group (one flat buffer per stage and dtype), so
   that every rank holds the full state dict;
3. the engine loads it (``GenerationEngine.load_weights``).

Stage modules keep the full model's parameter names (a stage holds a subset of the layers), so the
union of the stages' state dicts is the full model's state dict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fusedrl.generation.engine import GenerationEngine


@dataclass(frozen=True)
class WeightSyncStats:
    seconds: float
    bytes: int  # size of the full state dict each rank ends up with


def _local_full_state(stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    full = {}
    for stage in stages:
        for name, value in stage.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            full[name] = value.detach()
    return full


def gather_full_state_dict(stages: nn.Module | list[nn.Module], pp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict on every rank, from this rank's training stage module(s).

    Collective: every rank of the job calls it with its own stages. ``pp_group=None`` means no pipeline
    parallelism (the stage is the whole model).
    """
    stages = stages if isinstance(stages, list) else [stages]
    local = _local_full_state(stages)
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return local
    meta = [(name, tuple(t.shape), t.dtype) for name, t in local.items()]
    all_meta: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(all_meta, meta, group=pp_group)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    me = dist.get_rank(pp_group)
    full: dict[str, torch.Tensor] = {}
    for src, entries in enumerate(all_meta):
        # One flat buffer per dtype and source stage keeps the number of collectives small.
        for dtype in sorted({d for _, _, d in entries}, key=str):
            group_entries = [(n, s) for n, s, d in entries if d == dtype]
            if src == me:
                flat = torch.cat([local[n].reshape(-1) for n, _ in group_entries]).to(device)
            else:
                flat = torch.empty(sum(_numel(s) for _, s in group_entries), dtype=dtype, device=device)
            dist.broadcast(flat, group_src=src, group=pp_group)
            offset = 0
            for name, shape in group_entries:
                full[name] = flat[offset : offset + _numel(shape)].view(shape)
                offset += _numel(shape)
    return full


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def sync_weights(
    engine: GenerationEngine,
    stages: nn.Module | list[nn.Module],
    pp_group: dist.ProcessGroup | None = None,
    *,
    gen_tp: int = 1,
) -> WeightSyncStats:
    """Load the training stages' current weights into ``engine`` (a full replica per rank); timed.

    ``gen_tp > 1`` (tensor-parallel generation instances) is not implemented.
    """
    if gen_tp != 1:
        raise NotImplementedError(
            f"gen_tp={gen_tp}: tensor-parallel generation instances are not implemented; use gen_tp=1 "
            "(each generation instance holds a full replica)"
        )
    start = time.perf_counter()
    stages = stages if isinstance(stages, list) else [stages]
    full = gather_full_state_dict(stages, pp_group)
    expected = set(engine.source_model.state_dict())
    if "output.weight" not in expected:
        full.pop("output.weight", None)  # tied LM head: the last stage's copy of tok_embeddings.weight
    missing, unexpected = expected - set(full), set(full) - expected
    if missing or unexpected:
        raise ValueError(
            f"training stages do not add up to the engine's model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; pass every stage of the Actor and the pp process group"
        )
    engine.load_weights({k: v.to(engine.device) for k, v in full.items()})
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    return WeightSyncStats(seconds=time.perf_counter() - start, bytes=nbytes)
