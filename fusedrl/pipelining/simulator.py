"""Discrete-event simulation of a dual-model pipeline schedule under a cost model.

Semantics: each rank runs its action list in order, one action at a time. F of stage s needs F of stage
s-1 of the same (model, replica, micro-batch); B of stage s needs B of stage s+1 (the last stage needs its
own F instead) and its own F. A dependency on another rank adds the cost model's P2P latency. Activation
memory of a micro-batch is held on its stage from the start of its F to the end of its B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.ir import ACTOR, CRITIC, MODELS, Action, Placement, Schedule


class ScheduleError(ValueError):
    """An invalid schedule: wrong or missing actions, backward before forward, or deadlock."""


class Problem:
    """A planning problem compiled to integer-indexed actions, shared by the simulator and the search.

    ``mb_critic`` is the number of micro-batches of each Critic replica.
    """

    def __init__(self, placement: Placement, costs: CostModel, mb_actor: int, mb_critic: int) -> None:
        if mb_actor < 1 or mb_critic < 1:
            raise ValueError(f"micro-batch counts must be >= 1, got mb_actor={mb_actor}, mb_critic={mb_critic}")
        costs.check(placement)
        self.placement, self.costs = placement, costs
        self.mb_actor, self.mb_critic = mb_actor, mb_critic
        self.pp = placement.pp
        self.actions: list[Action] = []
        self.rank: list[int] = []
        self.dur: list[float] = []
        self.mem: list[float] = []  # activation memory of the action's micro-batch on its stage
        self.deps: list[tuple[tuple[int, float], ...]] = []  # (action index, latency)
        self.tail: list[float] = []  # shortest time from this action's start to the end of its micro-batch
        # Per rank: the stages it hosts, each as (F indices by micro-batch, B indices by micro-batch).
        self.streams: list[list[tuple[list[int], list[int]]]] = [[] for _ in range(self.pp)]
        self.index: dict[Action, int] = {}
        lat = costs.p2p_latency
        for model, replica in self.pipelines():
            n, c, m_count = placement.num_stages(model), costs.of(model), self.microbatches(model)
            ranks = [placement.rank_of(model, s, replica) for s in range(n)]
            b_after = [sum(c.b[:s]) + s * lat for s in range(n)]  # backward tail below stage s
            f_after = [sum(c.f[s:]) + (n - 1 - s) * lat for s in range(n)]
            fwd = [
                [
                    self._add(
                        Action(model, s, m, "F", replica), ranks[s], c.f[s], c.mem[s], f_after[s] + c.b[n - 1] + b_after[n - 1]
                    )
                    for m in range(m_count)
                ]
                for s in range(n)
            ]
            bwd = [
                [
                    self._add(Action(model, s, m, "B", replica), ranks[s], c.b[s], c.mem[s], c.b[s] + b_after[s])
                    for m in range(m_count)
                ]
                for s in range(n)
            ]
            for s in range(n):
                for m in range(m_count):
                    if s > 0:
                        self.deps[fwd[s][m]] = ((fwd[s - 1][m], lat if ranks[s - 1] != ranks[s] else 0.0),)
                    down = ((bwd[s + 1][m], lat if ranks[s + 1] != ranks[s] else 0.0),) if s < n - 1 else ()
                    self.deps[bwd[s][m]] = ((fwd[s][m], 0.0),) + down
                self.streams[ranks[s]].append((fwd[s], bwd[s]))
        self.forward_of = {b: f for st in self.streams for fw, bw in st for f, b in zip(fw, bw)}

    def pipelines(self) -> list[tuple[str, int]]:
        return [(ACTOR, 0)] + [(CRITIC, r) for r in range(self.placement.critic_replicas)]

    def microbatches(self, model: str) -> int:
        return self.mb_actor if model == ACTOR else self.mb_critic

    def _add(self, action: Action, rank: int, dur: float, mem: float, tail: float) -> int:
        i = len(self.actions)
        self.actions.append(action)
        self.index[action] = i
        self.rank.append(rank)
        self.dur.append(dur)
        self.mem.append(mem)
        self.deps.append(())
        self.tail.append(tail)
        return i

    @cached_property
    def release_and_tail(self) -> tuple[list[float], list[float]]:
        """Per action: earliest start if it is its stage's k-th F (or B) to run, where k is its micro-batch index,
        and the shortest time from its end to the end of the schedule if it runs (M-1-k)-th from last.
        Computed once per problem (the search asks for it once per greedy run)."""
        release = [0.0] * len(self.actions)
        tail = [0.0] * len(self.actions)
        lat = self.costs.p2p_latency
        for model, replica in self.pipelines():
            c = self.costs.of(model)
            n, m_count = len(c.f), self.microbatches(model)
            idx = self.index
            act = lambda s, m, kind: idx[Action(model, s, m, kind, replica)]  # noqa: E731, B023 (used in this iteration only)
            ef = [[0.0] * m_count for _ in range(n)]  # completion of the k-th F on stage s
            eb = [[0.0] * m_count for _ in range(n)]
            for s in range(n):
                for k in range(m_count):
                    t = max(ef[s - 1][k] + lat if s else 0.0, ef[s][k - 1] if k else 0.0)
                    ef[s][k] = t + c.f[s]
                    release[act(s, k, "F")] = t
            for s in reversed(range(n)):
                for k in range(m_count):
                    t = max(eb[s + 1][k] + lat if s < n - 1 else 0.0, ef[s][k], eb[s][k - 1] if k else 0.0)
                    eb[s][k] = t + c.b[s]
                    release[act(s, k, "B")] = t
            tb = [[0.0] * m_count for _ in range(n)]  # tail after the k-th-from-last B on stage s
            tf = [[0.0] * m_count for _ in range(n)]
            for s in range(n):
                for k in range(m_count):
                    tb[s][k] = max(lat + c.b[s - 1] + tb[s - 1][k] if s else 0.0, c.b[s] + tb[s][k - 1] if k else 0.0)
                    tail[act(s, m_count - 1 - k, "B")] = tb[s][k]
            for s in reversed(range(n)):
                for k in range(m_count):
                    down = lat + c.f[s + 1] + tf[s + 1][k] if s < n - 1 else c.b[s] + tb[s][k]
                    tf[s][k] = max(down, c.f[s] + tf[s][k - 1] if k else 0.0)
                    tail[act(s, m_count - 1 - k, "F")] = tf[s][k]
        return release, tail

    def rank_work(self, rank: int) -> float:
        return sum(self.dur[i] for fw, bw in self.streams[rank] for i in fw + bw)

    # -- fast evaluation used by the search ------------------------------------------------------------
    def finish_times(self, order: list[list[int]]) -> list[float] | None:
        """Finish time of every action for per-rank index lists, or None on deadlock."""
        finish: list[float | None] = [None] * len(self.actions)
        pos = [0] * self.pp
        free = [0.0] * self.pp
        dur, deps = self.dur, self.deps
        remaining = sum(len(o) for o in order)
        while remaining:
            progressed = False
            for r in range(self.pp):
                lst, p, t = order[r], pos[r], free[r]
                while p < len(lst):
                    a = lst[p]
                    start = t
                    for d, lag in deps[a]:
                        fd = finish[d]
                        if fd is None:
                            break
                        if fd + lag > start:
                            start = fd + lag
                    else:
                        t = start + dur[a]
                        finish[a] = t
                        p += 1
                        continue
                    break
                if p != pos[r]:
                    remaining -= p - pos[r]
                    pos[r], free[r] = p, t
                    progressed = True
            if not progressed:
                return None
        return finish  # type: ignore[return-value]

    def makespan(self, order: list[list[int]]) -> float | None:
        finish = self.finish_times(order)
        return None if finish is None else max(finish)

    def peak_memory(self, order: list[list[int]]) -> list[float]:
        peaks = []
        for lst in order:
            cur = peak = 0.0
            for a in lst:
                if self.actions[a].kind == "F":
                    cur += self.mem[a]
                    peak = max(peak, cur)
                else:
                    cur -= self.mem[a]
            peaks.append(peak)
        return peaks

    def to_schedule(self, order: list[list[int]]) -> Schedule:
        return {r: [self.actions[a] for a in lst] for r, lst in enumerate(order)}

    def to_order(self, schedule: Schedule) -> list[list[int]]:
        """Validate ``schedule`` and convert it to index lists; raise ScheduleError naming the first problem."""
        bad_ranks = sorted(set(schedule) - set(range(self.pp)), key=str)
        if bad_ranks:
            raise ScheduleError(f"schedule has rank {bad_ranks[0]!r} outside [0, {self.pp}); use one list per pipeline rank")
        order: list[list[int]] = []
        seen: dict[int, int] = {}
        for r in range(self.pp):
            lst: list[int] = []
            for action in schedule.get(r, []):
                if action.kind not in ("F", "B"):
                    raise ScheduleError(f"{action}: kind {action.kind!r} is not supported by the planner; use F and B")
                i = self.index.get(action)
                if i is None:
                    raise ScheduleError(
                        f"{action}: no such action (model must be one of {', '.join(MODELS)}, stage/replica within the "
                        f"placement, micro-batch below {self.mb_actor} for the actor and {self.mb_critic} per critic replica)"
                    )
                if self.rank[i] != r:
                    raise ScheduleError(f"{action} is on rank {r} but the placement puts it on rank {self.rank[i]}")
                if i in seen:
                    raise ScheduleError(f"duplicate action {action} on rank {r}")
                seen[i] = len(lst)
                lst.append(i)
            order.append(lst)
        if len(seen) != len(self.actions):
            missing = next(a for i, a in enumerate(self.actions) if i not in seen)
            raise ScheduleError(
                f"missing action {missing} (rank {self.rank[self.index[missing]]}); every F and B must be scheduled once"
            )
        for b, f in self.forward_of.items():
            if seen[b] < seen[f]:
                raise ScheduleError(
                    f"backward {self.actions[b]} runs before its forward {self.actions[f]} on rank {self.rank[b]}"
                )
        return order

    def deadlock_message(self, order: list[list[int]]) -> str:
        finish = [False] * len(self.actions)
        pos = [0] * self.pp
        progressed = True
        while progressed:
            progressed = False
            for r in range(self.pp):
                while pos[r] < len(order[r]) and all(finish[d] for d, _ in self.deps[order[r][pos[r]]]):
                    finish[order[r][pos[r]]] = True
                    pos[r] += 1
                    progressed = True
        stuck = []
        for r in range(self.pp):
            if pos[r] < len(order[r]):
                a = order[r][pos[r]]
                waits = [self.actions[d] for d, _ in self.deps[a] if not finish[d]]
                stuck.append(f"rank {r} at {self.actions[a]} waits for {', '.join(map(str, waits))}")
        return "deadlock: " + "; ".join(stuck)


@dataclass(frozen=True)
class TimelineEntry:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # per rank
    bubble_ratio: float  # idle fraction of all ranks over the makespan
    peak_memory: list[float]  # per rank, in the cost model's memory units
    timeline: list[TimelineEntry] = field(repr=False)

    @property
    def max_peak_memory(self) -> float:
        return max(self.peak_memory)


def simulate(schedule: Schedule, placement: Placement, costs: CostModel, mb_actor: int, mb_critic: int) -> SimResult:
    """Simulate ``schedule``; raise ScheduleError for an invalid one (the message names the offending action)."""
    problem = Problem(placement, costs, mb_actor, mb_critic)
    return simulate_order(problem, problem.to_order(schedule))


def simulate_order(problem: Problem, order: list[list[int]]) -> SimResult:
    finish = problem.finish_times(order)
    if finish is None:
        raise ScheduleError(problem.deadlock_message(order))
    makespan = max(finish)
    busy = [sum(problem.dur[a] for a in lst) for lst in order]
    timeline = [
        TimelineEntry(r, problem.actions[a], finish[a] - problem.dur[a], finish[a]) for r, lst in enumerate(order) for a in lst
    ]
    bubble = 1.0 - sum(busy) / (problem.pp * makespan)
    return SimResult(makespan, busy, bubble, problem.peak_memory(order), timeline)
