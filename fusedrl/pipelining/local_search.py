"""The search's building blocks: its budget (simulated work, machine-independent), forward-backward justification
(compacts a valid order without breaking the memory limit), simulated annealing with adjacent swaps, and the
single-model 1F1B peak the memory limits are measured against. :mod:`.search` composes them."""

from __future__ import annotations

import bisect
import math
import random
import time
from collections.abc import Callable

from fusedrl.pipelining.cost import CostModel, StageCosts
from fusedrl.pipelining.ir import ACTOR, CRITIC, Action
from fusedrl.pipelining.simulator import Problem

# Simulated actions per second of budget (measured on one core of a 2020s x86 CPU with CPython 3.11); one greedy
# run costs about GREEDY_COST simulations.
ACTIONS_PER_SECOND = 2_000_000


GREEDY_COST = 30


JUSTIFY_PASS_COST = 8  # one justification pass, in simulations


JUSTIFY_ROUNDS = 8  # at most this many right+left pass pairs per justification


WALL_CLOCK_FACTOR = 1.25


def single_model_1f1b_peak(problem: Problem) -> float:
    """Peak activation memory of one model alone under 1F1B: stage 0 holds num_stages micro-batches.

    Reported for the model with the larger peak (the Actor unless the Critic's memory is much larger)."""
    peaks = []
    for model in (ACTOR, CRITIC):
        c = problem.costs.of(model)
        n = len(c.f)
        m = problem.microbatches(model)
        peaks.append(max(min(n - s, m) * c.mem[s] for s in range(n)))
    return max(peaks)


class Evaluator:
    """Counts simulated work so the search stops after a machine-independent amount of it."""

    def __init__(self, problem: Problem, budget_s: float) -> None:
        self.problem = problem
        self.work_limit = budget_s * ACTIONS_PER_SECOND
        self.work = 0
        self.evaluations = 0
        self.started = time.perf_counter()
        self.deadline = self.started + WALL_CLOCK_FACTOR * budget_s
        self.n = len(problem.actions)

    def continue_on(self, problem: Problem, budget_s: float) -> Evaluator:
        """An evaluator of ``problem`` that counts this one's work and evaluations and whose budget ``budget_s`` (with
        its wall-clock guard) runs from this one's start."""
        nxt = Evaluator(problem, budget_s)
        nxt.work, nxt.evaluations, nxt.started = self.work, self.evaluations, self.started
        nxt.deadline = self.started + WALL_CLOCK_FACTOR * budget_s
        return nxt

    def charge_greedy(self) -> None:
        self.work += GREEDY_COST * self.n

    def exhausted(self, reserve: float = 0.0) -> bool:
        """True once the budget minus ``reserve`` (a fraction kept for later phases) is spent."""
        return self.work >= (1.0 - reserve) * self.work_limit or time.perf_counter() > self.deadline

    def makespan(self, order: list[list[int]]) -> float | None:
        self.work += self.n
        self.evaluations += 1
        return self.problem.makespan(order)


class Best:
    """The fastest order a search phase has found within its memory limit, and the name of what found it."""

    def __init__(self, evaluator: Evaluator, memory_limit: float, order: list[list[int]], makespan: float, method: str):
        self.evaluator, self.memory_limit = evaluator, memory_limit
        self.order, self.makespan, self.method = order, makespan, method

    def consider(self, order: list[list[int]], method: str) -> None:
        """Keep ``order`` if it fits the memory limit and is faster (one simulation, charged to the evaluator)."""
        if max(self.evaluator.problem.peak_memory(order)) > self.memory_limit + 1e-9:
            return
        ms = self.evaluator.makespan(order)
        if ms is not None:
            self.keep(order, ms, method)

    def keep(self, order: list[list[int]], makespan: float, method: str) -> None:
        """Keep an already simulated ``order`` if it is faster."""
        if makespan < self.makespan - 1e-12:
            self.order, self.makespan, self.method = order, makespan, method


class _RankLine:
    """One rank's placed actions during a justification pass: their intervals in time order and the running
    activation memory after each (counted in sequence order, as ``Problem.peak_memory`` does)."""

    __slots__ = ("starts", "ends", "mem_after")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.mem_after: list[float] = []

    def insert(self, est: float, dur: float, delta: float, limit: float) -> float | None:
        """Place an action at the earliest start >= ``est`` in a gap of length ``dur`` where adding ``delta`` to the
        running memory from there on keeps it within ``limit``; return the start (None if no place fits)."""
        starts, ends, mem = self.starts, self.ends, self.mem_after
        k = len(starts)
        i = bisect.bisect_right(starts, est)
        if delta > 0:
            room = limit - delta + 1e-9
            if (mem[k - 1] if k else 0.0) > room:
                return None
            # The memory after position j only grows by delta, so the feasible insert positions are a suffix.
            j = k
            while j > i and (mem[j - 2] if j >= 2 else 0.0) <= room:
                j -= 1
            i = j
        t = est
        if i > 0 and ends[i - 1] > t:
            t = ends[i - 1]
        while i < k and starts[i] - t < dur - 1e-9:
            t = ends[i]
            i += 1
        starts.insert(i, t)
        ends.insert(i, t + dur)
        mem.insert(i, mem[i - 1] if i else 0.0)
        for j in range(i, k + 1):
            mem[j] += delta
        return t


class Justifier:
    """Forward-backward improvement: shift every action as late as possible (in order of decreasing finish time,
    filling gaps), then as early as possible (in order of increasing start time, filling gaps), and repeat while
    the makespan drops. Each pass keeps precedences, the micro-batch order within each stage and the memory limit,
    and never lengthens the schedule it starts from, so the result is valid whenever the input is."""

    def __init__(self, problem: Problem, memory_limit: float, evaluator: Evaluator | None = None) -> None:
        self.problem, self.limit, self.evaluator = problem, memory_limit, evaluator
        n = len(problem.actions)
        preds = [list(d) for d in problem.deps]
        for st in problem.streams:
            for stage in st:
                for lst in stage:
                    for a, b in zip(lst, lst[1:]):
                        preds[b].append((a, 0.0))  # keep the micro-batch order on each stage
        succs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        for b in range(n):
            for a, lag in preds[b]:
                succs[a].append((b, lag))
        self.preds, self.succs = preds, succs

    def _pass(
        self, frame_start: list[float], deps: list[list[tuple[int, float]]], mirrored: bool
    ) -> tuple[list[float], list[float]] | None:
        """Left-justify in a time frame (the real one, or mirrored for the late pass, where backwards add memory)."""
        p = self.problem
        if self.evaluator is not None:
            self.evaluator.work += JUSTIFY_PASS_COST * len(p.actions)
        dur, mem_delta, rank = p.dur, p.mem_delta, p.rank
        lines = [_RankLine() for _ in range(p.pp)]
        start = [0.0] * len(dur)
        finish = [0.0] * len(dur)
        for a in sorted(range(len(dur)), key=frame_start.__getitem__):
            est = 0.0
            for b, lag in deps[a]:
                if finish[b] + lag > est:
                    est = finish[b] + lag
            t = lines[rank[a]].insert(est, dur[a], -mem_delta[a] if mirrored else mem_delta[a], self.limit)
            if t is None:
                return None
            start[a], finish[a] = t, t + dur[a]
        return start, finish

    def improve(self, order: list[list[int]]) -> list[list[int]]:
        p = self.problem
        finish = p.finish_times(order)
        if finish is None:
            return order
        best, best_ms = order, max(finish)
        for _ in range(JUSTIFY_ROUNDS):
            if self.evaluator is not None and self.evaluator.exhausted():
                break
            ms = max(finish)
            late = self._pass([ms - f for f in finish], self.succs, True)
            if late is None:
                break
            early = self._pass([ms - f for f in late[1]], self.preds, False)
            if early is None:
                break
            start, finish = early
            if max(finish) >= best_ms - 1e-9:
                break
            best_ms = max(finish)
            best = [[] for _ in range(p.pp)]
            for a in sorted(range(len(start)), key=start.__getitem__):
                best[p.rank[a]].append(a)
        return best


def justify_order(problem: Problem, order: list[list[int]], memory_limit: float) -> list[list[int]]:
    """Forward-backward improvement of a valid per-rank order (see ``Justifier``): never slower, never above
    ``memory_limit`` when the input is within it, and the micro-batch order on every stage is kept."""
    return Justifier(problem, memory_limit).improve(order)


class TimeReversal:
    """The problem run backwards in time, which is a problem of the same form: reversed, a pipeline runs its
    backwards first, from stage 0 up, then its forwards back down, so its backwards act as forwards (with the
    backward times) and vice versa, on the same ranks and with the same activation memory between the pair.
    Micro-batch m maps to M-1-m so that the micro-batch order on each stage is kept. A greedy schedule of the
    reversed problem, read backwards, is a valid schedule of the original with the same peak memory; it packs
    the end of the schedule as tightly as the forward greedy packs the start."""

    def __init__(self, problem: Problem) -> None:
        c = problem.costs

        def swap(st: StageCosts) -> StageCosts:
            return StageCosts(st.b, st.f, st.mem)

        self.problem = problem
        self.reversed = Problem(
            problem.placement, CostModel(swap(c.actor), swap(c.critic), c.p2p_latency), problem.mb_actor, problem.mb_critic
        )
        self.original_index = [
            problem.index[
                Action(
                    a.model, a.stage, problem.microbatches(a.model) - 1 - a.microbatch, "B" if a.kind == "F" else "F", a.replica
                )
            ]
            for a in self.reversed.actions
        ]

    def to_original(self, order: list[list[int]]) -> list[list[int]]:
        return [[self.original_index[a] for a in reversed(lst)] for lst in order]


def _swappable(problem: Problem, x: int, y: int) -> bool:
    ax, ay = problem.actions[x], problem.actions[y]
    if (ax.model, ax.replica, ax.stage) == (ay.model, ay.replica, ay.stage):
        # Same stage: only actions of different kinds and micro-batches (an F and a later B, I or W) may trade places.
        return ax.kind != ay.kind and ax.microbatch != ay.microbatch
    return True


def _rank_peak(problem: Problem, lst: list[int]) -> float:
    return problem.peak_memory([lst])[0]


def anneal(
    problem: Problem,
    order: list[list[int]],
    best_makespan: float,
    memory_limit: float,
    evaluator: Evaluator,
    rng: random.Random,
    target: float,
    iterations: int,
    justify: Callable[[list[list[int]]], list[list[int]]] | None = None,
) -> tuple[list[list[int]], float]:
    """Simulated annealing over adjacent swaps on one rank; keeps the best valid order within the memory limit.
    Every new best is passed through ``justify`` (if given), and annealing continues from the justified order."""
    cur = [list(lst) for lst in order]
    cur_ms = best_makespan
    best = [list(lst) for lst in cur]
    temp0 = 0.002 * best_makespan
    ranks = [r for r in range(problem.pp) if len(cur[r]) > 1]
    for it in range(iterations):
        if evaluator.exhausted() or best_makespan <= target:
            break
        temp = temp0 * (1.0 - it / iterations) + 1e-12
        r = rng.choice(ranks)
        lst = cur[r]
        p = rng.randrange(len(lst) - 1)
        x, y = lst[p], lst[p + 1]
        if not _swappable(problem, x, y):
            continue
        lst[p], lst[p + 1] = y, x
        if problem.mem_delta[y] > 0 and _rank_peak(problem, lst) > memory_limit + 1e-9:
            lst[p], lst[p + 1] = x, y
            continue
        ms = evaluator.makespan(cur)
        if ms is not None and (ms <= cur_ms or rng.random() < math.exp((cur_ms - ms) / temp)):
            cur_ms = ms
            if ms < best_makespan - 1e-12:
                if justify is not None:
                    justified = justify(cur)
                    jms = evaluator.makespan(justified)
                    if jms is not None and jms < ms - 1e-12:
                        cur, cur_ms, ms = [list(q) for q in justified], jms, jms
                best_makespan = ms
                best = [list(q) for q in cur]
        else:
            lst[p], lst[p + 1] = x, y
    return best, best_makespan
