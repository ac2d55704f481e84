"""python -m fusedrl.bench.soak's summary: the memory trend after warm-up and the non-finite figures of a run."""

import math

import pytest

from fusedrl.bench.soak import slope_per_100, summarize


def test_slope_is_per_100_iterations_and_flat_data_has_none():
    assert slope_per_100([1, 2, 3, 4], [10.0, 10.5, 11.0, 11.5]) == pytest.approx(50.0)
    assert slope_per_100([5, 6, 7], [3.0, 3.0, 3.0]) == 0.0 and slope_per_100([5], [3.0]) == 0.0


def test_summary_leaves_out_the_warmup_and_the_evaluation_record_and_names_non_finite_figures():
    records = [{"step": 0, "eval/accuracy": 0.5}]  # [eval] before the first iteration: not an iteration
    for step in range(1, 31):
        leak = 0.0 if step <= 10 else (step - 10) / 1024  # 1 MiB per iteration after the warm-up
        records.append(
            {
                "step": step,
                "resident_memory_gib": 2.0 + (0.5 if step <= 10 else leak),  # the warm-up's level is left out
                "peak_memory_gib": 3.0,
                "host_heap_free_gib": 0.5 + leak,  # on CPU: the kept memory grows, not what is in use
                "host_heap_in_use_gib": 1.5,
                "policy_loss": math.nan if step == 17 else 0.1,
                "reward_mean": 0.5,
            }
        )
    summary = summarize(records, warmup=10)
    resident = summary["resident_memory_gib"]
    assert summary["iterations"] == 30 and resident["first"] == pytest.approx(2.0 + 1 / 1024)
    assert resident["slope_mib_per_100"] == pytest.approx(100.0)
    assert summary["peak_memory_gib"]["slope_mib_per_100"] == 0.0 and summary["peak_memory_gib"]["last_over_first"] == 1.0
    assert summary["host_heap_free_gib"]["slope_mib_per_100"] == pytest.approx(100.0)
    assert summary["host_heap_in_use_gib"]["slope_mib_per_100"] == 0.0
    assert resident["slope_second_half_mib_per_100"] == pytest.approx(100.0)  # a steady rise: the second half rises too

    assert summary["non_finite"] == ["step 17: policy_loss = nan"]


def test_a_rise_that_stops_is_told_from_a_leak():
    records = [{"step": s, "resident_memory_gib": 2.0 + min(s, 40) / 100} for s in range(1, 101)]  # flat from 40
    resident = summarize(records, warmup=0)["resident_memory_gib"]
    assert resident["slope_mib_per_100"] > 100 and resident["slope_second_half_mib_per_100"] == 0.0
    assert resident["settled_from"] == 39  # 2.39 GiB is within 16 MiB of the end's 2.40; 2.38 is not
