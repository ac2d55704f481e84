"""python -m fusedrl.plot: a run's metrics.jsonl drawn as six panels, figures the run did not log left out, clear errors."""

import json

import pytest

from fusedrl import plot


def _records(n: int) -> list[dict]:
    out = []
    for step in range(1, n + 1):
        out.append(
            {
                "step": step,
                "reward_mean": 0.1 * step,
                "reward_fn_mean": 0.1 * step,
                "response_len_mean": 20.0 + step,
                "response_len_p50": 18,
                "response_len_p90": 30,
                "response_len_max": 40,
                "kl": 0.01,
                "entropy": 2.0,
                "clip_frac": 0.001,
                "time_generation": 2.0,
                "time_training": 3.0,
                "time_scoring_exposed": 0.0,  # hidden by the fusion: no bar
                "samples_per_s": 5.0,
                **({"eval/accuracy": 0.5, "eval/response_len_mean": 12.0} if step % 2 == 0 else {}),
            }
        )
    return out


def _labels(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def test_figure_draws_what_the_run_logged_and_says_what_it_did_not():
    start = {"step": 0, "eval/accuracy": 0.25, "eval/response_len_mean": 11.0}  # [eval] before the first iteration
    fig = plot.figure([start, *_records(8)], "run", smooth=3)
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    assert set(axes) == set(plot.PANELS)
    score = _labels(axes["score"])
    assert "reward_mean" in score and "reward_mean (3-it. mean)" in score and "eval/accuracy" in score
    assert "true_score" not in score  # not logged
    assert "eval/response_len_mean" not in score and "eval/response_len_mean" in _labels(axes["response length (tokens)"])
    assert fig._suptitle.get_text() == "run: 8 iterations"  # not counting the evaluation before the first (step 0)
    assert _labels(axes["phase seconds per iteration"]) == ["generation", "training"]  # in STACKED_PHASES order
    stacked = axes["phase seconds per iteration"].patches
    assert max(p.get_y() + p.get_height() for p in stacked) == pytest.approx(5.0)  # generation + training
    assert _labels(axes["KL and entropy"]) == ["kl", "entropy"]
    assert [t.get_text() for t in axes["clip fraction"].texts] == [] and _labels(axes["clip fraction"]) == ["clip_frac"]
    moving = next(line for line in axes["score"].lines if line.get_label() == "reward_mean (3-it. mean)")
    assert list(moving.get_ydata())[:4] == pytest.approx([0.1, 0.15, 0.2, 0.3])


def test_a_panel_without_figures_says_so():
    records = [{"step": 1, "reward_mean": 0.5}]
    fig = plot.figure(records, "run", smooth=5)
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    assert [t.get_text() for t in axes["samples/s"].texts] == ["not logged by this run"]
    assert _labels(axes["score"]) == ["reward_mean"]  # one point: no moving mean


def test_plot_run_writes_a_png_and_the_command_line_reports_bad_folders(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(4)))
    plot.main([str(run)])
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {run / 'metrics.png'}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(tmp_path / "missing")])
    assert exit_.value.code == 2 and "metrics.jsonl does not exist" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit):
        plot.main([str(run)])
    assert "holds no iteration records yet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot.main([str(run), "--smooth", "0"])
    assert "--smooth 0" in capsys.readouterr().err
