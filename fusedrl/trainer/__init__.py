"""fusedrl.trainer: the PPO Trainer that ``fusedrl.train`` runs."""

from fusedrl.trainer.trainer import PHASES, STDOUT_KEYS, Trainer, reduce_iteration, use_device

__all__ = [
    "PHASES",
    "STDOUT_KEYS",
    "Trainer",
    "reduce_iteration",
    "use_device",
]
