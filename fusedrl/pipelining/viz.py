"""Views of a simulated schedule: a Chrome/Perfetto trace and a Gantt chart (needs the ``viz`` extra)."""

from __future__ import annotations

import json
from pathlib import Path

from fusedrl.pipelining.ir import ACTOR
from fusedrl.pipelining.simulator import SimResult

# (forward, backward) colours per model: F light, B dark.
COLORS = {"actor": ("#7fb3e6", "#1f5f9f"), "critic": ("#f5b971", "#b35f00")}


def chrome_trace(result: SimResult, time_unit_us: float = 1000.0) -> dict:
    """Trace events (one thread per rank); one cost-model time unit is ``time_unit_us`` microseconds."""
    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}} for r in range(len(result.busy))
    ]
    for e in result.timeline:
        events.append(
            {
                "name": str(e.action),
                "cat": f"{e.action.model},{e.action.kind}",
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": e.start * time_unit_us,
                "dur": (e.end - e.start) * time_unit_us,
                "args": {
                    "model": e.action.model,
                    "replica": e.action.replica,
                    "stage": e.action.stage,
                    "microbatch": e.action.microbatch,
                    "kind": e.action.kind,
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(result)))


def save_gantt_png(result: SimResult, path: str | Path, title: str = "") -> None:
    """Ranks x time; blue = Actor, orange = Critic; F light, B dark; labels are micro-batch indices."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("--png needs matplotlib: pip install 'fusedrl[viz]'") from err
    pp = len(result.busy)
    fig, ax = plt.subplots(figsize=(14, 0.45 * pp + 1.5))
    for e in result.timeline:
        f_color, b_color = COLORS[e.action.model]
        ax.barh(
            e.rank,
            e.end - e.start,
            left=e.start,
            height=0.8,
            color=f_color if e.action.kind == "F" else b_color,
            edgecolor="white",
            linewidth=0.3,
        )
        if e.end - e.start > 0.012 * result.makespan and pp <= 16:
            ax.text(
                (e.start + e.end) / 2,
                e.rank,
                str(e.action.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="black" if e.action.kind == "F" else "white",
            )
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (cost-model units)")
    ax.set_title(title or f"makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.1%}")
    ax.legend(
        handles=[Patch(color=COLORS[m][i], label=f"{m} {k}") for m in (ACTOR, "critic") for i, k in enumerate("FB")],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
