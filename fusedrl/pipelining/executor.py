"""Fused executor: runs a lowered dual-model program (Actor + Critic) with ``PipelineStage`` objects.

torch's own ``_PipelineScheduleRuntime`` keys everything by stage index and holds one model, so this
executor interprets :class:`~fusedrl.pipelining.lowering.LoweredProgram` itself, driving the stock
``PipelineStage`` methods (``forward_one_chunk``, ``backward_one_chunk``, ``get_*_ops``,
``perform_reduce_grad``) of both models.

The Critic is optional: critic-free algorithms (GRPO, RLOO, ...) train the Actor alone with a program whose Critic
has 0 micro-batches (``lower(schedule, placement, {ACTOR: m, CRITIC: 0})``) and no Critic :class:`StageModule`;
then no Critic stage is built, :meth:`FusedPipelineSchedule.step` takes ``None`` for the Critic's inputs and
targets and returns the Actor's result only. The planner's split-backward schedules (``fused_schedule(...,
mb_critic=0, split_backward=True)``: each backward as an input backward I and a weight backward W, the W's in the
bubbles) are the single-model counterpart of the fused Actor+Critic schedule.

Loss scaling: each micro-batch loss is divided by that model's micro-batch count ``M`` before its backward
(not the gradients afterwards, so gradients may accumulate over several steps), and FSDP2 averages the
gradients over ``dp_shard``. The gradient is therefore that of ``mean over dp ranks and micro-batches of
loss_fn(micro-batch)``, which equals the full-batch gradient whenever ``loss_fn`` is a mean over equally
sized micro-batches.

Critic replicas: a program whose Critic has fewer stages than the Actor (``Placement(pp, critic_stages)``) runs
``K = pp / critic_stages`` Critic replicas, each on its own block of pipeline ranks; the Critic's batch is cut into
``K x M`` micro-batches and replica ``r`` trains micro-batches ``r*M .. r*M+M-1`` (``M`` = the program's Critic
micro-batches, per replica). The replicas' gradients are averaged by FSDP2's hybrid sharding: each Critic stage
must be ``fully_shard``-ed over a 2-D mesh whose replicate dim holds the K ranks of that stage
(``ParallelDims.build_critic_mesh()["critic_replica", "dp_shard"]``), so the one gradient reduction per step
averages over replicas and data-parallel shards alike, and every replica takes the same optimizer step.

Shapes: stages use static shape metadata (no communication when they are built). All micro-batches of one
step share one shape, so the batch must be divisible by the model's micro-batch count and sequences are
right-padded to a common length. Pad each minibatch to one of a few bucket lengths (see
:mod:`fusedrl.buckets`): the executor builds and caches one ``PipelineStage`` pair per distinct shape.

Hot path: a step adds nothing to the program's own work (no barrier, no device synchronization, no host
read of a device value, no object collective) unless it is asked to record its timeline
(``step(..., record=True)``); then it starts after a barrier and times every compute action (with CUDA
events on a GPU, read once at the end of the step).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from fusedrl.distributed import DecoderStage
from fusedrl.distributed.compat import pipeline_stage_on_ranks, prepare_static_stage, recomputes_in_backward
from fusedrl.pipelining.ir import ACTOR, CRITIC, MODELS, Action
from fusedrl.pipelining.lowering import (
    COMM_KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    LoweredProgram,
    Message,
    comm_batches,
    message_of,
    needed_message,
    peer_of,
)
from fusedrl.pipelining.timeline import TimedAction, Timeline

STAGE_CACHE_SIZE = 2
"""Pipeline stages the fused executor keeps per model, one per micro-batch shape, least recently used evicted. Each
preallocates its receive buffers (M activation and M gradient buffers of ``c x T x D``: 6 GiB per rank at
Llama-3.1-70B's longest bucket), and long-tailed lengths visit many sequence buckets over a run."""


def _minibatch_to_device(
    device: torch.device, inputs: tuple[torch.Tensor, ...], targets: tuple[dict[str, torch.Tensor], ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[dict[str, torch.Tensor], ...]]:
    """A minibatch shard's tensors on ``device``, each moved once, before it is split into micro-batches: on CUDA
    through pinned host memory without blocking the host (a copy queued before the first forward, instead of one
    blocking copy per micro-batch, and targets after the forward's launch). A tensor passed twice (the Actor's and
    the Critic's tokens) moves once."""
    moved: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            pinned = device.type == "cuda" and t.device.type == "cpu"
            moved[id(t)] = t.pin_memory().to(device, non_blocking=True) if pinned else t.to(device)
        return moved[id(t)]

    return tuple(move(t) for t in inputs), tuple({k: move(v) for k, v in d.items()} for d in targets)


LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]]
"""``loss_fn(last_stage_output, targets_of_the_micro_batch) -> (scalar loss, stats)``."""


class StageModule:
    """This rank's stage of one model, its loss and how its activations look.

    Activations between stages are ``[micro_batch, seq, hidden_dim]`` in ``activation_dtype`` (the compute
    dtype: bfloat16 under an FSDP2 bf16 mixed-precision policy); the last stage returns float32
    ``[micro_batch, seq, output_dim]`` (the vocabulary for a policy that applies its LM head, the hidden width for
    one whose loss applies it, 1 for a value model); the first stage takes the token ids ``[micro_batch, seq]``.
    A :class:`~fusedrl.distributed.DecoderStage` (``split_decoder``) states both dims itself; any other module needs
    them passed.
    """

    def __init__(
        self,
        module: nn.Module,
        loss_fn: LossFn,
        activation_dtype: torch.dtype = torch.float32,
        *,
        hidden_dim: int | None = None,
        output_dim: int | None = None,
    ) -> None:
        self.module, self.loss_fn, self.activation_dtype = module, loss_fn, activation_dtype
        self.hidden_dim: int = _stage_dim(module, "hidden_dim", hidden_dim)
        self.output_dim: int = _stage_dim(module, "output_dim", output_dim)


def _stage_dim(module: nn.Module, name: str, given: int | None) -> int:
    if given is not None:
        return given
    if isinstance(module, DecoderStage):  # also once FSDP2 or TP parallelized it (the class stays a subclass)
        return getattr(module, name)
    raise ValueError(f"StageModule: a {type(module).__name__} does not state its {name}; pass {name}=")


@dataclass
class ModelStepResult:
    """Mean loss and stats over a model's micro-batches, as detached 0-dim tensors on the stage's device (read
    them when needed: reading is a host synchronization); None/empty on ranks without its last stage."""

    loss: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


class StepObserver:
    """Watches :meth:`FusedPipelineSchedule.step` from outside (``fusedrl.memory`` measures with it): the executor
    calls these around its step, each compute action and each model's gradient reduction (of the models it trains:
    never the Critic's when it has none). No-ops here."""

    def step_started(self) -> None:
        pass

    def forward_started(self, model: str, microbatch: int) -> None:
        pass

    def forward_finished(self, model: str, microbatch: int, stage: PipelineStage, output: Any) -> None:
        """After the stage's forward (and on its last stage the loss); ``output``: the stage's output."""

    def backward_finished(self, model: str, microbatch: int, released: bool) -> None:
        """``released``: the micro-batch's last backward action on this stage (B, or W when split) has run."""

    def reduce_started(self, model: str, stage: PipelineStage) -> None:
        pass

    def step_finished(self) -> None:
        pass


class FusedPipelineSchedule:
    """Trains the Actor and the Critic on the same pipeline ranks with one lowered program, or the Actor alone.

    Actor stage ``i`` lives on pipeline rank ``i`` and Critic stage ``j`` on rank ``pp-1-j`` (the placement
    of ``program``; a Critic with fewer stages runs as replicas, see the module doc). Every rank of ``group`` (the
    pipeline group; for FSDP2 the stage modules are already ``fully_shard``-ed over dp_shard) constructs this with
    its own stage modules and calls :meth:`step` with the same minibatch. The unfused baseline is the same executor
    with a ``sequential_1f1b`` program.

    ``critic`` is optional: None (critic-free training) needs a program whose Critic has 0 micro-batches, and a
    program with Critic micro-batches needs a ``critic`` (ValueError otherwise). :attr:`models` holds the
    :class:`StageModule` of each model present, the Actor first.
    """

    def __init__(
        self,
        program: LoweredProgram,
        actor: StageModule,
        critic: StageModule | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        placement = program.placement
        if placement.pp < 2:
            raise ValueError("the fused executor needs pp >= 2; with pp=1 train the models without pipelining")
        program.verify()  # before any communication: a bad program never starts
        models = _present_models(actor, critic, program.microbatches, "the program")
        if critic is not None and placement.critic_replicas > 1:
            _check_replicated(critic.module, placement.critic_replicas)
        if any(a.kind in ("I", "W") for prog in program.programs.values() for a in prog):
            for spec in models.values():
                for module in spec.module.modules():
                    if recomputes_in_backward(module):
                        raise ValueError(
                            "the program splits backwards into I and W, which torch cannot run on layers recomputed in "
                            "the backward (activation checkpointing); plan without split backward or turn recomputation off"
                        )
                    # W runs on the graph of the unsharded parameters that its I saw: FSDP2 must keep the stage
                    # unsharded from its forward to its W (resharding after forward loses the weight gradients).
                    if isinstance(module, FSDPModule):
                        module.set_reshard_after_forward(False, recurse=False)
        world = dist.get_world_size(group)
        if world != placement.pp:
            raise ValueError(f"pipeline group has {world} ranks but the program is for pp={placement.pp}")
        _check_same_program(program, group)
        self.program = program
        self.group = group
        self.rank = dist.get_rank(group)
        self.models: dict[str, StageModule] = models
        self.stage_index, self.replica = {}, {}
        for m in self.models:
            self.stage_index[m], self.replica[m] = placement.stage_at(m, self.rank)
        if device is None:
            device = next(actor.module.parameters(), torch.empty(0)).device
        self.device = torch.device(device)
        self.timeline: Timeline | None = None  # of the last step, when it was recorded
        self._steps = compile_rank_program(program, self.rank)
        self._stages: OrderedDict[tuple, PipelineStage] = OrderedDict()  # least recently used first
        self.observer: StepObserver | None = None

    @property
    def stages(self) -> dict[tuple, PipelineStage]:
        """The cached stages by ``(model, micro-batches, input shape, input dtype)``, least recently used first."""
        return dict(self._stages)

    def _stage(self, model: str, mb_input: torch.Tensor) -> PipelineStage:
        """``model``'s stage for micro-batches shaped like ``mb_input``: cached per shape, at most
        :data:`STAGE_CACHE_SIZE` per model (every rank sees the same shapes, so every rank evicts the same)."""
        n_mb = self.program.microbatches[model]
        key = (model, n_mb, tuple(mb_input.shape), mb_input.dtype)
        if key in self._stages:
            self._stages.move_to_end(key)
            return self._stages[key]
        cached = [k for k in self._stages if k[0] == model]
        if len(cached) >= STAGE_CACHE_SIZE:  # before building the next one: the peak holds at most the cap
            del self._stages[cached[0]]  # freed at once (no reference cycle holds a stage: tests/test_executor.py)
        spec, s, n = self.models[model], self.stage_index[model], self.program.placement.num_stages(model)
        b, seq = mb_input.shape[:2]

        def act(dim: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(b, seq, dim, dtype=dtype, device=self.device, requires_grad=True)

        # Non-first stages need requires_grad example inputs, or received activations get no gradient.
        example_in = mb_input.to(self.device) if s == 0 else act(spec.hidden_dim, spec.activation_dtype)
        example_out = act(spec.output_dim, torch.float32) if s == n - 1 else act(spec.hidden_dim, spec.activation_dtype)
        ranks = [self.program.placement.rank_of(model, j, self.replica[model]) for j in range(n)]
        stage = pipeline_stage_on_ranks(spec.module, s, ranks, self.device, example_in, example_out, self.group)
        prepare_static_stage(stage, n_mb)  # static metadata: no P2P while building
        self._stages[key] = stage
        return stage

    def _split(self, model: str, inputs: torch.Tensor, targets: dict[str, torch.Tensor]):
        """This rank's micro-batches of ``model``: all M of the batch, or for a Critic replica its M of K x M."""
        m = self.program.microbatches[model]
        replicas = self.program.placement.critic_replicas if model == CRITIC else 1
        if inputs.dim() != 2:
            raise ValueError(f"{model} inputs must be token ids [batch, seq], got shape {tuple(inputs.shape)}")
        batch = inputs.shape[0]
        if batch % (m * replicas):
            counted = f"{m} micro-batches" if replicas == 1 else f"{replicas} replicas x {m} micro-batches"
            raise ValueError(
                f"{model} batch {batch} is not divisible by its {counted}; change the minibatch size or the micro-batch count"
            )
        for name, t in targets.items():
            if t.shape[0] != batch:
                raise ValueError(f"{model} target {name!r} has batch {t.shape[0]}, inputs have {batch}")
        size = batch // (m * replicas)
        rows = [slice((self.replica[model] * m + i) * size, (self.replica[model] * m + i + 1) * size) for i in range(m)]
        return [inputs[r] for r in rows], [{k: v[r] for k, v in targets.items()} for r in rows]

    def step(
        self,
        actor_inputs: torch.Tensor,
        critic_inputs: torch.Tensor | None,
        actor_targets: dict[str, torch.Tensor],
        critic_targets: dict[str, torch.Tensor] | None,
        *,
        record: bool = False,
        documents: torch.Tensor | None = None,
    ) -> dict[str, ModelStepResult]:
        """Forward, backward and gradient reduction of one minibatch for every model it trains.

        Gradients accumulate into ``.grad`` (zero them between optimizer steps). Returns per model the mean
        micro-batch loss and stats on the rank that holds its last stage (each Critic replica's last stage: over
        that replica's micro-batches). ``record``: time every compute action into :attr:`timeline` (else it is
        None after the step). Without a Critic, ``critic_inputs`` and ``critic_targets`` must be None and the
        result holds the Actor's entry only. Packed rows (:mod:`fusedrl.rlhf.packing`): ``documents`` are the inputs'
        ``[B, S]`` document ids, split like them and passed to every stage's forward as ``documents=``.
        """
        inputs, targets = _model_batches(self.models, actor_inputs, critic_inputs, actor_targets, critic_targets)
        moved_inputs, moved_targets = _minibatch_to_device(self.device, tuple(inputs.values()), tuple(targets.values()))
        split = {m: self._split(m, x, t) for m, x, t in zip(self.models, moved_inputs, moved_targets)}
        # the document ids stay on the host: a stage reads their spans without a device-to-host copy
        stage_kwargs: dict[str, list[dict[str, torch.Tensor]]] = {
            m: [{} for _ in split[m][0]] if documents is None else [{"documents": d} for d in self._split(m, documents, {})[0]]
            for m in self.models
        }
        stages = {m: self._stage(m, split[m][0][0]) for m in self.models}  # same build order on every rank
        for st in stages.values():
            st.clear_runtime_states()
        losses: dict[str, list[torch.Tensor]] = {m: [] for m in self.models}
        stats: dict[str, list[Mapping[str, torch.Tensor | float]]] = {m: [] for m in self.models}
        pending_loss: dict[tuple[str, int], torch.Tensor] = {}
        backwards = {m: 0 for m in self.models}
        watch = self.observer or StepObserver()
        split_backward = {m: any(a.kind == "W" for a in self.program.programs[self.rank] if a.model == m) for m in self.models}

        def compute(a: Action) -> None:
            if a.kind == "F":
                watch.forward_started(a.model, a.microbatch)
                watch.forward_finished(a.model, a.microbatch, stages[a.model], run(a))
            else:
                run(a)
                watch.backward_finished(a.model, a.microbatch, a.kind == ("W" if split_backward[a.model] else "B"))

        def run(a: Action) -> Any:
            st, m = stages[a.model], a.model
            n_mb = self.program.microbatches[m]
            if a.kind == "F":
                args = (split[m][0][a.microbatch],) if st.is_first else ()
                out = st.forward_one_chunk(a.microbatch, args, stage_kwargs[m][a.microbatch], save_forward_output=False)
                if st.is_last:
                    loss, mb_stats = self.models[m].loss_fn(out, split[m][1][a.microbatch])
                    pending_loss[(m, a.microbatch)] = loss / n_mb
                    losses[m].append(loss.detach())
                    stats[m].append(mb_stats)
                return out
            if a.kind in ("B", "I"):
                if a.kind == "B":
                    backwards[m] += 1
                st.backward_one_chunk(
                    a.microbatch,
                    loss=pending_loss.pop((m, a.microbatch), None),
                    full_backward=a.kind == "B",
                    last_backward=backwards[m] == n_mb,
                )
            else:  # W
                backwards[m] += 1
                st.backward_weight_one_chunk(a.microbatch, last_backward=backwards[m] == n_mb)

        def comm_ops(a: Action) -> list[dist.P2POp]:
            st = stages[a.model]
            return {
                SEND_F: st.get_fwd_send_ops,
                RECV_F: st.get_fwd_recv_ops,
                SEND_B: st.get_bwd_send_ops,
                RECV_B: st.get_bwd_recv_ops,
            }[a.kind](a.microbatch)

        watch.step_started()
        self.timeline = run_rank_program(
            self._steps, self.rank, compute, comm_ops, group=self.group, record=record, device=self.device
        )
        for m in self.models:  # same order on every rank: FSDP reduce-scatters are collectives over dp_shard
            watch.reduce_started(m, stages[m])
            stages[m].perform_reduce_grad(1)  # losses were already divided by M
        watch.step_finished()
        return {m: _summarize(losses[m], stats[m]) for m in self.models}


class LocalSchedule:
    """pp = 1: each model is whole on every rank (FSDP2-sharded over dp_shard) and the two train one after the
    other: each model's micro-batches run forward and backward in turn (each loss divided by the micro-batch
    count, gradients accumulated), FSDP2's gradient reduction runs once per model, after its last micro-batch.
    The same :meth:`step` as :class:`FusedPipelineSchedule`; there are no pipeline bubbles to fuse.

    ``critic`` is optional: None trains the Actor alone (``microbatches[CRITIC]`` then 0 or absent; a Critic
    micro-batch count above 0 needs a ``critic``, ValueError otherwise).
    """

    def __init__(
        self,
        actor: StageModule,
        critic: StageModule | None,
        microbatches: Mapping[str, int],
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        counts = dict(microbatches)
        if critic is None:
            counts.setdefault(CRITIC, 0)
        self.models: dict[str, StageModule] = _present_models(actor, critic, counts, "microbatches")
        for m in self.models:
            if counts[m] < 1:
                raise ValueError(f"{m}: micro-batch count must be >= 1, got {counts[m]}")
        self.microbatches = counts
        self.group = group
        if device is None:
            device = next(actor.module.parameters(), torch.empty(0)).device
        self.device = torch.device(device)
        self.timeline: Timeline | None = None  # of the last step, when it was recorded

    def step(
        self,
        actor_inputs: torch.Tensor,
        critic_inputs: torch.Tensor | None,
        actor_targets: dict[str, torch.Tensor],
        critic_targets: dict[str, torch.Tensor] | None,
        *,
        record: bool = False,
        documents: torch.Tensor | None = None,
        microbatches: int | None = None,
    ) -> dict[str, ModelStepResult]:
        """Forward, backward and gradient reduction of one minibatch for every model it trains (see the class doc);
        without a Critic, ``critic_inputs`` and ``critic_targets`` must be None and the result holds the Actor only.

        Packed rows (:mod:`fusedrl.rlhf.packing`): ``documents`` are the inputs' ``[B, S]`` document ids, split like
        them and passed to each model's forward as ``documents=``; ``microbatches`` sets this step's micro-batch count
        for every model instead of the constructor's (a packed minibatch's count varies with its lengths)."""
        batches = _model_batches(self.models, actor_inputs, critic_inputs, actor_targets, critic_targets)
        clock = (
            _ActionClock(dist.get_rank(self.group) if dist.is_initialized() else 0, self.group, self.device) if record else None
        )
        results = {}
        moved_inputs, moved_targets = _minibatch_to_device(self.device, tuple(batches[0].values()), tuple(batches[1].values()))
        for m, inputs, targets in zip(self.models, moved_inputs, moved_targets):
            spec, n_mb = self.models[m], microbatches or self.microbatches[m]
            if inputs.shape[0] % n_mb:
                raise ValueError(f"{m} batch {inputs.shape[0]} is not divisible by its {n_mb} micro-batches")
            size = inputs.shape[0] // n_mb
            losses: list[torch.Tensor] = []
            stats: list[Mapping[str, torch.Tensor | float]] = []
            for i in range(n_mb):
                sync = getattr(spec.module, "set_requires_gradient_sync", None)
                if sync is not None:  # FSDP2 reduce-scatters after the last micro-batch only
                    sync(i == n_mb - 1)
                rows = slice(i * size, (i + 1) * size)
                if clock:
                    clock.start()
                if documents is None:
                    out = spec.module(inputs[rows])
                else:  # the ids stay on the host (see FusedPipelineSchedule.step)
                    out = spec.module(inputs[rows], documents=documents[rows])
                loss, mb_stats = spec.loss_fn(out, {k: v[rows] for k, v in targets.items()})
                if clock:
                    clock.stop(Action(m, 0, i, "F"))
                    clock.start()
                (loss / n_mb).backward()
                if clock:
                    clock.stop(Action(m, 0, i, "B"))
                losses.append(loss.detach())
                stats.append(mb_stats)
            results[m] = _summarize(losses, stats)
        self.timeline = clock.timeline() if clock else None
        return results


def _present_models(
    actor: StageModule, critic: StageModule | None, microbatches: Mapping[str, int], where: str
) -> dict[str, StageModule]:
    """The models to train, in :data:`MODELS` order: the Critic only when given, and then only with micro-batches."""
    mc = microbatches.get(CRITIC, 0)
    if critic is None and mc:
        raise ValueError(
            f"{where} has {mc} Critic micro-batches but no Critic StageModule was given; pass critic=, or plan with "
            "mb_critic=0 to train the Actor alone"
        )
    if critic is not None and not mc:
        raise ValueError(
            f"{where} has 0 Critic micro-batches but a Critic StageModule was given; pass critic=None to train the Actor "
            "alone, or plan with mb_critic >= 1"
        )
    present = {ACTOR: actor, CRITIC: critic}
    return {m: spec for m in MODELS if (spec := present[m]) is not None}


def _model_batches(
    models: Mapping[str, StageModule],
    actor_inputs: torch.Tensor,
    critic_inputs: torch.Tensor | None,
    actor_targets: dict[str, torch.Tensor],
    critic_targets: dict[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A step's inputs and targets by model, for the models it trains (in ``models`` order); the Critic's must be
    given exactly when it trains."""
    if CRITIC in models:
        if critic_inputs is None or critic_targets is None:
            raise ValueError("this schedule trains a Critic: pass critic_inputs and critic_targets (got None)")
        return {ACTOR: actor_inputs, CRITIC: critic_inputs}, {ACTOR: actor_targets, CRITIC: critic_targets}
    if critic_inputs is not None or critic_targets is not None:
        raise ValueError("this schedule trains no Critic (critic=None): pass critic_inputs=None and critic_targets=None")
    return {ACTOR: actor_inputs}, {ACTOR: actor_targets}


def _check_replicated(module: nn.Module, replicas: int) -> None:
    """Critic replicas train different micro-batches: their gradients must be averaged, which FSDP2 does for
    parameters hybrid-sharded over a mesh whose first (replicate) dim holds the ``replicas`` copies."""
    for name, p in module.named_parameters():
        if not (isinstance(p, DTensor) and p.placements[0].is_replicate() and p.device_mesh.size(0) == replicas):
            raise ValueError(
                f"the program runs {replicas} Critic replicas, but Critic parameter {name!r} is not replicated over them "
                "(its gradient would hold one replica's micro-batches only); fully_shard the Critic stage over "
                'ParallelDims(...).build_critic_mesh()["critic_replica", "dp_shard"] (fusedrl.distributed.apply_fsdp)'
            )


def _check_same_program(program: LoweredProgram, group: dist.ProcessGroup | None) -> None:
    """Every rank must run the same lowered program (e.g. plan once and broadcast, or use a fixed seed/budget)."""
    digest = hashlib.sha256(repr(sorted(program.programs.items())).encode()).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise ValueError(
            f"pipeline ranks hold different programs (digests {digests}); plan the schedule once and "
            "broadcast it, or make the planner deterministic"
        )


def _summarize(losses: list[torch.Tensor], stats: list[Mapping[str, torch.Tensor | float]]) -> ModelStepResult:
    if not losses:
        return ModelStepResult()
    device = losses[0].device
    keys = stats[0].keys() if stats else ()
    mean = {
        k: torch.stack([torch.as_tensor(s[k], dtype=torch.float32, device=device).detach() for s in stats]).mean() for k in keys
    }
    return ModelStepResult(torch.stack(losses).float().mean(), mean)


@dataclass(frozen=True)
class _Step:
    """One entry of a rank's decoded program: a compute action with the message it must wait for (None: its
    inputs are local), or a batch of communication actions posted together (see :func:`comm_batches`)."""

    actions: tuple[Action, ...]
    is_comm: bool
    message: Message | None = None


def compile_rank_program(program: LoweredProgram, rank: int) -> list[_Step]:
    """Decode one rank's program once so that running it does no per-action lookups."""
    placement = program.placement
    prog = program.programs[rank]
    first_of = {batch[0]: batch for batch in comm_batches(prog, placement)}
    steps = []
    for i, a in enumerate(prog):
        if i in first_of:
            steps.append(_Step(tuple(prog[j] for j in first_of[i]), True))
        elif a.kind not in COMM_KINDS:
            steps.append(_Step((a,), False, needed_message(a, placement)))
    return steps


def run_rank_program(
    steps: list[_Step],
    rank: int,
    compute: Callable[[Action], None],
    comm_ops: Callable[[Action], list[dist.P2POp]],
    *,
    group: dist.ProcessGroup | None = None,
    record: bool = False,
    device: torch.device | None = None,
) -> Timeline | None:
    """Interpret one rank's program (:func:`compile_rank_program`): post each communication batch as one P2P
    batch, wait for a compute action's input right before it runs, and wait for all sends at the end. With
    ``record`` returns the measured timeline (compute intervals only; time spent waiting for a message is idle)."""
    received: dict[Message, list[dist.Work]] = {}
    sends: list[dist.Work] = []
    clock = _ActionClock(rank, group, device) if record else None
    for step in steps:
        if step.is_comm:
            per_action = [comm_ops(a) for a in step.actions]
            if not all(per_action):
                raise RuntimeError(f"rank {rank}: {[str(a) for a in step.actions]} have no tensors to send or receive")
            works = dist.batch_isend_irecv([op for ops in per_action for op in ops])
            # gloo returns one handle per operation; a coalescing backend (NCCL) one for the whole batch
            own = len(works) == sum(map(len, per_action))
            start = 0
            for a, ops in zip(step.actions, per_action):
                mine = works[start : start + len(ops)] if own else works
                start += len(ops)
                if a.kind in (SEND_F, SEND_B):
                    sends.extend(mine)
                else:
                    received[message_of(a)] = mine
            continue
        (a,) = step.actions
        if step.message is not None:
            for w in received.pop(step.message):
                w.wait()
        if clock is None:
            compute(a)
        else:
            clock.start()
            compute(a)
            clock.stop(a)
    for w in sends:
        w.wait()
    return None if clock is None else clock.timeline()


class _ActionClock:
    """Times compute actions of a recorded step: host clock on CPU; on CUDA one event pair per action, read
    after the step (one synchronization per recorded step instead of two per action)."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None, device: torch.device | None) -> None:
        if dist.is_initialized():
            dist.barrier(group=group)
        self.rank = rank
        self.cuda = device is not None and device.type == "cuda"
        self.spans: list[tuple[Action, Any, Any]] = []
        if self.cuda:
            torch.cuda.synchronize(device)  # the reference event's host time is then exact
            self.origin = time.perf_counter()
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()

    def start(self) -> None:
        self._begin: torch.cuda.Event | float
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._begin = time.perf_counter()

    def stop(self, action: Action) -> None:
        end: torch.cuda.Event | float
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.spans.append((action, self._begin, end))

    def timeline(self) -> Timeline:
        if not self.cuda:
            return Timeline([TimedAction(self.rank, a, s, e) for a, s, e in self.spans])
        if self.spans:
            self.spans[-1][2].synchronize()

        def host(event: torch.cuda.Event) -> float:
            return self.origin + self.reference.elapsed_time(event) / 1e3

        return Timeline([TimedAction(self.rank, a, host(s), host(e)) for a, s, e in self.spans])


def run_emulated(
    program: LoweredProgram,
    compute_seconds: Callable[[Action], float],
    *,
    message_numel: int = 1024,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> Timeline:
    """Run ``program`` with every compute action replaced by a sleep of ``compute_seconds(action)`` while
    messages (``message_numel`` floats each) really travel: measures the runtime's ordering and overheads."""
    rank = dist.get_rank(group)
    buffers: dict[Message, torch.Tensor] = {}

    def comm_ops(a: Action) -> list[dist.P2POp]:
        msg = message_of(a)
        op: Callable[..., dist.Work | None]
        if a.kind in (SEND_F, SEND_B):
            op, buf = dist.isend, torch.zeros(message_numel, device=device)
        else:
            op, buf = dist.irecv, buffers.setdefault(msg, torch.empty(message_numel, device=device))
        return [dist.P2POp(op, buf, group=group, group_peer=peer_of(a, program.placement))]

    timeline = run_rank_program(
        compile_rank_program(program, rank), rank, lambda a: time.sleep(compute_seconds(a)), comm_ops, group=group, record=True
    )
    assert timeline is not None  # record=True always returns one
    return timeline
