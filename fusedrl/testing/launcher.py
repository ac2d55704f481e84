"""The worker processes of a torchrun launcher, found through /proc (Linux), to kill one or clean up all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from fusedrl.testing.multirank import free_port


def torchrun_command(*program: str, nproc: int = 2, max_restarts: int = 0, logs: Path | None = None) -> list[str]:
    """``python -m torch.distributed.run`` on this node for ``program`` (a script or ``-m module``, then its
    arguments). A job that may restart uses the c10d rendezvous without a shared store (run it with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): the static one keeps its store across restarts, so the restarted
    workers' gloo group would read the previous attempt's addresses. ``logs``: torchrun's --tee files go there."""
    rendezvous = (
        ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
        if max_restarts
        else ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    )
    tee = [f"--log-dir={logs}", "--tee=3"] if logs is not None else []
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}"]
    return [*launcher, *rendezvous, f"--max_restarts={max_restarts}", *tee, *program]


def job_env(root: Path, **extra: str) -> dict[str, str]:
    """This environment with one thread per worker and ``root`` (the checkout) first on PYTHONPATH."""
    path = str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def _workers(launcher_pid: int) -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, environment) of each child of the launcher that has a RANK."""
    for children in Path(f"/proc/{launcher_pid}/task").glob("*/children"):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            env = dict(e.split("=", 1) for e in entries if "=" in e)
            if "RANK" in env:
                yield pid, env


def torchrun_workers(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the launcher's worker processes."""
    return {int(env["RANK"]): pid for pid, env in _workers(launcher_pid)}


def torchrun_worker_env(launcher_pid: int) -> dict[int, dict[str, str]]:
    """RANK -> the variables torchrun set for that worker of the launcher (RANK, LOCAL_RANK, GROUP_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, ...): where the rendezvous placed it."""
    names = (
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
    )
    return {int(env["RANK"]): {k: env[k] for k in names if k in env} for _, env in _workers(launcher_pid)}


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and its workers: torchrun starts each worker in its own session, so killing the
    launcher's process group alone would leave them running. Start the launcher with ``process_group=0`` (its own
    group in this session), not ``start_new_session``: on Linux a new session is a new scheduler autogroup, and with
    both cores busy such processes were measured running up to 80x slower than those of the loading session
    (docs/benchmarks.md, issue 38)."""
    for pid in [*torchrun_workers(proc.pid).values(), proc.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
