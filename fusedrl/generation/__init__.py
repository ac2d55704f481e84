"""fusedrl.generation: KV-cache generation engine, sampling, request export/import, weight sync."""

from fusedrl.generation.engine import EngineStats, GenerationEngine, RequestProgress
from fusedrl.generation.migration import MigrationController, MigrationStats, StageResult
from fusedrl.generation.migration_plan import MigrationPlan, PlanError, verify_plan
from fusedrl.generation.stage_sim import StageConfig, StageCosts, best_migration, simulate_stage
from fusedrl.generation.workload import LengthDistribution, lmsys_lengths
from fusedrl.generation.request import Request, RequestResult, SamplingParams, request_seed
from fusedrl.generation.state import RequestState, recv_request_state, send_request_state
from fusedrl.generation.weight_sync import WeightSyncStats, sync_weights

__all__ = [
    "LengthDistribution",
    "MigrationController",
    "MigrationPlan",
    "MigrationStats",
    "PlanError",
    "StageConfig",
    "StageCosts",
    "StageResult",
    "best_migration",
    "lmsys_lengths",
    "simulate_stage",
    "verify_plan",
    "EngineStats",
    "GenerationEngine",
    "Request",
    "RequestProgress",
    "RequestResult",
    "RequestState",
    "SamplingParams",
    "recv_request_state",
    "request_seed",
    "send_request_state",
    "sync_weights",
    "WeightSyncStats",
]
