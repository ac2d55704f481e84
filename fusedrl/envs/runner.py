"""Runs environments off the caller's thread, within limits, and counts what they did.

:class:`EnvRunner` keeps one episode per sample id. Its work runs on a ``ThreadPoolExecutor`` of ``workers`` threads;
every call of the caller (the rollout loop) returns at once, except :meth:`EnvRunner.wait` and
:meth:`EnvRunner.opening`, which block by design.

Invariants:

- Every :meth:`~EnvRunner.submit` yields exactly one result through :meth:`~EnvRunner.poll` or
  :meth:`~EnvRunner.wait` (unless its episode is closed first), in the order the results completed; nothing else
  yields results.
- Nothing an environment does raises into the caller. A step that raises ("exception"), returns something that
  breaks the interface ("invalid", :func:`fusedrl.envs.check_step`) or runs past ``step_timeout_s`` ("timeout") ends
  its episode with ``EnvStep(None, error_reward, done=True, info={"env_error": "<kind>: <message>"})``; the episode's
  reward is then ``error_reward`` alone (what its earlier steps gave is dropped: a failed episode is not partly right). Creating an
  episode (the factory, then ``opening()``) is held to the same rules; a failed start is the result of the episode's
  first submit. The caller's own mistakes (an unknown sample id, a second step in flight) raise ValueError.
- The ``max_turns``-th step of an episode ends it: ``done`` is forced and ``info["limit"] = "turns"`` added, after the
  step ran (its reward counts).
- One method of an episode runs at a time, never after ``close()``; an environment is closed once, on a worker.

Timeouts: a step's clock starts when a worker starts it (time queued behind other steps does not count); expiry is
noticed by the caller's next call (``poll``, ``wait``, ``pending``, ``opening``, ``stats``), and ``wait`` wakes for it.
A thread cannot be killed, so a timed-out step keeps running and keeps its worker: it is counted (``env_stuck``, until
it returns) and its late result is dropped (``env_late_results``). When every worker is held by such a step, queued
work ends at once as a timeout ("no free worker") rather than waiting forever. A step that never returns also keeps
the interpreter from exiting (``concurrent.futures`` joins its threads at exit): environments should bound their own
blocking calls (``run_python`` has its own wall-clock limit).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fusedrl.envs.base import EnvError, EnvFactory, Environment, EnvStep, check_opening, check_step

ERROR_KINDS = ("exception", "timeout", "invalid")


@dataclass(eq=False)
class _Episode:
    sample_id: int
    env: Environment | None = None
    opening: str | None = None
    ready: bool = False  # its start finished, well or not
    failure: EnvStep | None = None  # a failed start: the result of the first submit
    task: _Task | None = None  # the task a worker holds or will run (timed-out ones too, until their thread returns)
    deferred: str | None = None  # a turn submitted before the start finished
    awaiting: bool = False  # a submitted step's result is not yet in the ready list
    done: bool = False
    closing: bool = False  # closed by the caller: nothing more is delivered; the worker holding it closes its env
    turns: int = 0
    step_seconds: float = 0.0
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    errors: int = 0

    def stats(self) -> dict[str, float]:
        return {
            "turns": self.turns,
            "step_seconds": self.step_seconds,
            "reward": self.reward,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "errors": self.errors,
            "done": float(self.done),
        }


@dataclass(eq=False)
class _Task:
    episode: _Episode
    kind: str  # "start" (payload: the row) | "step" (payload: the model's text)
    payload: Any
    started: float | None = None  # time.monotonic() when a worker began it
    expired: bool = False  # its result was given already (a timeout): what it returns is dropped
    future: Future[None] | None = field(default=None, repr=False)


class EnvRunner:
    """Episodes of ``factory`` run on ``workers`` threads; see the module docstring for the invariants.

    ``start`` creates an episode in the pool and returns at once; ``opening(sample_id)`` waits for it. ``submit``
    queues a turn; ``poll`` / ``wait`` return finished steps as ``(sample_id, EnvStep)``. ``close(sample_id)`` ends an
    episode and returns its stats; ``stats()`` holds the totals since construction. All methods are thread-safe.
    """

    def __init__(
        self,
        factory: EnvFactory,
        *,
        workers: int = 4,
        step_timeout_s: float = 10.0,
        max_turns: int = 8,
        error_reward: float = 0.0,
    ) -> None:
        if not callable(factory):
            raise ValueError(f"factory {factory!r} is not callable; pass an Environment subclass or load_env_factory(path)")
        for name, value in (("workers", workers), ("max_turns", max_turns)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EnvRunner {name}={value!r}: must be an int >= 1")
        if isinstance(step_timeout_s, bool) or not isinstance(step_timeout_s, int | float) or not 0 < step_timeout_s < math.inf:
            raise ValueError(f"EnvRunner step_timeout_s={step_timeout_s!r}: must be a positive number of seconds")
        if isinstance(error_reward, bool) or not isinstance(error_reward, int | float) or not math.isfinite(error_reward):
            raise ValueError(f"EnvRunner error_reward={error_reward!r}: must be a finite number")
        self._factory = factory
        self._workers = workers
        self._timeout = float(step_timeout_s)
        self._max_turns = max_turns
        self._error_reward = float(error_reward)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fusedrl-env")
        self._cond = threading.Condition()
        self._episodes: dict[int, _Episode] = {}
        self._running: set[_Task] = set()  # tasks whose result is still to come: queued or running, not expired
        self._ready: list[tuple[_Episode, EnvStep]] = []
        self._pending = 0  # submitted steps whose result the caller has not taken
        self._stuck = 0  # expired tasks whose thread has not returned
        self._shut = False
        self._totals: dict[str, float] = dict.fromkeys(
            (
                "env_episodes",
                "env_episodes_done",
                "env_steps",
                "env_step_seconds",
                "env_turn_limits",
                "env_errors",
                *(f"env_errors_{kind}" for kind in ERROR_KINDS),
                "env_late_results",
                "env_close_errors",
                "tool_calls",
                "tool_errors",
            ),
            0.0,
        )

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the caller's side ------------------------------------------------------------------------------------------

    def start(self, sample_id: int, row: Mapping[str, Any]) -> None:
        """Creates the episode of ``sample_id`` from its prompt row in the pool (``factory(row)``, then ``opening()``);
        returns at once."""
        with self._cond:
            self._check_open()
            if sample_id in self._episodes:
                raise ValueError(f"sample {sample_id} already has an episode; close({sample_id}) it before starting another")
            episode = _Episode(sample_id)
            self._episodes[sample_id] = episode
            self._totals["env_episodes"] += 1
            self._launch(episode, "start", row)

    def opening(self, sample_id: int) -> str | None:
        """The episode's first user message (None: the prompt row's own messages), once its start finished; blocks
        until then. None as well when the start failed: its error is then the first submit's result."""
        with self._cond:
            episode = self._episode(sample_id)
            while not episode.ready:
                self._expire()
                if not episode.ready:
                    self._cond.wait(self._next_expiry())
            return episode.opening

    def submit(self, sample_id: int, text: str) -> None:
        """Queues the model's turn ``text`` for the episode's ``step``; returns at once. One step per episode at a
        time: take its result (``poll``/``wait``) before submitting the next."""
        if not isinstance(text, str):
            raise TypeError(f"submit(text=...) takes the decoded turn as a str, got {type(text).__name__}")
        with self._cond:
            self._check_open()
            episode = self._episode(sample_id)
            if episode.done:
                raise ValueError(f"the episode of sample {sample_id} is over; close({sample_id}) it")
            if episode.awaiting:
                raise ValueError(f"sample {sample_id} has a step in flight; take its result with poll() or wait() first")
            self._pending += 1
            episode.awaiting = True
            if episode.failure is not None:
                self._deliver(episode, episode.failure, failed=True)
            elif not episode.ready:
                episode.deferred = text  # launched when the start finishes
            else:
                self._launch(episode, "step", text)

    def poll(self) -> list[tuple[int, EnvStep]]:
        """The steps finished since the last ``poll``/``wait``, in completion order; never blocks."""
        with self._cond:
            self._expire()
            return self._take()

    def wait(self, timeout_s: float | None = None) -> list[tuple[int, EnvStep]]:
        """Like ``poll``, but blocks until at least one step finished or ``timeout_s`` passed ([] then); returns []
        at once when nothing is pending."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._expire()
                if self._ready or self._pending == 0:
                    return self._take()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                waits = [w for w in (left, self._next_expiry()) if w is not None]
                self._cond.wait(min(waits) if waits else None)

    def pending(self) -> int:
        """Submitted steps whose results the caller has not taken yet."""
        with self._cond:
            self._expire()
            return self._pending

    def close(self, sample_id: int) -> dict[str, float]:
        """Ends the episode (a result not yet taken is dropped) and returns its stats: ``turns``, ``step_seconds``,
        ``reward`` (the sum of its steps' rewards; ``error_reward`` alone after an error), ``tool_calls``, ``tool_errors``, ``errors``, ``done``. Its
        environment's ``close()`` runs on a worker, after any step that still holds it."""
        with self._cond:
            episode = self._episode(sample_id)
            del self._episodes[sample_id]
            self._close_locked(episode)
            return episode.stats()

    def record_error(self, sample_id: int, kind: str, message: str) -> None:
        """Count an error its caller found in a step's result (``kind`` one of ``ERROR_KINDS``; e.g. an observation
        the model cannot take): the episode gets ``error_reward`` as a failed step gives it; the caller ends it."""
        if kind not in ERROR_KINDS:
            raise ValueError(f"record_error kind {kind!r}: one of {', '.join(ERROR_KINDS)}")
        with self._cond:
            episode = self._episode(sample_id)
            episode.reward = self._error_step(episode, kind, message).reward

    def episode_stats(self, sample_id: int) -> dict[str, float]:
        """The stats of an open episode, as ``close`` returns them."""
        with self._cond:
            return self._episode(sample_id).stats()

    def stats(self) -> dict[str, float]:
        """Totals since construction: ``env_episodes`` (started), ``env_episodes_done``, ``env_steps``,
        ``env_step_seconds`` (summed over steps, late ones included), ``env_turn_limits``, ``env_errors`` and
        ``env_errors_<kind>`` per kind, ``env_late_results`` (dropped), ``env_close_errors``, ``tool_calls``,
        ``tool_errors``; and now: ``env_open`` (episodes), ``env_pending``, ``env_stuck`` (timed-out steps still
        running)."""
        with self._cond:
            self._expire()
            now = {"env_open": float(len(self._episodes)), "env_pending": float(self._pending), "env_stuck": float(self._stuck)}
            return {**self._totals, **now}

    def shutdown(self) -> None:
        """Closes every episode and stops taking work; returns without waiting for running steps (their environments
        are closed when they return). Idempotent."""
        with self._cond:
            if self._shut:
                return
            for episode in self._episodes.values():
                self._close_locked(episode)
            self._episodes.clear()
            self._shut = True
        self._pool.shutdown(wait=False)

    # -- bookkeeping (under self._cond unless said otherwise) -------------------------------------------------------

    def _check_open(self) -> None:
        if self._shut:
            raise RuntimeError("this EnvRunner is shut down; make a new one")

    def _episode(self, sample_id: int) -> _Episode:
        episode = self._episodes.get(sample_id)
        if episode is None:
            raise ValueError(f"sample {sample_id} has no episode; start({sample_id}, row) it first")
        return episode

    def _launch(self, episode: _Episode, kind: str, payload: Any) -> None:
        task = _Task(episode, kind, payload)
        episode.task = task
        self._running.add(task)
        task.future = self._pool.submit(self._run, task)

    def _take(self) -> list[tuple[int, EnvStep]]:
        out = [(episode.sample_id, step) for episode, step in self._ready]
        self._ready = []
        self._pending -= len(out)
        return out

    def _close_locked(self, episode: _Episode) -> None:
        episode.closing = True
        if episode.awaiting:
            episode.awaiting = False
            self._pending -= 1
        kept = [(e, s) for e, s in self._ready if e is not episode]
        self._pending -= len(self._ready) - len(kept)
        self._ready = kept
        if episode.task is None and episode.env is not None:  # else the worker holding it closes it
            self._pool.submit(self._close_env, episode.env)

    def _next_expiry(self) -> float | None:
        """Seconds until the first running task passes its timeout; None when no task is running."""
        starts = [t.started for t in self._running if t.started is not None]
        return None if not starts else max(0.0, min(starts) + self._timeout - time.monotonic())

    def _expire(self) -> None:
        """Ends the running tasks past their timeout, and the queued ones when every worker is stuck."""
        now = time.monotonic()
        for task in [t for t in self._running if t.started is not None and now - t.started > self._timeout]:
            self._stuck += 1
            self._time_out(task, f"ran past step_timeout_s={self._timeout:g}s; its thread keeps running, its result is dropped")
        if self._stuck >= self._workers:
            for task in [t for t in self._running if t.started is None]:
                if task.future is not None and task.future.cancel() and task.episode.task is task:
                    task.episode.task = None  # it will never run, so it holds nothing
                self._time_out(task, f"no free worker: all {self._workers} workers hold steps that ran past step_timeout_s")

    def _time_out(self, task: _Task, message: str) -> None:
        task.expired = True
        self._running.discard(task)
        if task.kind == "start":
            self._started(task.episode, ("timeout", message))
        else:
            self._stepped(task.episode, None, ("timeout", message))

    def _error_step(self, episode: _Episode, kind: str, message: str) -> EnvStep:
        episode.errors += 1
        self._totals["env_errors"] += 1
        self._totals[f"env_errors_{kind}"] += 1
        return EnvStep(observation=None, reward=self._error_reward, done=True, info={"env_error": f"{kind}: {message}"})

    def _started(self, episode: _Episode, error: tuple[str, str] | None) -> None:
        episode.ready = True
        if error is not None:
            episode.failure = self._error_step(episode, error[0], f"start: {error[1]}")
        self._cond.notify_all()
        if episode.deferred is not None and not episode.closing:
            text, episode.deferred = episode.deferred, None
            if episode.failure is not None:
                self._deliver(episode, episode.failure, failed=True)
            else:
                self._launch(episode, "step", text)

    def _stepped(self, episode: _Episode, step: EnvStep | None, error: tuple[str, str] | None) -> None:
        episode.turns += 1
        self._totals["env_steps"] += 1
        if error is not None:
            step = self._error_step(episode, *error)
        else:
            assert step is not None
            if "tool" in step.info:
                episode.tool_calls += 1
                self._totals["tool_calls"] += 1
            if "tool_error" in step.info:
                episode.tool_errors += 1
                self._totals["tool_errors"] += 1
            if not step.done and episode.turns >= self._max_turns:
                step = EnvStep(observation=None, reward=step.reward, done=True, info={**step.info, "limit": "turns"})
                self._totals["env_turn_limits"] += 1
        self._deliver(episode, step, failed=error is not None)

    def _deliver(self, episode: _Episode, step: EnvStep, *, failed: bool = False) -> None:
        episode.reward = step.reward if failed else episode.reward + step.reward
        if step.done and not episode.done:
            episode.done = True
            self._totals["env_episodes_done"] += 1
        if episode.closing:
            return
        episode.awaiting = False
        self._ready.append((episode, step))
        self._cond.notify_all()

    # -- the workers' side (no lock held unless taken) --------------------------------------------------------------

    def _run(self, task: _Task) -> None:
        episode = task.episode
        with self._cond:
            skip = task.expired or episode.closing
            if not skip:
                task.started = time.monotonic()
                self._cond.notify_all()  # a waiter's next expiry changed
        value: Any = None
        error: tuple[str, str] | None = None
        seconds = 0.0
        if not skip:
            begin = time.perf_counter()
            try:
                value = self._call(task)
            except EnvError as e:
                error = ("invalid", str(e))
            except BaseException as e:  # an environment's sys.exit() ends its episode, not the runner
                error = ("exception", _one_line(e))
            seconds = time.perf_counter() - begin
        with self._cond:
            release = self._finish(task, value, error, seconds, ran=not skip)
        for env in release:
            self._close_env(env)

    def _call(self, task: _Task) -> Any:
        """The task's work: (env, opening) for a start, the checked EnvStep for a step."""
        if task.kind == "step":
            env = task.episode.env
            assert env is not None
            return check_step(env, env.step(task.payload))
        env = self._factory(task.payload)
        if not isinstance(env, Environment):
            name = getattr(self._factory, "__name__", type(self._factory).__name__)
            raise EnvError(f"the factory {name} returned {type(env).__name__}; return an Environment instance")
        try:
            return env, check_opening(env, env.opening())
        except BaseException:
            self._close_env(env)
            raise

    def _finish(self, task: _Task, value: Any, error: tuple[str, str] | None, seconds: float, *, ran: bool) -> list[Environment]:
        """Records a task's end (under the lock); returns the environments its worker must now close."""
        episode = task.episode
        if episode.task is task:
            episode.task = None
        created = value[0] if task.kind == "start" and error is None and ran else None
        if task.kind == "step" and ran:
            episode.step_seconds += seconds
            self._totals["env_step_seconds"] += seconds
        if task.expired:  # its result was given already
            if ran and task.started is not None:
                self._stuck -= 1
                self._totals["env_late_results"] += 1
            if created is not None:
                return [created]
            return [episode.env] if episode.closing and episode.env is not None else []
        self._running.discard(task)
        if not ran:  # skipped: the episode was closed before it began
            return [episode.env] if task.kind == "step" and episode.env is not None else []
        if error is None and seconds > self._timeout:
            error = ("timeout", f"ran {seconds:.3g}s, past step_timeout_s={self._timeout:g}s")
        if task.kind == "start":
            if error is None and not episode.closing:
                episode.env, episode.opening = value
                created = None
            self._started(episode, error)
            return [created] if created is not None else []
        self._stepped(episode, value, error)
        return [episode.env] if episode.closing and episode.env is not None else []

    def _close_env(self, env: Environment) -> None:
        try:
            env.close()
        except BaseException:  # counted; closing must not stop the worker
            with self._cond:
                self._totals["env_close_errors"] += 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:200] if text else type(e).__name__
