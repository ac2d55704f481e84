"""One trainer run of one fusedrl source tree, with the executor's time split up; the worker of
``python -m fusedrl.bench.e2e --baseline TREE``.

Run as a script (``python fusedrl/bench/tree_worker.py '<json>'`` with the tree first on ``PYTHONPATH`` and the
tree as working directory), so that ``import fusedrl`` is that tree's package. It imports fusedrl only inside
functions and only through names every fusedrl version has (``load_config``, ``Trainer``,
``FusedPipelineSchedule``, the PPO loss classes, ``run_multirank``), so that the commit a change started from
can be measured by the same code as the change. Prints one JSON line: per rank, the measured iterations'
metrics and the executor figures:

- ``executor_s``: time inside ``FusedPipelineSchedule.step``;
- ``compute_s``: time inside torch's ``PipelineStage`` forward/backward calls and the PPO losses;
- ``wait_s``: time blocked waiting for point-to-point messages;
- ``actions``: entries of the rank's program executed (compute and SEND/RECV).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from typing import Any


def _timed(owner: Any, name: str, counters: dict[str, float], key: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            counters[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


class _TimedWork:
    """A P2P handle whose ``wait`` is timed."""

    def __init__(self, work: Any, counters: dict[str, float]) -> None:
        self._work, self._counters = work, counters

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._counters["wait_s"] += time.perf_counter() - start


def _instrument(counters: dict[str, float]) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from fusedrl.pipelining import FusedPipelineSchedule
    from fusedrl.rlhf import losses

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        _timed(PipelineStage, name, counters, "compute_s")
    for cls in (losses.PolicyLoss, losses.ValueLoss):
        _timed(cls, "__call__", counters, "compute_s")
    step = FusedPipelineSchedule.step

    @functools.wraps(step)
    def counted_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        counters["actions"] += len(self.program.programs[self.rank])
        start = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:
            counters["executor_s"] += time.perf_counter() - start

    # setattr: the replacements are duck-typed (a _TimedWork is not a Work), which a plain assignment cannot say
    setattr(FusedPipelineSchedule, "step", counted_step)  # noqa: B010
    batch = dist.batch_isend_irecv
    setattr(dist, "batch_isend_irecv", lambda ops: [_TimedWork(w, counters) for w in batch(ops)])  # noqa: B010


def _rank(argv: list[str], warmup: int, steps: int) -> dict[str, Any]:
    from fusedrl.config import load_config
    from fusedrl.trainer import Trainer

    counters = dict.fromkeys(("executor_s", "compute_s", "wait_s", "actions"), 0.0)
    _instrument(counters)
    trainer = Trainer(load_config(argv))
    records = []
    for step in range(1, warmup + steps + 1):
        if step == warmup + 1:
            counters.update(dict.fromkeys(counters, 0.0))
        records.append(trainer.train_step(step))
    return {"records": records[warmup:], **counters}


def main(spec: dict[str, Any]) -> None:
    from fusedrl.testing import run_multirank

    argv = [
        "--job.config_file",
        spec["config"],
        *spec["overrides"],
        f"--training.steps={spec['warmup'] + spec['steps']}",
        f"--job.output_dir={spec['out']}",
        "--checkpoint.interval=0",
        "--checkpoint.resume=false",
        "--checkpoint.export_hf=false",
        "--metrics.trace=[]",
        "--metrics.jsonl=false",
        "--metrics.tensorboard=false",
    ]
    ranks = run_multirank(_rank, spec["world"], argv, spec["warmup"], spec["steps"], timeout_s=3600.0)
    print(json.dumps(ranks))


if __name__ == "__main__":
    sys.path.pop(0)  # this folder is not a package root: fusedrl must come from PYTHONPATH
    main(json.loads(sys.argv[1]))
