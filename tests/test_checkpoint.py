import logging
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from fusedrl.components.checkpoint import COMPLETE_MARKER, CheckpointManager, export_hf
from fusedrl.components.lr_schedule import build_lr_scheduler
from fusedrl.components.optimizer import build_optimizer


class Counter:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, s):
        self.position = s["position"]


def _train_state(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    sched = build_lr_scheduler(opt, warmup_steps=2, total_steps=10, decay="cosine")
    return model, opt, sched


def _step(model, opt, sched):
    loss = model(torch.randn(3, 4)).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def test_round_trip_and_resume_equals_uninterrupted(tmp_path):
    model, opt, sched = _train_state()
    data = Counter()
    mgr = CheckpointManager(tmp_path, {"actor": model}, {"actor": opt}, {"actor": sched}, {"data": data}, interval=2, keep_last=2)
    assert mgr.load() is None
    for step in range(1, 5):
        _step(model, opt, sched)
        data.position += 10
        mgr.save(step)
    assert mgr.complete_steps() == [2, 4]
    expected_params = [p.detach().clone() for p in model.parameters()]
    lr_at_4 = sched.get_last_lr()
    # continue 2 more steps uninterrupted
    for _ in range(2):
        _step(model, opt, sched)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = _train_state(seed=123)
    data2 = Counter()
    mgr2 = CheckpointManager(tmp_path, {"actor": model2}, {"actor": opt2}, {"actor": sched2}, {"data": data2})
    torch.manual_seed(999)
    random.seed(5)
    assert mgr2.load() == 4
    assert data2.position == 40 and sched2.last_epoch == 4
    assert sched2.get_last_lr() == lr_at_4 and opt2.param_groups[0]["lr"] == lr_at_4[0]
    for a, b in zip(model2.parameters(), expected_params):
        assert torch.equal(a, b)
    for _ in range(2):  # RNG and optimizer state restored: the continuation is bit-identical
        _step(model2, opt2, sched2)
    for a, b in zip(model2.parameters(), uninterrupted):
        assert torch.equal(a, b)
    # keep_last=2 pruned step 2 after saving 6
    for step in (5, 6):
        mgr.save(step)
    assert mgr.complete_steps() == [4, 6]


def test_incomplete_checkpoint_is_ignored(tmp_path, caplog):
    model, opt, sched = _train_state()
    mgr = CheckpointManager(tmp_path, {"m": model}, {"m": opt}, interval=1)
    mgr.save(1)
    mgr.save(2)
    (mgr.path(2) / COMPLETE_MARKER).unlink()
    with caplog.at_level(logging.WARNING):
        assert mgr.latest_step() == 1
    assert "incomplete checkpoint" in caplog.text
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        mgr.load(2)


def test_a_component_without_state_in_an_older_checkpoint_starts_fresh(tmp_path, caplog):
    model, _, _ = _train_state()
    old = Counter()
    old.position = 5
    CheckpointManager(tmp_path, {"m": model}, extra={"data": old}).save(1, force=True)
    data, added = Counter(), Counter()
    added.position = 7
    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(tmp_path, {"m": model}, extra={"data": data, "fusion": added}).load(1) == 1
    assert (data.position, added.position) == (5, 7)  # restored; untouched
    assert "holds no 'fusion' state" in caplog.text


def test_bad_arguments(tmp_path):
    model, opt, _ = _train_state()
    with pytest.raises(ValueError, match="no model of the same name"):
        CheckpointManager(tmp_path, {"actor": model}, {"critic": opt})
    with pytest.raises(ValueError, match="needs state_dict"):
        CheckpointManager(tmp_path, {"actor": model}, extra={"x": 3})
    with pytest.raises(ValueError, match="interval"):
        CheckpointManager(tmp_path, {"actor": model}, interval=-1)


_WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from torch import nn
    import torch.distributed.checkpoint.filesystem as fs
    from fusedrl.components.checkpoint import CheckpointManager

    folder, kill_point = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    mgr = CheckpointManager(folder, {"m": model}, interval=1)
    with torch.no_grad():
        model.weight.fill_(1.0)
    mgr.save(1)
    with torch.no_grad():
        model.weight.fill_(2.0)
    if kill_point == "write":  # die while DCP writes the tensor files
        orig = fs._write_item
        def dying(*a, **k):
            orig(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        fs._write_item = dying
    else:  # die after all data is written, just before the commit (marker + rename)
        CheckpointManager._commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    mgr.save(2)
    print("UNREACHABLE")
    """
)


def test_killed_writer_leaves_previous_checkpoint_loadable(tmp_path):
    """Kill (SIGKILL) a writer while DCP writes tensor files, and another just before the commit."""
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    kill_points = ("write", "commit")
    procs = {
        k: subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / k), k],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in kill_points
    }
    for kill_point, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, err
        assert "UNREACHABLE" not in out
        folder = tmp_path / kill_point
        assert (folder / ".step-00000002.tmp").exists()  # the half-written checkpoint is there, but not as a step
        model = nn.Linear(64, 64)
        mgr = CheckpointManager(folder, {"m": model}, interval=1)
        assert mgr.complete_steps() == [1]
        assert mgr.load() == 1
        assert torch.all(model.weight == 1.0)
        # the next save of step 2 cleans the leftovers and succeeds
        mgr.save(2)
        assert mgr.complete_steps() == [1, 2] and not (folder / ".step-00000002.tmp").exists()


def _fsdp_ranks(folder):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fusedrl.models import build_model
    from fusedrl.models.hf import load_hf_checkpoint

    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))

    def build(seed):
        torch.manual_seed(seed)
        m = build_model("debug", "value")
        for layer in m.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = build_optimizer(m, lr=1e-3)
        return m, opt, build_lr_scheduler(opt, 1, 5)

    model, opt, sched = build(0)
    tokens = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(tokens).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    data = Counter()
    data.position = 7
    mgr = CheckpointManager(folder, {"critic": model}, {"critic": opt}, {"critic": sched}, {"data": data}, interval=1)
    mgr.save(3)
    full_before = {k: v.full_tensor() for k, v in model.state_dict().items()}
    exp_avg_before = [opt.state[p]["exp_avg"].to_local().clone() for p in model.parameters()]

    model2, opt2, sched2 = build(1)
    data2 = Counter()
    mgr2 = CheckpointManager(folder, {"critic": model2}, {"critic": opt2}, {"critic": sched2}, {"data": data2})
    assert mgr2.load() == 3
    assert data2.position == 7 and sched2.last_epoch == 1
    for k, v in model2.state_dict().items():
        assert isinstance(v, DTensor)
        assert torch.equal(v.full_tensor(), full_before[k]), k
    for p, before in zip(model2.parameters(), exp_avg_before):
        assert torch.equal(opt2.state[p]["exp_avg"].to_local(), before)

    out = export_hf(model2, os.path.join(folder, "hf"), "debug", "value")
    dist.barrier()
    assert (out is not None) == (rank == 0)
    plain = build_model("debug", "value")
    load_hf_checkpoint(plain, os.path.join(folder, "hf"), "debug", "value")
    for k, v in plain.state_dict().items():
        assert torch.equal(v, full_before[k]), k


def test_fsdp2_two_ranks_round_trip_and_hf_export(rank_pools, tmp_path):
    rank_pools(2).run(_fsdp_ranks, str(tmp_path), timeout_s=150)
