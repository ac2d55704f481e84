"""Embedded tasks: everything a task brings (prompts, assets, a rule-based score) in one module, reaching the
trainer only through an evaluation hook (:data:`EvalHook`) whose time no phase timer counts.

:mod:`.debug`: "repeat <unit> <k> times:" with heavy-tailed answer lengths, the CPU debug run's task.
"""

from collections.abc import Callable

from fusedrl.components import Tokenizer
from fusedrl.rlhf import Experience

EvalHook = Callable[[Experience, Tokenizer], dict[str, float]]
"""Figures of one iteration's scored batch (every rank holds it), added to that iteration's metrics."""

__all__ = ["EvalHook"]
