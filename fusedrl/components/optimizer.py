"""AdamW per model and gradient-norm clipping that works with FSDP2 (DTensor) and pipeline stages."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fusedrl.distributed import group_devices


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight matrices with ``weight_decay``; norms, biases and other 1-D params without."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable params (call after ``fully_shard`` so it holds the DTensor shards)."""
    if lr <= 0:
        raise ValueError(f"learning rate must be > 0, got {lr}; set [optimizer] actor_lr / critic_lr")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    groups = [g for g in param_groups(model, weight_decay) if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters; nothing to optimise")
    # the fused kernel (CPU and CUDA) updates each tensor in one pass: 5-10x faster than the per-tensor loop on CPU
    # (SmolLM2-135M: 0.05 s against 0.24-0.57 s per step), equal to float rounding
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


@torch.no_grad()
def grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Total gradient norm of ``params`` over the whole model.

    DTensor (FSDP2/TP) gradients are reduced over their meshes; with ``pp_group`` the per-stage
    norms are combined over the pipeline ranks, so every rank gets the same full-model norm. A rank whose
    parameters have no gradient adds a zero on its parameters' device (the one its peers' collectives use).
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if grads:
        # DTensors of different meshes (FSDP2 x TP layers next to FSDP2-only embeddings and norms) cannot be
        # stacked: one norm per mesh (reduced over it), then combined.
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
        norms = []
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, norm_type, foreach=False)
            norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
        total = torch.nn.utils.get_total_norm(norms, norm_type, foreach=False)
    elif params:  # e.g. a stage that took no part in this minibatch: a zero where its peers' norms are
        local = params[0].to_local() if isinstance(params[0], DTensor) else params[0]
        total = torch.zeros((), dtype=torch.float32, device=local.device)
    else:  # no parameters at all; NCCL needs the tensor on the GPU
        on_gpu = pp_group is not None and "cpu" not in group_devices(pp_group)
        total = torch.zeros((), dtype=torch.float32, device="cuda" if on_gpu else "cpu")
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total ** (1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    norm_type: float = 2.0,
    *,
    uncounted: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping.

    ``uncounted``: parameters of ``params`` scaled but left out of the norm, because another rank counts the same
    gradient (a tied LM head on the last pipeline stage is the first stage's embedding). A non-finite norm leaves
    the gradients untouched so the caller can skip the update.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}; set [optimizer] grad_clip")
    params = list(params)
    skip = {id(p) for p in uncounted}
    total = grad_norm([p for p in params if id(p) not in skip], norm_type, pp_group)
    params = [p for p in params if p.grad is not None]
    if params and torch.isfinite(total):
        grad = params[0].grad
        assert grad is not None  # params were filtered to those with a gradient
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(grad.device), foreach=False)
    return total
