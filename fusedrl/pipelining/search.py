"""Schedule generators: sequential 1F1B (the unfused baseline), a greedy fused list scheduler, forward-backward
justification (which compacts any valid schedule without breaking the memory limit) and a local search; with
``split_backward`` the search continues on the problem whose backwards are split into I and W.

The search is deterministic for a given seed and budget: the budget is converted into a number of simulated
actions (a machine-independent amount of work), so two runs with the same arguments return the same schedule.
A wall-clock guard of ``WALL_CLOCK_FACTOR x budget_s`` only cuts a run short on a much slower or loaded machine
(then the result depends on timing).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from fusedrl.pipelining.bounds import problem_lower_bound
from fusedrl.pipelining.cost import CostModel, StageCosts
from fusedrl.pipelining.ir import ACTOR, CRITIC, Action, Placement, Schedule
from fusedrl.pipelining.simulator import Problem, SimResult, simulate_order

# Simulated actions per second of budget (measured on one core of a 2020s x86 CPU with CPython 3.11); one greedy
# run costs about GREEDY_COST simulations.
ACTIONS_PER_SECOND = 2_000_000
GREEDY_COST = 30
JUSTIFY_PASS_COST = 8  # one justification pass, in simulations
JUSTIFY_ROUNDS = 8  # at most this many right+left pass pairs per justification
WALL_CLOCK_FACTOR = 1.25
MEMORY_PASS_SHARE = 0.1  # of the budget, kept for the memory pass
RESTART_SHARE = 0.6  # of the budget, spent (with the deterministic greedy variants) before annealing starts
NOISES = (0.0, 0.02, 0.05, 0.1)
UNCAPPED = 1 << 30
# (extra in-flight, backward bias, active, memory pressure): tried in this order (most often best on the
# benchmark grid first); randomised restarts then draw from these and the memory-pressure variants.
GREEDY_VARIANTS: list[tuple[int, float, bool, float]] = [
    (extra, bias, active, 1.0) for extra in (4, UNCAPPED, 3, 2, 1, 0) for active in (True, False) for bias in (0.0, 1.0, -0.5)
]
RESTART_VARIANTS = GREEDY_VARIANTS + [(extra, bias, active, 0.75) for extra, bias, active, _ in GREEDY_VARIANTS]
# Deterministic greedy settings: a variant, whether the Critic's priorities use the balanced weight, and whether
# the greedy runs on the time-reversed problem. The leading six, each followed by justification, covered the best
# justified result to within 0.2% on 8 large problems of the benchmark grid (pp 8-16, M 2-4 x pp); a large problem
# may only have budget for a dozen settings. The rest of the product follows.
LEADING_SETTINGS: list[tuple[tuple[int, float, bool, float], bool, bool]] = [
    ((2, -0.5, False, 1.0), True, False),
    ((UNCAPPED, 0.0, False, 1.0), True, False),
    ((3, 1.0, False, 1.0), False, True),
    ((2, -0.5, True, 1.0), True, False),
    ((3, 0.0, True, 1.0), True, False),
    ((1, 1.0, False, 1.0), False, False),
]
GREEDY_SETTINGS = LEADING_SETTINGS + [
    setting for setting in itertools.product(GREEDY_VARIANTS, (False, True), (False, True)) if setting not in LEADING_SETTINGS
]
# Greedy settings on the split-backward problem (a variant and whether the Critic's priorities use the balanced
# weight; forwards in time only, as a split problem run backwards is not of the same form). Each followed by
# justification, the leading four reached the best of all 144 settings (RESTART_VARIANTS x both weights) to within
# 0.1% on the 64 benchmark-grid problems with pp <= 16 and M <= 32; the first alone on 59 of them.
SPLIT_LEADING_SETTINGS: list[tuple[tuple[int, float, bool, float], bool]] = [
    ((UNCAPPED, -0.5, False, 1.0), True),
    ((3, 0.0, False, 1.0), True),
    ((1, -0.5, True, 1.0), False),
    ((1, 0.0, False, 1.0), False),
]
SPLIT_GREEDY_SETTINGS = SPLIT_LEADING_SETTINGS + [
    setting for setting in itertools.product(GREEDY_VARIANTS, (False, True)) if setting not in SPLIT_LEADING_SETTINGS
]
SPLIT_FB_SHARE = 0.25  # of the budget, for the F/B search whose best order the split-backward phase starts from


def sequential_1f1b(placement: Placement, mb_actor: int, mb_critic: int) -> Schedule:
    """Actor 1F1B, then Critic 1F1B on every rank (each Critic replica runs its own 1F1B on its ranks)."""
    schedule: Schedule = {r: [] for r in range(placement.pp)}
    pipelines = [(ACTOR, 0, mb_actor)] + [(CRITIC, r, mb_critic) for r in range(placement.critic_replicas)]
    for model, replica, m_count in pipelines:
        n = placement.num_stages(model)
        for s in range(n):
            warmup = min(n - 1 - s, m_count)
            acts = [Action(model, s, m, "F", replica) for m in range(warmup)]
            for i in range(m_count - warmup):
                acts += [Action(model, s, warmup + i, "F", replica), Action(model, s, i, "B", replica)]
            acts += [Action(model, s, m, "B", replica) for m in range(m_count - warmup, m_count)]
            schedule[placement.rank_of(model, s, replica)] += acts
    return schedule


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


@dataclass
class PlanResult:
    """The best schedule found, its simulation, and the figures to judge it by."""

    schedule: Schedule
    result: SimResult
    lower_bound: float
    sequential_1f1b_makespan: float
    memory_limit: float
    search_seconds: float
    evaluations: int
    method: str  # which generator produced the returned schedule
    split_backward: bool  # the schedule's backwards are split into I and W
    split_lower_bound: float  # lower bound over split-backward schedules (which include every F/B schedule)

    @property
    def makespan(self) -> float:
        return self.result.makespan


# ---------------------------------------------------------------------------------------------------------
# Greedy list scheduler


def balanced_critic_weight(problem: Problem) -> float:
    """Critic priority weight that puts both models' longest remaining paths on the same scale (a light Critic
    otherwise always loses to the Actor and piles up at the end)."""
    _, tails = problem.release_and_tail
    longest = {ACTOR: 0.0, CRITIC: 0.0}
    for t, a in zip(tails, problem.actions):
        longest[a.model] = max(longest[a.model], t)
    return longest[ACTOR] / longest[CRITIC]


def greedy_order(
    problem: Problem,
    memory_limit: float,
    *,
    extra_in_flight: int = 1,
    backward_bias: float = 0.0,
    active: bool = True,
    memory_pressure: float = 1.0,
    critic_weight: float = 1.0,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> list[list[int]]:
    """Active-schedule list scheduling (Giffler-Thompson): repeatedly take the rank whose next action could finish
    earliest and, among the actions that could start there before that finish, run the one with the longest
    remaining critical path. In-flight micro-batches per stage are capped at (stages after it + 1 +
    ``extra_in_flight``) and each rank's activation memory at ``memory_limit``; once a rank holds more than
    ``memory_pressure`` x ``memory_limit``, its backwards take precedence. ``critic_weight`` scales the Critic's
    priorities against the Actor's; ``noise`` > 0 perturbs every priority by up to that fraction (drawn from
    ``rng``) for randomised restarts."""
    if noise and rng is None:
        raise ValueError("greedy_order: noise > 0 needs an rng (random.Random(seed)) so runs stay reproducible")
    pp = problem.pp
    n_act = len(problem.actions)
    _, tails = problem.release_and_tail
    key = [
        (t + d + (backward_bias * d if a.kind in ("B", "I") else 0.0))
        * (critic_weight if a.model != ACTOR else 1.0)
        * (1.0 + noise * rng.random() if noise else 1.0)  # type: ignore[union-attr]
        for t, d, a in zip(tails, problem.dur, problem.actions)
    ]
    finish: list[float | None] = [None] * n_act
    streams = problem.streams
    done = [[[0, 0, 0] for _ in st] for st in streams]  # per rank and stage: forwards, backwards, weight backwards run
    slot = {a: (k, which) for st in streams for k, stage in enumerate(st) for which, lst in enumerate(stage) for a in lst}
    caps = [
        [
            problem.placement.num_stages(problem.actions[stage.forward[0]].model)
            - problem.actions[stage.forward[0]].stage
            + extra_in_flight
            for stage in st
        ]
        for st in streams
    ]
    mem_cur = [0.0] * pp
    free = [0.0] * pp
    order: list[list[int]] = [[] for _ in range(pp)]
    deps, dur, mem, mem_delta = problem.deps, problem.dur, problem.mem, problem.mem_delta
    # Successors, for invalidating cached candidates of the ranks they live on.
    succ_ranks: list[set[int]] = [set() for _ in range(n_act)]
    for a in range(n_act):
        for d, _ in deps[a]:
            succ_ranks[d].add(problem.rank[a])

    def candidates(r: int, ignore_memory: bool) -> list[tuple[float, int]]:
        out = []
        for k, (fw, bw, wt) in enumerate(streams[r]):
            i, j, w = done[r][k]
            if i < len(fw) and (ignore_memory or (i - j < caps[r][k] and mem_cur[r] + mem[fw[i]] <= memory_limit + 1e-9)):
                a = fw[i]
                est = _ready(a)
                if est is not None:
                    out.append((max(est, free[r]), a))
            for lst, nxt in ((bw, j if j < i else -1), (wt, w if w < j else -1)):  # backward, weight backward
                if 0 <= nxt < len(lst):
                    est = _ready(lst[nxt])
                    if est is not None:
                        out.append((max(est, free[r]), lst[nxt]))
        return out

    def _ready(a: int) -> float | None:
        t = 0.0
        for d, lag in deps[a]:
            fd = finish[d]
            if fd is None:
                return None
            t = max(t, fd + lag)
        return t

    cache: list[list[tuple[float, int]] | None] = [None] * pp
    for _ in range(n_act):
        best_r, best_ect = -1, math.inf
        for r in range(pp):
            if cache[r] is None:
                cache[r] = candidates(r, False)
            for est, a in cache[r]:  # type: ignore[union-attr]
                ect = est + dur[a]
                if ect < best_ect:
                    best_r, best_ect = r, ect
        if best_r < 0:  # every remaining forward is blocked by memory: relax on the rank that can start first
            relaxed = [(est + dur[a], r, a) for r in range(pp) for est, a in candidates(r, True)]
            _, best_r, _ = min(relaxed)
            cache[best_r] = candidates(best_r, True)
            best_ect = min(est + dur[a] for est, a in cache[best_r])  # type: ignore[union-attr]
        # Active: any action that could start before the earliest finish; non-delay: only the earliest starters.
        horizon = best_ect - 1e-12 if active else min(est for est, _ in cache[best_r]) + 1e-9  # type: ignore[union-attr]
        conflict = [(est, a) for est, a in cache[best_r] if est < horizon]  # type: ignore[union-attr]
        r = best_r
        # Above memory_pressure x limit, backwards (which lead to freeing memory) go before forwards.
        pressed = mem_cur[r] > memory_pressure * memory_limit
        est, a = max(conflict, key=lambda c: (pressed and problem.actions[c[1]].kind != "F", key[c[1]], -c[1]))
        finish[a] = free[r] = est + dur[a]
        order[r].append(a)
        k, which = slot[a]
        done[r][k][which] += 1
        mem_cur[r] += mem_delta[a]
        cache[r] = None
        for q in succ_ranks[a]:
            cache[q] = None
    return order


class _Evaluator:
    """Counts simulated work so the search stops after a machine-independent amount of it."""

    def __init__(self, problem: Problem, budget_s: float) -> None:
        self.problem = problem
        self.work_limit = budget_s * ACTIONS_PER_SECOND
        self.work = 0
        self.evaluations = 0
        self.started = time.perf_counter()
        self.deadline = self.started + WALL_CLOCK_FACTOR * budget_s
        self.n = len(problem.actions)

    def continue_on(self, problem: Problem, budget_s: float) -> _Evaluator:
        """An evaluator of ``problem`` that counts this one's work and evaluations and whose budget ``budget_s`` (with
        its wall-clock guard) runs from this one's start."""
        nxt = _Evaluator(problem, budget_s)
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


class _Best:
    """The fastest order a search phase has found within its memory limit, and the name of what found it."""

    def __init__(self, evaluator: _Evaluator, memory_limit: float, order: list[list[int]], makespan: float, method: str):
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


# ---------------------------------------------------------------------------------------------------------
# Justification (forward-backward improvement)


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


class _Justifier:
    """Forward-backward improvement: shift every action as late as possible (in order of decreasing finish time,
    filling gaps), then as early as possible (in order of increasing start time, filling gaps), and repeat while
    the makespan drops. Each pass keeps precedences, the micro-batch order within each stage and the memory limit,
    and never lengthens the schedule it starts from, so the result is valid whenever the input is."""

    def __init__(self, problem: Problem, memory_limit: float, evaluator: _Evaluator | None = None) -> None:
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
    """Forward-backward improvement of a valid per-rank order (see ``_Justifier``): never slower, never above
    ``memory_limit`` when the input is within it, and the micro-batch order on every stage is kept."""
    return _Justifier(problem, memory_limit).improve(order)


class _TimeReversal:
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


# ---------------------------------------------------------------------------------------------------------
# Split backward


def split_order(problem: Problem, split: Problem, order: list[list[int]]) -> list[list[int]]:
    """An order of the F/B ``problem`` as an order of the split-backward problem ``split``: each B becomes its I
    directly followed by its W. The work and memory per rank are the same, and it is never slower (the next stage's
    I waits for this I only, not for the W)."""
    out = []
    for lst in order:
        acts = [problem.actions[a] for a in lst]
        out.append(
            [split.index[x] for a in acts for x in ((replace(a, kind="I"), replace(a, kind="W")) if a.kind == "B" else (a,))]
        )
    return out


def _split_search(
    problem: Problem,
    split: Problem,
    fb_order: list[list[int]],
    fb_method: str,
    memory_limit: float,
    target: float,
    evaluator: _Evaluator,
    rng: random.Random,
) -> tuple[list[list[int]], str]:
    """The split-backward phase of ``fused_schedule``: the best F/B order with each B split into I then W, then greedy
    schedules of the split problem (a W's remaining path is short, so W's run where nothing on a critical path can:
    in the bubbles), each compacted by justification, then annealing. Returns the best order within
    ``memory_limit`` (the split F/B order whatever its peak) and the name of its phase. With no budget only the
    leading greedy settings run, unjustified."""
    start = split_order(problem, split, fb_order)
    start_ms = evaluator.makespan(start)
    assert start_ms is not None, "a valid F/B order split into I then W cannot deadlock"
    best = _Best(evaluator, memory_limit, start, start_ms, fb_method + "+split")
    weight = balanced_critic_weight(split)

    def greedy(setting: tuple[tuple[int, float, bool, float], bool]) -> list[list[int]]:
        (extra, bias, active, pressure), balanced = setting
        evaluator.charge_greedy()
        return greedy_order(
            split,
            memory_limit,
            extra_in_flight=extra,
            backward_bias=bias,
            active=active,
            memory_pressure=pressure,
            critic_weight=weight if balanced else 1.0,
        )

    if evaluator.work_limit == 0:
        for setting in SPLIT_LEADING_SETTINGS:
            best.consider(greedy(setting), "split_greedy")
        return best.order, best.method
    justifier = _Justifier(split, memory_limit, evaluator)
    best.consider(justifier.improve(best.order), best.method + "+justify")
    for setting in SPLIT_GREEDY_SETTINGS:
        if evaluator.exhausted(1.0 - RESTART_SHARE) or best.makespan <= target:
            break
        order = greedy(setting)
        best.consider(order, "split_greedy")
        if best.makespan > target and not evaluator.exhausted() and max(split.peak_memory(order)) <= memory_limit + 1e-9:
            best.consider(justifier.improve(order), "split_greedy+justify")
    if not evaluator.exhausted(MEMORY_PASS_SHARE) and best.makespan > target:
        remaining = max(0.0, (1.0 - MEMORY_PASS_SHARE) * evaluator.work_limit - evaluator.work)
        iterations = max(1, int(remaining / max(1, evaluator.n)))
        order, ms = anneal(
            split, best.order, best.makespan, memory_limit, evaluator, rng, target, iterations, justify=justifier.improve
        )
        best.keep(order, ms, "split_anneal")
    return memory_pass(split, best.order, best.makespan, evaluator), best.method


# ---------------------------------------------------------------------------------------------------------
# Local search


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
    evaluator: _Evaluator,
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


# ---------------------------------------------------------------------------------------------------------
# Memory pass

REPLAN_RESOLUTION = 0.02  # x the single-model 1F1B peak: the memory pass stops bisecting a narrower bracket
REPLAN_ANNEAL_SHARE = 0.25  # of the remaining budget, for annealing towards the makespan at a limit that failed
LIST_SCHEDULE_COST = 30  # one capped list schedule, in simulations
REPLAN_MIN_BUDGET = 200  # simulations: with less budget left, the memory pass only shaves single ranks
SHAVE_REACH = 4  # in-flight forwards and later frees a shaving step combines
SHAVE_FULL_CHECKS = 4  # candidates a shaving step checks by full simulation when no timing frame admits one


def _successors(problem: Problem) -> list[list[tuple[int, float]]]:
    succs: list[list[tuple[int, float]]] = [[] for _ in problem.actions]
    for b, deps in enumerate(problem.deps):
        for a, lag in deps:
            succs[a].append((b, lag))
    return succs


def _latest_starts(
    problem: Problem, order: list[list[int]], makespan: float, succs: list[list[tuple[int, float]]]
) -> list[float] | None:
    """The latest start of every action such that each rank keeps ``order`` and everything ends by ``makespan``
    (None on deadlock): the simulation run backwards from the end."""
    latest: list[float | None] = [None] * len(problem.actions)
    pos = [len(lst) for lst in order]
    end = [makespan] * problem.pp
    remaining = len(problem.actions)
    while remaining:
        progressed = False
        for r, lst in enumerate(order):
            while pos[r]:
                a = lst[pos[r] - 1]
                t = end[r]
                for x, lag in succs[a]:
                    lx = latest[x]
                    if lx is None:
                        break
                    t = min(t, lx - lag)
                else:
                    latest[a] = end[r] = t - problem.dur[a]
                    pos[r] -= 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            return None
    return latest  # type: ignore[return-value]


def _capped_list_schedule(problem: Problem, priority: list[float], limit: float, active: bool) -> list[list[int]] | None:
    """List scheduling under a per-rank activation memory cap: repeatedly take the rank whose next action could finish
    earliest and run there, among the actions that could start before that finish (``active``) or at the earliest
    start (non-delay), the one with the lowest ``priority``. An action that allocates runs only within ``limit``;
    actions of one kind on one stage keep their micro-batch order. None if the cap blocks every rank."""
    n, pp = len(problem.actions), problem.pp
    dur, deps, delta = problem.dur, problem.deps, problem.mem_delta
    queues: list[dict[tuple[str, int, int, str], list[int]]] = [{} for _ in range(pp)]
    for a in sorted(range(n), key=lambda a: problem.actions[a].microbatch):
        act = problem.actions[a]
        queues[problem.rank[a]].setdefault((act.model, act.replica, act.stage, act.kind), []).append(a)
    lanes = [list(q.values()) for q in queues]
    head = [[0] * len(q) for q in lanes]
    succ_ranks: list[set[int]] = [set() for _ in range(n)]
    for b in range(n):
        for a, _ in deps[b]:
            succ_ranks[a].add(problem.rank[b])
    finish: list[float | None] = [None] * n
    free = [0.0] * pp
    mem = [0.0] * pp
    order: list[list[int]] = [[] for _ in range(pp)]
    cache: list[list[tuple[float, int, int]] | None] = [None] * pp

    def candidates(r: int) -> list[tuple[float, int, int]]:
        out = []
        for k, lane in enumerate(lanes[r]):
            if head[r][k] == len(lane):
                continue
            a = lane[head[r][k]]
            if delta[a] > 0 and mem[r] + delta[a] > limit + 1e-9:
                continue
            t = free[r]
            for d, lag in deps[a]:
                fd = finish[d]
                if fd is None:
                    break
                t = max(t, fd + lag)
            else:
                out.append((t, a, k))
        return out

    for _ in range(n):
        best_r, best_ect = -1, math.inf
        for r in range(pp):
            if cache[r] is None:
                cache[r] = candidates(r)
            for est, a, _ in cache[r]:  # type: ignore[union-attr]
                if est + dur[a] < best_ect:
                    best_r, best_ect = r, est + dur[a]
        if best_r < 0:
            return None
        ready: list[tuple[float, int, int]] = cache[best_r]  # type: ignore[assignment]
        horizon = best_ect - 1e-12 if active else min(est for est, _, _ in ready) + 1e-9
        est, a, k = min((c for c in ready if c[0] < horizon), key=lambda c: (priority[c[1]], c[1]))
        finish[a] = free[best_r] = est + dur[a]
        head[best_r][k] += 1
        mem[best_r] += delta[a]
        order[best_r].append(a)
        cache[best_r] = None
        for q in succ_ranks[a]:
            cache[q] = None
    return order


def _lower_limit(problem: Problem, order: list[list[int]], makespan: float, evaluator: _Evaluator) -> list[list[int]]:
    """Rebuild the schedule under lower memory limits, bisecting between the single-model 1F1B peak and the order's
    peak. At each limit: memory-capped list schedules whose priorities are the current order's latest starts (so
    they follow its timing wherever the cap allows), non-delay and active, also on the time-reversed problem, and
    one by release time; each compacted by justification within the limit. The first that ends by ``makespan`` is
    kept and the bisection goes lower; if none does, annealing from the closest tries to close the gap."""
    floor = single_model_1f1b_peak(problem)
    low, high = floor, max(problem.peak_memory(order))
    succs = _successors(problem)
    n = len(problem.actions)
    reversal = None if problem.split_backward else _TimeReversal(problem)  # a split problem does not reverse
    rng = random.Random(0)
    while high - low > REPLAN_RESOLUTION * floor and not evaluator.exhausted():
        limit = (low + high) / 2
        evaluator.work += 2 * n
        latest = _latest_starts(problem, order, makespan, succs)
        assert latest is not None, "the order is valid"
        # (problem to schedule, priorities, active, back to this problem's order)
        attempts: list[tuple[Problem, list[float], bool, Callable[[list[list[int]]], list[list[int]]] | None]] = [
            (problem, latest, False, None),
            (problem, latest, True, None),
        ]
        if reversal is not None:
            # Mirrored in time, an action's latest finish is its earliest start in the reversed problem.
            mirrored = [makespan - latest[i] - problem.dur[i] for i in reversal.original_index]
            attempts += [(reversal.reversed, mirrored, active, reversal.to_original) for active in (False, True)]
        attempts.append((problem, problem.release_and_tail[0], False, None))
        justifier = _Justifier(problem, limit, evaluator)
        found, closest, closest_ms = None, None, math.inf
        for prob, priority, active, back in attempts:
            if evaluator.exhausted():
                break
            evaluator.work += LIST_SCHEDULE_COST * n
            candidate = _capped_list_schedule(prob, priority, limit, active)
            if candidate is None:
                continue
            if back is not None:
                candidate = back(candidate)
            ms = evaluator.makespan(candidate)
            if ms is not None and ms > makespan + 1e-9:
                candidate = justifier.improve(candidate)
                ms = evaluator.makespan(candidate)
            if ms is None:
                continue
            if ms <= makespan + 1e-9:
                found = candidate
                break
            if ms < closest_ms:
                closest, closest_ms = candidate, ms
        if found is None and closest is not None and not evaluator.exhausted():
            iterations = max(1, int(REPLAN_ANNEAL_SHARE * (evaluator.work_limit - evaluator.work) / n))
            annealed, ms = anneal(
                problem, closest, closest_ms, limit, evaluator, rng, makespan * (1 + 1e-9), iterations, justifier.improve
            )
            if ms <= makespan + 1e-9:
                found = annealed
        if found is None:
            low = limit
        else:
            order, high = found, max(problem.peak_memory(found))
    return order


class _PeakShaver:
    """Lowers single ranks' peak activation memory without lengthening the makespan.

    A move reorders one rank: a forward in flight at the rank's peak goes after a later freeing action (B, or W when
    split), or a freeing action goes before the peak. Either lowers the rank's running memory over the span it
    crosses and raises it nowhere. The makespan check is cheap first: in a timing frame (the current order timed as
    early as possible, or as late as possible within the makespan) the other ranks keep their times and the moved
    rank, timed as early as its inputs allow, must finish each action before its successors elsewhere start; the
    simulator, which starts everything as early as possible, then finds a makespan no longer. Only when no
    candidate fits a frame do a few full simulations decide."""

    def __init__(self, problem: Problem, order: list[list[int]], makespan: float, evaluator: _Evaluator) -> None:
        self.problem, self.evaluator, self.makespan = problem, evaluator, makespan
        self.order = [list(lst) for lst in order]
        delta, rank = problem.mem_delta, problem.rank
        self.stream = [(a.model, a.replica, a.stage, a.kind) for a in problem.actions]  # keeps its micro-batch order
        frees = {(a.model, a.replica, a.stage, a.microbatch): i for i, a in enumerate(problem.actions) if delta[i] < 0}
        self.freer = [frees.get((a.model, a.replica, a.stage, a.microbatch), -1) for a in problem.actions]
        self.succs = _successors(problem)
        self.neighbours: list[set[int]] = [set() for _ in range(problem.pp)]
        for a, succ in enumerate(self.succs):
            for b, _ in succ:
                if rank[a] != rank[b]:
                    self.neighbours[rank[a]].add(rank[b])
                    self.neighbours[rank[b]].add(rank[a])
        self.frames: list[list[float]] | None = None  # start times: as early as possible, as late as possible

    def peak(self, r: int) -> tuple[float, int]:
        """The rank's running-memory peak and how many positions of its order reach it."""
        cur, peak, count = 0.0, 0.0, 0
        for a in self.order[r]:
            cur += self.problem.mem_delta[a]
            if cur > peak + 1e-9:
                peak, count = cur, 1
            elif cur >= peak - 1e-9:
                count += 1
        return peak, count

    def _timing_frames(self) -> list[list[float]]:
        if self.frames is None:
            p = self.problem
            self.evaluator.work += 2 * len(p.actions)
            finish = p.finish_times(self.order)
            latest = _latest_starts(p, self.order, self.makespan, self.succs)
            assert finish is not None and latest is not None, "every kept order is valid"
            self.frames = [[f - d for f, d in zip(finish, p.dur)], latest]
        return self.frames

    def _fits(self, lst: list[int], start: list[float]) -> bool:
        """Whether rank order ``lst``, timed as early as its inputs in timing frame ``start`` allow, ends every action
        by the makespan and before its successors on other ranks start, running nothing before a dependency."""
        p = self.problem
        self.evaluator.work += len(lst)
        dur, deps, rank, succs = p.dur, p.deps, p.rank, self.succs
        r = rank[lst[0]]
        done: dict[int, float] = {}
        t = 0.0
        for a in lst:
            s = t
            for d, lag in deps[a]:
                fd = done.get(d) if rank[d] == r else start[d] + dur[d]
                if fd is None:
                    return False
                s = max(s, fd + lag)
            t = s + dur[a]
            if t > self.makespan + 1e-9 or any(rank[x] != r and t + lag > start[x] + 1e-9 for x, lag in succs[a]):
                return False
            done[a] = t
        return True

    def _moves(self, lst: list[int]) -> list[list[int]]:
        """Reorders of one rank that lower its running memory at the first position reaching its peak, the shortest
        moves first."""
        delta, stream = self.problem.mem_delta, self.stream
        run, cur = [], 0.0
        for a in lst:
            cur += delta[a]
            run.append(cur)
        peak = max(run, default=0.0)
        if peak <= 1e-9:
            return []
        p = next(i for i, v in enumerate(run) if v >= peak - 1e-9)
        pos = {a: i for i, a in enumerate(lst)}
        frees = [q for q in range(p + 1, len(lst)) if delta[lst[q]] < 0][:SHAVE_REACH]
        held = [i for i in range(p, -1, -1) if delta[lst[i]] > 0 and pos.get(self.freer[lst[i]], len(lst)) > p]
        moves: list[tuple[int, list[int]]] = []
        for i in held[:SHAVE_REACH]:
            a = lst[i]
            for q in frees:  # the allocation after a later free
                if any(stream[x] == stream[a] for x in lst[i + 1 : q + 1]):
                    break
                moves.append((q - i, lst[:i] + lst[i + 1 : q + 1] + [a] + lst[q + 1 :]))
        for q in frees:
            b = lst[q]
            for i in held[:SHAVE_REACH]:  # the free before an allocation in flight at the peak
                if any(stream[x] == stream[b] for x in lst[i:q]):
                    break
                moves.append((q - i, lst[:i] + [b] + lst[i:q] + lst[q + 1 :]))
        moves.sort(key=lambda m: m[0])
        return [m for _, m in moves]

    def lower(self, r: int) -> bool:
        """Apply one move that lowers rank ``r``'s peak, or the number of positions at it; False if none fits."""
        frames = self._timing_frames()
        moves = self._moves(self.order[r])
        for trial in moves:
            if self.evaluator.exhausted():
                return False
            if any(self._fits(trial, start) for start in frames):
                self.order[r], self.frames = trial, None
                return True
        for trial in moves[:SHAVE_FULL_CHECKS]:
            if self.evaluator.exhausted():
                return False
            old, self.order[r] = self.order[r], trial
            ms = self.evaluator.makespan(self.order)
            if ms is not None and ms <= self.makespan + 1e-9:
                self.frames = None
                return True
            self.order[r] = old
        return False


def _shave(problem: Problem, order: list[list[int]], makespan: float, evaluator: _Evaluator) -> list[list[int]]:
    """Apply ``_PeakShaver`` moves, always to the rank with the highest peak that can still be lowered, until none
    can or the budget is spent."""
    shaver = _PeakShaver(problem, order, makespan, evaluator)
    peaks = [shaver.peak(r) for r in range(problem.pp)]
    stuck = [False] * problem.pp
    while not all(stuck) and not evaluator.exhausted():
        r = max((q for q in range(problem.pp) if not stuck[q]), key=lambda q: (peaks[q], -q))
        if shaver.lower(r):
            peaks[r] = shaver.peak(r)
            for q in shaver.neighbours[r]:
                stuck[q] = False
        else:
            stuck[r] = True
    return shaver.order


def memory_pass(problem: Problem, order: list[list[int]], makespan: float, evaluator: _Evaluator) -> list[list[int]]:
    """Lower the per-rank peak activation memory of a valid order without lengthening ``makespan``, within the
    evaluator's budget: rebuild the schedule under lower memory limits (``_lower_limit``, when the budget left
    affords a few rebuilds), then shave single ranks (``_shave``). Deterministic."""
    if evaluator.work_limit - evaluator.work >= REPLAN_MIN_BUDGET * len(problem.actions):
        order = _lower_limit(problem, order, makespan, evaluator)
    return _shave(problem, order, makespan, evaluator)


def fused_schedule(
    placement: Placement,
    costs: CostModel,
    mb_actor: int,
    mb_critic: int,
    budget_s: float = 30.0,
    seed: int = 0,
    memory_limit: float | None = None,
    split_backward: bool = False,
) -> PlanResult:
    """Find a fused Actor+Critic schedule: greedy list scheduling with several priority settings (each result
    compacted by forward-backward justification), randomised restarts, simulated annealing and a memory pass.
    Never worse than sequential 1F1B (returned when nothing better is found).

    ``split_backward``: the F/B search gets ``SPLIT_FB_SHARE`` of the budget, then every backward is split into an
    input backward I and a weight backward W and the search continues on that problem (``_split_search``); the
    schedule holds F, I and W actions, and activations stay until W. Never slower than the F/B schedule it
    starts from.

    ``budget_s = 0`` runs the greedy fused scheduler alone (its leading priority settings, no justification,
    restarts, annealing or memory pass: milliseconds).

    ``memory_limit`` caps each rank's peak activation memory (cost-model units); it defaults to 1.5 x the
    single-model 1F1B peak (or the sequential schedule's peak, if that is larger). If no fused schedule fits a
    tighter limit, sequential 1F1B is returned whatever its peak (see ``result.max_peak_memory``).
    """
    if budget_s < 0:
        raise ValueError(f"budget_s must be >= 0 (0: greedy schedule only), got {budget_s}")
    start = time.perf_counter()
    problem = Problem(placement, costs, mb_actor, mb_critic)
    rng = random.Random(seed)
    evaluator = _Evaluator(problem, budget_s * (SPLIT_FB_SHARE if split_backward else 1.0))
    split_problem = Problem(placement, costs, mb_actor, mb_critic, split_backward=True)
    split_bound = problem_lower_bound(split_problem)
    seq_order = problem.to_order(sequential_1f1b(placement, mb_actor, mb_critic))
    seq_ms = evaluator.makespan(seq_order)
    assert seq_ms is not None, "sequential 1F1B cannot deadlock"
    seq_peak = max(problem.peak_memory(seq_order))
    if memory_limit is None:
        memory_limit = max(1.5 * single_model_1f1b_peak(problem), seq_peak)
    bound = problem_lower_bound(problem)
    target = bound * (1 + 1e-9)

    best = _Best(evaluator, memory_limit, seq_order, seq_ms, "sequential_1f1b")

    # Greedy settings (in-flight cap above 1F1B's, backward bias, active vs non-delay; raw or balanced Critic
    # priorities; forwards in time or on the time-reversed problem) in GREEDY_SETTINGS order, each justified.
    reversal = _TimeReversal(problem)
    directions = (
        (problem, (1.0, balanced_critic_weight(problem)), lambda order: order, "greedy"),
        (reversal.reversed, (1.0, balanced_critic_weight(reversal.reversed)), reversal.to_original, "reverse_greedy"),
    )

    def greedy(setting: tuple[tuple[int, float, bool, float], bool, bool]) -> tuple[list[list[int]], str]:
        (extra, bias, active, pressure), balanced, reverse = setting
        prob, weights, to_original, name = directions[reverse]
        evaluator.charge_greedy()
        order = greedy_order(
            prob,
            memory_limit,
            extra_in_flight=extra,
            backward_bias=bias,
            active=active,
            memory_pressure=pressure,
            critic_weight=weights[balanced],
        )
        return to_original(order), name

    def plan_result(prob: Problem, order: list[list[int]], name: str, evaluations: int) -> PlanResult:
        return PlanResult(
            prob.to_schedule(order),
            simulate_order(prob, order),
            bound,
            seq_ms,
            memory_limit,
            time.perf_counter() - start,
            evaluations,
            name,
            split_backward,
            split_bound,
        )

    def split_phase() -> PlanResult:
        split_evaluator = evaluator.continue_on(split_problem, budget_s)
        order, name = _split_search(
            problem, split_problem, best.order, best.method, memory_limit, split_bound * (1 + 1e-9), split_evaluator, rng
        )
        return plan_result(split_problem, order, name, split_evaluator.evaluations)

    if budget_s == 0:
        for setting in LEADING_SETTINGS:
            best.consider(*greedy(setting))
        return split_phase() if split_backward else plan_result(problem, best.order, best.method, evaluator.evaluations)

    justifier = _Justifier(problem, memory_limit, evaluator)

    def consider_justified(order: list[list[int]], name: str) -> None:
        if max(problem.peak_memory(order)) > memory_limit + 1e-9:
            return  # a greedy that had to relax the memory cap: justification cannot repair that
        best.consider(order, name)
        if best.makespan > target and not evaluator.exhausted():
            best.consider(justifier.improve(order), name + "+justify")

    best.consider(justifier.improve(seq_order), "sequential_1f1b+justify")
    for setting in GREEDY_SETTINGS:
        if evaluator.exhausted(MEMORY_PASS_SHARE) or best.makespan <= target:
            break
        consider_justified(*greedy(setting))
    # Randomised restarts: perturbed priorities and a log-uniform Critic weight spanning both deterministic ones,
    # until RESTART_SHARE of the budget is spent.
    while not evaluator.exhausted(1.0 - RESTART_SHARE) and best.makespan > target:
        extra, bias, active, pressure = RESTART_VARIANTS[rng.randrange(len(RESTART_VARIANTS))]
        prob, weights, to_original, name = directions[rng.randrange(2)]
        weight = math.exp(rng.uniform(math.log(0.6), math.log(1.25 * max(weights))))
        evaluator.charge_greedy()
        consider_justified(
            to_original(
                greedy_order(
                    prob,
                    memory_limit,
                    extra_in_flight=extra,
                    backward_bias=bias,
                    active=active,
                    memory_pressure=pressure,
                    critic_weight=weight,
                    noise=rng.choice(NOISES),
                    rng=rng,
                )
            ),
            name + "_restart",
        )
    if not evaluator.exhausted(MEMORY_PASS_SHARE) and best.makespan > target:
        remaining = max(0.0, (1.0 - MEMORY_PASS_SHARE) * evaluator.work_limit - evaluator.work)
        iterations = max(1, int(remaining / max(1, evaluator.n)))
        order, ms = anneal(
            problem, best.order, best.makespan, memory_limit, evaluator, rng, target, iterations, justify=justifier.improve
        )
        best.keep(order, ms, "anneal")
    best.order = memory_pass(problem, best.order, best.makespan, evaluator)
    return split_phase() if split_backward else plan_result(problem, best.order, best.method, evaluator.evaluations)
