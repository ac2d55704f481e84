"""Model registry over torchtune builders: flavors, roles, HF weights, tokenizers."""

from fusedrl.models.hf import (
    CheckpointError,
    PretrainedModel,
    from_pretrained,
    hf_config,
    infer_flavor,
    load_hf_checkpoint,
    load_hf_weights,
    save_hf_checkpoint,
)
from fusedrl.models.registry import FLAVORS, ROLES, ModelFlavor, build_model
from fusedrl.models.weights import hf_to_tune_state, init_rope_buffers, load_state_slices, local_indices, tune_to_hf_state

__all__ = [
    "FLAVORS",
    "ROLES",
    "CheckpointError",
    "ModelFlavor",
    "PretrainedModel",
    "build_model",
    "from_pretrained",
    "hf_config",
    "hf_to_tune_state",
    "infer_flavor",
    "init_rope_buffers",
    "load_hf_checkpoint",
    "load_hf_weights",
    "load_state_slices",
    "local_indices",
    "save_hf_checkpoint",
    "tune_to_hf_state",
]
