"""Weight sync: a trained model's weights from the training layout into its rollout copy.

Training layout: each pipeline rank holds its stage module(s) (``fusedrl.distributed.split_decoder``), whose
parameters may be DTensors sharded over ``dp_shard`` (FSDP2) and/or ``tp``. Rollout layout: every generation
instance holds a copy of the model, tensor-parallel over its ``gen_tp`` ranks (DTensors) or whole (gen_tp = 1),
in its own dtype. :class:`WeightSync` plans the copy once (:func:`fusedrl.distributed.plan_reshard`: which rank
sends which block of which tensor to which rank) and runs it each iteration, one decoder layer at a time, each
block sent once in the rollout copy's dtype; no rank gathers a full model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.distributed import plan_reshard, reshard
from fusedrl.generation.engine import GenerationEngine


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
        self.sources = {n: p for stage in stages for n, p in stage.named_parameters()}
        self.targets = dict(module.named_parameters())
        self.plan = plan_reshard(self.sources, self.targets, group)

    @torch.no_grad()
    def sync(self) -> WeightSyncStats:
        start = time.perf_counter()
        received = reshard(self.plan, self.sources, self.targets)
        if self.engine is not None:
            self.engine.weights_updated()
        return WeightSyncStats(seconds=time.perf_counter() - start, bytes=received)
