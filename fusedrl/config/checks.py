"""The startup checks of a job: every rule that needs more than the config's own keys (the job's size, the models'
architectures, files, devices), run before any process group or model is built.

Each rule has one owner, the package whose code it guards (the parallel layout checks its dims, the data component
its dataset, the model loader its checkpoints), which registers a check function under the entry-point group
``fusedrl.config_checks`` (pyproject.toml). :func:`run_checks` loads them with :mod:`importlib.metadata` and runs
them in :data:`ORDER`, so this package imports none of its owners; a user's package registers a check for its own
component the same way (it runs after fusedrl's). The trainer (``fusedrl.train``) and ``python -m fusedrl.config
--world_size N`` both call :func:`run_checks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from fusedrl.config.job_config import JobConfig
from fusedrl.config.loader import InputError

GROUP = "fusedrl.config_checks"

# fusedrl's own checks (entry-point names), in the order they run: a refusal names the first problem found, so
# the cheap rules on the config come before those that read checkpoints, devices and the tokenizer.
ORDER = (
    "task",  # tasks: job.task imports and has the parts the config uses; folders it builds after the checks
    "parallelism",  # distributed: parallel degrees, world size, Critic replicas, generation instances
    "nodes",  # distributed: no TP group or generation instance across nodes
    "resume",  # components: checkpoint.resume = true finds a checkpoint
    "reward",  # rlhf: the rule-based reward function and the Reward model
    "sampling",  # generation: a sampling distribution PPO can use
    "engine_compile",  # generation: the engine's compile scope and mode
    "recompute",  # rlhf: what needs the old log-probs recomputed
    "partial_rollouts",  # rlhf: carried (stale) tokens of over-provisioned rollouts have their importance correction
    "env",  # rlhf: [env]'s environment imports; episodes stay on single-rank instances
    "data",  # components: the dataset
    "models",  # models: checkpoint folders, flavors, vocabulary, sequence length
    "lora",  # models: [lora] on built, trained models without float8
    "model_split",  # distributed: the models' layers over pipeline stages, heads over TP ranks
    "schedule_memory",  # rlhf: fusion.schedule_memory_gib against the fallback schedule's peak
    "packing",  # rlhf: ppo.microbatch_tokens holds the longest sequence (and a pipeline's rows)
    "device",  # distributed: training.device
    "float8",  # distributed: float8 training
    "training_compile",  # distributed: regional compilation of the trained and scoring models
    "tokenizer",  # components: the tokenizer loads and fits the Actor's vocabulary
)

INSTALL_FIX = "run `pip install -e .` in the fusedrl checkout"


@dataclass
class Startup:
    """What every startup check reads: the config, the job's size and the folders built after the checks."""

    cfg: JobConfig
    world_size: int
    local_world_size: int | None = None  # ranks per node (torchrun's LOCAL_WORLD_SIZE); None skips the node checks
    assets: dict[Path, str] = field(default_factory=dict)  # a folder built at startup -> the flavor of its models


StartupCheck = Callable[[Startup], None]


def built_later(assets: dict[Path, str], path: str | Path) -> str | None:
    """The flavor of the models built later in the folder of ``assets`` that holds ``path``; None when no such
    folder holds it (then ``path`` must exist now)."""
    return next((flavor for folder, flavor in assets.items() if Path(path).is_relative_to(folder)), None)


def registered_checks() -> list[tuple[str, StartupCheck]]:
    """(name, function) of every check of the entry-point group, fusedrl's in :data:`ORDER`, then the others by
    name. Raises InputError when fusedrl's own are not all registered (a source tree without installed metadata, or
    metadata older than the code): checks are never skipped silently."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found:  # one would silently replace the other
            raise InputError(
                f"two startup checks are registered as {ep.name!r} under the entry-point group {GROUP!r} "
                f"({_origin(found[ep.name])} and {_origin(ep)}); rename or uninstall one of them"
            )
        found[ep.name] = ep
    missing = [name for name in ORDER if name not in found]
    if missing:
        what = "no startup checks are" if len(missing) == len(ORDER) else f"the startup checks {', '.join(missing)} are not"
        raise InputError(
            f"{what} registered under the entry-point group {GROUP!r} (fusedrl is not installed, or its installed "
            f"metadata is older than its code); {INSTALL_FIX}"
        )
    rank = {name: i for i, name in enumerate(ORDER)}
    names = sorted(found, key=lambda name: (rank.get(name, len(ORDER)), name))
    checks = []
    for name in names:
        try:
            checks.append((name, found[name].load()))
        except Exception as e:  # noqa: BLE001 - a registered module may fail to import in any way
            raise InputError(
                f"the startup check {name!r} ({_origin(found[name])}) cannot be loaded ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:300]}); fix or uninstall the package that registers it"
            ) from None
    return checks


def _origin(ep: EntryPoint) -> str:
    """``value`` of an entry point and the distribution that registers it."""
    dist = getattr(ep, "dist", None)
    return f"{ep.value} from {dist.name}" if dist is not None else ep.value


def run_checks(cfg: JobConfig, world_size: int, local_world_size: int | None = None) -> None:
    """Run every registered startup check for a job of ``world_size`` ranks (``local_world_size`` per node; None
    skips the node checks); the first problem raises ConfigError (one line naming the key and the fix)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    startup = Startup(cfg, world_size, local_world_size)
    for _, check in registered_checks():
        check(startup)
