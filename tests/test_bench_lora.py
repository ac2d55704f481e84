"""python -m fusedrl.bench.lora: a run's figures and the refusal of a config without adapters."""

from pathlib import Path

import pytest

from fusedrl.bench.jobs import run_figures
from fusedrl.bench.lora import main

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


def test_a_base_reference_job_also_runs_the_reference_copy_and_unmerged_adapters_and_reports_each_ratio(capsys, monkeypatch):
    import fusedrl.bench.jobs as jobs
    import fusedrl.bench.lora as bench

    monkeypatch.chdir(ROOT)
    order: list[str] = []

    def fake_run(cmd: list[str], out: Path, env: dict[str, str]) -> list[dict]:
        copy, unmerged = "--lora.reference=copy" in cmd, "--lora.rollout_weights=adapters" in cmd
        order.append("full" if "--lora.models=[]" in cmd else "lora_copy" if copy else "lora_unmerged" if unmerged else "lora")
        reference = 0.0 if copy or order[-1] == "full" else 2.0
        return [
            {
                "step": s,
                "samples_per_s": 4.0 if copy else 5.5 if unmerged else 5.0,
                "time_reference": reference,
                "peak_memory_gib": 3.0 if copy else 2.5,
            }
            for s in (1, 2, 3)
        ]

    monkeypatch.setattr(jobs, "run_job", fake_run)
    monkeypatch.setattr(bench, "estimated_peak_gib", lambda argv: 1.0)
    args = ["--steps", "3", "--warmup", "1", "--json", "--", '--lora.models=["actor"]', "--ppo.kl_loss_coef=0.01"]
    assert bench.main(["--config", "train_configs/debug_grpo.toml", *args]) == 0
    assert order == ["lora", "full", "lora_copy", "lora_unmerged"] * 2
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("figure"))
    assert header.split()[-3:] == ["lora/full", "lora/lora_copy", "lora_unmerged/lora"]
    memory = next(line for line in lines if line.startswith("peak_memory_gib")).split()
    assert memory[-2] == f"{2.5 / 3.0:.3f}"
    speed = next(line for line in lines if line.startswith("samples_per_s")).split()
    assert speed[-1] == f"{5.5 / 5.0:.3f}"
    reference = next(line for line in lines if line.startswith("time_reference")).split()
    assert reference[-3:-1] == ["-", "-"]  # neither the full run nor the copy runs a base Reference pass
