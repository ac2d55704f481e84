"""Telling when an engine's weights changed, so that nothing it derived from them (cached CPU layouts, a quantized
copy) is used stale.

A weight's stamp is its version counter and data pointer. The counter moves with every in-place write autograd sees
(``copy_``, ``load_state_dict``, ``mul_`` under ``no_grad``, foreach and plain optimizers); the pointer when ``.data`` is
reassigned. Fused optimizer kernels (``torch.optim.AdamW(fused=True)``, fusedrl's ``build_optimizer``) write without
moving the counter: for the weights of a :func:`watch`-ed model, a global ``torch.optim`` step hook moves it after
every step of an optimizer that holds them. What remains unseen are writes through ``.data`` or kernels of one's own:
after those, call ``GenerationEngine.weights_updated()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fusedrl.distributed import compat

Stamp = tuple[tuple[int, int], ...]
_WATCHED: dict[int, weakref.ref] = {}  # id -> a watched weight
_step_hook: Any = None


def weights_stamp(tensors: Iterable[torch.Tensor]) -> Stamp:
    """Each tensor's (version counter, data pointer): equal stamps, unchanged tensors (module docstring)."""
    return tuple((compat.version_counter(t), t.data_ptr()) for t in tensors)


def _moved_after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step hook: move the version counter of each watched weight the optimizer holds."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _WATCHED.get(id(p))
            if ref is not None and ref() is p:
                torch.autograd.graph.increment_version(cast(torch.Tensor, p))


def _unwatch(key: int) -> Callable[[weakref.ref], None]:
    def drop(_: weakref.ref) -> None:
        _WATCHED.pop(key, None)

    return drop


def watch(model: nn.Module) -> None:
    """Make every ``torch.optim`` step move the stamps of ``model``'s weights (module docstring). Weights stay
    watched until they are freed; other tensors are never touched."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_moved_after_step)
    for p in model.parameters():
        _WATCHED[id(p)] = weakref.ref(p, _unwatch(id(p)))
