"""A lower bound on the makespan of any valid schedule of a planning problem.

Each rank is relaxed to a single machine whose jobs (its F and B actions) carry a release time (earliest possible
start) and a tail (shortest possible time from their end to the end of the schedule), both derived from the
pipeline alone: the k-th forward executed on stage s cannot start before k+1 micro-batches went through stages
0..s-1, and the k-th-from-last backward on stage s leaves k+1 micro-batches to push through stages s-1..0. The
optimal preemptive schedule of that relaxation (Jackson's rule: run the released job with the longest tail) is a
valid lower bound. It includes each pipeline's critical path and, per rank, earliest start + all work + shortest
tail; total work / ranks is added for completeness.
"""

from __future__ import annotations

import heapq

from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.ir import Action, Placement
from fusedrl.pipelining.simulator import Problem


def lower_bound(placement: Placement, costs: CostModel, mb_actor: int, mb_critic: int) -> float:
    """Lower bound on the makespan of every valid schedule of this problem."""
    return problem_lower_bound(Problem(placement, costs, mb_actor, mb_critic))


def release_and_tail(problem: Problem) -> tuple[list[float], list[float]]:
    """Per action: earliest start if it is its stage's k-th F (or B) to run, where k is its micro-batch index,
    and the shortest time from its end to the end of the schedule if it runs (M-1-k)-th from last.
    Cached on the problem (the search asks for it once per greedy run)."""
    cached = getattr(problem, "_release_and_tail", None)
    if cached is not None:
        return cached
    release = [0.0] * len(problem.actions)
    tail = [0.0] * len(problem.actions)
    lat = problem.costs.p2p_latency
    for model, replica in problem.pipelines():
        c = problem.costs.of(model)
        n, m_count = len(c.f), problem.microbatches(model)
        idx = problem.index
        act = lambda s, m, kind: idx[Action(model, s, m, kind, replica)]  # noqa: E731
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
    problem._release_and_tail = (release, tail)  # type: ignore[attr-defined]
    return release, tail


def problem_lower_bound(problem: Problem) -> float:
    release, tail = release_and_tail(problem)
    bound = sum(problem.dur) / problem.pp
    for rank in range(problem.pp):
        jobs = sorted(
            (release[a], problem.dur[a], tail[a]) for fw, bw in problem.streams[rank] for a in fw + bw
        )
        bound = max(bound, _jackson_preemptive(jobs))
    return bound


def _jackson_preemptive(jobs: list[tuple[float, float, float]]) -> float:
    """Optimal makespan (max of completion + tail) of preemptive single-machine jobs (release, duration, tail)."""
    heap: list[tuple[float, float]] = []  # (-tail, remaining duration)
    t, i, best = 0.0, 0, 0.0
    while i < len(jobs) or heap:
        if not heap and t < jobs[i][0]:
            t = jobs[i][0]
        while i < len(jobs) and jobs[i][0] <= t:
            heapq.heappush(heap, (-jobs[i][2], jobs[i][1]))
            i += 1
        neg_tail, left = heapq.heappop(heap)
        next_release = jobs[i][0] if i < len(jobs) else float("inf")
        run = min(left, next_release - t)
        t += run
        if run < left:
            heapq.heappush(heap, (neg_tail, left - run))
        else:
            best = max(best, t - neg_tail)
    return best
