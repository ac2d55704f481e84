"""LoRA: low-rank adapters on a decoder's projections, the base weights frozen (``[lora]``).

A targeted ``nn.Linear`` becomes a :class:`LoRALinear`: the same ``weight`` (and ``bias``) under the same name, so HF
checkpoints load into it unchanged, plus ``lora_a`` (rank x in) and ``lora_b`` (out x rank). Its output is
``x W^T + b + scale * dropout(x) A^T B^T`` with ``scale = alpha / rank``; ``B`` starts at zero, so a fresh adapter
changes nothing. Targets are named as in HF / PEFT (``q_proj`` ... ``down_proj``).

Checkpoint loaders skip the adapters (:func:`fusedrl.models.weights.is_adapter`); :func:`init_adapters` fills them.
An exported model is either the merged weights (:func:`merge_adapters`, an ordinary HF checkpoint) or the adapters
alone in PEFT's format (:func:`save_peft_adapter`), which ``peft.PeftModel.from_pretrained`` loads onto the base.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from fusedrl.models.registry import ModelFlavor, ValueHead, resolve_flavor
from fusedrl.models.weights import ADAPTER_A, ADAPTER_B, fill_slices, hf_name, is_adapter, rope_head_dim, tune_to_hf_rows

# HF / PEFT projection name -> the torchtune module inside a decoder layer
TARGET_MODULES = {
    "q_proj": "attn.q_proj",
    "k_proj": "attn.k_proj",
    "v_proj": "attn.v_proj",
    "o_proj": "attn.output_proj",
    "gate_proj": "mlp.w1",
    "up_proj": "mlp.w3",
    "down_proj": "mlp.w2",
}
PEFT_PREFIX = "base_model.model."  # PeftModel's name of the wrapped HF model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRASpec:
    """What :func:`add_lora` puts on a model: the ``[lora]`` section's rank, alpha, dropout and targets."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """A linear layer with a trainable low-rank update; ``weight`` and ``bias`` are the frozen base."""

    def __init__(self, base: nn.Linear, spec: LoRASpec) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight only to drop it
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", cast(nn.Parameter, base.weight))
        self.register_parameter("bias", cast(nn.Parameter | None, base.bias))
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(spec.rank, base.in_features, device=device, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, spec.rank, device=device, dtype=torch.float32))
        self.scale = spec.scale
        self.dropout = spec.dropout  # functional: TP plans visit every submodule as a linear
        self.adapted = True  # False: the frozen base alone (switch_adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapted:
            return F.linear(x, self.weight, self.bias)
        dropped = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)  # no-ops under FSDP2's mixed precision, which casts
        update = F.linear(F.linear(dropped, a) * self.scale, b)  # scaled at rank width: cheap
        return F.linear(x, self.weight, self.bias).add_(update)  # in place: no third output-sized tensor

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.shape[0]}, scale={self.scale:g}"


def add_lora(model: nn.Module, spec: LoRASpec, *, base_dtype: torch.dtype | None = None) -> nn.Module:
    """Put adapters on ``model``'s targeted projections (any device, meta included) and freeze everything else but a
    value model's scalar head, which a value model trains (its fresh head is not part of the base). ``base_dtype``:
    the frozen floating-point parameters' storage (e.g. bf16 when training computes in bf16 anyway). Returns ``model``."""
    unknown = sorted(set(spec.targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}; valid: {', '.join(TARGET_MODULES)}")
    suffixes = tuple("." + TARGET_MODULES[t] for t in spec.targets)
    for name, module in list(model.named_modules()):
        if not name.endswith(suffixes):
            continue
        if isinstance(module, nn.Linear):
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
        else:  # a q/k-norm projection wraps its linear
            owner, attr = module, "linear"
        base = getattr(owner, attr, None)
        if isinstance(base, LoRALinear) or not isinstance(base, nn.Linear):
            found = "adapters already" if isinstance(base, LoRALinear) else type(base).__name__
            raise ValueError(f"{name}: expected a plain linear projection to adapt, found {found}")
        setattr(owner, attr, LoRALinear(base, spec))
    trainable_heads = {id(p) for m in model.modules() if isinstance(m, ValueHead) for p in m.parameters()}
    for name, p in model.named_parameters():
        train = is_adapter(name) or id(p) in trainable_heads
        p.requires_grad_(train)
        if not train and base_dtype is not None and p.is_floating_point():
            p.data = p.data.to(base_dtype)
    return model


def adapter_modules(module: nn.Module) -> dict[str, LoRALinear]:
    """The adapted projections of ``module`` by module name."""
    return {name: m for name, m in module.named_modules() if isinstance(m, LoRALinear)}


def switch_adapters(module: nn.Module, on: bool) -> None:
    """Turn every adapter of ``module`` on or off (off: ``module`` computes as its frozen base, the Reference of a LoRA
    Actor with ``lora.reference = "base"``). A compiled layer compiles the second variant once, on first use."""
    for layer in adapter_modules(module).values():
        layer.adapted = on


def trainable_counts(modules: Sequence[nn.Module]) -> tuple[int, int]:
    """(trainable, all) parameter elements of ``modules`` (full shapes: DTensor shards count as their whole)."""
    params = [p for m in modules for p in m.parameters()]
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@torch.no_grad()
def init_adapters(module: nn.Module, seed: int) -> None:
    """Fill ``module``'s adapters (plain or DTensor shards, materialized): ``A`` as ``nn.Linear`` initialises its weight
    (Kaiming-uniform, a = sqrt(5)), ``B`` zero. Each ``A`` is drawn whole from ``seed`` and its name, so every rank
    and every layout gets the same adapter."""
    targets: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    for name, m in adapter_modules(module).items():
        rank, fan_in = m.lora_a.shape
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_ with a = sqrt(5): gain sqrt(1/3) x sqrt(3 / fan_in)
        full[f"{name}.{ADAPTER_A}"] = torch.empty(rank, fan_in).uniform_(-bound, bound, generator=gen)
        full[f"{name}.{ADAPTER_B}"] = torch.zeros(m.lora_b.shape)
        targets[f"{name}.{ADAPTER_A}"], targets[f"{name}.{ADAPTER_B}"] = m.lora_a, m.lora_b
    fill_slices(targets, lambda name, box: full[name][box])


def merge_adapters(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict with every adapted weight merged (``W + scale B A``) and the adapters dropped: the state of a
    plain model computing what the adapted one does. Floating-point tensors come out in float32: an update far below
    a bf16 base weight's rounding step would vanish in bf16."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if is_adapter(name):
            continue
        base = name.removesuffix(".weight")
        a, b = state.get(f"{base}.{ADAPTER_A}"), state.get(f"{base}.{ADAPTER_B}")
        t = t.float() if t.is_floating_point() else t
        out[name] = t if a is None or b is None else torch.addmm(t, b.float(), a.float(), alpha=scale)
    return out


def save_peft_adapter(
    state: Mapping[str, torch.Tensor], folder: str | os.PathLike, flavor: str | ModelFlavor, spec: LoRASpec, base_model: str
) -> Path:
    """Write the adapters of a full policy state dict as a PEFT LoRA folder (``adapter_config.json``,
    ``adapter_model.safetensors``): HF module names, q/k rows in HF's RoPE layout. ``base_model``: the HF folder the
    adapter applies to (recorded as ``base_model_name_or_path``)."""
    f = resolve_flavor(flavor)
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for name, a in state.items():
        if not name.endswith("." + ADAPTER_A):
            continue
        base = name.removesuffix("." + ADAPTER_A)
        b = state[f"{base}.{ADAPTER_B}"]
        hd = rope_head_dim(f"{base}.weight", f)
        hf = hf_name(f"{base}.weight", "policy").removesuffix(".weight")
        modules.add(hf.rpartition(".")[2])
        tensors[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = a.detach().float().cpu().contiguous()
        tensors[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = (
            (b if hd is None else tune_to_hf_rows(b, hd)).detach().float().cpu().contiguous()
        )
    if not tensors:
        raise ValueError("the state dict holds no LoRA adapters; export the merged model instead")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder
