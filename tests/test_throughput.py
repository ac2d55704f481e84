"""The trainer's compute figures (train_mfu, score_mfu, pad_frac, train_tokens_per_s) and the whole-model forward
FLOPs they count, by hand; the peak's cache."""

import json

import pytest
import torch

from fusedrl import hardware
from fusedrl.config import load_config
from fusedrl.hardware import Peak, cached_peak
from fusedrl.models import FLAVORS
from fusedrl.models.figures import forward_flops
from fusedrl.rlhf import sequence_lengths
from fusedrl.trainer.throughput import compute_figures, peak_flops_per_s

DEBUG = FLAVORS["debug"]  # vocab 512, 2 layers, dim 64; one layer over 10 tokens: 983_040 matmul FLOPs + 12_800 attention


def test_forward_flops_counts_each_sequence_and_the_head_on_its_tokens():
    layer_mm = 983_040 // 10  # per token
    # sequences of 3 and 7 tokens attend to their own tokens only: 2 x (9 + 49) x 64 per layer
    body = 2 * (10 * layer_mm + 2 * (9 + 49) * 64)
    assert forward_flops(DEBUG, "policy", [3, 7], 4) == body + 2 * 4 * 64 * 512
    assert forward_flops(DEBUG, "policy", [3, 7], 0) == body
    assert forward_flops(DEBUG, "value", [3, 7], 10) == body + 2 * 10 * 64


def _cfg(*overrides):
    return load_config(["--job.config_file", "train_configs/debug_grpo.toml", *overrides])


def test_compute_figures_by_hand():
    cfg = _cfg("--ppo.epochs=2", "--training.mixed_precision_param=bfloat16", "--training.frozen_dtype=float32")
    flops = forward_flops(DEBUG, "policy", [3, 7], 4)
    peak = {"float32": 1e9, "bfloat16": 4e9}
    out = compute_figures(cfg, [3, 7], 4, 16, {"time_training": 2.0, "time_scoring": 0.5}, peak, world=2)
    assert out["pad_frac"] == pytest.approx(1 - 10 / 16)
    assert out["train_tokens_per_s"] == pytest.approx(2 * 10 / 2.0)
    # 3 x forward per trained token, 2 epochs, over 2 ranks' bf16 peak for the phase's time
    assert out["train_mfu"] == pytest.approx(3 * 2 * flops / (2.0 * 2 * 4e9))
    # the Reference's forward (the KL term), in the frozen models' float32
    assert out["score_mfu"] == pytest.approx(flops / (0.5 * 2 * 1e9))
    # no KL term: no Reference scores, no score_mfu; no time: no rates
    cfg = _cfg("--ppo.kl_loss_coef=0", "--ppo.kl_coef=0")
    assert set(compute_figures(cfg, [3, 7], 4, 16, {}, peak, world=1)) == {"pad_frac"}


def test_peak_from_the_config_or_the_measurement():
    assert peak_flops_per_s(_cfg("--training.peak_tflops=2.5"), None) == {"float32": 2.5e12, "bfloat16": 2.5e12}
    measured = Peak("cpu", 2, {"float32": 1.0, "bfloat16": 3.0}, 5.0)
    assert peak_flops_per_s(_cfg(), measured) == {"float32": 1.0, "bfloat16": 3.0}
    no_bf16 = Peak("cuda:0", 1, {"float32": 2.0}, 5.0)  # a GPU without bf16: its float32 peak stands in
    assert peak_flops_per_s(_cfg(), no_bf16) == {"float32": 2.0, "bfloat16": 2.0}


def test_sequence_lengths_of_right_padded_rows():
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    assert sequence_lengths(mask) == [4, 6]


def test_cached_peak_measures_once_per_key(tmp_path, monkeypatch):
    calls = []

    def fake(device, threads, seconds=2.0):
        calls.append(threads)
        return Peak(str(device), threads, {"float32": 1e9 * threads}, 2e10)

    monkeypatch.setattr(hardware, "measure_peak", fake)
    first = cached_peak("cpu", 1, cache_dir=tmp_path)
    assert cached_peak("cpu", 1, cache_dir=tmp_path) == first and calls == [1]
    assert cached_peak("cpu", 2, cache_dir=tmp_path).matmul_flops_per_s == {"float32": 2e9} and calls == [1, 2]
    entries = json.loads((tmp_path / "peak.json").read_text())
    assert len(entries) == 2 and all(torch.__version__ in key for key in entries)
    (tmp_path / "peak.json").write_text("not json")  # a damaged cache is measured again and rewritten
    assert cached_peak("cpu", 1, cache_dir=tmp_path) == first and calls == [1, 2, 1]
