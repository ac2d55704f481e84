"""Static-shape buckets: pad a size up to one of a few values so compiled code and cached pipeline stages see
few distinct shapes. Shared by the decode engine, the rollout simulator that mirrors it, the pipeline
executor and the trainer; it imports nothing from fusedrl (the bottom layer of the import graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch


@overload
def round_up(x: int, buckets: Sequence[int], *, strictly_above: bool = False) -> int: ...
@overload
def round_up(x: torch.Tensor, buckets: Sequence[int], *, strictly_above: bool = False) -> torch.Tensor: ...


def round_up(x, buckets, *, strictly_above=False):
    """The smallest bucket >= ``x`` (> ``x`` with ``strictly_above``), elementwise for a tensor.

    ``buckets`` must be sorted; empty buckets mean no padding (``x`` itself). A value above the largest
    bucket raises ValueError: the caller's buckets must cover every size it can produce.
    """
    if not buckets:
        return x
    if isinstance(x, torch.Tensor):
        table = torch.tensor(buckets, dtype=x.dtype, device=x.device)
        index = torch.searchsorted(table, x, right=strictly_above)
        if bool((index >= len(buckets)).any()):
            raise ValueError(f"size {x.max().item()} exceeds the largest bucket {buckets[-1]}; add a larger bucket")
        return table[index]
    for b in buckets:
        if b > x or (b == x and not strictly_above):
            return b
    raise ValueError(f"size {x} exceeds the largest bucket {buckets[-1]}; add a larger bucket")


def doubling(start: int, limit: int) -> tuple[int, ...]:
    """``start, 2*start, 4*start, ...`` below ``limit``, then ``limit`` itself."""
    if not 1 <= start:
        raise ValueError(f"bucket start must be >= 1, got {start}")
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return (*out, limit)


def evenly_spaced(limit: int, count: int = 8, minimum: int = 16) -> tuple[int, ...]:
    """About ``count`` multiples of one step (at least ``minimum``) up to the first one >= ``limit``."""
    step = max(minimum, -(-limit // count))
    return tuple(range(step, limit + step, step))
