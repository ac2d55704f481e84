"""One program for every rank: plan on one rank, share the schedule, lower it everywhere.

Every pipeline rank must run the same lowered program (the executor checks it), and every data-parallel replica
the same one too (their FSDP2 collectives follow the program's order). A time-budgeted search can return different
schedules on different ranks, so the schedule is planned once and broadcast; lowering is deterministic, so each
rank lowers the broadcast schedule itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from fusedrl.pipelining.ir import Placement, Schedule
from fusedrl.pipelining.lowering import LoweredProgram, lower
from fusedrl.pipelining.search import PlanResult


def plan_and_share(
    plan: Callable[[], PlanResult | Schedule],
    placement: Placement,
    microbatches: Mapping[str, int],
    *,
    group: dist.ProcessGroup | None = None,
) -> tuple[LoweredProgram, PlanResult | None]:
    """Run ``plan`` on the first rank of ``group`` (default: every rank) only, broadcast its schedule and lower it
    on every rank (collective over ``group``). Returns the program and the search's :class:`PlanResult` (its
    method and figures; None when ``plan`` returns a bare schedule, e.g. ``sequential_1f1b``).

    ``group`` must hold every rank that runs the program together: with data parallelism the whole job, not one
    pipeline group."""
    holder: list[Any] = [plan() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(holder, group_src=0, group=group)
    found = holder[0] if isinstance(holder[0], PlanResult) else None
    schedule = found.schedule if found is not None else holder[0]
    return lower(schedule, placement, dict(microbatches)), found
