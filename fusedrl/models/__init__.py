"""Decoder architectures over torchtune modules: flavors (named, or read from an HF config.json), roles, HF weights;
the architecture each [model] key of a job builds and its startup check (``fusedrl.models.job``)."""

from fusedrl.models.hf import (
    PretrainedModel,
    check_hf_checkpoint,
    from_pretrained,
    load_hf_checkpoint,
    load_hf_weights,
    save_hf_checkpoint,
)
from fusedrl.models.hf_config import CheckpointError, flavor_from_hf_config, hf_config, read_flavor
from fusedrl.models.job import (
    DEFAULT_FLAVOR,
    MODEL_ROLES,
    RANDOM_INIT_MAX_PARAMS,
    check_models,
    model_flavor,
    model_flavors,
    neural_models,
    scoring_flavors,
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
    "DEFAULT_FLAVOR",
    "FAMILIES",
    "FLAVORS",
    "MODEL_ROLES",
    "RANDOM_INIT_MAX_PARAMS",
    "ROLES",
    "CheckpointError",
    "Llama3RoPE",
    "ModelFlavor",
    "PretrainedModel",
    "QKNormProjection",
    "ValueHead",
    "build_model",
    "cast_parameters",
    "check_models",
    "flavor_from_hf_config",
    "from_pretrained",
    "hf_config",
    "hf_to_tune_state",
    "init_rope_buffers",
    "load_hf_checkpoint",
    "load_hf_weights",
    "check_hf_checkpoint",
    "load_state_slices",
    "local_indices",
    "model_flavor",
    "model_flavors",
    "neural_models",
    "read_flavor",
    "resolve_flavor",
    "scoring_flavors",
    "save_hf_checkpoint",
    "tune_to_hf_state",
]
