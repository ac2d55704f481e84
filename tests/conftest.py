import pytest
import torch

from fusedrl.testing import MultiRankPool


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run with `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class RankPools:
    """``pools(n)``: a pool of ``n`` gloo ranks shared by every test module of the session (one process start-up per
    world size instead of one per call); a failed or timed-out call restarts that pool's processes. ``close()`` stops
    every pool's processes (the next call starts them again)."""

    def __init__(self) -> None:
        self._pools: dict[int, MultiRankPool] = {}

    def __call__(self, world_size: int) -> MultiRankPool:
        if world_size not in self._pools:
            self._pools[world_size] = MultiRankPool(world_size, timeout_s=300)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def rank_pools():
    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture
def two_ranks(rank_pools):
    return rank_pools(2)


@pytest.fixture
def four_ranks(rank_pools):
    return rank_pools(4)
