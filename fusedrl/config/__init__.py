"""Job config: typed sections loaded from TOML with ``--section.key=value`` overrides.

``load_config(argv)`` builds a :class:`JobConfig`; every problem raises :class:`ConfigError` with a
one-line message. ``python -m fusedrl.config --job.config_file FILE --print`` shows the effective
config; ``--help`` lists every key. ``run_checks(cfg, world_size)`` runs the startup checks that the packages
owning each rule register (``fusedrl.config.checks``).
"""

from fusedrl.config.checks import Startup, StartupCheck, run_checks
from fusedrl.config.job_config import (
    CheckpointSection,
    DataSection,
    EvalSection,
    FusionSection,
    GenerationSection,
    JobConfig,
    JobSection,
    LoRASection,
    LRSchedulerSection,
    MetricsSection,
    ModelSection,
    OptimizerSection,
    ParallelismSection,
    PPOSection,
    RolloutSection,
    TrainingSection,
    microbatch_count,
)
from fusedrl.config.loader import (
    ConfigError,
    InputError,
    config_to_toml,
    import_object,
    load_config,
    validate_config,
)

__all__ = [
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "EvalSection",
    "LoRASection",
    "FusionSection",
    "GenerationSection",
    "InputError",
    "JobConfig",
    "JobSection",
    "LRSchedulerSection",
    "MetricsSection",
    "ModelSection",
    "OptimizerSection",
    "PPOSection",
    "ParallelismSection",
    "RolloutSection",
    "Startup",
    "StartupCheck",
    "TrainingSection",
    "config_to_toml",
    "import_object",
    "load_config",
    "microbatch_count",
    "run_checks",
    "validate_config",
]
