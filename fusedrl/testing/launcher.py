"""The worker processes of a torchrun launcher, found through /proc (Linux), to kill one or clean up all."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path


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
    launcher's process group alone would leave them running."""
    for pid in [*torchrun_workers(proc.pid).values(), proc.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
