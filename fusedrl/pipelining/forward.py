"""A forward-only pass of one model through its pipeline stages: no autograd, no program, no PipelineStage.

What PPO's log-prob recomputation needs (``ppo.recompute_logprobs``): the Actor's training layout (pipeline stages x
FSDP2 x TP) run over a batch without gradients, each stage's output sent on to the next as soon as it is computed
(stage ``s`` works on micro-batch ``i`` while stage ``s + 1`` works on ``i - 1``: the GPipe fill, forward only).
Messages of one direction between one rank pair, in micro-batch order, so they match in order on any backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule


def pipeline_forward(
    module: nn.Module,
    inputs: Sequence[torch.Tensor],
    stage_ranks: Sequence[int],
    stage: int,
    *,
    hidden_dim: int,
    activation_dtype: torch.dtype,
    device: torch.device,
    last: Callable[[torch.Tensor, int], torch.Tensor],
    group: dist.ProcessGroup | None = None,
    before: Callable[[int], None] | None = None,
) -> list[torch.Tensor] | None:
    """Run this rank's stage ``module`` (stage ``stage`` of ``len(stage_ranks)``, stage ``j`` on global rank
    ``stage_ranks[j]`` of ``group``) over the micro-batches ``inputs`` (token ids ``[b, S]``; every stage passes the
    same list, the first one feeds them, the others read their shapes). A non-first stage receives ``[b, S,
    hidden_dim]`` activations in ``activation_dtype``. The last stage returns ``[last(output_i, i) for each
    micro-batch]``, the others None. ``before(i)``, when given, runs on every stage before micro-batch ``i``'s forward
    (e.g. to switch what the module computes). FSDP2 units of ``module`` are resharded afterwards (a forward without
    backward would leave them gathered). Collective over the stages' ranks."""
    first, final = stage == 0, stage == len(stage_ranks) - 1
    sends: list[dist.Work] = []
    outs: list[torch.Tensor] = []
    with torch.no_grad():
        for i, tokens in enumerate(inputs):
            if first:
                x = tokens.to(device)
            else:
                x = torch.empty(*tokens.shape, hidden_dim, dtype=activation_dtype, device=device)
                dist.recv(x, src=stage_ranks[stage - 1], group=group)
            if before is not None:
                before(i)
            out = module(x)
            if final:
                outs.append(last(out, i))
            else:
                work = dist.isend(out.to(activation_dtype).contiguous(), dst=stage_ranks[stage + 1], group=group)
                assert work is not None  # a point-to-point op on a member of the group
                sends.append(work)
        for work in sends:
            work.wait()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return outs if final else None
