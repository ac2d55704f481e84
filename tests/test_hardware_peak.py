"""fusedrl.hardware.measure_peak and ``python -m fusedrl.bench.peak``: the figures' shape, not their speed."""

import json
import math

import pytest
import torch

from fusedrl.bench import peak as peak_bench
from fusedrl.hardware import Peak, measure_peak

HAND = Peak("cpu", 2, {"float32": 4e11, "bfloat16": 2e12}, 3e10)


def test_measure_peak_figures_and_threads_restored():
    before = torch.get_num_threads()
    threads = 1 if before > 1 else 2
    peak = measure_peak("cpu", threads=threads, seconds=0.0)
    assert torch.get_num_threads() == before
    assert peak.device == "cpu" and peak.threads == threads
    assert set(peak.matmul_flops_per_s) == {"float32", "bfloat16"}
    for figure in [*peak.matmul_flops_per_s.values(), peak.memory_read_bytes_per_s]:
        assert math.isfinite(figure) and figure > 0
    assert json.loads(json.dumps(peak.as_dict())) == peak.as_dict()


def test_fraction_on_hand_given_figures():
    assert HAND.fraction(1e12, torch.bfloat16) == 0.5
    assert HAND.fraction(1e11, "float32") == 0.25
    assert HAND.memory_fraction(1.5e10) == 0.5
    with pytest.raises(ValueError, match="no float16 matmul peak"):
        HAND.fraction(1e12, torch.float16)


def test_bad_arguments():
    with pytest.raises(ValueError, match="threads=0"):
        measure_peak(threads=0)
    with pytest.raises(ValueError, match="seconds=-1"):
        measure_peak(seconds=-1)


def test_cli_json_last_line(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(peak_bench, "measure_peak", lambda *args: calls.append(args) or HAND)
    assert peak_bench.main(["--device", "cpu", "--threads", "2", "--seconds", "0.5", "--json"]) == 0
    assert calls == [("cpu", 2, 0.5)]
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["matmul_flops_per_s"] == HAND.matmul_flops_per_s
    assert out["memory_read_bytes_per_s"] == 3e10 and out["bf16_fp32_ratio"] == 5.0
    assert any("TFLOP/s" in line for line in lines[:-1])
