"""A lower bound on the makespan of any valid schedule of a planning problem.

Each rank is relaxed to a single machine whose jobs (its F and B actions) carry a release time (earliest possible
start) and a tail (shortest possible time from their end to the end of the schedule), both derived from the
pipeline alone: the k-th forward executed on stage s cannot start before k+1 micro-batches went through stages
0..s-1, and the k-th-from-last backward on stage s leaves k+1 micro-batches to push through stages s-1..0. The
optimal preemptive schedule of that relaxation (Jackson's rule: run the released job with the longest tail) is a
valid lower bound. It includes each pipeline's critical path and, per rank, earliest start + all work + shortest
tail; total work / ranks is added for completeness.

The split-backward bound (``split_backward=True``) relaxes schedules whose backwards are split into I and W the same
way: I takes B's place on the critical path (with B's time minus W's), and each W is a job released when k+1 I's of
its stage can have ended, with the W's still to follow on its stage as its tail. It is valid for the same reason:
in every split schedule the k-th W (I, F) to run on a stage starts no earlier than its release and leaves at least
its tail. Every F/B schedule is a split schedule (each B as I directly followed by W), so it bounds F/B schedules
too; it is lower than the F/B bound by about the W times taken off the fill and drain of the critical path.
"""

from __future__ import annotations

import heapq

from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.ir import Placement
from fusedrl.pipelining.simulator import Problem


def lower_bound(placement: Placement, costs: CostModel, mb_actor: int, mb_critic: int, *, split_backward: bool = False) -> float:
    """Lower bound on the makespan of every valid schedule of this problem (``split_backward``: of every schedule
    whose backwards are split into I and W, which includes every F/B schedule)."""
    return problem_lower_bound(Problem(placement, costs, mb_actor, mb_critic, split_backward=split_backward))


def problem_lower_bound(problem: Problem) -> float:
    release, tail = problem.release_and_tail
    bound = sum(problem.dur) / problem.pp
    for rank in range(problem.pp):
        jobs = sorted((release[a], problem.dur[a], tail[a]) for stage in problem.streams[rank] for lst in stage for a in lst)
        bound = max(bound, _jackson_preemptive(jobs))
    return bound


def rank_work_bound(problem: Problem) -> float:
    """The largest total work of one rank: no schedule is shorter, and idle time above it is forced by the pipeline."""
    return max(problem.rank_work(r) for r in range(problem.pp))


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
