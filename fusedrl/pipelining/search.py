"""Schedule generators: sequential 1F1B (the unfused baseline), a greedy fused list scheduler, forward-backward
justification (which compacts any valid schedule without breaking the memory limit) and a local search; with
``split_backward`` the search continues on the problem whose backwards are split into I and W.

The search is deterministic for a given seed and budget: the budget is converted into a number of simulated
actions (a machine-independent amount of work), so two runs with the same arguments return the same schedule.
A wall-clock guard of ``WALL_CLOCK_FACTOR x budget_s`` only cuts a run short on a much slower or loaded machine
(then the result depends on timing).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, replace

from fusedrl.pipelining.bounds import problem_lower_bound
from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.ir import ACTOR, CRITIC, Action, Placement, Schedule
from fusedrl.pipelining.local_search import (
    Best,
    Evaluator,
    Justifier,
    TimeReversal,
    anneal,
    single_model_1f1b_peak,
)
from fusedrl.pipelining.memory_pass import memory_pass
from fusedrl.pipelining.simulator import Problem, SimResult, simulate_order

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
    """Actor 1F1B, then Critic 1F1B on every rank (each Critic replica runs its own 1F1B on its ranks); with
    ``mb_critic`` 0 the Actor's 1F1B alone."""
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
    otherwise always loses to the Actor and piles up at the end). 1.0 when the Critic has no work (Actor alone)."""
    _, tails = problem.release_and_tail
    longest = {ACTOR: 0.0, CRITIC: 0.0}
    for t, a in zip(tails, problem.actions):
        longest[a.model] = max(longest[a.model], t)
    if longest[CRITIC] == 0.0:
        return 1.0
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


# ---------------------------------------------------------------------------------------------------------
# Justification (forward-backward improvement)


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
    evaluator: Evaluator,
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
    best = Best(evaluator, memory_limit, start, start_ms, fb_method + "+split")
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
    justifier = Justifier(split, memory_limit, evaluator)
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

    ``mb_critic = 0``: no Critic, the Actor alone (critic-free training). There are then no Critic micro-batches to
    fill the Actor's bubbles, so the F/B search returns 1F1B; with ``split_backward`` the weight backwards fill them
    (zero-bubble style).

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
    evaluator = Evaluator(problem, budget_s * (SPLIT_FB_SHARE if split_backward else 1.0))
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

    best = Best(evaluator, memory_limit, seq_order, seq_ms, "sequential_1f1b")

    # Greedy settings (in-flight cap above 1F1B's, backward bias, active vs non-delay; raw or balanced Critic
    # priorities; forwards in time or on the time-reversed problem) in GREEDY_SETTINGS order, each justified.
    reversal = TimeReversal(problem)
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

    justifier = Justifier(problem, memory_limit, evaluator)

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
