import json
import math
import time

import pytest
import torch
from torch import nn

from fusedrl.components.lr_schedule import build_lr_scheduler, lr_factor
from fusedrl.components.metrics import (
    ChromeTrace,
    MetricsLogger,
    PhaseTimers,
    length_stats,
    memory_figures,
    peak_memory_gib,
    percentile,
    read_jsonl,
    resident_memory_gib,
)
from fusedrl.components.optimizer import build_optimizer, clip_grad_norm, grad_norm, param_groups


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 1, bias=False)
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)


def test_param_groups_and_weight_decay():
    m = Tiny()
    decay, no_decay = param_groups(m, 0.1)
    assert {id(p) for p in decay["params"]} == {id(m.proj.weight), id(m.head.weight)}
    assert {id(p) for p in no_decay["params"]} == {id(m.proj.bias), id(m.norm.weight), id(m.norm.bias)}
    opt = build_optimizer(m, lr=0.1, weight_decay=0.5)
    # with zero gradients AdamW only applies decoupled weight decay: w <- w * (1 - lr * wd)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(m.proj.weight, before["proj.weight"] * (1 - 0.05))
    assert torch.equal(m.norm.weight, before["norm.weight"]) and torch.equal(m.proj.bias, before["proj.bias"])
    with pytest.raises(ValueError, match="learning rate"):
        build_optimizer(m, lr=0.0)


def test_clip_grad_norm():
    m = Tiny()
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 2.0)
    params = [p for p in m.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    total = clip_grad_norm(params, max_norm=1.0)
    assert total.item() == pytest.approx(2.0 * math.sqrt(n), rel=1e-5)
    assert grad_norm(params).item() == pytest.approx(1.0, rel=1e-4)
    # below the limit: unchanged
    assert clip_grad_norm(params, max_norm=10.0).item() == pytest.approx(1.0, rel=1e-4)
    assert grad_norm(params).item() == pytest.approx(1.0, rel=1e-4)
    # non-finite: gradients left untouched so the caller can skip the step
    params[0].grad[0, 0] = float("nan")
    before = params[1].grad.clone()
    assert not torch.isfinite(clip_grad_norm(params, max_norm=0.1))
    assert torch.equal(params[1].grad, before)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(params, 0.0)


def _clip_ranks():
    """rank r holds "stage r" of a model; FSDP2-shard it over a 1-rank dp mesh so grads are DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp_shard"))
    stage = nn.Linear(3, 3, bias=False)
    fully_shard(stage, mesh=mesh["dp_shard"])
    with torch.no_grad():
        stage.weight.fill_(0.0)
    stage(torch.ones(1, 3)).sum().backward()
    assert isinstance(stage.weight.grad, DTensor)
    # each stage's grad = ones(3,3); scale rank 1's by 2
    with torch.no_grad():
        stage.weight.grad.mul_(rank + 1)
    expected = math.sqrt(9 * 1 + 9 * 4)
    total = clip_grad_norm(stage.parameters(), max_norm=1.0, pp_group=mesh["pp"].get_group())
    assert total.item() == pytest.approx(expected, rel=1e-5)
    local = stage.weight.grad.full_tensor()
    assert torch.allclose(local, torch.full((3, 3), (rank + 1) / expected), rtol=1e-4)


def test_clip_grad_norm_over_pp_group_with_dtensors(rank_pools):
    rank_pools(2).run(_clip_ranks, timeout_s=90)


def test_lr_schedule():
    assert [lr_factor(s, 4, 10, "constant") for s in (0, 3, 4, 9)] == [0.25, 1.0, 1.0, 1.0]
    assert lr_factor(4, 4, 12, "linear") == 1.0
    assert lr_factor(8, 4, 12, "linear") == pytest.approx(0.5)
    assert lr_factor(12, 4, 12, "linear") == pytest.approx(0.0)
    assert lr_factor(8, 4, 12, "cosine", min_ratio=0.2) == pytest.approx(0.6)
    assert lr_factor(50, 4, 12, "cosine", min_ratio=0.2) == pytest.approx(0.2)
    m = Tiny()
    opt = build_optimizer(m, lr=1.0)
    sched = build_lr_scheduler(opt, warmup_steps=2, total_steps=6, decay="linear")
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    sd = sched.state_dict()
    opt2 = build_optimizer(m, lr=1.0)
    sched2 = build_lr_scheduler(opt2, 2, 6, "linear")
    sched2.load_state_dict(sd)
    assert sched2.last_epoch == 6 and sched2.get_last_lr() == sched.get_last_lr()
    with pytest.raises(ValueError, match="decay"):
        build_lr_scheduler(opt, 1, 5, "exp")


def test_metrics_logger_jsonl_and_stdout(tmp_path, capsys):
    # With tensorboard installed this also writes events (tests/test_metrics_tensorboard.py); without it, warns and goes on.
    with MetricsLogger(tmp_path, log_freq=2, tensorboard=True) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": torch.tensor(1.0 / step), "samples": step * 4, "skipped": False})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4]
    assert time.time() - 60 < records[1].pop("wall_time") <= time.time() + 1e-3  # rounded to the millisecond
    assert records[1] == {"step": 4, "loss": 0.25, "samples": 16, "skipped": 0}
    out = capsys.readouterr().out
    assert "step 2: loss=0.5 samples=8" in out and "step 3" not in out
    quiet = MetricsLogger(tmp_path / "r1", rank=1)
    quiet.log(2, {"loss": 1.0})
    assert not (tmp_path / "r1").exists()
    with pytest.raises(ValueError, match="scalar"):
        MetricsLogger(None, jsonl=False, stdout=False).log(1, {"x": torch.ones(2)})


def test_timers_percentiles_memory_trace(tmp_path):
    trace = ChromeTrace()
    timers = PhaseTimers(trace=trace, pid=3)
    for _ in range(2):
        with timers("generation"):
            sum(range(10_000))
    timers.add("scoring_exposed", 0.5)
    totals = timers.pop()
    assert set(totals) == {"generation", "scoring_exposed"} and totals["generation"] > 0
    assert totals["scoring_exposed"] == 0.5 and timers.pop() == {}
    assert len(trace.events) == 2 and all(e["ph"] == "X" and e["pid"] == 3 for e in trace.events)
    trace.instant("migrate", 1.0, pid=0, unfinished=3)
    trace.counter("unfinished", 1.0, {"n": 3})
    trace.name_process(3, "rank 3")
    path = trace.save(tmp_path / "t" / "trace.json")
    data = json.loads(path.read_text())
    assert len(data["traceEvents"]) == 5 and data["traceEvents"][2]["args"] == {"unfinished": 3}

    lengths = list(range(1, 101))
    stats = length_stats(lengths)
    assert stats == {
        "response_len_mean": 50.5,
        "response_len_p50": 50.0,
        "response_len_p90": 90.0,
        "response_len_p99": 99.0,
        "response_len_max": 100.0,
    }
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    assert 0 < peak_memory_gib() < 1024
    before = resident_memory_gib()
    held = torch.ones(2**26)  # 256 MiB, every page written
    assert resident_memory_gib() - before > 0.2 and float(held[-1]) == 1.0  # the resident set, not a high-water mark


def test_memory_figures_count_a_live_tensor_as_heap_in_use_on_cpu():
    before = memory_figures("cpu")
    if "host_heap_in_use_gib" not in before:
        pytest.skip("no glibc mallinfo2 here")
    held = torch.ones(2**26)  # 256 MiB
    during = memory_figures("cpu")
    assert float(held[-1]) == 1.0
    del held
    after = memory_figures("cpu")
    assert during["host_heap_in_use_gib"] - before["host_heap_in_use_gib"] > 0.24
    assert during["host_heap_in_use_gib"] - after["host_heap_in_use_gib"] > 0.24  # freed: no longer in use
    assert set(during) == {"peak_memory_gib", "resident_memory_gib", "host_heap_in_use_gib", "host_heap_free_gib"}
