"""Memory per rank of an RL job (PPO, or critic-free: no Critic), estimated from the real layouts built on the meta
device, and measured against the real trainer. ``docs/memory.md`` derives every figure and tells how to read them;
``python -m fusedrl.bench.memory`` is the command line.

Read it top to bottom: :mod:`.formulas` (the closed-form terms and constants), :mod:`.meta` (each rank's layouts
built on meta under a fake process group; the weight sync replayed over the real plan), :mod:`.estimate` (per rank
and phase), :mod:`.report` (table and JSON), :mod:`.measure` (the real trainer on CPU ranks, compared per category).
The training activations of a micro-batch are :func:`fusedrl.models.figures.stage_activation_bytes`, the
planner's own figure.
"""

from fusedrl.memory.estimate import Estimate, RankEstimate, estimate
from fusedrl.memory.formulas import PHASES
from fusedrl.memory.measure import TOLERANCE, Comparison, compare, format_comparison, measure_rank
from fusedrl.memory.report import format_table, to_json

__all__ = [
    "PHASES",
    "TOLERANCE",
    "Comparison",
    "Estimate",
    "RankEstimate",
    "compare",
    "estimate",
    "format_comparison",
    "format_table",
    "measure_rank",
    "to_json",
]
