"""Parallel layout of a job: degrees, their startup checks, DeviceMesh building, process-group setup."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fusedrl.config import ConfigError, JobConfig, Startup
from fusedrl.config.loader import divisors, source_of
from fusedrl.distributed.tp import tp_indivisible
from fusedrl.models import model_flavors

TRAIN_MESH_DIMS: tuple[str, str, str] = ("pp", "dp_shard", "tp")
GEN_MESH_DIMS: tuple[str, str] = ("gen_dp", "gen_tp")
CRITIC_MESH_DIMS: tuple[str, str, str, str] = ("critic_replica", "critic_pp", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Training layout ``pp x dp_shard x tp == world_size`` and generation layout ``gen_tp`` (TP per instance).

    All checks run in ``__post_init__`` (:func:`check_layout`), before any collective, so a bad layout fails the
    same way on every rank. ``world_size`` defaults to the initialised process group's size, else ``$WORLD_SIZE``
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
        if self.pp_critic is None:
            object.__setattr__(self, "pp_critic", self.pp)
        for name in ("pp", "dp_shard", "tp", "gen_tp", "world_size", "pp_critic"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallelism.{name} must be an integer >= 1, got {value!r}")
        check_layout(self.pp, self.dp_shard, self.tp, self.gen_tp, self.world_size, self.pp_critic)

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


def check_layout(
    pp: int, dp_shard: int, tp: int, gen_tp: int, world_size: int, pp_critic: int, source: Callable[[str], str] | None = None
) -> None:
    """The parallel degrees against the world size (raises ConfigError): ``pp * dp_shard * tp`` ranks, ``gen_tp``
    dividing them, ``pp_critic`` dividing ``pp``. ``source(key)`` names where ``parallelism.<key>`` came from."""

    def where(*keys: str) -> str:
        return f" ({', '.join(sorted({source(k) for k in keys}))})" if source is not None else ""

    product = pp * dp_shard * tp
    if product != world_size:
        if world_size % (pp * tp) == 0:
            fix = f"set --parallelism.dp_shard={world_size // (pp * tp)} or launch {product} processes"
        else:
            fix = f"choose pp, dp_shard and tp whose product is {world_size}, or launch {product} processes"
        raise ConfigError(
            f"parallelism.pp * parallelism.dp_shard * parallelism.tp = {pp} * {dp_shard} * {tp} = {product}"
            f"{where('pp', 'dp_shard', 'tp')}: must equal the world size {world_size}; {fix}"
        )
    if world_size % gen_tp:
        raise ConfigError(
            f"parallelism.gen_tp = {gen_tp}{where('gen_tp')}: must divide the world size {world_size} (each generation "
            f"instance holds gen_tp whole ranks); choose one of {divisors(world_size)}"
        )
    if pp % pp_critic:
        raise ConfigError(
            f"parallelism.pp_critic = {pp_critic}{where('pp_critic')}: must divide parallelism.pp = {pp} (the Critic runs "
            f"as pp / pp_critic replicas); choose one of {divisors(pp)}"
        )


def check_dims(cfg: JobConfig, world_size: int) -> None:
    """The [parallelism] degrees of ``cfg`` against ``world_size`` (:func:`check_layout`) and the split of a
    minibatch's micro-batches over the Critic's replicas (raises ConfigError)."""
    par = cfg.parallelism
    check_layout(
        par.pp, par.dp_shard, par.tp, par.gen_tp, world_size, par.critic_stages, lambda k: source_of(cfg, f"parallelism.{k}")
    )
    microbatches = cfg.microbatches
    if microbatches % par.critic_replicas:
        raise ConfigError(
            f"parallelism.pp_critic = {par.pp_critic} ({source_of(cfg, 'parallelism.pp_critic')}): the "
            f"{par.critic_replicas} Critic replicas split each minibatch's {microbatches} micro-batches per data-parallel "
            f"shard evenly; make that count (ppo.minibatch_size / dp_shard / microbatch_size) a multiple of "
            f"{par.critic_replicas}, or choose another pp_critic"
        )


def check_parallelism(startup: Startup) -> None:
    """Startup check: :func:`check_dims`, and the prompts of a batch split evenly over the generation instances."""
    cfg, world_size = startup.cfg, startup.world_size
    check_dims(cfg, world_size)
    par = cfg.parallelism
    instances = world_size // par.gen_tp
    n = cfg.generation.n
    if (cfg.ppo.batch_size // n) % instances:
        prompts = (
            f"ppo.batch_size / generation.n = {cfg.ppo.batch_size} / {n} prompts"
            if n > 1
            else f"ppo.batch_size = {cfg.ppo.batch_size}"
        )
        raise ConfigError(
            f"{prompts}: must be a multiple of the number of generation instances "
            f"{instances} (world size {world_size} / parallelism.gen_tp {par.gen_tp}; each instance generates an "
            "equal share of the prompts)"
        )


def check_nodes(startup: Startup) -> None:
    """Startup check of node boundaries (with ``local_world_size`` only): torchrun gives node n the global ranks
    n * local_world_size onwards, and a generation instance (gen_tp consecutive ranks) or a training TP group (tp
    consecutive ranks: the innermost mesh dim) must not span two nodes (raises ConfigError). Pipeline stages and
    FSDP shards may."""
    cfg, world_size, local_world_size = startup.cfg, startup.world_size, startup.local_world_size
    if local_world_size is None:
        return
    if local_world_size < 1 or world_size % local_world_size:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE = {local_world_size} (ranks per node): must divide the world size {world_size}; "
            "launch the same number of processes on every node"
        )
    for key, what in (
        ("gen_tp", "a generation instance (gen_tp consecutive ranks)"),
        ("tp", "a tensor-parallel group (tp consecutive ranks)"),
    ):
        degree = getattr(cfg.parallelism, key)
        if local_world_size % degree:
            raise ConfigError(
                f"parallelism.{key} = {degree} ({source_of(cfg, f'parallelism.{key}')}): {what} would span "
                f"nodes (LOCAL_WORLD_SIZE = {local_world_size}: ranks per node); choose a {key} dividing "
                f"{local_world_size}, or launch a multiple of {degree} processes per node"
            )


def check_model_split(startup: Startup) -> None:
    """Startup check of the models against the layout (raises ConfigError): the Actor and the Critic have at least
    one layer per pipeline stage, and ``tp`` (trained models) and ``gen_tp`` (every model of a generation instance)
    divide their attention heads, KV heads and MLP width."""
    cfg, par = startup.cfg, startup.cfg.parallelism
    for key, f in model_flavors(cfg, startup.assets).items():
        what = f"model.{key} = {getattr(cfg.model, key)!r}" if getattr(cfg.model, key) else f"model.{key}_path's {f.family} model"
        own = key == "critic" and par.pp_critic is not None
        stages, name = (par.critic_stages, "pp_critic") if own else (par.pp, "pp")
        if key != "reward" and f.num_layers < stages:
            smaller = " (or give the Critic fewer stages: parallelism.pp_critic)" if key == "critic" and not own else ""
            raise ConfigError(
                f"{what} has {f.num_layers} layers, fewer than parallelism.{name} = {stages} stages; "
                f"lower {name}{smaller} or use a deeper model"
            )
        sharded = "gen_tp" if key == "reward" else "tp and gen_tp"
        degrees = (("gen_tp", par.gen_tp),) if key == "reward" else (("tp", par.tp), ("gen_tp", par.gen_tp))
        for option, degree in degrees:
            indivisible = tp_indivisible(degree, f.num_heads, f.num_kv_heads, f.intermediate_dim)
            if indivisible is not None:
                part, value = indivisible
                raise ConfigError(
                    f"parallelism.{option} = {degree}: does not divide the {part} of {what} ({value}); tensor parallelism "
                    f"({sharded}) splits them evenly: choose a degree dividing it"
                )


def check_device(startup: Startup) -> None:
    """Startup check: ``training.device`` is available (raises ConfigError)."""
    try:
        select_device(startup.cfg.training.device)
    except RuntimeError:
        raise ConfigError('training.device = "cuda": no CUDA device is available; use --training.device=cpu (or auto)') from None


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
