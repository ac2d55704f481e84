"""python -m fusedrl.bench.generation: every mode but the compiled one is timed first, for every batch size; the compiled
engine follows while its time budget lasts, so a run cut at its limit (the GPU check's step) keeps the other figures."""

import json

import pytest
import torch

from fusedrl.bench.generation import main

TINY = ["--flavor", "debug", "--new-tokens", "4", "--repeats", "1", "--prefill-groups", "", "--graphs-slots", "0", "--json"]


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_eager_figures_come_first_and_the_compiled_mode_runs_while_its_budget_lasts(capsys):
    figures = main([*TINY, "--batch-sizes", "1,2", "--time-budget-s", "0.001"])
    assert set(figures["modes"]["eager"]) == set(figures["modes"]["torchtune"]) == {"1", "2"}
    assert figures["modes"]["compiled"] == {} and figures["compiled_skipped"] == ["1", "2"]
    out = capsys.readouterr().out
    assert "compiled: not run, --time-budget-s 0.001 spent" in out
    assert _json_lines(out)[-2]["compiled_skipped"] == ["1", "2"]  # said in a partial line too, before the last one

    torch.compiler.reset()  # a same-shaped graph compiled earlier in this process (another test's) would be reused
    figures = main([*TINY, "--batch-sizes", "1"])
    lines = _json_lines(capsys.readouterr().out)
    first, second = lines[0], lines[1]  # the partial figures after each pass
    assert first["partial"] and "1" in first["modes"]["eager"] and first["modes"]["compiled"] == {}
    assert second["partial"] and "1" in second["modes"]["compiled"] and second["compiled_graphs"]["1"]["graphs"] >= 1
    assert figures["compiled_skipped"] == [] and set(second["modes"]["torchtune"]) == {"1"}
