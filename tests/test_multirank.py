"""The multi-rank harness: results come back, a rank's failure surfaces with its rank, a hang is killed."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from fusedrl.testing import MultiRankPool, run_multirank


def _allreduce_rank(offset: int, *, scale: int) -> tuple[int, int, int]:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), int(t.item()) * scale


def _fail_on_rank_one() -> None:
    assert dist.get_rank() != 1, "deliberate failure on this rank"


def _hang_on_rank_one(pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()  # both ranks are up: rank 0 returns at once, rank 1 hangs
    if dist.get_rank() == 1:
        time.sleep(3600)


def _pid() -> int:
    return os.getpid()


@pytest.mark.slow
def test_results_are_returned_per_rank():
    results = run_multirank(_allreduce_rank, 3, 10, scale=2)
    # all_reduce of rank+10 over ranks 0..2 = 33, times scale 2
    assert results == [(0, 0, 66), (1, 1, 66), (2, 2, 66)]


def test_local_function_is_refused_clearly():
    def local_fn():
        pass

    with pytest.raises(ValueError, match="module-level function"):
        run_multirank(local_fn, 2)


@pytest.mark.slow
def test_pool_reuses_processes_and_recovers_after_a_failure():
    with MultiRankPool(2) as pool:
        first = pool.run(_pid)
        assert pool.run(_pid) == first  # same processes serve the second call
        with pytest.raises(AssertionError, match=r"rank 1 failed(.|\n)*deliberate failure on this rank"):
            pool.run(_fail_on_rank_one)
        after = pool.run(_allreduce_rank, 0, scale=1)  # fresh processes after the failure
        assert after == [(0, 0, 1), (1, 1, 1)]
        assert set(pool.run(_pid)).isdisjoint(first)


def _open_a_group() -> int:
    dist.new_group(backend="gloo")  # left to the pool to destroy, as a trainer's meshes are
    return os.getpid()


def _groups_and_gloo_threads() -> tuple[int, int]:
    """This rank's process groups besides the default one, and its gloo transport threads."""
    from fusedrl.distributed.compat import subgroups

    groups = len(subgroups())
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return groups, names.count("gloo_tcp_loop")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_groups_a_call_leaves_behind_are_destroyed_after_it():
    """Each leaked gloo group kept a transport thread that wakes up periodically: ranks of a session's pools ended up
    with 100+ of them, ~15% of a core each while idle."""
    with MultiRankPool(2) as pool:
        before = pool.run(_groups_and_gloo_threads)
        first = pool.run(_open_a_group)
        for _ in range(3):
            pool.run(_open_a_group)
        assert pool.run(_pid) == first  # the same processes, not fresh ones
        after = pool.run(_groups_and_gloo_threads)
        assert [groups for groups, _ in after] == [0, 0]
        assert after == before, (before, after)


@pytest.mark.slow
def test_ranks_over_the_open_file_budget_are_replaced_before_the_next_call():
    with MultiRankPool(2) as pool:
        first = pool.run(_open_a_group)
        assert pool.run(_pid) == first  # under the default budget (half the soft limit): the same processes
        pool.max_open_files = 0
        second = pool.run(_pid)
        assert set(second).isdisjoint(first)
        pool.max_open_files = 10**6
        assert pool.run(_pid) == second


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hang_is_killed_at_timeout(tmp_path):
    # the ranks fork from the fork server that imported fusedrl: rank 0's call returns within a fraction of the limit
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 5s \(ranks \[0\] returned"):
        run_multirank(_hang_on_rank_one, 2, str(tmp_path), timeout_s=5)
    pid = int((tmp_path / "1.pid").read_text())
    with pytest.raises(ProcessLookupError):  # the hanging rank was killed and reaped
        os.kill(pid, 0)


def _return_lambda():
    return lambda: None


def test_unpicklable_result_is_reported():
    with pytest.raises(AssertionError, match=r"rank \d failed(.|\n)*(pickle|lambda)"):
        run_multirank(_return_lambda, 1)


OWNER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from fusedrl.testing import MultiRankPool
import test_multirank
pool = MultiRankPool(2)
print(*pool.run(test_multirank._pid), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs: the ranks must notice by themselves
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited rank its fork server has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_ranks_end_when_their_owner_is_killed():
    script = OWNER.format(tests=os.path.dirname(__file__))
    owner = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert owner.returncode == -signal.SIGKILL, owner.stderr
    pids = [int(p) for p in owner.stdout.split()]
    assert len(set(pids)) == 2
    deadline = time.monotonic() + 60  # a generous bound: they end within a second, on a loaded machine too
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)]
