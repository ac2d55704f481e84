"""Embedded tasks: everything a task brings (prompts, assets, a rule-based score) in one module, reaching the
trainer only through an evaluation hook (:data:`EvalHook`) whose time no phase timer counts.

:mod:`.debug`: "repeat <unit> <k> times:" with heavy-tailed answer lengths, the CPU debug run's task.
:mod:`.arithmetic`: one-line arithmetic questions with an exact checker, the real-model recipe's task
(``train_configs/smollm2_135m_ppo.toml``: its reward function, no evaluation hook).
"""

from collections.abc import Callable

from fusedrl.components import Tokenizer
from fusedrl.rlhf import Experience

EvalHook = Callable[[Experience, Tokenizer], dict[str, float]]
"""Figures of one iteration's scored batch (every rank holds it), added to that iteration's metrics."""

__all__ = ["EvalHook"]
