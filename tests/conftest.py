import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run with `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(n)``: a pool of ``n`` gloo ranks shared by every test module of the session (one process start-up
    per world size instead of one per call); a failed or timed-out call restarts that pool's processes."""
    from fusedrl.testing import MultiRankPool

    pools: dict[int, MultiRankPool] = {}

    def get(world_size: int) -> MultiRankPool:
        if world_size not in pools:
            pools[world_size] = MultiRankPool(world_size, timeout_s=300)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def two_ranks(rank_pools):
    return rank_pools(2)


@pytest.fixture
def four_ranks(rank_pools):
    return rank_pools(4)
