"""python -m fusedrl.bench.lora: a run's figures and the refusal of a config without adapters."""

from pathlib import Path

import pytest

from fusedrl.bench.lora import main, run_figures

ROOT = Path(__file__).resolve().parents[1]


def test_run_figures_average_after_the_warmup_and_keep_the_largest_peak():
    records = [{"step": 0, "eval/accuracy": 0.5}]  # an evaluation record is not an iteration
    for step in range(1, 6):
        records.append(
            {"step": step, "samples_per_s": float(step), "time_training": 10.0 / step, "peak_memory_gib": 3.0 - step / 10}
        )
    figures = run_figures(records, warmup=2)
    assert figures["samples_per_s"] == pytest.approx(4.0)  # steps 3-5
    assert figures["time_training"] == pytest.approx((10 / 3 + 10 / 4 + 10 / 5) / 3)
    assert figures["peak_memory_gib"] == pytest.approx(2.9)  # over every iteration, the warm-up's included
    with pytest.raises(ValueError, match="raise --steps"):
        run_figures(records, warmup=5)


def test_a_config_without_lora_models_is_refused_before_running(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        main(["--config", "train_configs/debug_grpo.toml", "--steps", "3"])
    assert "has no [lora] models: nothing to compare" in capsys.readouterr().err
