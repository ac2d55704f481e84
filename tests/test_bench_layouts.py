"""python -m fusedrl.bench.layouts: the variants' arguments, their alternation, the ratios, a misspelt key refused."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PP2 = "--parallelism.pp=2 --parallelism.dp_shard=1 --ppo.microbatch_size=4"


def test_each_layout_runs_the_common_arguments_then_its_overrides_alternating_and_reports_its_ratio(capsys, monkeypatch):
    import fusedrl.bench.jobs as jobs
    import fusedrl.bench.layouts as bench

    monkeypatch.chdir(ROOT)
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], out: Path, env: dict[str, str]) -> list[dict]:
        calls.append(cmd)
        pipelined = "--parallelism.pp=2" in cmd
        return [
            {
                "step": s,
                "samples_per_s": 2.0 if pipelined else 2.5,
                "time_training": 8.0 if pipelined else 6.0,
                "peak_memory_gib": 1.0,
            }
            for s in (1, 2, 3)
        ]

    monkeypatch.setattr(jobs, "run_job", fake_run)
    argv = ["--config", "train_configs/smollm2_135m_ppo.toml", "--layout", PP2, "--steps", "3", "--warmup", "1"]
    assert bench.main([*argv, "--json", "--", "--generation.max_new_tokens=16"]) == 0
    assert ["--parallelism.pp=2" in cmd for cmd in calls] == [False, True, False, True]  # 2 rounds, alternating
    for cmd in calls:
        assert cmd[cmd.index("fusedrl.train") + 1 : cmd.index("fusedrl.train") + 3] == [
            "--job.config_file",
            "train_configs/smollm2_135m_ppo.toml",
        ]
        # the same samples in every layout: no update moves the weights (the PPO recipe's Critic included)
        assert "--optimizer.actor_lr=1e-12" in cmd and "--optimizer.critic_lr=1e-12" in cmd
        assert "--eval.interval=0" in cmd and "--training.steps=3" in cmd
        assert cmd.index("--generation.max_new_tokens=16") > cmd.index("--training.steps=3")  # the user's come last
    assert calls[1][-3:] == PP2.split()  # the layout's overrides win over everything else
    out = capsys.readouterr().out
    assert f"{PP2}  (against config: samples/s ratio {2.0 / 2.5:.3f}x)" in out
    training = [line.split() for line in out.splitlines() if line.strip().startswith("time_training")]
    assert training == [["time_training", "6.000", "1.000x"], ["time_training", "8.000", f"{8 / 6:.3f}x"]]


def test_a_misspelt_layout_key_is_refused_in_one_line_before_any_run(capsys, monkeypatch):
    import fusedrl.bench.jobs as jobs
    import fusedrl.bench.layouts as bench

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(jobs, "run_job", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit):
        bench.main(
            ["--config", "train_configs/smollm2_135m_grpo.toml", "--layout", "--parallelism.ppp=2 --ppo.microbatch_size=4"]
        )
    assert "parallelism.ppp (command line): unknown key in [parallelism]; did you mean pp?" in capsys.readouterr().err


@pytest.mark.parametrize("bench_name", ["layouts", "lora"])
def test_runs_with_no_iteration_after_the_warmup_are_refused_before_any_run(capsys, monkeypatch, bench_name):
    import importlib

    import fusedrl.bench.jobs as jobs

    bench = importlib.import_module(f"fusedrl.bench.{bench_name}")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(jobs, "run_job", lambda *a: pytest.fail("a run started"))
    argv = ["--config", "train_configs/smollm2_135m_grpo_lora.toml", "--steps", "2", "--warmup", "2"]
    with pytest.raises(SystemExit):
        bench.main([*argv, *(["--layout", PP2] if bench_name == "layouts" else [])])
    assert "--steps 2 must exceed --warmup 2" in capsys.readouterr().err
