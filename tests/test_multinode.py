"""Issue 19, beyond one machine: two torchrun agents on this host stand for two nodes (c10d rendezvous), and the
node checks that refuse a generation instance or a TP group spanning nodes.

The launch test runs the debug config (``TINY`` of tests/test_train.py, one generation instance of gen_tp = 2 per
node) as 2 agents x 2 processes and as 1 agent x 4 processes at the same seed: the rendezvous must place node n's
workers at global ranks 2n, 2n+1 (what the node checks assume), the trainer must log the same layout, and the
deterministic figures of metrics.jsonl must be equal. The one-agent launch is also the check of the plain
``torchrun ... -m fusedrl.train`` entry point: it trains, logs, and exports the Actor as an HF folder.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch.distributed as dist
from test_train import COMPARED, TINY

from fusedrl.components import read_jsonl
from fusedrl.config import ConfigError, load_config
from fusedrl.testing import free_port
from fusedrl.testing.launcher import kill_job, torchrun_worker_env

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "train_configs" / "debug_ppo.toml")
NODES, PER_NODE = 2, 2
# pp=2 x dp_shard=2 x tp=1 (the debug config) with gen_tp=2: each node holds one generation instance, and the two
# pipeline stages lie on different nodes (stage s on global ranks 2s, 2s+1).
LAYOUT = ["--parallelism.gen_tp=2", "--checkpoint.export_hf=true"]
LAUNCH_TIMEOUT_S = 240.0
LAYOUT_LINE = "fusedrl: debug_ppo: 4 ranks ("


@dataclass
class Agent:
    name: str
    log: Path
    proc: subprocess.Popen
    workers: dict[int, dict[str, str]] = field(default_factory=dict)  # RANK -> torchrun's variables of the worker

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _report(agents: list[Agent]) -> str:
    """Every agent's exit status, workers, error lines and output tail, one block each."""
    blocks = []
    for a in agents:
        placed = {r: (w.get("GROUP_RANK"), w.get("LOCAL_RANK")) for r, w in sorted(a.workers.items())}
        errors = "\n".join(line for line in a.output.splitlines() if line.startswith("error:")) or "(none)"
        blocks.append(
            f"===== {a.name}: exit status {a.proc.returncode}, workers RANK -> (GROUP_RANK, LOCAL_RANK) "
            f"{placed}\n--- its error lines ---\n{errors}\n--- the tail of its output ---\n{a.output[-2500:]}"
        )
    return "\n".join(blocks)


def _run_agents(out: Path, launches: list[list[str]]) -> list[Agent]:
    """Start one torchrun agent per argument list (all at once) and wait for all of them; record each agent's
    workers while they run. A hang past LAUNCH_TIMEOUT_S kills every agent and fails with their outputs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    agents = []
    try:
        for i, args in enumerate(launches):
            log = out / f"agent{i}.log"
            with open(log, "w") as f:
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    *args,
                    "-m",
                    "fusedrl.train",
                    "--job.config_file",
                    CONFIG,
                    *TINY,
                    *LAYOUT,
                    f"--job.output_dir={out / 'run'}",
                ]
                proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT, process_group=0)
            agents.append(Agent(f"agent {i}", log, proc))
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while any(a.proc.poll() is None for a in agents):
            if time.monotonic() > deadline:
                pytest.fail(f"the launch did not end within {LAUNCH_TIMEOUT_S:.0f}s\n{_report(agents)}")
            for a in agents:
                if a.proc.poll() is None:
                    a.workers.update(torchrun_worker_env(a.proc.pid))
            time.sleep(0.2)
    finally:
        for a in agents:
            if a.proc.poll() is None:
                kill_job(a.proc)
    return agents


def _layout_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(LAYOUT_LINE)]
    assert len(lines) == 1, f"expected one layout line, found {lines}"
    return lines[0]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> tuple[list[Agent], list[dict], Path]:
    """One agent of 4 workers: the reference of the two-agent launch, and what a user's plain ``torchrun`` runs."""
    out = tmp_path_factory.mktemp("one_node")
    agents = _run_agents(
        out,
        [
            [
                "--nnodes=1",
                f"--nproc_per_node={NODES * PER_NODE}",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                "--max_restarts=0",
            ]
        ],
    )
    assert agents[0].proc.returncode == 0, _report(agents)
    return agents, read_jsonl(out / "run" / "metrics.jsonl"), out / "run"


@pytest.mark.slow
def test_torchrun_entry_point_trains_and_exports_the_actor(one_node):
    from fusedrl.models import build_model, load_hf_checkpoint

    (agent,), records, run = one_node
    assert "step 1: true_score=" in agent.output and "step 2: true_score=" in agent.output, _report([agent])
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["policy_loss"]) and r["samples_per_s"] > 0 for r in records)
    load_hf_checkpoint(build_model("debug", "policy"), run / "actor_hf", "debug", "policy")


@pytest.mark.slow
def test_two_agents_place_ranks_by_node_and_train_as_one_agent_does(tmp_path, one_node):
    port = free_port()
    # c10d rendezvous: both agents name the same endpoint and --rdzv_id; the rendezvous assigns node ranks
    # (--node_rank is ignored), and the agent on the endpoint's host serves its store.
    rdzv = [
        f"--nnodes={NODES}",
        f"--nproc_per_node={PER_NODE}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=fusedrl-test-{port}",
        "--local_addr=127.0.0.1",
        "--max_restarts=0",
    ]
    agents = _run_agents(tmp_path, [rdzv, rdzv])
    report = _report(agents)
    assert all(a.proc.returncode == 0 for a in agents), report

    # Placement: each agent ran PER_NODE workers of one node rank, at global ranks node * PER_NODE + local rank.
    nodes = set()
    for a in agents:
        assert len(a.workers) == PER_NODE, report
        (node,) = {int(w["GROUP_RANK"]) for w in a.workers.values()}
        nodes.add(node)
        for rank, w in a.workers.items():
            assert (w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"]) == (str(NODES * PER_NODE), str(PER_NODE)), report
            assert rank == node * PER_NODE + int(w["LOCAL_RANK"]), report
    assert nodes == set(range(NODES)), report

    # Rank 0 (on the agent of node 0) logged the same layout as the single agent; the other agent's ranks log
    # no progress lines.
    first = next(a for a in agents if 0 in a.workers)
    second = next(a for a in agents if a is not first)
    single, reference, _ = one_node
    assert _layout_line(first.output) == _layout_line(single[0].output), report
    assert "2 generation instances of gen_tp=2" in _layout_line(first.output), report
    assert LAYOUT_LINE not in second.output, report

    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [r["step"] for r in reference] == [1, 2], report
    for a, b in zip(records, reference):
        for key in (*COMPARED, "true_score", "lr_actor"):
            x, y = a[key], b[key]
            assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-6, abs=1e-9), (
                f"step {a['step']}: {key} = {x} on two agents, {y} on one"
            )
    assert records[1]["grad_norm_actor"] > 0 and records[1]["lr_actor"] > 0  # it trained
    print(f"\n{_layout_line(first.output)}")


# ------------------------------------------------------------------------------------------- node checks


def _cfg(*overrides: str):
    return load_config(["--job.config_file", CONFIG, *overrides])


def _lines(world: int, pp: int, dp_shard: int, tp: int, gen_tp: int) -> dict[str, list[list[int]]]:
    """The real TP groups and generation instances (global ranks) of a layout, from the meshes the trainer builds,
    under a fake process group (rank 0 of ``world``)."""
    from fusedrl.distributed import ParallelDims, mesh_lines
    from fusedrl.distributed.compat import init_fake_process_group

    init_fake_process_group(0, world)
    try:
        dims = ParallelDims(pp=pp, dp_shard=dp_shard, tp=tp, gen_tp=gen_tp, world_size=world)
        return {"tp": mesh_lines(dims.build_mesh("cpu"), "tp"), "gen_tp": mesh_lines(dims.build_gen_mesh("cpu"), "gen_tp")}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pp,dp_shard,tp,gen_tp", [(2, 2, 2, 1), (1, 4, 2, 4), (2, 1, 4, 2), (1, 2, 4, 8), (4, 2, 1, 2)])
def test_node_check_refuses_exactly_the_layouts_with_a_group_across_nodes(pp, dp_shard, tp, gen_tp):
    """For 8 ranks on nodes of 1, 2, 4 or 8 ranks (torchrun: node n holds ranks n * L ...), check_nodes refuses a
    layout exactly when one of its TP groups or generation instances holds ranks of two nodes."""
    from fusedrl.config import Startup
    from fusedrl.distributed import check_nodes

    world = 8
    lines = _lines(world, pp, dp_shard, tp, gen_tp)
    cfg = _cfg(
        f"--parallelism.pp={pp}", f"--parallelism.dp_shard={dp_shard}", f"--parallelism.tp={tp}", f"--parallelism.gen_tp={gen_tp}"
    )
    for local in (1, 2, 4, 8):
        spanning = [key for key in ("gen_tp", "tp") if any(len({r // local for r in g}) > 1 for g in lines[key])]
        if not spanning:
            check_nodes(Startup(cfg, world, local))
            continue
        with pytest.raises(ConfigError) as err:
            check_nodes(Startup(cfg, world, local))
        assert str(err.value).startswith(f"parallelism.{spanning[0]} = "), (local, lines, str(err.value))
    assert not dist.is_initialized()


NODE_REFUSALS = [
    (
        {"LOCAL_WORLD_SIZE": "1"},
        ["--parallelism.gen_tp=2"],
        "parallelism.gen_tp = 2 (command line): a generation instance (gen_tp consecutive ranks) would span nodes "
        "(LOCAL_WORLD_SIZE = 1: ranks per node); choose a gen_tp dividing 1, or launch a multiple of 2 processes per node",
    ),
    (
        {"LOCAL_WORLD_SIZE": "1"},
        ["--parallelism.dp_shard=1", "--parallelism.tp=2"],
        "parallelism.tp = 2 (command line): a tensor-parallel group (tp consecutive ranks) would span nodes",
    ),
    ({"LOCAL_WORLD_SIZE": "3"}, [], "LOCAL_WORLD_SIZE = 3 (ranks per node): must divide the world size 4"),
]


@pytest.mark.parametrize("env,overrides,message", NODE_REFUSALS, ids=["gen-tp", "tp", "uneven-nodes"])
def test_trainer_refuses_a_group_across_nodes_before_any_process_group(env, overrides, message, monkeypatch):
    """What the trainer does under torchrun: prepare() reads WORLD_SIZE and LOCAL_WORLD_SIZE."""
    from fusedrl.train import prepare

    monkeypatch.setenv("WORLD_SIZE", "4")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        prepare(["--job.config_file", CONFIG, *overrides])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not dist.is_initialized()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # the same layout on one node of 4 ranks passes
    prepare(["--job.config_file", CONFIG, *overrides])


def test_config_cli_runs_the_node_checks_with_local_world_size(monkeypatch, capsys):
    from fusedrl.config.__main__ import main

    monkeypatch.chdir(ROOT)
    args = ["--job.config_file", CONFIG, "--parallelism.gen_tp=2", "--world_size", "4"]
    assert main([*args, "--local_world_size", "2"]) == 0
    capsys.readouterr()
    assert main([*args, "--local_world_size=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: parallelism.gen_tp = 2") and "LOCAL_WORLD_SIZE = 1" in err and err.count("\n") == 1, err
    assert main(["--job.config_file", CONFIG, "--local_world_size", "2"]) == 2
    assert "add --world_size N" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- resume modes


def test_resume_accepts_true_false_and_auto():
    assert [_cfg(f"--checkpoint.resume={v}").checkpoint.resume for v in ("true", "false", "auto")] == [True, False, "auto"]
    assert _cfg("--checkpoint.resume").checkpoint.resume is True  # a bare flag still means true
    with pytest.raises(
        ConfigError, match="checkpoint.resume \\(command line\\): expected bool \\(true/false\\) or \"auto\", got 'maybe'"
    ):
        _cfg("--checkpoint.resume=maybe")


def test_resume_true_needs_a_checkpoint_and_auto_does_not(tmp_path, monkeypatch):
    """Refused before any process group: true with no complete checkpoint in the job's folder (an incomplete one does
    not count); "auto" starts fresh there instead, and true passes once a complete checkpoint exists."""
    from fusedrl.components.checkpoint import COMPLETE_MARKER
    from fusedrl.train import prepare

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.chdir(ROOT)
    argv = ["--job.config_file", CONFIG, f"--job.output_dir={tmp_path}"]
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)  # a writer died before the marker
    with pytest.raises(ConfigError) as err:
        prepare([*argv, "--checkpoint.resume=true"])
    assert str(err.value) == (
        f"checkpoint.resume = true (command line): no complete checkpoint in {tmp_path / 'checkpoints'}; "
        "check job.output_dir and checkpoint.folder, or set --checkpoint.resume=auto to start fresh "
        "when there is none"
    )
    assert not dist.is_initialized()
    assert prepare([*argv, "--checkpoint.resume=auto"]).checkpoint.resume == "auto"
    (tmp_path / "checkpoints" / "step-00000002").mkdir()
    (tmp_path / "checkpoints" / "step-00000002" / COMPLETE_MARKER).write_text("{}")
    assert prepare([*argv, "--checkpoint.resume=true"]).checkpoint.resume is True
