"""Tasks: what a task brings to a run (prompts, a rule-based reward, an evaluation, models to build first) as one
:class:`Task` object. The trainer knows tasks only through this object, which ``job.task`` names
(``"package.module:attribute"``); nothing in the trainer names a task.

:mod:`.debug`: "repeat <unit> <k> times:" with heavy-tailed answer lengths, the CPU debug run's task
(``fusedrl.tasks.debug:TASK``: synthetic prompts, the ``true_score`` evaluation, its SFT Actor and Reward model).
:mod:`.arithmetic`: one-line arithmetic questions with an exact checker, the real-model recipe's task
(``fusedrl.tasks.arithmetic:TASK``: its reward function).
:mod:`.word_problems`: generated multi-step word problems whose worked answers vary in length, the reasoning recipe's
task (``fusedrl.tasks.word_problems:TASK``: its exact checker).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusedrl.components import Prompt, Tokenizer
from fusedrl.config import ConfigError, JobConfig, Startup, import_object
from fusedrl.config.loader import source_of
from fusedrl.rlhf import Experience, RewardFn

EvalHook = Callable[[Experience, Tokenizer], dict[str, float]]
"""Figures of one iteration's scored batch (every rank holds it), added to that iteration's metrics."""


@dataclass(frozen=True)
class TaskAssets:
    """Models a task trains for itself before the run (e.g. the debug task's SFT Actor and Reward model).

    ``missing(cfg)``: the folder still to build for this config, or None; paths inside it are not checked at startup,
    and model paths inside it (without a flavor name) have architecture ``flavor``. ``build(cfg)``: builds that folder,
    before any process group (the trainer's ``prepare`` calls it on every rank: one local rank builds, others wait).
    """

    flavor: str
    missing: Callable[[JobConfig], Path | None]
    build: Callable[[JobConfig], None]


@dataclass(frozen=True)
class HeldOut:
    """A task's evaluation on prompts it does not train on (``[eval]``, :class:`fusedrl.tasks.evaluation.Evaluator`).

    ``prompts(count, seed)``: prompt texts, as :attr:`Task.prompts` gives (user turns that the tokenizer's chat
    template renders when ``chat``). ``grade(prompt, response, finished)``: the exact checker of one sample (the rendered
    prompt, the response without its stop token, whether it ended with one): 1.0 for a right answer, less otherwise.
    """

    prompts: Callable[[int, int], Sequence[Prompt]]
    grade: Callable[[str, str, bool], float]
    chat: bool = False


@dataclass(frozen=True)
class Task:
    """One task's contribution to a run; every part is optional.

    ``prompts(count, seed)``: prompt texts for ``data.format = "synthetic"``. ``reward_fn``: a rule-based reward
    (:data:`fusedrl.rlhf.RewardFn`) that ``model.reward_fn = "task"`` selects. ``evaluate``: figures of each
    iteration's scored batch, logged after the timed phases (``time_eval``). ``held_out``: prompts and a checker for
    ``[eval]``. ``assets``: models built before training.
    """

    name: str
    prompts: Callable[[int, int], Sequence[Prompt]] | None = None
    reward_fn: RewardFn | None = None
    evaluate: EvalHook | None = None
    held_out: HeldOut | None = None
    assets: TaskAssets | None = None


def load_task(path: str | None) -> Task | None:
    """The :class:`Task` that ``job.task`` names (``"package.module:attribute"``; None or "" for none).
    Raises ConfigError (one line) when it cannot be imported or is not a Task."""
    if not path:
        return None
    try:
        task = import_object(path)
    except ValueError as e:
        raise ConfigError(f"job.task = {path!r}: {e}") from None
    if not isinstance(task, Task):
        raise ConfigError(
            f"job.task = {path!r} is a {type(task).__name__}, not a fusedrl.tasks.Task; name a Task object "
            "(e.g. fusedrl.tasks.debug:TASK)"
        )
    return task


def check_task(startup: Startup) -> None:
    """Startup check (the first to run): ``job.task`` imports and is a :class:`Task` with the parts the config uses
    (prompts for ``data.format = "synthetic"``, a reward function for ``model.reward_fn = "task"``); the folder its
    assets still need is declared, so the later checks take paths inside it as models of the assets' flavor."""
    cfg = startup.cfg
    task = load_task(cfg.job.task)
    task_reward_fn(cfg, task)
    if cfg.data.format == "synthetic":
        synthetic_prompts(cfg, task, count=1)
    _check_eval(cfg, task)
    assets = task.assets if task is not None else None
    folder = assets.missing(cfg) if assets is not None else None
    if assets is not None and folder is not None:
        startup.assets[folder] = assets.flavor


def _check_eval(cfg: JobConfig, task: Task | None) -> None:
    """``[eval]`` has held-out prompts to grade and a sampling it can use."""
    e = cfg.eval
    if e.interval == 0:
        return
    _part(
        task,
        "held_out",
        f"eval.interval = {e.interval} ({source_of(cfg, 'eval.interval')}) grades held-out prompts with the task's checker",
        "set --job.task to a task with them (e.g. fusedrl.tasks.word_problems:TASK) or --eval.interval=0",
    )
    if e.n > 1 and e.temperature == 0:
        raise ConfigError(
            f"eval.n = {e.n} ({source_of(cfg, 'eval.n')}) samples per prompt, but eval.temperature = 0 makes them all the "
            "same greedy sample; set --eval.temperature above 0 (e.g. 1.0) for pass@n, or --eval.n=1"
        )
    if e.path and cfg.data.format == "synthetic":
        raise ConfigError(
            f"eval.path = {e.path!r} ({source_of(cfg, 'eval.path')}) is read in [data]'s format, but data.format = "
            "synthetic names no file format; set --data.format (jsonl, parquet or hf_disk), or leave eval.path empty"
        )

    if e.path and not Path(e.path).exists():
        raise ConfigError(
            f"eval.path = {e.path!r} ({source_of(cfg, 'eval.path')}): not found; give an existing {cfg.data.format} "
            "prompt file, or leave it empty for the task's held-out prompts"
        )


def synthetic_prompts(cfg: JobConfig, task: Task | None, count: int = 1024) -> Sequence[Prompt] | None:
    """``count`` prompts of the task for ``data.format = "synthetic"`` (seeded by ``job.seed``); None for other formats.
    Raises ConfigError when the task gives no prompts."""
    if cfg.data.format != "synthetic":
        return None
    prompts = _part(
        task,
        "prompts",
        'data.format = "synthetic" takes its prompts from the task',
        "set --job.task to a task with prompts (e.g. fusedrl.tasks.debug:TASK) or give a dataset (data.format, data.path)",
    )
    return prompts(count, cfg.job.seed)


def task_reward_fn(cfg: JobConfig, task: Task | None) -> RewardFn | None:
    """The task's reward function when ``model.reward_fn = "task"`` (None otherwise); ConfigError if it has none."""
    if cfg.model.reward_fn != "task":
        return None
    return _part(
        task,
        "reward_fn",
        'model.reward_fn = "task" scores with the task\'s reward function',
        'set --job.task to a task with one or name a function: --model.reward_fn="package.module:function"',
    )


def _part(task: Task | None, name: str, need: str, fix: str) -> Any:
    """``task``'s part ``name``; ConfigError ``"<need>, but <what is missing>; <fix>"`` when there is none."""
    value = getattr(task, name) if task is not None else None
    if value is None:
        what = "job.task is unset" if task is None else f"the task {task.name!r} has no {name}"
        raise ConfigError(f"{need}, but {what}; {fix}")
    return value


__all__ = ["EvalHook", "HeldOut", "Task", "TaskAssets", "check_task", "load_task", "synthetic_prompts", "task_reward_fn"]
