"""Measured timeline of one executed pipeline step: per-rank action intervals, Chrome trace, bubble ratio."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from fusedrl.components.metrics import ChromeTrace, save_gantt_png
from fusedrl.pipelining.ir import Action
from fusedrl.pipelining.viz import COLORS, action_category


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float  # seconds since the step started (after a barrier of the pipeline group)
    end: float


@dataclass
class Timeline:
    """Compute intervals of one step. Waiting for a message is idle time, not part of an interval."""

    events: list[TimedAction] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank)

    def bubble_ratio(self) -> float:
        """Idle fraction of all ranks over the makespan: 1 - busy / (ranks * makespan)."""
        span = self.makespan()
        if span == 0.0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in self.ranks) / (len(self.ranks) * span)

    def to_chrome_trace(
        self, trace: ChromeTrace | None = None, *, t0: float | None = None, pid: str | None = None
    ) -> ChromeTrace:
        """The intervals as Chrome/Perfetto trace spans (open in ui.perfetto.dev or chrome://tracing), added to ``trace``
        (a new one by default), counted from ``t0`` seconds (default: the first start): one process per rank, or one
        row per rank under the process ``pid``."""
        trace = ChromeTrace() if trace is None else trace
        t0 = min((e.start for e in self.events), default=0.0) if t0 is None else t0
        for r in self.ranks:
            if pid is None:
                trace.name_process(r, f"pp rank {r}")
            else:
                trace.name_thread(pid, r, f"pp rank {r}")
        for e in self.events:
            a = e.action
            trace.complete(
                f"{a.model} {a.kind}{a.microbatch}",
                e.start - t0,
                e.end - e.start,
                pid=e.rank if pid is None else pid,
                tid=0 if pid is None else e.rank,
                cat=action_category(a),
                action=str(a),
            )
        return trace

    def save_chrome_trace(self, path: str | Path) -> None:
        self.to_chrome_trace().save(path)

    def gather(self, group: dist.ProcessGroup | None = None) -> Timeline:
        """All ranks of ``group`` get the union of their timelines (a collective: call it on every rank)."""
        parts: list[list[TimedAction]] = [[] for _ in range(dist.get_world_size(group))]  # every slot is overwritten
        dist.all_gather_object(parts, self.events, group=group)
        return Timeline(sorted((e for p in parts for e in p), key=lambda e: (e.rank, e.start)))

    def save_png(self, path: str | Path, title: str = "") -> None:
        """Gantt chart of the timeline (needs matplotlib: ``pip install fusedrl[viz]``)."""
        save_gantt_png(
            self.to_chrome_trace(),
            path,
            COLORS,
            title=title or f"measured timeline, bubble ratio {self.bubble_ratio():.1%}",
            label=lambda e: e["name"].rsplit(" ", 1)[1][1:],  # the micro-batch index
        )
