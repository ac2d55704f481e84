"""Rule-based (verifiable) rewards: a Python function scores finished samples from their texts and token ids.

A reward function has the signature of :data:`RewardFn`::

    fn(prompts, responses, *, prompt_ids, response_ids, finished) -> one number per sample

``prompts[i]`` / ``responses[i]`` are sample i's prompt and response decoded with the trainer's tokenizer
(special tokens skipped; the response without its stop token), ``prompt_ids[i]`` the prompt's token ids as the
Actor saw them, ``response_ids[i]`` the generated ids (ending with the stop token when ``finished[i]``), and
``finished[i]`` whether the response ended with a stop token (False: it hit the token limit).

A call gets any subset of the batch (inter-stage fusion changes which samples are scored together), so a
sample's value must depend on that sample alone; then fused and unfused runs get the same values.
:class:`RuleReward` checks every output: a call that raises or returns a list of the wrong length is repeated
one sample at a time to find the failing samples, and a value that is not a finite number fails its sample.
Under ``on_failure="stop"`` a failure raises :class:`RewardFunctionError` naming the sample; under ``"skip"``
the sample's value is NaN (its score then gets no term from the function) and a warning names it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.distributed as dist

from fusedrl.components import Tokenizer
from fusedrl.config import ConfigError, Startup, import_object
from fusedrl.generation import RequestResult
from fusedrl.rlhf.experience import Experience

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]
"""``fn(prompts: list[str], responses: list[str], *, prompt_ids: list[list[int]], response_ids: list[list[int]],
finished: list[bool]) -> list[float]`` (any sequence of numbers, one per sample)."""

PROMPT_START_CHARS = 60  # how much of a prompt a failure message shows


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample under ``on_failure="stop"``."""


def load_reward_fn(path: str) -> RewardFn:
    """The callable named by ``"package.module:function"`` (:func:`fusedrl.config.import_object`).

    Raises ValueError (one line) when the path is malformed, the module cannot be imported, the attribute is
    missing or it is not callable."""
    obj = import_object(path)
    if not callable(obj):
        raise ValueError(f"{path} is a {type(obj).__name__}, not a callable; name a function")
    return cast(RewardFn, obj)


def check_reward(startup: Startup) -> None:
    """Startup check of the rule-based reward (raises ConfigError): ``model.reward_fn`` imports and is callable;
    ``model.reward = "none"`` needs it (or an environment, whose episodes earn rewards) and no ``model.reward_path``;
    ``model.reward_fn_weight`` needs it."""
    m = startup.cfg.model
    if m.reward_fn == "task":
        pass  # the task's own function: the "task" check found it
    elif m.reward_fn is not None:
        try:
            load_reward_fn(m.reward_fn)
        except ValueError as e:
            raise ConfigError(f"model.reward_fn = {m.reward_fn!r}: {e}") from None
    elif not m.uses_reward_model and not startup.cfg.env.env:
        raise ConfigError(
            'model.reward = "none", model.reward_fn and env.env are unset: nothing would score the samples; set '
            "--model.reward_fn=package.module:function, give a Reward model (model.reward_path) or an environment "
            "(env.env)"
        )
    elif m.reward_fn_weight != 1.0:
        raise ConfigError(
            f"model.reward_fn_weight = {m.reward_fn_weight} weighs no function: model.reward_fn is unset; set "
            "--model.reward_fn=package.module:function or drop the weight"
        )
    if not m.uses_reward_model and m.reward_path is not None:
        raise ConfigError(
            f'model.reward_path = {m.reward_path!r} is set but model.reward = "none" builds no Reward model; '
            'unset it (--model.reward_path=) or build a Reward model (model.reward = "" reads its config.json)'
        )


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


@dataclass
class RuleReward:
    """Scores samples with a reward function ``fn`` (see the module docstring).

    ``weight`` scales the function's value in a sample's score (the :class:`~fusedrl.rlhf.Scorer` adds
    ``weight * value`` to the Reward model's score). ``group``: the ranks that score the same samples together
    (a tensor-parallel generation instance; None: this rank alone): the function runs on the group's first rank
    and its values are broadcast, so every rank of the group uses the same values and the function runs once.
    """

    fn: RewardFn
    tokenizer: Tokenizer
    weight: float = 1.0
    on_failure: Literal["skip", "stop"] = "stop"
    name: str = ""
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"RuleReward.fn must be callable, got {type(self.fn).__name__}")
        if self.on_failure not in ("skip", "stop"):
            raise ValueError(f'on_failure must be "skip" or "stop", got {self.on_failure!r}')
        if not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number, got {self.weight}")
        self.name = self.name or f"{getattr(self.fn, '__module__', '?')}:{getattr(self.fn, '__qualname__', repr(self.fn))}"

    def __call__(self, samples: Sequence[RequestResult]) -> torch.Tensor:
        """The function's value per sample, ``[len(samples)]`` float32 in the order of ``samples``; NaN where it
        failed (``on_failure="skip"``; a warning counts them and names the first three). Raises
        :class:`RewardFunctionError` on a failure under ``"stop"`` (on every rank of ``group``)."""
        leader = self.group is None or dist.get_rank(self.group) == 0
        results = self._values(samples, [self._texts(s) for s in samples]) if leader else None
        if self.group is not None:
            box = [results]
            dist.broadcast_object_list(box, group_src=0, group=self.group)
            results = box[0]
        assert results is not None  # the leader computed them; the other ranks received them from it
        failed = [(s, r) for s, r in zip(samples, results) if isinstance(r, str)]
        if failed:
            named = "; ".join(
                f"sample {s.id} (prompt {self.tokenizer.decode(s.prompt)[:PROMPT_START_CHARS]!r}): {reason}"
                for s, reason in failed[:3]
            )
            more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
            if self.on_failure == "stop":
                raise RewardFunctionError(
                    f"reward function {self.name} failed on {len(failed)} of {len(samples)} samples: {named}{more}; fix the "
                    "function, or set --training.nan_policy=skip to score such samples without its term (counted in "
                    "reward_fn_failures)"
                )
            if leader:
                log.warning(
                    "reward function %s failed on %d of %d samples; their scores get no term from it "
                    '(training.nan_policy = "skip"): %s%s',
                    self.name,
                    len(failed),
                    len(samples),
                    named,
                    more,
                )
        return torch.tensor([math.nan if isinstance(r, str) else r for r in results], dtype=torch.float32)

    def _texts(self, s: RequestResult) -> tuple[str, str]:
        response = s.tokens[:-1] if _finished(s) else s.tokens
        return self.tokenizer.decode(s.prompt), self.tokenizer.decode(response)

    def _values(self, samples: Sequence[RequestResult], texts: list[tuple[str, str]]) -> list[float | str]:
        """Each sample's value, or why it has none. A call that fails as a whole is repeated per sample."""
        try:
            out = self.fn(
                [p for p, _ in texts],
                [r for _, r in texts],
                prompt_ids=[list(s.prompt) for s in samples],
                response_ids=[list(s.tokens) for s in samples],
                finished=[_finished(s) for s in samples],
            )
        except Exception as e:  # noqa: BLE001 - any failure of user code is reported per sample
            problem = f"raised {_one_line(e)}"
        else:
            try:
                values = list(out)
            except TypeError:
                values, problem = None, f"returned a {type(out).__name__}, not a list of numbers"
            if values is not None:
                if len(values) == len(samples):
                    return [_number(v) for v in values]
                problem = f"returned {len(values)} values for {len(samples)} sample{'s' * (len(samples) > 1)}"
        if len(samples) == 1:
            return [problem]
        log.warning(
            "reward function %s %s (a call of %d samples); calling it on each sample alone to find the failing ones",
            self.name,
            problem,
            len(samples),
        )
        return [self._values([s], [t])[0] for s, t in zip(samples, texts)]


def _finished(s: RequestResult) -> bool:
    return s.finish_reason == "stop"


def _number(v: object) -> float | str:
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"returned {v!r:.60}, not a number"
    return x if math.isfinite(x) else f"returned {x}, not a finite number"


def reward_fn_metrics(exp: Experience) -> dict[str, float]:
    """``reward_fn_mean`` (the function's mean value over the samples it scored; NaN if none) and
    ``reward_fn_failures`` (samples it failed on) of a scored batch; nothing without a reward function."""
    values = exp.reward_fn_scores
    if values is None:
        return {}
    ok = ~values.isnan()
    mean = values[ok].mean().item() if ok.any() else math.nan
    return {"reward_fn_mean": mean, "reward_fn_failures": int((~ok).sum())}
