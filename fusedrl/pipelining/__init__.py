"""Intra-stage fusion: Actor and Critic trained together on the same pipeline ranks.

The Critic is optional: critic-free algorithms (GRPO, RLOO, REINFORCE++) train the Actor alone, planned with 0
Critic micro-batches (``fused_schedule(placement, costs, m, 0, split_backward=True)``: a split-backward schedule,
each backward as an input backward I and a weight backward W, the W's filling the bubbles that a Critic would
otherwise fill), lowered with ``{ACTOR: m, CRITIC: 0}`` and run by :class:`FusedPipelineSchedule` (or
:class:`LocalSchedule` at pp = 1) built with ``critic=None``.

Read it top to bottom: :mod:`.ir` (actions, placement: Actor stages in rank order, Critic reversed),
:mod:`.cost` (per-stage times and activation memory), :mod:`.simulator` (makespan, bubbles, peak memory of a
schedule), :mod:`.bounds` (a lower bound on any schedule's makespan), :mod:`.search` (sequential 1F1B, the
greedy fused scheduler and the local search), :mod:`.lowering` (SEND/RECV insertion and the static
verifier), :mod:`.shared` (one program for every rank: planned on one, shared, lowered everywhere),
:mod:`.executor` (runs a lowered program with torch ``PipelineStage`` objects of both models, or of the Actor
alone),
:mod:`.forward` (one model's forward-only pass through its stages: PPO's log-prob recomputation),
:mod:`.timeline` (a recorded step's measured timeline).
"""

from fusedrl.pipelining.bounds import lower_bound
from fusedrl.pipelining.cost import CostModel, StageCosts
from fusedrl.pipelining.executor import (
    STAGE_CACHE_SIZE,
    FusedPipelineSchedule,
    LocalSchedule,
    ModelStepResult,
    StageModule,
    StepObserver,
    run_emulated,
)
from fusedrl.pipelining.forward import pipeline_forward
from fusedrl.pipelining.ir import ACTOR, CRITIC, MODELS, Action, Placement, Schedule
from fusedrl.pipelining.lowering import LoweredProgram, ProgramError, lower, verify_program
from fusedrl.pipelining.search import PlanResult, fused_schedule, greedy_order, sequential_1f1b
from fusedrl.pipelining.shared import plan_and_share
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
    "STAGE_CACHE_SIZE",
    "FusedPipelineSchedule",
    "LocalSchedule",
    "LoweredProgram",
    "ModelStepResult",
    "ProgramError",
    "StageModule",
    "StepObserver",
    "TimedAction",
    "Timeline",
    "lower",
    "pipeline_forward",
    "plan_and_share",
    "run_emulated",
    "verify_program",
]
