"""Every trace producer writes through ChromeTrace, and one Gantt plotter draws any ChromeTrace."""

import json

import pytest

from fusedrl.components import ChromeTrace, save_gantt_png
from fusedrl.pipelining import CostModel, Placement, TimedAction, Timeline, sequential_1f1b, simulate
from fusedrl.pipelining.ir import Action
from fusedrl.pipelining.viz import chrome_trace

TIMELINE = Timeline(
    [
        TimedAction(0, Action("actor", 0, 0, "F"), 10.0, 10.5),
        TimedAction(1, Action("actor", 1, 0, "F"), 10.5, 11.0),
        TimedAction(1, Action("critic", 0, 0, "W"), 11.0, 11.25),
    ]
)


def test_timeline_spans_count_from_its_first_start_or_a_given_zero(tmp_path):
    trace = TIMELINE.to_chrome_trace()
    spans = [e for e in trace.events if e["ph"] == "X"]
    assert [(e["name"], e["cat"], e["pid"], e["ts"], e["dur"]) for e in spans] == [
        ("actor F0", "actor F", 0, 0.0, 0.5e6),
        ("actor F0", "actor F", 1, 0.5e6, 0.5e6),
        ("critic W0", "critic B", 1, 1.0e6, 0.25e6),  # a weight backward is drawn as a backward
    ]
    merged = ChromeTrace()
    TIMELINE.to_chrome_trace(merged, t0=9.0, pid="training")
    assert {(e["pid"], e["tid"], e["ts"]) for e in merged.events if e["ph"] == "X"} == {
        ("training", 0, 1e6),
        ("training", 1, 1.5e6),
        ("training", 1, 2e6),
    }
    assert {e["args"]["name"] for e in merged.events if e["name"] == "thread_name"} == {"pp rank 0", "pp rank 1"}
    TIMELINE.save_chrome_trace(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] == trace.events


def test_simulated_schedule_trace_is_in_cost_units_of_a_millisecond():
    placement = Placement(2)
    result = simulate(sequential_1f1b(placement, 2, 2), placement, CostModel.uniform(placement, 1.0, 1.0), 2, 2)
    spans = [e for e in chrome_trace(result).events if e["ph"] == "X"]
    assert len(spans) == len(result.timeline) == 2 * 2 * 2 * 2
    for e, t in zip(spans, result.timeline):
        assert (e["tid"], e["ts"], e["dur"]) == (t.rank, pytest.approx(t.start * 1e3), pytest.approx((t.end - t.start) * 1e3))
        assert e["args"]["microbatch"] == t.action.microbatch


def test_gantt_of_a_trace_with_named_and_numbered_processes(tmp_path):
    pytest.importorskip("matplotlib")
    trace = ChromeTrace()
    trace.name_process(0, "rank 0")
    trace.complete("decode", 0.0, 0.5, pid=0)
    trace.complete("score", 0.5, 0.1, pid=0)
    TIMELINE.to_chrome_trace(trace, t0=10.0, pid="training")  # the trainer's merged trace mixes int and str pids
    path = save_gantt_png(trace, tmp_path / "g" / "gantt.png", {"decode": "#4c8bd6", "actor F": "#7fb3e6"}, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
