"""Full (unsharded) state dicts from a training layout: pipeline stages x FSDP2 / TP shards."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local_full_state(stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    full = {}
    for stage in stages:
        for name, value in stage.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            full[name] = value.detach()
    return full


def gather_full_state_dict(
    stages: nn.Module | list[nn.Module], pp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """The full model state dict on every rank, from this rank's training stage module(s).

    Collective: every rank of the job calls it with its own stages. DTensor shards (FSDP2 / TP) are
    all-gathered within their mesh; the stages' full tensors are then broadcast over ``pp_group``, one
    flat buffer per source stage and dtype. Stage modules keep the full model's parameter names, so the
    union is the full model's state dict (a stage held by several ranks, as Critic replicas are, is broadcast
    once). ``pp_group=None`` means the stage is the whole model.
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
        if all(name in full for name, _, _ in entries):  # a replica of a stage already received (Critic replicas)
            continue
        for dtype in sorted({d for _, _, d in entries}, key=str):
            group_entries = [(n, s) for n, s, d in entries if d == dtype]
            if src == me:
                flat = torch.cat([local[n].reshape(-1) for n, _ in group_entries]).to(device)
            else:
                flat = torch.empty(sum(math.prod(s) for _, s in group_entries), dtype=dtype, device=device)
            dist.broadcast(flat, group_src=src, group=pp_group)
            offset = 0
            for name, shape in group_entries:
                full[name] = flat[offset : offset + math.prod(shape)].view(shape)
                offset += math.prod(shape)
    return full
