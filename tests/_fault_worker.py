"""A torchrun worker for the fault tests: ``fusedrl.train``'s command line, where rank ``FAULT_RANK`` SIGKILLs itself in
iteration ``FAULT_STEP`` of the job's first attempt, inside the phase ``FAULT_PHASE``: ``rollout`` (after its first
decode step) or ``update`` (after its first minibatch's optimizer step). A deterministic point, whatever the machine's
load; a restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0) runs unharmed."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from fusedrl import train
from fusedrl.trainer import trainer as trainer_module


class _KillOnUpdate:
    """A progress object that kills its process on the first progress it is told of."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress

    def update(self, n: int = 1, **figures: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.progress, name)


def _install(phase: str, step: int) -> None:
    if phase == "rollout":
        generate_and_score = trainer_module.generate_and_score
        rollout_round = trainer_module.Trainer.rollout_round

        def round_with_fault(self, at: int, timers):
            if at == step:
                trainer_module.generate_and_score = lambda c, r, pad, progress, **plan: generate_and_score(
                    c, r, pad, _KillOnUpdate(progress), **plan
                )
            return rollout_round(self, at, timers)

        trainer_module.Trainer.rollout_round = round_with_fault  # type: ignore[method-assign]
    elif phase == "update":
        ppo_update = trainer_module.ppo_update

        def update_with_fault(cfg, layout, executor, opt, exp, at, *, progress=None, **kwargs):
            return ppo_update(
                cfg, layout, executor, opt, exp, at, progress=_KillOnUpdate(progress) if at == step else progress, **kwargs
            )

        trainer_module.ppo_update = update_with_fault
    else:
        raise ValueError(f"FAULT_PHASE must be rollout or update, got {phase!r}")


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == os.environ.get("FAULT_RANK"):
        _install(os.environ["FAULT_PHASE"], int(os.environ["FAULT_STEP"]))
    sys.exit(train.main(sys.argv[1:]))
