"""The environment interface of multi-turn rollouts: what a user implements, and the checks on what it returns.

An :class:`Environment` is one episode of one sample. The model writes a turn; ``step(text)`` answers with an
:class:`EnvStep`: an observation the model reads before its next turn (text, rendered by the caller as the chat
template's next turn, or token ids appended as they are), this turn's reward, and whether the episode is over. A
sample's environment reward is the sum of its episode's step rewards. An :data:`EnvFactory` builds an episode from the
sample's prompt row; ``load_env_factory("package.module:attribute")`` finds one named in a config.

A minimal environment::

    class Echo(Environment):
        def __init__(self, row):
            self.answer = str(row["answer"])

        def step(self, text):
            return EnvStep(reward=float(text.strip() == self.answer), done=True)

:func:`check_step` and :func:`check_opening` hold an environment to the interface; :class:`fusedrl.envs.EnvRunner`
applies them to every value an environment returns.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

Observation = str | tuple[int, ...]


class EnvError(ValueError):
    """An environment broke the interface (one line: the environment class, the problem, the fix)."""


@dataclass(frozen=True)
class EnvStep:
    """What one ``step`` returns.

    Invariants (:func:`check_step`): ``done`` is a bool; ``reward`` a finite real number; ``observation`` is None
    exactly when ``done`` (the episode has no next turn to read it), else a str or a sequence of non-negative token
    ids (held as a tuple after the check); ``info`` maps str keys to str or real-number values. ``info["tool"]`` names
    a tool the turn called and ``info["tool_error"]`` says that call failed: the runner counts both in its metrics.
    """

    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, str | float] = field(default_factory=dict)


class Environment(abc.ABC):
    """One episode (one sample), built by an :data:`EnvFactory` from the sample's prompt row.

    The runner calls one method of an episode at a time (``opening``, then ``step`` until one returns ``done``, then
    ``close``), each on a worker thread: different episodes run concurrently, so state shared between episodes needs
    a lock. ``step`` is never called after a step returned ``done``.
    """

    def opening(self) -> str | None:
        """The first user message when the environment writes it; None: the prompt row's own messages."""
        return None

    @abc.abstractmethod
    def step(self, text: str) -> EnvStep:
        """Answers the model's turn ``text`` (decoded, without its stop token)."""

    def close(self) -> None:  # noqa: B027 - optional hook: most environments hold nothing to release
        """Releases what the episode holds; called once, after its last step (or instead of it)."""


EnvFactory = Callable[[Mapping[str, Any]], Environment]
"""Called once per sample with its prompt row (e.g. ``{"messages": [...], "answer": 42}``); returns its episode."""


def check_opening(env: object, opening: object) -> str | None:
    """``opening`` when it is what ``env.opening()`` may return (str or None); else :class:`EnvError`."""
    if opening is None or isinstance(opening, str):
        return opening
    raise EnvError(f"{_name(env)}.opening() returned {_kind(opening)}; return the first user message as a str, or None")


def check_step(env: object, step: object) -> EnvStep:
    """``step`` when it keeps :class:`EnvStep`'s invariants (token ids as a tuple); else :class:`EnvError`."""
    where = f"{_name(env)}.step()"
    if not isinstance(step, EnvStep):
        raise EnvError(f"{where} returned {_kind(step)}; return an EnvStep(observation=..., reward=..., done=...)")
    if not isinstance(step.done, bool):
        raise EnvError(f"{where} returned done={step.done!r}; done must be True or False")
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvError(f"{where} returned reward={reward!r}; return a finite float reward (0.0 for none)")
    observation = step.observation
    if step.done and observation is not None:
        raise EnvError(f"{where} returned an observation with done=True; return observation=None when the episode ends")
    if not step.done and observation is None:
        raise EnvError(f"{where} returned observation=None with done=False; return the model's next input (str or token ids)")
    if observation is not None and not isinstance(observation, str):
        token_ids = isinstance(observation, Sequence) and not isinstance(observation, bytes | bytearray)
        if not token_ids or not all(_is_token_id(t) for t in observation):
            raise EnvError(
                f"{where} returned observation {_kind(observation)}; return a str, or a sequence of non-negative int token ids"
            )
        observation = tuple(observation)
    if not isinstance(step.info, Mapping):
        raise EnvError(f"{where} returned info {_kind(step.info)}; return a mapping of str to str or float")
    for key, value in step.info.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, str | int | float):
            raise EnvError(f"{where} returned info[{key!r}]={value!r}; info maps str keys to str or float values")
    if observation is step.observation:
        return step
    return EnvStep(observation=observation, reward=step.reward, done=step.done, info=step.info)


def load_env_factory(path: str) -> EnvFactory:
    """The factory that ``"package.module:attribute"`` names: an :class:`Environment` subclass (called with the row)
    or any callable taking the row. Raises ValueError (one line) for a bad path or an object that is neither."""
    from fusedrl.config import import_object

    try:
        obj = import_object(path)
    except ValueError as e:
        raise ValueError(f"environment factory {path!r}: {e}") from None
    if isinstance(obj, type) and not issubclass(obj, Environment):
        raise ValueError(
            f"environment factory {path!r} is the class {obj.__name__}, not an Environment subclass; "
            "subclass fusedrl.envs.Environment or name a function that returns one"
        )
    if isinstance(obj, Environment) or not callable(obj):
        raise ValueError(
            f"environment factory {path!r} is {_kind(obj)}, not callable; name an Environment subclass or a function "
            "of the prompt row that returns one"
        )
    return cast(EnvFactory, obj)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _name(env: object) -> str:
    return type(env).__name__


def _kind(value: object) -> str:
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
