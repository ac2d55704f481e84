"""Measured timeline of one executed pipeline step: per-rank action intervals, Chrome trace, bubble ratio."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from fusedrl.pipelining.ir import Action


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

    def to_chrome_trace(self) -> dict:
        """Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing): one row per rank."""
        t0 = min((e.start for e in self.events), default=0.0)
        trace = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"pp rank {r}"}} for r in self.ranks]
        for e in self.events:
            a = e.action
            trace.append(
                {
                    "name": f"{a.kind}{a.microbatch}",
                    "cat": a.model,
                    "ph": "X",
                    "pid": e.rank,
                    "tid": 0,
                    "ts": (e.start - t0) * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "args": {"action": str(a)},
                }
            )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))

    def gather(self, group: dist.ProcessGroup | None = None) -> Timeline:
        """All ranks of ``group`` get the union of their timelines (a collective: call it on every rank)."""
        parts: list[list[TimedAction]] = [[] for _ in range(dist.get_world_size(group))]  # every slot is overwritten
        dist.all_gather_object(parts, self.events, group=group)
        return Timeline(sorted((e for p in parts for e in p), key=lambda e: (e.rank, e.start)))

    def save_png(self, path: str | Path, title: str = "") -> None:
        """Gantt chart of the timeline (needs matplotlib: ``pip install fusedrl[viz]``)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {("actor", "F"): "#4c8bd6", ("actor", "B"): "#1c4f91", ("critic", "F"): "#f0a04b", ("critic", "B"): "#b0601a"}
        t0 = min((e.start for e in self.events), default=0.0)
        fig, ax = plt.subplots(figsize=(12, 0.6 * len(self.ranks) + 1.2))
        for e in self.events:
            kind = "B" if e.action.kind in ("B", "I", "W") else "F"
            ax.barh(
                e.rank,
                (e.end - e.start) * 1e3,
                left=(e.start - t0) * 1e3,
                height=0.8,
                color=colors.get((e.action.model, kind), "gray"),
                edgecolor="white",
                linewidth=0.5,
            )
            ax.text(
                (e.start - t0 + (e.end - e.start) / 2) * 1e3,
                e.rank,
                f"{e.action.microbatch}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
        ax.set_yticks(self.ranks, [f"rank {r}" for r in self.ranks])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(
            handles,
            [f"{m} {k}" for m, k in colors],
            ncol=4,
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=7,
            frameon=False,
        )
        ax.set_title(title or f"measured timeline, bubble ratio {self.bubble_ratio():.1%}", loc="left", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
