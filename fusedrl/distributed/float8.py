"""Float8 training of a model's linears via torchao (CUDA, SM89+)."""

from __future__ import annotations

import torch
from torch import nn

from fusedrl.config import ConfigError, Startup
from fusedrl.distributed.parallel_dims import select_device

FLOAT8_MIN_CAPABILITY = (8, 9)


def check_float8(startup: Startup) -> None:
    """Startup check of ``training.float8`` (raises ConfigError): it needs CUDA, and no tensor-parallel plan is built
    for float8 linears."""
    cfg = startup.cfg
    if not cfg.training.float8:
        return
    if select_device(cfg.training.device).type != "cuda":
        raise ConfigError("training.float8 = true: float8 training needs CUDA; set --training.float8=false on CPU")
    if cfg.parallelism.tp > 1:
        raise ConfigError(
            "training.float8 = true with parallelism.tp > 1: float8 tensor-parallel plans are not built; "
            "use tp = 1 (FSDP2 and pipeline stages work with float8) or --training.float8=false"
        )


def _float8_eligible(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear) or fqn == "output" or fqn.endswith(".output"):
        return False  # the LM / value head stays in high precision
    return module.in_features % 16 == 0 and module.out_features % 16 == 0  # float8 GEMM shape requirement


def convert_to_float8(model: nn.Module) -> nn.Module:
    """Swap ``model``'s linears for torchao ``Float8Linear`` (dynamic tensorwise scaling), in place.

    The output head and linears whose dimensions are not multiples of 16 stay as they are. Apply
    before ``apply_tp``/``apply_fsdp``. Needs CUDA with compute capability 8.9 or newer.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "float8 training needs a CUDA GPU with compute capability 8.9+ (Ada/Hopper or newer) and none is "
            "available; set `[training] float8 = false`"
        )
    capability = torch.cuda.get_device_capability()
    if capability < FLOAT8_MIN_CAPABILITY:
        raise RuntimeError(
            f"float8 training needs compute capability 8.9+, this GPU has {capability[0]}.{capability[1]}; "
            "set `[training] float8 = false`"
        )
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=_float8_eligible)
    return model
