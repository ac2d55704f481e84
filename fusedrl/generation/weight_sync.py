"""Weight sync: Actor weights from the training layout to a full replica in every generation engine.

Training layout: each pipeline rank holds its stage module(s) (``fusedrl.distributed.split_decoder``),
whose parameters may be DTensors sharded over ``dp_shard`` (FSDP2) and/or ``tp``.
``fusedrl.distributed.gather_full_state_dict`` gives every rank the full state dict (an all-gather of the
shards, then a broadcast of each stage over the ``pp`` group), and the engine loads it
(``GenerationEngine.load_weights``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fusedrl.distributed.state_dict import gather_full_state_dict
from fusedrl.generation.engine import GenerationEngine


@dataclass(frozen=True)
class WeightSyncStats:
    seconds: float
    bytes: int  # size of the full state dict each rank ends up with


def sync_engine_weights(
    engine: GenerationEngine,
    stages: nn.Module | list[nn.Module],
    pp_group: dist.ProcessGroup | None = None,
) -> WeightSyncStats:
    """Load the training stages' current weights into ``engine`` (a full replica per rank); timed."""
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
