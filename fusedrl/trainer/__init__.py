"""fusedrl.trainer: the PPO Trainer that ``fusedrl.train`` runs, and the startup checks of a job's config."""

from fusedrl.trainer.checks import check_config, check_nodes, model_flavors, resume_step
from fusedrl.trainer.trainer import PHASES, STDOUT_KEYS, Trainer, reduce_iteration, use_device

__all__ = [
    "PHASES",
    "STDOUT_KEYS",
    "Trainer",
    "check_config",
    "check_nodes",
    "model_flavors",
    "reduce_iteration",
    "resume_step",
    "use_device",
]
