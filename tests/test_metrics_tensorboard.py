"""[metrics] tensorboard = true: TensorBoard's own event reader reads back the scalars of metrics.jsonl."""

import math
import struct

import pytest
import torch

from fusedrl.components.metrics import MetricsLogger, read_jsonl
from fusedrl.config import MetricsSection

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="needs the tensorboard extra: pip install -e '.[dev,tensorboard]'",
)


def _float32(x: float) -> float:
    # TensorBoard stores a scalar as a 32-bit float (Summary.Value.simple_value).
    return struct.unpack("f", struct.pack("f", x))[0]


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    section = MetricsSection(log_freq=2, jsonl=True, tensorboard=True)
    with MetricsLogger.from_config(section, tmp_path, rank=0) as logger:
        for step in range(1, 7):
            logger.log(
                step,
                {
                    "loss": torch.tensor(1.0 / (3 * step)),  # a tensor
                    "samples": 10_000_019 * step,  # an int above 2**24: TensorBoard keeps it rounded to float32
                    "skipped": step == 4,  # a bool, logged as 0/1
                    "kl": float("nan") if step == 6 else 0.1 * step,  # a Python float, not exact in float32
                },
            )

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["kl", "loss", "samples", "skipped"]
    for tag in ("kl", "loss", "samples", "skipped"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in records], tag
        for event, record in zip(events, records):
            if math.isnan(record[tag]):
                assert math.isnan(event.value), (tag, record["step"])
            else:
                assert event.value == _float32(record[tag]), (tag, record["step"], event.value, record[tag])
    assert records[1]["skipped"] == 1 and records[0]["skipped"] == 0
