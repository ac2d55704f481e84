"""A check that every collective fusedrl calls passes tensors its group's backend can carry.

``with checked_collectives(): ...`` wraps torch.distributed's tensor collectives and point-to-point calls; a
tensor whose device type the group's backend does not serve (``fusedrl.distributed.group_devices``: a CPU tensor
on an NCCL group, a CUDA one on a gloo group) raises ``CollectiveDeviceError`` before the call. On CPU test runs
every group is gloo, so the check proves that nothing sends a non-CPU tensor there and, with a mixed default
group on GPUs, that each tensor goes where a backend serves it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fusedrl.distributed import group_devices

# name -> position(s) of its tensor arguments. isend / irecv are checked as the ops of batch_isend_irecv (wrapping
# them would break torch's P2POp, which accepts only the original functions).
_CALLS: dict[str, int | tuple[int, ...]] = {
    "all_reduce": 0,
    "broadcast": 0,
    "send": 0,
    "recv": 0,
    "reduce": 0,
    "all_gather": (0, 1),
    "all_gather_into_tensor": (0, 1),
    "reduce_scatter_tensor": (0, 1),
    "all_to_all_single": (0, 1),
}


class CollectiveDeviceError(RuntimeError):
    """A collective got a tensor on a device its group's backend does not serve."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _check(name: str, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    served = group_devices(group)
    for t in tensors:
        if t.device.type not in served:
            raise CollectiveDeviceError(
                f"{name}: a {t.device.type} tensor {tuple(t.shape)} on a group whose backend "
                f"{dist.get_backend(group)!r} serves {sorted(served)}"
            )


def _wrap(name: str, original: Callable, where: int | tuple[int, ...]) -> Callable:
    positions = (where,) if isinstance(where, int) else where

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for i in positions if i < len(args) for t in _tensors(args[i])]
        tensors += [
            t
            for k in ("tensor", "tensor_list", "output_tensor", "input_tensor", "output", "input")
            for t in _tensors(kwargs.get(k))
        ]
        _check(name, tensors, kwargs.get("group"))
        return original(*args, **kwargs)

    return checked


@contextlib.contextmanager
def checked_collectives() -> Iterator[None]:
    """Check the devices of every wrapped collective's tensors while the block runs (this process only)."""
    originals: dict[str, Callable] = {name: getattr(dist, name) for name in _CALLS}
    batch = dist.batch_isend_irecv

    def checked_batch(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
        for op in p2p_op_list:
            _check("batch_isend_irecv", [op.tensor], op.group)
        return batch(p2p_op_list)

    try:
        for name, where in _CALLS.items():
            setattr(dist, name, _wrap(name, originals[name], where))
        dist.batch_isend_irecv = checked_batch
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.batch_isend_irecv = batch
