"""fusedrl.pipelining: dual-model (Actor + Critic) pipeline schedule IR, cost model, simulator and search."""

from fusedrl.pipelining.bounds import lower_bound
from fusedrl.pipelining.cost import CostModel, StageCosts
from fusedrl.pipelining.executor import FusedPipelineSchedule, ModelStepResult, StageModule, bucket_length, run_emulated
from fusedrl.pipelining.ir import ACTOR, CRITIC, MODELS, Action, Placement, Schedule
from fusedrl.pipelining.lowering import LoweredProgram, ProgramError, lower, verify_program
from fusedrl.pipelining.search import PlanResult, fused_schedule, greedy_order, sequential_1f1b
from fusedrl.pipelining.simulator import Problem, ScheduleError, SimResult, TimelineEntry, simulate
from fusedrl.pipelining.timeline import TimedAction, Timeline

__all__ = [
    "ACTOR",
    "CRITIC",
    "MODELS",
    "Action",
    "CostModel",
    "PlanResult",
    "Placement",
    "Problem",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StageCosts",
    "TimelineEntry",
    "fused_schedule",
    "greedy_order",
    "lower_bound",
    "sequential_1f1b",
    "simulate",
    # executor (lowering, fused runtime, measured timeline)
    "FusedPipelineSchedule",
    "LoweredProgram",
    "ModelStepResult",
    "ProgramError",
    "StageModule",
    "TimedAction",
    "Timeline",
    "bucket_length",
    "lower",
    "run_emulated",
    "verify_program",
]
