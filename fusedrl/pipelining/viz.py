"""Views of a simulated schedule: a Chrome/Perfetto trace and its Gantt chart (needs the ``viz`` extra)."""

from __future__ import annotations

from pathlib import Path

from fusedrl.components.metrics import ChromeTrace, save_gantt_png
from fusedrl.pipelining.ir import ACTOR, CRITIC, Action
from fusedrl.pipelining.simulator import SimResult

# Per model and kind: forward light, backward (I and W too) dark.
COLORS = {f"{ACTOR} F": "#7fb3e6", f"{ACTOR} B": "#1f5f9f", f"{CRITIC} F": "#f5b971", f"{CRITIC} B": "#b35f00"}


def action_category(action: Action) -> str:
    """The Gantt colour key of an action: its model and F or B (input and weight backwards count as B)."""
    return f"{action.model} {'F' if action.kind == 'F' else 'B'}"


def chrome_trace(result: SimResult, time_unit_us: float = 1000.0) -> ChromeTrace:
    """Trace events (one thread per rank); one cost-model time unit is ``time_unit_us`` microseconds."""
    trace = ChromeTrace()
    for r in range(len(result.busy)):
        trace.name_thread(0, r, f"rank {r}")
    unit_s = time_unit_us / 1e6
    for e in result.timeline:
        a = e.action
        trace.complete(
            str(a),
            e.start * unit_s,
            (e.end - e.start) * unit_s,
            pid=0,
            tid=e.rank,
            cat=action_category(a),
            model=a.model,
            replica=a.replica,
            stage=a.stage,
            microbatch=a.microbatch,
            kind=a.kind,
        )
    return trace


def write_chrome_trace(result: SimResult, path: str | Path) -> None:
    chrome_trace(result).save(path)


def save_gantt(result: SimResult, path: str | Path, title: str = "") -> None:
    """Ranks x time; blue = Actor, orange = Critic; F light, B dark; labels are micro-batch indices."""
    save_gantt_png(
        chrome_trace(result),  # one cost-model unit = 1 ms on the chart
        path,
        COLORS,
        title=title or f"makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.1%}",
        label=lambda e: str(e["args"]["microbatch"]),
        xlabel="time (cost-model units)",
    )
