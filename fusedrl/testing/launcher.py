"""The worker processes of a torchrun launcher, found through /proc (Linux), to kill one or clean up all."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def torchrun_workers(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the launcher's worker processes."""
    found = {}
    for children in Path(f"/proc/{launcher_pid}/task").glob("*/children"):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = pid
    return found


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and its workers: torchrun starts each worker in its own session, so killing the
    launcher's process group alone would leave them running."""
    for pid in [*torchrun_workers(proc.pid).values(), proc.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
