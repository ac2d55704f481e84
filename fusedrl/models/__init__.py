"""Model registry over torchtune builders: flavors, roles, HF weights, tokenizers."""

from fusedrl.models.registry import FLAVORS, ROLES, ModelFlavor, build_model

__all__ = ["FLAVORS", "ROLES", "ModelFlavor", "build_model"]
