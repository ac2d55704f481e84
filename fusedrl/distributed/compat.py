"""The one place fusedrl touches torch internals (private modules and methods), each with the reason.

Everything else in fusedrl uses public torch APIs; when a torch upgrade moves one of these, only this file
changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage


def prepare_static_stage(stage: PipelineStage, num_microbatches: int) -> None:
    """Set up a ``PipelineStage`` built with static example inputs/outputs for ``num_microbatches`` with
    backward, without the shape-inference P2P exchange. The stock schedules do this inside their ``step``;
    fusedrl's executor drives two models' stages itself, so it calls the stages' own preparation.

    torch 2.13 and 2.14: the stage has an inference mode (``_utils.InferenceMode.STATIC`` skips the exchange)
    and ``_prepare_forward_infra`` takes ``has_backward``. torch 2.11 has neither: a stage given ``input_args``
    at construction already holds its input metadata and skips the exchange, and ``has_backward`` is read from
    the stage.
    """
    from torch.distributed.pipelining import _utils

    stage.has_backward = True
    if hasattr(_utils, "InferenceMode"):
        stage._inference_mode = _utils.InferenceMode.STATIC
        stage._prepare_forward_infra(num_microbatches, None, {}, has_backward=True)
    else:
        stage._prepare_forward_infra(num_microbatches, (), {})
    stage._prepare_backward_infra(num_microbatches)


def pipeline_stage_on_ranks(
    module: nn.Module,
    stage_index: int,
    stage_ranks: list[int],
    device: torch.device,
    input_args: torch.Tensor,
    output_args: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> PipelineStage:
    """A ``PipelineStage`` of a pipeline whose ``len(stage_ranks)`` stages live on ``stage_ranks`` (ranks of
    ``group``, stage by stage), where ``group`` may hold more ranks than the pipeline has stages: a Critic replica's
    stages on its block of the pipeline group, whose messages must travel on that group (one message order per
    rank pair with the Actor's). ``PipelineStage`` refuses a group larger than its stage count; the stage only ever
    talks to the ranks of ``stage_index_to_group_rank``, so it is built for as many stages as the group has ranks,
    then given its true stage count (``num_stages``: the constructor only checks it; ``is_first`` / ``is_last`` and
    the stage's preparation read it afterwards)."""
    stages = len(stage_ranks)
    built = max(stages, dist.get_world_size(group))
    stage = PipelineStage(module, stage_index, built, device, input_args=input_args, output_args=output_args, group=group)
    stage.num_stages = stages
    stage.stage_index_to_group_rank = dict(enumerate(stage_ranks))
    return stage


def recompute_in_backward(module: nn.Module) -> None:
    """Activation checkpointing of ``module`` in place: its forward keeps only its inputs for autograd and runs
    again in the backward. torch's composable ``checkpoint`` (``torch.distributed._composable``, the form that
    composes with ``fully_shard``) leaves parameter names unchanged, unlike ``checkpoint_wrapper``, so weight
    loading, resharding and checkpoints see the same names with it on or off."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def recomputes_in_backward(module: nn.Module) -> bool:
    """Whether ``recompute_in_backward`` was applied to ``module`` (the composable ``checkpoint`` keeps a state)."""
    from torch.distributed._composable import checkpoint

    return checkpoint.state(module) is not None


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A process group that performs no communication (torch's test-only "fake" backend), for building the
    real layouts of a large job on the meta device in one process (``python -m fusedrl.bench.memory``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def onednn_pack_linear_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """``weight`` [out, in] (fp32, CPU) reordered into oneDNN's blocked layout for products with about
    ``rows_hint`` rows. ``torch.ops.mkldnn`` has no public linear that takes a prepacked weight; these two ops
    are what inductor's CPU freezing pass emits for the same purpose."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def onednn_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``onednn_pack_linear_weight(weight, ...)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's ``unique_graphs`` counter; no public
    API counts them)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def mark_dim_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Let torch.compile take ``tensor``'s size along ``dim`` as symbolic (one graph for every size) where it can;
    torch.compiler has no public form of ``torch._dynamo.maybe_mark_dynamic``."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def allow_recompiles(graphs: int) -> None:
    """Let one compiled function hold at least ``graphs`` graphs (dynamo's ``recompile_limit``, 8 by default) before
    it falls back to eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)
