"""The job's two layouts of the four PPO models, built on the meta device and materialized shard by shard.

A critic-free advantage estimator (``ppo.advantage_estimator`` other than gae) builds no Critic in either layout, and
a job without a KL term (``ppo.kl_coef = ppo.kl_loss_coef = 0``) no Reference, nor a LoRA Actor whose Reference is its own
frozen base (``lora.reference = "base"``: its training stages with the adapters off).

- **Training**: the Actor and the Critic as pipeline stages (Actor stage i on pipeline rank i, Critic stage j on
  rank pp-1-j; a Critic with fewer stages as replicas on blocks of ranks) x tensor parallelism over ``tp`` x FSDP2
  over ``dp_shard``, with a mixed-precision policy (``training.mixed_precision_*``: compute in bf16, float32 master
  weights, optimizer state and gradient reduction). With ``[lora]`` a trained model's projections carry adapters over a
  frozen base stored in the compute dtype (``fusedrl.models.add_lora``, docs/lora.md).
- **Rollout**: ``gen_tp`` consecutive ranks form one generation instance (``world / gen_tp`` instances). Each
  instance holds the engine's Actor, the Reference, the Reward and the scoring Critic, tensor-parallel over its
  ranks (DTensors: attention, MLP, token embedding and LM head sharded, norms and value heads replicated), in
  ``training.rollout_dtype`` / ``training.frozen_dtype``. With ``training.offload_frozen`` the Reference and the
  Reward wait in host memory outside the rollout (:class:`HostCopies`). With ``model.reward = "none"`` (a
  rule-based reward alone) no Reward model is built or loaded. With ``lora.rollout_weights = "adapters"`` the rollout
  copies of the LoRA models carry their adapters unmerged.

Nothing is replicated across ranks that a layout shards: every model is built on the meta device, parallelized
there, then ``to_empty``-ed on the device and filled with only this rank's shards, read as slices from the HF
checkpoint (``fusedrl.models.load_hf_weights``). Without a checkpoint (random initialisation, for tests and
debug runs) the whole model is built once in host memory from a seed and sliced the same way. The rollout copies
of the trained models get their weights from the weight sync, not from here.

:func:`build_training_layout` and :func:`build_rollout_layout` with ``materialize=False`` stop before allocating
anything: ``python -m fusedrl.bench.memory`` measures the real module trees and shardings that way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fusedrl.config import JobConfig
from fusedrl.distributed import (
    VOCAB_MODULES,
    DecoderStage,
    ParallelDims,
    TiedEmbeddings,
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    apply_tp,
    convert_to_float8,
    group_devices,
    mesh_lines,
    split_decoder,
)
from fusedrl.models import (
    CheckpointError,
    ModelFlavor,
    add_lora,
    build_model,
    cast_parameters,
    init_adapters,
    init_rope_buffers,
    load_hf_weights,
    load_state_slices,
    lora_spec,
    model_flavor,
    reference_from_base,
)
from fusedrl.models.registry import Role
from fusedrl.pipelining import CRITIC, Placement

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class TrainingLayout:
    """This rank's place in the (pp, dp_shard, tp) mesh and its training stages of both models, complete when built:
    the executor that runs the stages is its own object (``fusedrl.rlhf.build_executor``).

    The Critic has ``pp_critic`` stages (``critic_index`` is this rank's); with fewer stages than pp it runs as
    ``critic_replicas`` replicas on consecutive blocks of pipeline ranks, and ``critic_group`` holds the pipeline
    ranks of this rank's replica (the pipeline group otherwise)."""

    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    pp_rank: int
    dp_rank: int
    pp: int
    dp: int
    tp: int
    actor_stage: DecoderStage
    critic_stage: DecoderStage | None  # None with a critic-free advantage estimator (ppo.advantage_estimator)
    tied: TiedEmbeddings  # sums the Actor's embedding and LM-head gradients when pipeline stages split them
    critic_index: int
    critic_replicas: int
    critic_group: dist.ProcessGroup


@dataclass
class RolloutLayout:
    """This rank's generation instance and its tensor-parallel rollout models.

    ``group`` holds one rank per instance (the ranks of this rank's TP index: request states travel there),
    ``control_group`` the same ranks on gloo, ``instance_group`` this instance's ranks (gloo; None when
    gen_tp = 1). See :class:`fusedrl.rollout_fusion.MigrationController`.
    """

    mesh: DeviceMesh
    instance: int
    instances: int
    gen_tp: int
    actor: nn.Module  # the engine's Actor, refreshed by weight sync
    critic: nn.Module | None  # the scoring Critic, refreshed by weight sync; None with a critic-free estimator
    reference: nn.Module | None  # None without a KL term (ppo.kl_coef = ppo.kl_loss_coef = 0)
    reward: nn.Module | None  # None with model.reward = "none"
    group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    instance_group: dist.ProcessGroup | None


def dims_of(cfg: JobConfig, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims(pp=p.pp, dp_shard=p.dp_shard, tp=p.tp, gen_tp=p.gen_tp, world_size=world_size, pp_critic=p.critic_stages)


def build_training_layout(cfg: JobConfig, device: torch.device, *, materialize: bool = True) -> TrainingLayout:
    """Split Actor and Critic into pipeline stages, tensor-parallelize them over ``tp`` and shard them with FSDP2
    over ``dp_shard`` (collective). Parameters stay on the meta device unless ``materialize``.

    A Critic with fewer stages than pp (``parallelism.pp_critic``) is hybrid-sharded over its replicas and
    ``dp_shard`` (:meth:`ParallelDims.build_critic_mesh`): FSDP2's gradient reduction then averages the replicas'
    gradients along with the data-parallel shards', once per step."""
    dims = dims_of(cfg, dist.get_world_size())
    mesh = dims.build_mesh(device.type)
    pp_rank = mesh["pp"].get_local_rank()
    t = cfg.training
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[t.mixed_precision_param], reduce_dtype=DTYPES[t.mixed_precision_reduce])

    def stage(
        key: str, flavor: ModelFlavor, role: Role, stages: int, index: int, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh
    ) -> DecoderStage:
        model = build_model(flavor, role, device="meta")
        lora = lora_spec(cfg, key)
        if lora is not None:  # the frozen base is stored as training computes it: bf16 under bf16 mixed precision
            add_lora(model, lora, base_dtype=policy.param_dtype)
        # the Actor's LM head runs in its loss, in chunks of positions: no full-vocabulary logits of a micro-batch
        module = split_decoder(model, stages, apply_head=role == "value")[index]
        if t.float8:  # before parallelizing (torchao's order); the LM / value head stays in high precision
            convert_to_float8(module)
        if t.compile:  # compiled inside the layer's call: checkpointing and FSDP2's hooks wrap it
            apply_compile(module)
        if dims.tp > 1:
            apply_tp(module, tp_mesh, vocab_parallel=() if flavor.tie_word_embeddings else VOCAB_MODULES)
        if t.activation_checkpointing == "full":
            apply_activation_checkpointing(module)
        # unsharded between a micro-batch's forward and backward: one all-gather per stage and step
        apply_fsdp(module, dp_mesh, mp_policy=policy, reshard_after_forward=False)
        if materialize:
            module.to_empty(device=device)
        return module

    actor_flavor = model_flavor(cfg, "actor")
    actor = stage("actor", actor_flavor, "policy", dims.pp, pp_rank, mesh["tp"], mesh["dp_shard"])
    tied = TiedEmbeddings(mesh, actor, actor_flavor.tie_word_embeddings)
    parts = (mesh, mesh.get_group("pp"), pp_rank, mesh["dp_shard"].get_local_rank(), dims.pp, dims.dp_shard, dims.tp, actor)
    if cfg.ppo.critic_free:
        return TrainingLayout(*parts, None, tied, 0, 1, mesh.get_group("pp"))
    critic_flavor = model_flavor(cfg, "critic")
    c = dims.pp_critic
    critic_index, _ = Placement(dims.pp, c).stage_at(CRITIC, pp_rank)
    if dims.critic_replicas > 1:
        cmesh = dims.build_critic_mesh(device.type)
        critic = stage("critic", critic_flavor, "value", c, critic_index, cmesh["tp"], cmesh["critic_replica", "dp_shard"])
        critic_group = cmesh.get_group("critic_pp")
    else:
        critic = stage("critic", critic_flavor, "value", c, critic_index, mesh["tp"], mesh["dp_shard"])
        critic_group = mesh.get_group("pp")
    return TrainingLayout(*parts, critic, tied, critic_index, dims.critic_replicas, critic_group)


def build_rollout_layout(cfg: JobConfig, device: torch.device, *, materialize: bool = True) -> RolloutLayout:
    """The generation instances and their tensor-parallel models (collective). Meta unless ``materialize``."""
    dims = dims_of(cfg, dist.get_world_size())
    mesh = dims.build_gen_mesh(device.type)
    t, m = cfg.training, cfg.model

    def model(flavor: ModelFlavor, role: Role, dtype: str, key: str | None = None) -> nn.Module:
        """A rollout copy; ``key``: the trained model it copies, whose adapters it carries unmerged (in its own
        dtype, as training computes them) under ``lora.rollout_weights = "adapters"``."""
        module = build_model(flavor, role, device="meta")
        lora = None if key is None or cfg.lora.rollout_weights == "merged" else lora_spec(cfg, key)
        if lora is not None:
            add_lora(module, lora)
        module = cast_parameters(module, DTYPES[dtype])  # RoPE tables stay float32
        if t.compile:  # the scoring forward; the engine runs its own decode and prefill
            apply_compile(module)
        if dims.gen_tp > 1:
            apply_tp(module, mesh["gen_tp"])
        if materialize:
            module.to_empty(device=device)
            init_rope_buffers(module)
        return module.eval().requires_grad_(False)

    group = mesh["gen_dp"].get_group()
    # control messages are CPU tensors: a group whose backend carries them (gloo, "cuda:nccl,cpu:gloo", or the
    # fake backend of memory estimates) serves as is, an NCCL-only one gets gloo copies
    gloo = "cpu" in group_devices(group)
    control = group if gloo else _gloo_copy(mesh, "gen_dp")
    instance = None if dims.gen_tp == 1 else (mesh["gen_tp"].get_group() if gloo else _gloo_copy(mesh, "gen_tp"))
    reference_in_rollout = cfg.ppo.uses_reference and not reference_from_base(cfg)  # else the LoRA Actor's base
    return RolloutLayout(
        mesh,
        mesh["gen_dp"].get_local_rank(),
        dims.num_gen_instances,
        dims.gen_tp,
        actor=model(model_flavor(cfg, "actor"), "policy", t.rollout_dtype, "actor"),
        critic=None if cfg.ppo.critic_free else model(model_flavor(cfg, "critic"), "value", t.rollout_dtype, "critic"),
        reference=model(model_flavor(cfg, "actor"), "policy", t.frozen_dtype) if reference_in_rollout else None,
        reward=model(model_flavor(cfg, "reward"), "value", t.frozen_dtype) if m.uses_reward_model else None,
        group=group,
        control_group=control,
        instance_group=instance,
    )


def _gloo_copy(mesh: DeviceMesh, dim: str) -> dist.ProcessGroup:
    """A gloo group of the ranks that share this rank's coordinate on every mesh dim but ``dim`` (collective:
    every rank creates every such group, in the same order)."""
    mine = None
    for row in mesh_lines(mesh, dim):
        g = dist.new_group(row, backend="gloo")
        if dist.get_rank() in row:
            mine = g
    assert mine is not None
    return mine


# ---------------------------------------------------------------------------------------------- weights


def load_initial_weights(cfg: JobConfig, training: TrainingLayout, rollout: RolloutLayout) -> None:
    """Fill the training stages, the Reference and the Reward from their checkpoints (this rank's slices only),
    or from a seeded random initialisation (every rank draws the same full model). The rollout copies of the
    Actor and the Critic are filled by the first weight sync."""
    m = cfg.model
    actor_flavor = model_flavor(cfg, "actor")
    actor = _source(cfg, actor_flavor, "policy", m.actor_path, offset=0)
    actor(training.actor_stage)
    if training.critic_stage is not None:
        _source(cfg, model_flavor(cfg, "critic"), "value", m.critic_path, offset=1)(training.critic_stage)
    for stage, offset in ((training.actor_stage, 0), (training.critic_stage, 1)):
        if stage is not None:  # LoRA adapters (a stage without them has none to fill)
            init_adapters(stage, cfg.job.seed * 7919 + offset)
    if rollout.reference is not None:
        (_source(cfg, actor_flavor, "policy", m.reference_path, offset=3) if m.reference_path else actor)(rollout.reference)
    if rollout.reward is not None:
        _source(cfg, model_flavor(cfg, "reward"), "value", m.reward_path, offset=2)(rollout.reward)


def _source(cfg: JobConfig, flavor: ModelFlavor, role: Role, path: str | None, offset: int) -> Callable[[nn.Module], None]:
    """A function filling a module of (flavor, role) from ``path`` or from the seeded random initialisation."""
    if path:

        def from_checkpoint(module: nn.Module) -> None:
            if role == "policy":
                load_hf_weights(module, path, flavor, role)
                return
            try:  # a value model from a value checkpoint, or from an LM checkpoint with a fresh head
                load_hf_weights(module, path, flavor, role)
            except CheckpointError as value_error:
                torch.manual_seed(cfg.job.seed * 7919 + offset)  # the fresh head is the same on every rank
                try:
                    load_hf_weights(module, path, flavor, role, init_value_head_from_lm=True)
                except CheckpointError:
                    raise value_error from None

        return from_checkpoint
    state: dict[str, torch.Tensor] = {}

    def from_seed(module: nn.Module) -> None:
        if not state:  # built once per model, whatever the number of modules filled from it
            torch.manual_seed(cfg.job.seed * 7919 + offset)
            state.update(build_model(flavor, role).state_dict())
        load_state_slices(module, state)

    return from_seed


class HostCopies:
    """Frozen modules whose weights live in host memory between the phases that use them
    (``training.offload_frozen``): :meth:`release` frees the device storage of every parameter (the tensors, and
    their DTensor wrappers, stay), :meth:`restore` copies the host copy back into a fresh one. The host copy is
    taken once, from the loaded weights; pinned on CUDA so the copies run at full PCIe / C2C bandwidth."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for module in modules:
            for p in module.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                if local.storage_offset() or local.untyped_storage().nbytes() != local.numel() * local.element_size():
                    raise ValueError(
                        "offload_frozen needs every frozen parameter to own its storage; a view or a "
                        "shared storage cannot be freed alone"
                    )
                # pinned from the start: one host copy, never a pageable one pinned afterwards
                host = torch.empty_like(local, device="cpu", pin_memory=local.is_cuda)
                self._pairs.append((local, host.copy_(local.detach())))

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, h in self._pairs)

    def release(self) -> None:
        for local, _ in self._pairs:
            local.untyped_storage().resize_(0)

    def restore(self) -> None:
        """Copies on the current stream: work queued after this call sees the weights."""
        with torch.no_grad():
            for local, host in self._pairs:
                local.untyped_storage().resize_(host.numel() * host.element_size())
                local.copy_(host, non_blocking=True)
