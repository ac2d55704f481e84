"""Discrete-event simulation of a dual-model pipeline schedule under a cost model.

Semantics: each rank runs its action list in order, one action at a time. F of stage s needs F of stage
s-1 of the same (model, replica, micro-batch); B of stage s needs B of stage s+1 (the last stage needs its
own F instead) and its own F. A dependency on another rank adds the cost model's P2P latency. Activation
memory of a micro-batch is held on its stage from the start of its F to the end of its B.

Split backward (``Problem(..., split_backward=True)``, chosen by :func:`simulate` when a schedule holds I/W
actions): every B is replaced by an input backward I (which takes B's place in the chain: I of stage s needs
I of stage s+1, or the last stage's own F, and its own F) and a weight backward W that needs only its own I.
The activation memory is then held until the end of W, which still reads the stored inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.ir import ACTOR, CRITIC, MODELS, Action, Placement, Schedule


class ScheduleError(ValueError):
    """An invalid schedule: wrong or missing actions, backward before forward, or deadlock."""


class StageActions(NamedTuple):
    """Action indices of one stage (of one model replica) by micro-batch: its forwards, its backwards (B, or I when
    split) and its weight backwards (W; empty unless split)."""

    forward: list[int]
    backward: list[int]
    weight: list[int]


class Problem:
    """A planning problem compiled to integer-indexed actions, shared by the simulator and the search.

    ``mb_critic`` is the number of micro-batches of each Critic replica; 0: no Critic (critic-free training, the
    Actor alone; the placement's Critic stages stay unused). ``split_backward``: every backward is an input backward
    I followed (not necessarily at once) by a weight backward W instead of one B.
    """

    def __init__(
        self, placement: Placement, costs: CostModel, mb_actor: int, mb_critic: int, split_backward: bool = False
    ) -> None:
        if mb_actor < 1 or mb_critic < 0:
            raise ValueError(
                f"micro-batch counts must be >= 1 for the Actor and >= 0 for the Critic (0: no Critic, the Actor trains "
                f"alone), got mb_actor={mb_actor}, mb_critic={mb_critic}"
            )
        costs.check(placement)
        self.placement, self.costs = placement, costs
        self.mb_actor, self.mb_critic = mb_actor, mb_critic
        self.pp = placement.pp
        self.split_backward = split_backward
        self.kinds: tuple[str, ...] = ("F", "I", "W") if split_backward else ("F", "B")
        self.actions: list[Action] = []
        self.rank: list[int] = []
        self.dur: list[float] = []
        self.mem: list[float] = []  # activation memory of the action's micro-batch on its stage
        self.mem_delta: list[float] = []  # change of its rank's activation memory: +mem at F, -mem at B (or W), else 0
        self.deps: list[tuple[tuple[int, float], ...]] = []  # (action index, latency)
        self.streams: list[list[StageActions]] = [[] for _ in range(self.pp)]  # per rank: the stages it hosts
        self.index: dict[Action, int] = {}
        self.local_pred: dict[int, int] = {}  # B or I -> its F; W -> its I (same stage and micro-batch)
        lat = costs.p2p_latency
        for model, replica in self.pipelines():
            n, c, m_count = placement.num_stages(model), costs.of(model), self.microbatches(model)
            ranks = [placement.rank_of(model, s, replica) for s in range(n)]
            fwd = self._add_stages(model, replica, ranks, "F", c.f, 1.0)
            if split_backward:
                bwd = self._add_stages(model, replica, ranks, "I", c.i, 0.0)
                wgt = self._add_stages(model, replica, ranks, "W", c.w, -1.0)
            else:
                bwd, wgt = self._add_stages(model, replica, ranks, "B", c.b, -1.0), [[] for _ in range(n)]
            for s in range(n):
                for m in range(m_count):
                    if s > 0:
                        self.deps[fwd[s][m]] = ((fwd[s - 1][m], lat if ranks[s - 1] != ranks[s] else 0.0),)
                    down = ((bwd[s + 1][m], lat if ranks[s + 1] != ranks[s] else 0.0),) if s < n - 1 else ()
                    self.deps[bwd[s][m]] = ((fwd[s][m], 0.0),) + down
                    self.local_pred[bwd[s][m]] = fwd[s][m]
                    if split_backward:
                        self.deps[wgt[s][m]] = ((bwd[s][m], 0.0),)
                        self.local_pred[wgt[s][m]] = bwd[s][m]
                self.streams[ranks[s]].append(StageActions(fwd[s], bwd[s], wgt[s]))

    def pipelines(self) -> list[tuple[str, int]]:
        """``(model, replica)`` of every pipeline that has work: the Actor, then each Critic replica (none when
        ``mb_critic`` is 0)."""
        if self.mb_critic == 0:
            return [(ACTOR, 0)]
        return [(ACTOR, 0)] + [(CRITIC, r) for r in range(self.placement.critic_replicas)]

    def microbatches(self, model: str) -> int:
        return self.mb_actor if model == ACTOR else self.mb_critic

    def _add_stages(
        self, model: str, replica: int, ranks: list[int], kind: str, times: tuple[float, ...], sign: float
    ) -> list[list[int]]:
        """Add one action of ``kind`` per stage and micro-batch; ``sign`` x the stage's memory is its memory change."""
        mem = self.costs.of(model).mem
        out = []
        for s, rank in enumerate(ranks):
            ids = []
            for m in range(self.microbatches(model)):
                i = len(self.actions)
                action = Action(model, s, m, kind, replica)
                self.actions.append(action)
                self.index[action] = i
                self.rank.append(rank)
                self.dur.append(times[s])
                self.mem.append(mem[s])
                self.mem_delta.append(sign * mem[s])
                self.deps.append(())
                ids.append(i)
            out.append(ids)
        return out

    @cached_property
    def release_and_tail(self) -> tuple[list[float], list[float]]:
        """Per action: earliest start if it is its stage's k-th F (or B, I, W) to run, where k is its micro-batch
        index, and the shortest time from its end to the end of the schedule if it runs (M-1-k)-th from last.
        Computed once per problem (the search asks for it once per greedy run).

        Split backward: I takes B's place (with B's time minus W's); the k-th W cannot start before k+1 I's ended
        on its stage, and a W's tail is the W's still to run on its stage. An I's tail also counts the I's and W's
        that must follow it on its own stage (a per-rank work bound: with W off the chain the path alone can be 0).
        """
        release = [0.0] * len(self.actions)
        tail = [0.0] * len(self.actions)
        lat = self.costs.p2p_latency
        split = self.split_backward
        back_kind = "I" if split else "B"
        for model, replica in self.pipelines():
            c = self.costs.of(model)
            n, m_count = len(c.f), self.microbatches(model)
            bd = c.i if split else c.b
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
                    eb[s][k] = t + bd[s]
                    release[act(s, k, back_kind)] = t
                    if split:
                        t = max(eb[s][k], release[act(s, k - 1, "W")] + c.w[s] if k else 0.0)
                        release[act(s, k, "W")] = t
                        tail[act(s, m_count - 1 - k, "W")] = k * c.w[s]
            tb = [[0.0] * m_count for _ in range(n)]  # tail after the k-th-from-last B (or I) on stage s
            tf = [[0.0] * m_count for _ in range(n)]
            for s in range(n):
                for k in range(m_count):
                    tb[s][k] = max(lat + bd[s - 1] + tb[s - 1][k] if s else 0.0, bd[s] + tb[s][k - 1] if k else 0.0)
                    if split:
                        tb[s][k] = max(tb[s][k], k * bd[s] + (k + 1) * c.w[s])
                    tail[act(s, m_count - 1 - k, back_kind)] = tb[s][k]
            for s in reversed(range(n)):
                for k in range(m_count):
                    down = lat + c.f[s + 1] + tf[s + 1][k] if s < n - 1 else bd[s] + tb[s][k]
                    tf[s][k] = max(down, c.f[s] + tf[s][k - 1] if k else 0.0)
                    tail[act(s, m_count - 1 - k, "F")] = tf[s][k]
        return release, tail

    def rank_work(self, rank: int) -> float:
        return sum(self.dur[i] for stage in self.streams[rank] for lst in stage for i in lst)

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
        delta = self.mem_delta
        for lst in order:
            cur = peak = 0.0
            for a in lst:
                cur += delta[a]
                if cur > peak:
                    peak = cur
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
                if action.kind not in self.kinds:
                    if self.split_backward and action.kind == "B":
                        raise ScheduleError(
                            f"{action}: the schedule splits other backwards into I and W; split this one too (I, then W)"
                        )
                    raise ScheduleError(
                        f"{action}: kind {action.kind!r} is not supported by the planner; use F and B, or F, I and W"
                    )
                i = self.index.get(action)
                if i is None:
                    if action.model == CRITIC and self.mb_critic == 0:
                        raise ScheduleError(f"{action}: the Critic has 0 micro-batches (the Actor trains alone)")
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
                f"missing action {missing} (rank {self.rank[self.index[missing]]}); every "
                f"{', '.join(self.kinds)} action must be scheduled once"
            )
        for b, f in self.local_pred.items():
            if seen[b] < seen[f]:
                what = "weight backward" if self.actions[b].kind == "W" else "backward"
                before = "input backward" if self.actions[f].kind == "I" else "forward"
                raise ScheduleError(f"{what} {self.actions[b]} runs before its {before} {self.actions[f]} on rank {self.rank[b]}")
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
    """Simulate ``schedule``; raise ScheduleError for an invalid one (the message names the offending action).

    A schedule holding I or W actions is a split-backward schedule: all its backwards must be split."""
    split = any(a.kind in ("I", "W") for acts in schedule.values() for a in acts)
    problem = Problem(placement, costs, mb_actor, mb_critic, split_backward=split)
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
