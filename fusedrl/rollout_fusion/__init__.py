"""Inter-stage fusion: when few generation requests are left, migrate them (KV cache + sampling state) onto a
few instances and score finished samples on the freed ones at once.

Read it top to bottom: :mod:`.plan` (which instances keep decoding, where each request goes, a verifier),
:mod:`.controller` (runs a rollout with the plan; scoring arrives as a callable), :mod:`.simulator` (the same
rollout under a cost model: the ``auto`` threshold and paper-scale estimates), :mod:`.remaining` (the tokens the
unfinished requests have left, for the simulator), :mod:`.workload` (long-tailed response lengths for benchmarks).
"""

from fusedrl.rollout_fusion.controller import (
    GroupTarget,
    MigrationController,
    MigrationStats,
    RolloutResult,
    ScoreFn,
    whole_groups,
)
from fusedrl.rollout_fusion.plan import MigrationPlan, PlanError, verify_plan
from fusedrl.rollout_fusion.simulator import RolloutConfig, RolloutCosts, best_migration, simulate_rollout
from fusedrl.rollout_fusion.workload import LengthDistribution, lmsys_lengths

__all__ = [
    "GroupTarget",
    "LengthDistribution",
    "MigrationController",
    "MigrationPlan",
    "MigrationStats",
    "PlanError",
    "RolloutConfig",
    "RolloutCosts",
    "RolloutResult",
    "ScoreFn",
    "best_migration",
    "lmsys_lengths",
    "simulate_rollout",
    "verify_plan",
    "whole_groups",
]
