"""The quantized copy a ``GenerationEngine(quantize="int8_weight_only")`` decodes with (torchao's int8 weight-only
tensors), and the refresh of that copy from the trained weights in place (a compiled decode keeps its graphs)."""

from __future__ import annotations

import copy
from typing import Literal, TypeVar

import torch
from torch import nn

Quantize = Literal["int8_weight_only"]
QUANTIZE_MODES: tuple[str, ...] = ("int8_weight_only",)
_M = TypeVar("_M", bound=nn.Module)


def quantized_copy(model: _M) -> _M:
    """An eval-mode copy of ``model`` whose ``nn.Linear`` weights are int8 weight-only tensors."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantized = copy.deepcopy(model).eval()
    quantize_(quantized, Int8WeightOnlyConfig())
    return quantized


@torch.no_grad()
def requantize(source: nn.Module, quantized: nn.Module) -> None:
    """Write ``source``'s current weights into ``quantized`` (made by :func:`quantized_copy` from a model of the same
    structure) in place: linear weights quantized anew, every other parameter copied."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    copies = dict(quantized.named_parameters())
    linears = {f"{name}.weight": m for name, m in source.named_modules() if type(m) is nn.Linear}
    for name, p in source.named_parameters():
        target = copies[name]
        if name not in linears:
            target.copy_(p)
            continue
        fresh = nn.Linear(p.shape[1], p.shape[0], bias=False, device=p.device, dtype=p.dtype)
        fresh.weight.copy_(p)
        quantize_(fresh, Int8WeightOnlyConfig())
        _copy_tensor_data(target, fresh.weight)


def _copy_tensor_data(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s data into ``dst`` in place, through the inner tensors of tensor subclasses of the same layout
    (torchao's quantized weights: their ``__tensor_flatten__`` names)."""
    flatten = getattr(dst, "__tensor_flatten__", None)
    if flatten is None:
        dst.copy_(src)
        return
    for name in flatten()[0]:
        _copy_tensor_data(getattr(dst, name), getattr(src, name))
