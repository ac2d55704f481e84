"""Regional compilation (``training.compile``): every decoder layer of a model runs one torch.compile'd layer
forward, shared by all its layers and by every model of the same architecture (parameters are graph inputs), so a
job compiles a handful of graphs (training on packed rows, scoring on padded ones, their backwards) however many
layers it has. Rows and lengths are symbolic from the first call; the model's widths stay constants, which keeps
inductor's kernels specialised (everything symbolic made the q/k/v backward several times slower on CPU).
Packed-document attention runs eager between the compiled parts (its spans change every step).

FSDP2's hooks, activation checkpointing and the pipeline stages wrap the layer's call, outside the compiled region.
Not with tensor parallelism: in torch 2.13 the compiled layer's backward gave its DTensor input no gradient (the
embedding's gradient came out zero) or, after other graphs in the same process, failed to compile (a recursion error
in AOTAutograd), so :func:`check_compile` refuses tp > 1 (and gen_tp > 1: the scoring models).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchtune.modules import TransformerSelfAttentionLayer

from fusedrl.config import ConfigError, Startup
from fusedrl.distributed.compat import allow_recompiles, mark_dim_dynamic

MAX_GRAPHS = 32
"""Graphs the shared layer forward may hold before torch.compile falls back to eager (dynamo's limit is 8): one per
grad mode, mask kind and model width (Actor, Critic, Reference and Reward may differ), and per recompile."""


@functools.cache
def _compiled_layer_forward() -> Callable[..., torch.Tensor]:
    return torch.compile(TransformerSelfAttentionLayer.forward)


class CompiledLayer(TransformerSelfAttentionLayer):
    """A torchtune ``TransformerSelfAttentionLayer`` whose forward is the shared compiled one (same parameters and
    names; values equal up to the kernels' rounding)."""

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for dim in (0, 1):  # rows and positions
            mark_dim_dynamic(x, dim)
        return _compiled_layer_forward()(self, x, **kwargs)


def apply_compile(module: nn.Module) -> int:
    """Make every ``TransformerSelfAttentionLayer`` of ``module`` a :class:`CompiledLayer` in place (apply it before
    FSDP2, as torchtitan does); returns how many."""
    layers = [m for m in module.modules() if type(m) is TransformerSelfAttentionLayer]
    allow_recompiles(MAX_GRAPHS)
    for layer in layers:
        layer.__class__ = CompiledLayer
    return len(layers)


def check_compile(startup: Startup) -> None:
    """Startup check of ``training.compile`` (raises ConfigError): no tensor parallelism, in training or generation."""
    cfg = startup.cfg
    p = cfg.parallelism
    if cfg.training.compile and max(p.tp, p.gen_tp) > 1:
        key, degree = ("parallelism.tp", p.tp) if p.tp > 1 else ("parallelism.gen_tp", p.gen_tp)
        raise ConfigError(
            f"training.compile = true with {key} = {degree}: compiled layers do not work on tensor-parallel (DTensor) "
            "inputs in this torch; use tp = gen_tp = 1 (pipeline stages and FSDP2 work compiled) or --training.compile=false"
        )
