"""fusedrl.generation: the engine only: slot KV cache, continuous batching, sampling, compiled decode,
request-state export/import and its wire format, and loading training weights into the engine."""

from fusedrl.generation.engine import GenerationEngine
from fusedrl.generation.request import FinishReason, Request, RequestResult, SamplingParams, request_seed
from fusedrl.generation.sampling import check_sampling
from fusedrl.generation.state import PendingSend, RequestState, pack_states, recv_states, send_states
from fusedrl.generation.stats import CompileStats, EngineStats, PrefillStats, RequestProgress
from fusedrl.generation.weight_sync import WeightSync, WeightSyncStats

__all__ = [
    "CompileStats",
    "EngineStats",
    "FinishReason",
    "GenerationEngine",
    "PendingSend",
    "PrefillStats",
    "Request",
    "RequestProgress",
    "RequestResult",
    "RequestState",
    "SamplingParams",
    "WeightSync",
    "WeightSyncStats",
    "check_sampling",
    "pack_states",
    "recv_states",
    "request_seed",
    "send_states",
]
