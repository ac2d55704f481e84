"""Run functions on N real processes that share a gloo process group (multi-rank tests).

``run_multirank`` starts the processes for one call. ``MultiRankPool`` keeps them alive across
calls (one process start-up per pool instead of per call: starting Python + torch dominates the
cost of small multi-rank tests).
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import resource
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fusedrl.distributed.compat import destroy_subgroups
from fusedrl.hardware import release_host_memory


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a rank imports before its first task: a spawned rank spent ~5 s of CPU on them (torch, torchtune with torchao,
# the trainer); a rank forked from the fork server that imported them once starts in well under a second.
PRELOAD = ("fusedrl.testing.multirank", "fusedrl.train")


def rank_context() -> Any:
    """The multiprocessing context ranks start from: the fork server (its modules ``PRELOAD``) where the platform has
    one, else spawn. Like spawn, a forked rank gets the parent's ``sys.path`` and working directory when it starts, and
    imports its task's module afresh; unlike spawn, its environment is the fork server's, the parent's when the first
    rank of the process started."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _exit_with_owner() -> None:
    """End this rank as soon as the process that started it dies: a pool owner killed by a signal (a CI timeout, a
    killed benchmark) runs no cleanup, and its ranks, children of the fork server, would wait on their task queues
    (spinning OpenMP threads included) until someone kills them by hand."""
    owner = mp.parent_process()
    if owner is None:
        return

    def watch() -> None:
        owner.join()
        os._exit(1)

    threading.Thread(target=watch, name="multirank-owner-watch", daemon=True).start()


def _worker(rank: int, world_size: int, port: int, timeout_s: float, tasks: Any, results: Any) -> None:
    _exit_with_owner()
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((None, rank, "error", traceback.format_exc()))
        return
    results.put((None, rank, "ready", None))
    while (task := tasks.get()) is not None:
        task_id, payload = task
        _run_task(rank, task_id, payload, results)
        # an idle rank holds only what lives: a trainer run keeps its freed memory (reuse_host_memory), and idle
        # pools holding gigabytes slowed a session's later real-model jobs by a fifth; the groups a call created
        # go too (after its barrier: every rank is done with them)
        destroy_subgroups()
        gc.collect()
        release_host_memory()
    dist.barrier()
    dist.destroy_process_group()


def _run_task(rank: int, task_id: int, payload: bytes, results: Any) -> None:
    try:
        fn, args, kwargs = pickle.loads(payload)  # here, so that an import error is reported too
        value = pickle.dumps(fn(*args, **kwargs))  # an unpicklable result fails here, with a traceback
        results.put((task_id, rank, "returned", None))
        dist.barrier()
        results.put((task_id, rank, "ok", value))
    except BaseException:  # noqa: BLE001
        results.put((task_id, rank, "error", traceback.format_exc()))


def _pickle_task(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """Ranks receive fn and its arguments by pickle; fail early and clearly if that cannot work."""
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise ValueError(
            f"run_multirank needs a module-level function and picklable arguments ({type(e).__name__}: {e}); "
            "define fn at the top level of its module"
        ) from None


class MultiRankPool:
    """``world_size`` processes (:func:`rank_context`) with a gloo group on 127.0.0.1, reused across ``run`` calls.

    After a failure or a timeout the processes are killed (other ranks may be stuck in a
    collective) and the next ``run`` starts fresh ones. Functions must not destroy the default
    process group. Use as a context manager, e.g. in a module-scoped pytest fixture.

    ``timeout_s`` bounds each call; starting the processes and the group is bounded separately by
    ``startup_timeout_s`` so that a loaded machine does not eat into a test's time.

    Process groups a function creates (a trainer's meshes) are destroyed after its call: each gloo group keeps a
    transport thread that wakes up periodically. Before a call, ranks holding more than ``max_open_files`` file
    descriptors (what else a function left open; default: half the soft ``RLIMIT_NOFILE``, often 1024) are replaced by
    fresh ones. Counted on Linux only (``/proc``).
    """

    def __init__(
        self, world_size: int, timeout_s: float = 120.0, startup_timeout_s: float = 300.0, max_open_files: int | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.max_open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2 if max_open_files is None else max_open_files
        self._ctx = rank_context()
        self._procs: list = []
        self._tasks: list = []
        self._results: Any = None
        self._task_ids = itertools.count()

    def __enter__(self) -> MultiRankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank, then barrier; return the per-rank results.

        Raises ``AssertionError`` with the traceback of the first failing rank (its number in the
        message), or ``TimeoutError`` naming the ranks that had not finished after ``timeout_s``
        (default: the pool's), not counting process start-up.
        """
        payload = _pickle_task(fn, args, kwargs)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            if self._procs and self._open_files() > self.max_open_files:
                self.close()
            if not self._procs:
                self._start()
            task_id = next(self._task_ids)
            for q in self._tasks:
                q.put((task_id, payload))
            return self._wait(task_id, getattr(fn, "__qualname__", repr(fn)), timeout_s)
        except BaseException:
            self._kill()
            raise

    def _open_files(self) -> int:
        """The most file descriptors a rank holds (0 where ``/proc`` cannot tell)."""
        counts = []
        for p in self._procs:
            try:
                counts.append(len(os.listdir(f"/proc/{p.pid}/fd")))
            except OSError:
                counts.append(0)
        return max(counts, default=0)

    def close(self) -> None:
        """Stop the processes: gracefully if they are idle, else by killing them."""
        if not self._procs:
            return
        for q in self._tasks:
            q.put(None)
        end = time.monotonic() + 10.0
        for p in self._procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        self._kill()

    def _start(self) -> None:
        # The context hands the parent's sys.path to each child before it unpickles anything,
        # so a function defined in a test module that pytest put on sys.path (tests/) imports there too.
        port = free_port()
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        for rank in range(self.world_size):
            p = self._ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self.timeout_s, self._tasks[rank], self._results),
                name=f"multirank-{rank}",
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        self._wait(None, "process group start-up", self.startup_timeout_s)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5.0)
        self._procs, self._tasks, self._results = [], [], None

    def _next_result(self, timeout: float) -> tuple | None:
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return None

    def _wait(self, task_id: int | None, name: str, timeout_s: float) -> list[Any]:
        """Collect every rank's outcome of task ``task_id`` (``None``: start-up)."""
        outcomes: dict[int, tuple[str, Any]] = {}  # insertion order = arrival order
        returned: set[int] = set()  # ranks whose fn returned (they may still wait in the final barrier)
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(outcomes) - returned)
                waiting = sorted(returned - set(outcomes))
                raise TimeoutError(
                    f"run_multirank({name}): ranks {missing} did not finish within {timeout_s:.0f}s"
                    + (f" (ranks {waiting} returned and waited for them in the final barrier)" if waiting else "")
                    + _first_error_suffix(outcomes)
                )
            message = self._next_result(min(remaining, 0.5))
            if message is None:
                dead = [r for r, p in enumerate(self._procs) if r not in outcomes and p.exitcode is not None]
                if dead:
                    self._drain(task_id, outcomes, returned, wait_s=2.0)  # reports may still be in flight
                    dead = [r for r in dead if r not in outcomes]
                if dead:  # died without reporting (signal, os._exit, segfault): the others would wait forever
                    for r in dead:
                        outcomes[r] = ("error", f"rank {r} exited with code {self._procs[r].exitcode} without a result")
                    raise AssertionError(_format_error(name, outcomes))
                continue
            if self._record(message, task_id, outcomes, returned) == "error":
                self._drain(task_id, outcomes, returned, wait_s=2.0)  # let other ranks report their failure too
                raise AssertionError(_format_error(name, outcomes))
        return [None if task_id is None else pickle.loads(outcomes[r][1]) for r in range(self.world_size)]

    def _record(self, message: tuple, task_id: int | None, outcomes: dict, returned: set) -> str | None:
        msg_task, rank, status, payload = message
        if msg_task != task_id:
            return None  # stale report of an earlier call
        if status == "returned":
            returned.add(rank)
            return None
        outcomes[rank] = ("ok" if status == "ready" else status, payload)
        return status

    def _drain(self, task_id: int | None, outcomes: dict, returned: set, wait_s: float) -> None:
        end = time.monotonic() + wait_s
        while len(outcomes) < self.world_size and (remaining := end - time.monotonic()) > 0:
            message = self._next_result(remaining)
            if message is None:
                return
            self._record(message, task_id, outcomes, returned)


def run_multirank(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes (:func:`rank_context`) sharing a gloo group.

    Each rank gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK in its environment, one
    intra-op thread and an initialised default group; after ``fn`` returns it barriers, and the
    group is destroyed at the end. Returns the per-rank return values (picklable), indexed by rank.

    Raises ``AssertionError`` carrying the traceback of the first failing rank, and ``TimeoutError``
    naming the ranks that had not finished after ``timeout_s`` seconds (all ranks are then killed).
    """
    with MultiRankPool(world_size, timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)


def run_on_ranks(
    pool: MultiRankPool | None, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float, **kwargs: Any
) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``pool``'s ranks (a test session's, which skips the process start-up), else on
    fresh ones (:func:`run_multirank`); the pool must have ``world_size`` ranks."""
    if pool is None:
        return run_multirank(fn, world_size, *args, timeout_s=timeout_s, **kwargs)
    if pool.world_size != world_size:
        raise ValueError(f"this run needs {world_size} ranks; the pool given has {pool.world_size}")
    return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)


def _format_error(name: str, outcomes: dict[int, tuple[str, Any]]) -> str:
    failed = [r for r, (status, _) in outcomes.items() if status == "error"]
    first = failed[0]
    return (
        f"run_multirank({name}): rank {first} failed (failed ranks: {sorted(failed)})\n"
        f"--- traceback of rank {first} ---\n{outcomes[first][1]}"
    )


def _first_error_suffix(outcomes: dict[int, tuple[str, Any]]) -> str:
    failed = [r for r, (status, _) in outcomes.items() if status == "error"]
    return "" if not failed else f"; rank {failed[0]} failed first:\n{outcomes[failed[0]][1]}"
