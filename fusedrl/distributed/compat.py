"""The one place fusedrl touches torch internals (private modules and methods), each with the reason.

Everything else in fusedrl uses public torch APIs; when a torch upgrade moves one of these, only this file
changes.
"""

from __future__ import annotations

import weakref

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
    real layouts of a large job on the meta device in one process (``fusedrl.memory``), one rank after the other.

    DTensor's sharding-propagation caches are emptied first: their keys ignore the rank, so a cached output spec
    would carry the previous rank's mesh (and mesh coordinate) into this rank's FSDP2 parameters."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def subgroups() -> list[dist.ProcessGroup]:
    """Every process group this process belongs to but the default one."""
    from torch.distributed import distributed_c10d

    return [pg for pg in list(distributed_c10d._world.pg_map) if pg is not distributed_c10d.GroupMember.WORLD]


def destroy_subgroups() -> None:
    """Destroy every process group of this process but the default one. Each gloo group keeps a transport thread that
    wakes up periodically, so a long-lived process that leaves its groups behind (a multi-rank test pool: a trainer's
    meshes per test) spends more CPU on them with every group."""
    groups = subgroups()
    for pg in groups:
        dist.destroy_process_group(pg)
    if groups:  # DTensor's cached output specs hold the meshes of those groups (their keys compare meshes by value)
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes autograd has seen to ``tensor`` (and its views): ``Tensor._version``, which has no
    public name."""
    return tensor._version


def onednn_pack_linear_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """``weight`` [out, in] (fp32, CPU) reordered into oneDNN's blocked layout for products with about
    ``rows_hint`` rows. ``torch.ops.mkldnn`` has no public linear that takes a prepacked weight; these two ops
    are what inductor's CPU freezing pass emits for the same purpose."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 natively on this CPU (``torch.ops.mkldnn``'s own check; no public API)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``onednn_pack_linear_weight(weight, ...)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's ``unique_graphs`` counter; no public
    API counts them)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compile_seconds() -> float:
    """Wall time torch.compile has spent compiling in this process so far, forward and backward graphs (dynamo's
    cumulative timers; no public API reports them)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)  # older torch set it only after a first compile


def mark_dim_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Let torch.compile take ``tensor``'s size along ``dim`` as symbolic (one graph for every size) where it can;
    torch.compiler has no public form of ``torch._dynamo.maybe_mark_dynamic``."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def mark_static(tensor: torch.Tensor) -> None:
    """Keep every size of ``tensor`` a constant in graphs that torch.compile(dynamic=True) builds (otherwise a size
    that happens to equal another input's at the first compile is merged with it, and a later call recompiles);
    torch.compiler has no public form of ``torch._dynamo.mark_static``."""
    torch._dynamo.mark_static(tensor)


def allow_recompiles(graphs: int) -> None:
    """Let one compiled function hold at least ``graphs`` graphs (dynamo's ``recompile_limit``, 8 by default) before
    it falls back to eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)


def stage_receive_buffers(stage: PipelineStage) -> list[torch.Tensor]:
    """The activation and gradient receive buffers a ``PipelineStage`` preallocated (its ``args_recv_info`` /
    ``grad_recv_info`` tables; no public accessor)."""
    out: list[torch.Tensor] = []
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        out.extend(i.buffer for i in infos if getattr(i, "buffer", None) is not None)
    return out


def fsdp_unsharded_grads(module: nn.Module) -> list[torch.Tensor]:
    """The unsharded gradients FSDP2 has accumulated on the ``fully_shard``-ed modules under ``module`` (backwards
    run without gradient sync keep them until the reduction; FSDP2 has no public accessor). Read-only."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        for p in getattr(group, "fsdp_params", ()):
            grad = p.unsharded_accumulated_grad
            if grad is None and hasattr(p, "_unsharded_param"):
                grad = p._unsharded_param.grad
            if grad is not None:
                out.append(grad)
    return out


def tensor_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage holding ``t``'s data: a DTensor's local shard, the inner tensor of a functional collective's
    not yet waited result (``AsyncCollectiveTensor.elem``, not waited on here); None for meta tensors, opaque layouts
    (oneDNN-packed weights) and other storage-less subclasses."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        t = t.elem
    if t.is_meta or t.layout != torch.strided or (type(t) is not torch.Tensor and not isinstance(t, nn.Parameter)):
        return None
    return t.untyped_storage()


class TransientTensors:
    """Peak bytes of the transient tensors that torch ops create on this thread while it is entered: storages
    created and freed inside, counted from the tensors themselves (a ``TorchDispatchMode`` sees every op's outputs,
    a finalizer on each new storage sees its release). Storages still alive at the exit (caches, results) are left
    out. Allocator scratch, kernel workspaces and other threads' allocations (gloo's per-collective buffers) are no
    tensors and never count, so the figure depends on the ops alone, not on thread scheduling."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {id(s) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and (s := tensor_storage(a))}
                for t in tree_leaves(out):  # views and in-place results alias an input: nothing new
                    if isinstance(t, torch.Tensor) and (s := tensor_storage(t)) is not None and id(s) not in inputs:
                        tracker._created(s)
                return out

        self._mode = _Mode()
        self._events: list[tuple[int, int]] = []  # (storage key, +bytes / -bytes) in order
        self._live: set[int] = set()
        self._next = self._first = 0  # storage keys; this region's start at self._first
        self.peak = 0

    def _created(self, storage: torch.UntypedStorage) -> None:
        if not storage.nbytes() or id(storage) in self._live:
            return
        key, nbytes = self._next, storage.nbytes()
        self._next += 1
        self._live.add(id(storage))
        self._events.append((key, nbytes))
        weakref.finalize(storage, self._freed, key, id(storage), nbytes)

    def _freed(self, key: int, ident: int, nbytes: int) -> None:
        self._live.discard(ident)
        self._events.append((key, -nbytes))

    def __enter__(self) -> TransientTensors:
        self._events, self._live, self._first, self.peak = [], set(), self._next, 0
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        events, self._events = self._events, []
        freed = {key for key, n in events if n < 0 and key >= self._first}  # a late release of an earlier region's
        running = 0
        for key, n in events:
            if key in freed:
                running += n
                self.peak = max(self.peak, running)
