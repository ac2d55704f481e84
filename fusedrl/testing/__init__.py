"""Test helpers: run functions on several real processes that share a gloo process group."""

from fusedrl.testing.multirank import MultiRankPool, free_port, run_multirank, run_on_ranks

__all__ = ["MultiRankPool", "free_port", "run_multirank", "run_on_ranks"]
