"""Model registry over torchtune builders: flavors, roles, HF weights, tokenizers."""

from fusedrl.models.hf import CheckpointError, hf_config, load_hf_checkpoint, save_hf_checkpoint
from fusedrl.models.registry import FLAVORS, ROLES, ModelFlavor, build_model

__all__ = [
    "FLAVORS",
    "ROLES",
    "CheckpointError",
    "ModelFlavor",
    "build_model",
    "hf_config",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
]
