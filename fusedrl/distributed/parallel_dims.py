"""Parallel layout of a job: degrees, validation, DeviceMesh building, process-group setup."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

TRAIN_MESH_DIMS: tuple[str, str, str] = ("pp", "dp_shard", "tp")
GEN_MESH_DIMS: tuple[str, str] = ("gen_dp", "gen_tp")
CRITIC_MESH_DIMS: tuple[str, str, str, str] = ("critic_replica", "critic_pp", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Training layout ``pp x dp_shard x tp == world_size`` and generation layout ``gen_tp`` (TP per instance).

    All checks run in ``__post_init__``, before any collective, so a bad layout fails the same way on
    every rank. ``world_size`` defaults to the initialised process group's size, else ``$WORLD_SIZE``
    (1 when unset).
    """

    pp: int = 1
    dp_shard: int = 1
    tp: int = 1
    gen_tp: int = 1
    world_size: int = field(default=None)  # type: ignore[assignment]  # resolved in __post_init__
    pp_critic: int = field(default=None)  # type: ignore[assignment]  # the Critic's stages; None resolves to pp

    def __post_init__(self) -> None:
        if self.world_size is None:
            ws = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
            object.__setattr__(self, "world_size", ws)
        for name in ("pp", "dp_shard", "tp", "gen_tp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallelism.{name} must be an integer >= 1, got {value!r}")
        if self.pp * self.dp_shard * self.tp != self.world_size:
            raise ValueError(
                f"parallelism pp*dp_shard*tp = {self.pp}*{self.dp_shard}*{self.tp} = "
                f"{self.pp * self.dp_shard * self.tp} does not match the world size {self.world_size}; "
                "choose degrees whose product is the number of processes"
            )
        if self.pp_critic is None:
            object.__setattr__(self, "pp_critic", self.pp)
        if not isinstance(self.pp_critic, int) or self.pp_critic < 1 or self.pp % self.pp_critic:
            raise ValueError(
                f"parallelism.pp_critic = {self.pp_critic!r} must be a divisor of pp = {self.pp} (the Critic runs as "
                "pp / pp_critic replicas)"
            )
        if self.world_size % self.gen_tp != 0:
            raise ValueError(
                f"parallelism.gen_tp = {self.gen_tp} does not divide the world size {self.world_size}; "
                "each generation instance needs gen_tp whole ranks"
            )

    @property
    def num_gen_instances(self) -> int:
        """Number of generation instances (each a full replica, or a TP group of ``gen_tp`` ranks)."""
        return self.world_size // self.gen_tp

    def gen_instance_of(self, rank: int) -> int:
        """Generation instance that ``rank`` belongs to (consecutive ranks form one instance)."""
        return rank // self.gen_tp

    def gen_tp_groups(self) -> list[list[int]]:
        """Global ranks of every generation instance, instance by instance."""
        return [list(range(i * self.gen_tp, (i + 1) * self.gen_tp)) for i in range(self.num_gen_instances)]

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The training mesh with dims ``("pp", "dp_shard", "tp")``; collective: call on every rank."""
        self._check_group()
        return init_device_mesh(device_type, (self.pp, self.dp_shard, self.tp), mesh_dim_names=TRAIN_MESH_DIMS)

    @property
    def critic_replicas(self) -> int:
        return self.pp // self.pp_critic

    def build_critic_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The training ranks seen as Critic replicas: dims ``("critic_replica", "critic_pp", "dp_shard", "tp")``,
        the pipeline dim split into ``critic_replicas`` blocks of ``pp_critic`` consecutive pipeline ranks (the
        same rank order as :meth:`build_mesh`). The Critic shards over ``["critic_replica", "dp_shard"]`` (FSDP2's
        hybrid sharding: replicated over the replicas, so its gradient reduction averages them too); collective."""
        self._check_group()
        shape = (self.critic_replicas, self.pp_critic, self.dp_shard, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=CRITIC_MESH_DIMS)

    def build_gen_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The generation mesh with dims ``("gen_dp", "gen_tp")``; collective: call on every rank."""
        self._check_group()
        return init_device_mesh(device_type, (self.num_gen_instances, self.gen_tp), mesh_dim_names=GEN_MESH_DIMS)

    def _check_group(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("building a DeviceMesh needs an initialised process group; call init_distributed() first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was made for world size {self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks; launch with --nproc_per_node matching pp*dp_shard*tp"
            )


def select_device(setting: str | None = "auto") -> torch.device:
    """This rank's device for ``training.device``: ``cuda`` (GPU ``$LOCAL_RANK``), ``cpu``, or ``auto``/None
    (cuda when available). The one place that decides the device."""
    setting = "auto" if setting is None else setting
    if setting not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {setting!r}")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available; use 'cpu' (or 'auto')")
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    """The default group's backend for a job on ``device``: on CUDA one group serving both devices (NCCL for CUDA
    tensors, gloo for CPU tensors: object collectives, control messages and host-side figures go through gloo
    without a group of their own); gloo on CPU."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def mesh_lines(mesh: DeviceMesh, dim: str) -> list[list[int]]:
    """The global ranks of every line of ``mesh`` along ``dim`` (the ranks that differ only in that coordinate),
    in a fixed order: for creating one group per line, which every rank must do for every line."""
    assert mesh.mesh_dim_names is not None, "mesh_lines needs a mesh with named dims"
    axis = mesh.mesh_dim_names.index(dim)
    return mesh.mesh.movedim(axis, -1).reshape(-1, mesh.size(axis)).tolist()


_SERVES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "fake": {"cpu", "cuda", "meta"}}


def group_devices(group: dist.ProcessGroup | None = None) -> set[str]:
    """Device types whose tensors ``group``'s backend communicates: ``gloo`` CPU, ``nccl`` CUDA, a multi-device
    backend (``"cuda:nccl,cpu:gloo"``) each device it names."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return {part.split(":")[0] for part in backend.split(",")}
    return set(_SERVES.get(backend, {"cpu"}))


def init_distributed(device_type: str | None = None, timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group (nccl on CUDA, gloo on CPU) and return this rank's device
    (:func:`select_device` of ``device_type``).

    Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); without it, a
    single-process group on 127.0.0.1 is created so that the same code runs with ``python -m``.
    On CUDA the current device is set from LOCAL_RANK. Idempotent.
    """
    device = select_device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    backend = default_backend(device)
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout)
    return device
