"""Decoder architectures over torchtune modules: flavors (named, or read from an HF config.json), roles, HF weights."""

from fusedrl.models.hf import (
    CheckpointError,
    PretrainedModel,
    flavor_from_hf_config,
    from_pretrained,
    hf_config,
    load_hf_checkpoint,
    load_hf_weights,
    read_flavor,
    save_hf_checkpoint,
)
from fusedrl.models.registry import (
    FAMILIES,
    FLAVORS,
    ROLES,
    Llama3RoPE,
    ModelFlavor,
    QKNormProjection,
    ValueHead,
    build_model,
    resolve_flavor,
)
from fusedrl.models.weights import (
    cast_parameters,
    hf_to_tune_state,
    init_rope_buffers,
    load_state_slices,
    local_indices,
    tune_to_hf_state,
)

__all__ = [
    "FAMILIES",
    "FLAVORS",
    "ROLES",
    "CheckpointError",
    "Llama3RoPE",
    "ModelFlavor",
    "PretrainedModel",
    "QKNormProjection",
    "ValueHead",
    "build_model",
    "cast_parameters",
    "flavor_from_hf_config",
    "from_pretrained",
    "hf_config",
    "hf_to_tune_state",
    "init_rope_buffers",
    "load_hf_checkpoint",
    "load_hf_weights",
    "load_state_slices",
    "local_indices",
    "read_flavor",
    "resolve_flavor",
    "save_hf_checkpoint",
    "tune_to_hf_state",
]
