"""bench.e2e's layout plumbing: which cores each rank gets, pinning every thread, the layouts' configs."""

from __future__ import annotations

import os
import threading

import pytest

from fusedrl.bench import e2e
from fusedrl.bench.e2e import (
    LAYOUTS,
    ROOT,
    main,
    migration_summary,
    pick_cores,
    pin_process,
    pinned_dp_shard,
    rank_cores,
)
from fusedrl.config import ConfigError
from fusedrl.train import prepare

CONFIG = str(ROOT / "train_configs" / "debug_ppo.toml")


def test_pick_cores_takes_the_first_allowed_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7, 3, 5})
    assert pick_cores(2) == [3, 5]
    with pytest.raises(ConfigError, match=r"needs parallelism.pp \* parallelism.tp = 4 cores, but this process may run on 3"):
        pick_cores(4)


def test_too_few_cores_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert main(["--config", CONFIG, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: one rank per core needs parallelism.pp * parallelism.tp = 2 cores") and err.count("\n") == 1


def test_a_layout_the_batch_cannot_split_is_named_in_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    data_parallel = ["--parallelism.pp=1", "--parallelism.dp_shard=2", "--ppo.microbatch_size=16"]  # 32 / 2 shards: 16
    assert main(["--config", CONFIG, "--steps", "1", *data_parallel]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: layout oversubscribed (dp_shard = 4): ppo.microbatch_size = 16") and err.count("\n") == 1
    assert err.rstrip().endswith("or --fusion-layouts one_rank_per_core")


def test_rank_cores_per_layout() -> None:
    assert rank_cores([2, 5], 1) == [[2], [5]]
    assert rank_cores([2, 5], 2) == [[2, 5]] * 4


def test_one_rank_per_core_keeps_the_configs_data_parallel_degree_where_the_cores_hold_it(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert pinned_dp_shard(pp=2, tp=1, dp_shard=2) == 1  # the debug config on 2 cores: 2 pipeline ranks
    assert pinned_dp_shard(pp=1, tp=1, dp_shard=2) == 2  # the GRPO recipes: 2 data-parallel ranks, not 1
    assert pinned_dp_shard(pp=1, tp=1, dp_shard=1) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    assert pinned_dp_shard(pp=2, tp=1, dp_shard=2) == 2 and pinned_dp_shard(pp=1, tp=2, dp_shard=4) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert pinned_dp_shard(pp=2, tp=1, dp_shard=2) == 1  # too few cores even for pp: pick_cores says so


def test_both_layouts_of_the_debug_config_are_valid_with_its_batch() -> None:
    argv = ["--job.config_file", CONFIG, "--training.device=cpu"]
    batches = {prepare([*argv, f"--parallelism.dp_shard={dp}"], 2 * dp).ppo.batch_size for dp in LAYOUTS.values()}
    assert len(batches) == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one core is only observable with two or more")
def test_pin_process_pins_threads_started_before_and_after() -> None:
    original = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    before = threading.Thread(target=stop.wait)
    before.start()
    after = None
    try:
        pin_process(original[:1])
        after = threading.Thread(target=stop.wait)
        after.start()
        assert before.native_id is not None and after.native_id is not None
        assert os.sched_getaffinity(before.native_id) == {original[0]}
        assert os.sched_getaffinity(after.native_id) == {original[0]}
        assert os.sched_getaffinity(0) == {original[0]}
    finally:
        pin_process(original)
        stop.set()
        before.join()
        if after is not None:
            after.join()


def test_migration_summary_counts_migrations_and_the_simulators_error() -> None:
    common = {"rollout_s": 10.0, "rollout_predicted_never_s": 13.0, "decode_end_s": 8.0}
    records = [
        {"migration_kept": 1, "migration_moved": 6, "auto_threshold": 8, "rollout_predicted_s": 9.0, **common}
        | {"decode_end_predicted_s": 9.0},
        {"migration_kept": 0, "migration_moved": 0, "auto_threshold": 0, "rollout_predicted_s": 12.0, **common}
        | {"decode_end_predicted_s": 8.4},
        {"migration_kept": 0, "migration_moved": 0},  # decided before any scoring cost: no simulation
    ]
    summary = migration_summary(records)
    assert summary["iterations_migrated"] == 1 and summary["moved_per_iteration"] == 2.0
    assert summary["auto_threshold"] == 4.0 and summary["predicted_iterations"] == 2
    assert summary["prediction_error"] == pytest.approx(0.15)
    assert summary["predicted_rollout_s"] == 10.5 and summary["predicted_never_s"] == 13.0
    assert summary["measured_rollout_s"] == 10.0
    assert summary["decode_end_error"] == pytest.approx((1.0 / 8 + 0.4 / 8) / 2)
    assert summary["predicted_decode_end_s"] == pytest.approx(8.7) and summary["measured_decode_end_s"] == 8.0
    fixed = migration_summary([{"migration_kept": 1, "migration_moved": 3}])
    assert fixed["auto_threshold"] is None and fixed["prediction_error"] is None and fixed["decode_end_error"] is None


def test_runs_apart_give_each_mode_its_own_runs_in_alternating_order(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict] = []

    def fake_run_multirank(fn, world, argv, out, warmup, steps, cores, modes, timeout_s):
        assert fn is e2e.alternating_runs and world == len(cores) == 4 and (warmup, steps) == (1, 2)
        calls.append(modes)
        (mode,) = modes
        return [{mode: [{"run": len(calls), "step": s, "samples_per_s": 1.0, "time_step": 1.0} for s in range(steps)]}]

    monkeypatch.setattr(e2e, "run_multirank", fake_run_multirank)
    histories = e2e.runs_apart(["--job.config_file", CONFIG], "/tmp/out", 1, 2, [[0, 1]] * 4, rounds=3)
    assert calls == [{m: e2e.MODES[m]} for m in ("off", "on", "on", "off", "off", "on")]
    assert [r["run"] for r in histories["off"]] == [1, 1, 4, 4, 5, 5]
    assert [r["run"] for r in histories["on"]] == [2, 2, 3, 3, 6, 6]


def test_apart_with_a_baseline_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--config", CONFIG, "--apart", "--baseline", str(ROOT)])
    assert "--apart runs the fusion modes apart" in capsys.readouterr().err


def test_tree_figures_report_the_phases_and_the_executor_overhead_only_where_a_pipeline_ran() -> None:
    from fusedrl.bench.e2e import _tree_figures

    records = [
        {"step": s, "samples_per_s": 2.0, "time_step": 10.0, "time_weight_sync": 0.5 + s, "time_training": 4.0} for s in (2, 3)
    ]
    data_parallel = _tree_figures([{"records": records, "executor_s": 0.0, "compute_s": 0.0, "wait_s": 0.0, "actions": 0}] * 2)
    assert "overhead_us_per_action" not in data_parallel  # pp = 1 runs no pipeline program: nothing to divide by
    assert data_parallel["time_weight_sync"] == 3.0 and data_parallel["time_training"] == 4.0
    pipelined = _tree_figures(
        [
            {"records": records, "executor_s": 3.0, "compute_s": 2.0, "wait_s": 0.5, "actions": 1000},
            {"records": records, "executor_s": 3.0, "compute_s": 2.5, "wait_s": 0.1, "actions": 500},
        ]
    )
    assert pipelined["overhead_us_per_action"] == pytest.approx(1000.0)  # (1 ms + 1 ms) / 2
    assert pipelined["overhead_us_per_action_without_waits"] == pytest.approx((500.0 + 800.0) / 2)
