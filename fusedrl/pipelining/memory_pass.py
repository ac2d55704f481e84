"""The search's memory pass: lowers each rank's peak activation memory of a valid order without lengthening its
makespan, by rebuilding the schedule under lower memory limits and then shaving single ranks' peaks."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from fusedrl.pipelining.local_search import Evaluator, Justifier, TimeReversal, anneal, single_model_1f1b_peak
from fusedrl.pipelining.simulator import Problem

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


def _lower_limit(problem: Problem, order: list[list[int]], makespan: float, evaluator: Evaluator) -> list[list[int]]:
    """Rebuild the schedule under lower memory limits, bisecting between the single-model 1F1B peak and the order's
    peak. At each limit: memory-capped list schedules whose priorities are the current order's latest starts (so
    they follow its timing wherever the cap allows), non-delay and active, also on the time-reversed problem, and
    one by release time; each compacted by justification within the limit. The first that ends by ``makespan`` is
    kept and the bisection goes lower; if none does, annealing from the closest tries to close the gap."""
    floor = single_model_1f1b_peak(problem)
    low, high = floor, max(problem.peak_memory(order))
    succs = _successors(problem)
    n = len(problem.actions)
    reversal = None if problem.split_backward else TimeReversal(problem)  # a split problem does not reverse
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
        justifier = Justifier(problem, limit, evaluator)
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

    def __init__(self, problem: Problem, order: list[list[int]], makespan: float, evaluator: Evaluator) -> None:
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


def _shave(problem: Problem, order: list[list[int]], makespan: float, evaluator: Evaluator) -> list[list[int]]:
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


def memory_pass(problem: Problem, order: list[list[int]], makespan: float, evaluator: Evaluator) -> list[list[int]]:
    """Lower the per-rank peak activation memory of a valid order without lengthening ``makespan``, within the
    evaluator's budget: rebuild the schedule under lower memory limits (``_lower_limit``, when the budget left
    affords a few rebuilds), then shave single ranks (``_shave``). Deterministic."""
    if evaluator.work_limit - evaluator.work >= REPLAN_MIN_BUDGET * len(problem.actions):
        order = _lower_limit(problem, order, makespan, evaluator)
    return _shave(problem, order, makespan, evaluator)
