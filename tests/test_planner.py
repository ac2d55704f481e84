"""Fused pipeline planner: simulator, validity checks, lower bound, generators, CLI."""

import itertools
import json
import random
from dataclasses import replace

import pytest

from fusedrl.pipelining import (
    ACTOR,
    CRITIC,
    Action,
    CostModel,
    Placement,
    Problem,
    ScheduleError,
    StageCosts,
    fused_schedule,
    greedy_order,
    local_search,
    lower,
    lower_bound,
    sequential_1f1b,
    simulate,
    verify_program,
)
from fusedrl.pipelining import memory_pass as memory_pass_mod
from fusedrl.pipelining import search as search_mod
from fusedrl.pipelining.plan import main as plan_main


def _problem(pp, pp_critic, mb_actor, mb_critic, f_critic=1.0, **kw):
    placement = Placement(pp, pp_critic)
    return placement, CostModel.uniform(placement, 1.0, f_critic, **kw), mb_actor, mb_critic


# ---------------------------------------------------------------- simulator vs hand-computed makespans


@pytest.mark.parametrize("pp,mb", [(1, 3), (2, 2), (4, 6), (4, 4), (8, 3)])
def test_actor_1f1b_makespan_matches_formula(pp, mb):
    placement, costs, _, _ = _problem(pp, pp, mb, 1)
    res = simulate(sequential_1f1b(placement, mb, 1), placement, costs, mb, 1)
    actor_end = max(e.end for e in res.timeline if e.action.model == ACTOR)
    assert actor_end == pytest.approx((mb + pp - 1) * (1.0 + 2.0))


def test_sequential_makespan_with_latency_by_hand():
    # pp=2, one micro-batch each, f=1, b=2, latency 0.5 (worked out step by step in the comments).
    placement, costs, _, _ = _problem(2, 2, 1, 1, p2p_latency=0.5)
    res = simulate(sequential_1f1b(placement, 1, 1), placement, costs, 1, 1)
    # actor: F0 [0,1] r0; F1 [1.5,2.5] r1; B1 [2.5,4.5] r1; B0 [5,7] r0
    # critic: F0 on r1 [4.5,5.5]; F1 on r0 [7,8]; B1 on r0 [8,10]; B0 on r1 [10.5,12.5]
    assert res.makespan == pytest.approx(12.5)
    assert res.busy == pytest.approx([6.0, 6.0])
    assert res.bubble_ratio == pytest.approx(1 - 12.0 / (2 * 12.5))
    assert res.peak_memory == pytest.approx([1.0, 1.0])


def test_single_rank_is_sum_of_work_and_memory_counts_in_flight():
    placement, costs, _, _ = _problem(1, 1, 3, 2, f_critic=0.5, mem_actor=2.0, mem_critic=1.0)
    sched = {
        0: [Action(ACTOR, 0, m, "F") for m in range(3)]
        + [Action(ACTOR, 0, m, "B") for m in range(3)]
        + [Action(CRITIC, 0, m, k) for m in range(2) for k in "FB"]
    }
    res = simulate(sched, placement, costs, 3, 2)
    assert res.makespan == pytest.approx(3 * 3.0 + 2 * 1.5)
    assert res.bubble_ratio == pytest.approx(0.0)
    assert res.peak_memory == pytest.approx([6.0])


# ---------------------------------------------------------------- validity errors


def _valid():
    placement, costs, ma, mc = _problem(2, 2, 2, 2)
    return placement, costs, ma, mc, sequential_1f1b(placement, ma, mc)


@pytest.mark.parametrize("pp,pp_critic", [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_stage_at_inverts_rank_of(pp, pp_critic):
    placement = Placement(pp, pp_critic)
    for model in (ACTOR, CRITIC):
        for rank in range(pp):
            stage, replica = placement.stage_at(model, rank)
            assert placement.rank_of(model, stage, replica) == rank
    with pytest.raises(ValueError, match=r"pipeline rank 4 out of range \[0, 4\)"):
        Placement(4).stage_at(CRITIC, 4)


def test_missing_action_is_named():
    placement, costs, ma, mc, sched = _valid()
    dropped = sched[1].pop()
    with pytest.raises(ScheduleError, match=f"missing action {dropped}"):
        simulate(sched, placement, costs, ma, mc)


def test_duplicate_action_is_named():
    placement, costs, ma, mc, sched = _valid()
    sched[0].append(sched[0][0])
    with pytest.raises(ScheduleError, match=f"duplicate action {sched[0][0]}"):
        simulate(sched, placement, costs, ma, mc)


def test_backward_before_forward_is_named():
    placement, costs, ma, mc, sched = _valid()
    f = Action(ACTOR, 1, 0, "F")
    b = Action(ACTOR, 1, 0, "B")
    lst = [a for a in sched[1] if a not in (f, b)]
    sched[1] = [b, f] + lst
    with pytest.raises(ScheduleError, match=r"backward actor:B1\.mb0 runs before its forward"):
        simulate(sched, placement, costs, ma, mc)


def test_deadlock_is_named():
    placement, costs, ma, mc, sched = _valid()
    # Rank 0 starts with the Critic's last stage, which waits on rank 1; rank 1 starts with the Actor's last
    # stage, which waits on rank 0's Actor forward queued behind it: a cycle.
    critic_f = Action(CRITIC, 1, 0, "F")
    sched[0] = [critic_f] + [a for a in sched[0] if a != critic_f]
    assert sched[1][0] == Action(ACTOR, 1, 0, "F")
    with pytest.raises(
        ScheduleError,
        match=r"deadlock: rank 0 at critic:F1\.mb0 waits for critic:F0\.mb0; "
        r"rank 1 at actor:F1\.mb0 waits for actor:F0\.mb0",
    ):
        simulate(sched, placement, costs, ma, mc)


def test_wrong_rank_unknown_action_and_kind_rejected():
    placement, costs, ma, mc, sched = _valid()
    moved = sched[0].pop(0)
    sched[1].insert(0, moved)
    with pytest.raises(ScheduleError, match=f"{moved} is on rank 1 but the placement puts it on rank 0"):
        simulate(sched, placement, costs, ma, mc)
    _, _, _, _, sched = _valid()
    sched[0].append(Action(ACTOR, 0, 7, "F"))
    with pytest.raises(ScheduleError, match=r"actor:F0\.mb7: no such action"):
        simulate(sched, placement, costs, ma, mc)
    _, _, _, _, sched = _valid()
    sched[0].append(Action(ACTOR, 0, 0, "X"))
    with pytest.raises(ScheduleError, match="kind 'X' is not supported by the planner; use F and B, or F, I and W"):
        simulate(sched, placement, costs, ma, mc)


def test_bad_problem_inputs():
    with pytest.raises(ValueError, match="must divide pp"):
        Placement(4, 3)
    placement = Placement(4, 2)
    with pytest.raises(ValueError, match="cost model has 4 critic stages"):
        simulate({}, placement, CostModel.uniform(Placement(4), 1, 1), 1, 1)
    with pytest.raises(ValueError, match="micro-batch counts must be >= 1"):
        fused_schedule(placement, CostModel.uniform(placement, 1, 1), 0, 1, budget_s=0.1)
    with pytest.raises(ValueError, match="must be > 0"):
        CostModel.uniform(placement, 0.0, 1.0)


# ---------------------------------------------------------------- generators, bound


CONFIGS = [  # pp, pp_critic, mb_actor, mb_critic (per replica), f_critic
    (2, 2, 2, 2, 1.0),
    (4, 4, 8, 8, 0.4),
    (4, 2, 8, 4, 1.25),
    (4, 1, 4, 1, 0.8),
    (8, 4, 16, 8, 1.0),
    (8, 8, 8, 8, 0.8),
]


@pytest.mark.parametrize("pp,pc,ma,mc,fc", CONFIGS)
def test_generated_schedules_valid_and_bounded(pp, pc, ma, mc, fc):
    placement, costs, _, _ = _problem(pp, pc, ma, mc, f_critic=fc, mem_critic=fc, p2p_latency=0.1)
    bound = lower_bound(placement, costs, ma, mc)
    seq = simulate(sequential_1f1b(placement, ma, mc), placement, costs, ma, mc)
    plan = fused_schedule(placement, costs, ma, mc, budget_s=0.3, seed=1)
    res = simulate(plan.schedule, placement, costs, ma, mc)  # raises if invalid
    assert res.makespan == pytest.approx(plan.makespan)
    assert plan.lower_bound == pytest.approx(bound)
    assert bound <= res.makespan + 1e-9
    assert bound <= seq.makespan + 1e-9
    assert res.makespan <= seq.makespan + 1e-9
    assert res.max_peak_memory <= plan.memory_limit + 1e-9
    # The critic replicas each ran all their micro-batches on their own ranks.
    for replica in range(placement.critic_replicas):
        done = {
            (a.stage, a.microbatch, a.kind)
            for acts in plan.schedule.values()
            for a in acts
            if a.model == CRITIC and a.replica == replica
        }
        assert len(done) == 2 * pc * mc


def test_every_greedy_variant_valid():
    placement, costs, ma, mc = _problem(4, 2, 6, 3, f_critic=0.8, mem_critic=0.8)
    problem = Problem(placement, costs, ma, mc)
    limit = 6.0
    rng = random.Random(0)
    for extra, bias, active, pressure in search_mod.RESTART_VARIANTS:
        order = greedy_order(
            problem,
            limit,
            extra_in_flight=extra,
            backward_bias=bias,
            active=active,
            memory_pressure=pressure,
            critic_weight=rng.uniform(0.5, 2),
            noise=0.1,
            rng=rng,
        )
        res = simulate(problem.to_schedule(order), placement, costs, ma, mc)
        assert res.makespan >= lower_bound(placement, costs, ma, mc) - 1e-9
    with pytest.raises(ValueError, match="needs an rng"):
        greedy_order(problem, limit, noise=0.1)


def _stage_orders(order, problem):
    """Per (model, replica, stage, kind): the micro-batch sequence in which the order runs them."""
    seqs = {}
    for lst in order:
        for i in lst:
            a = problem.actions[i]
            seqs.setdefault((a.model, a.replica, a.stage, a.kind), []).append(a.microbatch)
    return seqs


@pytest.mark.parametrize("pp,pc,ma,mc,fc", CONFIGS + [(16, 16, 32, 32, 0.4)])
def test_justify_order_valid_never_slower_within_memory(pp, pc, ma, mc, fc):
    placement, costs, _, _ = _problem(pp, pc, ma, mc, f_critic=fc, mem_critic=fc, p2p_latency=0.1)
    problem = Problem(placement, costs, ma, mc)
    limit = 1.5 * local_search.single_model_1f1b_peak(problem)
    starts = [problem.to_order(sequential_1f1b(placement, ma, mc))]
    starts += [greedy_order(problem, limit, extra_in_flight=e, critic_weight=w) for e in (1, 4) for w in (1.0, 2.5)]
    for order in starts:
        if max(problem.peak_memory(order)) > limit + 1e-9:
            continue
        out = local_search.justify_order(problem, order, limit)
        res = simulate(problem.to_schedule(out), placement, costs, ma, mc)  # raises if invalid
        assert res.makespan <= problem.makespan(order) + 1e-9
        assert res.max_peak_memory <= limit + 1e-9
        assert all(seq == sorted(seq) for seq in _stage_orders(out, problem).values())


def test_justify_order_compacts_greedy_schedule():
    # Light Critic, deep pipeline: the greedy leaves gaps that forward-backward justification closes (measured
    # numbers: greedy 162.6, justified 150.6 against a lower bound of 146.4, within the 24.0 memory limit).
    placement, costs, ma, mc = _problem(16, 16, 32, 32, f_critic=0.4, mem_critic=0.4)
    problem = Problem(placement, costs, ma, mc)
    limit = 1.5 * local_search.single_model_1f1b_peak(problem)
    assert limit == pytest.approx(24.0)
    greedy = greedy_order(problem, limit, extra_in_flight=4)
    out = local_search.justify_order(problem, greedy, limit)
    assert problem.makespan(greedy) == pytest.approx(162.6)
    assert problem.makespan(out) < 0.95 * problem.makespan(greedy)
    assert lower_bound(placement, costs, ma, mc) <= problem.makespan(out) + 1e-9
    assert max(problem.peak_memory(out)) <= limit + 1e-9


def test_justify_order_respects_a_tight_memory_limit():
    # With the limit at the input's own peak, justification may not raise any rank's peak above it.
    placement, costs, ma, mc = _problem(4, 4, 8, 8, f_critic=0.8, mem_critic=0.8)
    problem = Problem(placement, costs, ma, mc)
    order = problem.to_order(sequential_1f1b(placement, ma, mc))
    limit = max(problem.peak_memory(order))
    out = local_search.justify_order(problem, order, limit)
    assert max(problem.peak_memory(out)) <= limit + 1e-9
    assert problem.makespan(out) < problem.makespan(order)  # it still fills the Actor's bubbles with the Critic


@pytest.mark.parametrize("pp,pc,ma,mc,fc", CONFIGS)
def test_time_reversed_greedy_is_a_valid_schedule_with_the_same_peak(pp, pc, ma, mc, fc):
    placement, costs, _, _ = _problem(
        pp, pc, ma, mc, f_critic=fc, mem_critic=0.5, p2p_latency=0.1, b_actor=1.5, b_critic=2.5 * fc
    )
    problem = Problem(placement, costs, ma, mc)
    reversal = local_search.TimeReversal(problem)
    rev = reversal.reversed
    assert rev.costs.actor.f == costs.actor.b and rev.costs.critic.b == costs.critic.f
    rev_order = greedy_order(rev, 1e9, extra_in_flight=1)
    order = reversal.to_original(rev_order)
    res = simulate(problem.to_schedule(order), placement, costs, ma, mc)  # raises if invalid
    assert res.peak_memory == pytest.approx(rev.peak_memory(rev_order))
    # Same work; the reversed schedule's makespan bounds the original's (semi-active simulation only shortens it).
    assert res.makespan <= rev.makespan(rev_order) + 1e-9
    assert all(seq == sorted(seq) for seq in _stage_orders(order, problem).values())


def test_same_seed_same_schedule(monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)  # only the deterministic work budget may stop it
    placement, costs, ma, mc = _problem(4, 2, 8, 4, f_critic=1.25, mem_critic=1.25)
    a = fused_schedule(placement, costs, ma, mc, budget_s=0.6, seed=3)
    b = fused_schedule(placement, costs, ma, mc, budget_s=0.6, seed=3)
    assert a.makespan > a.lower_bound  # the search does not reach the bound here ...
    assert a.evaluations > len(search_mod.GREEDY_VARIANTS) + 1  # ... so the seeded annealing ran
    assert a.schedule == b.schedule
    assert a.makespan == b.makespan


def test_lower_bound_below_exhaustive_optimum():
    # pp=2, 2 actor micro-batches, 1 critic micro-batch, uneven costs: try every valid per-rank order.
    placement = Placement(2)
    costs = CostModel.from_profile({ACTOR: {"f": [1.0, 2.0], "b": [2.5, 3.0]}, CRITIC: {"f": [0.7, 1.3]}}, p2p_latency=0.2)
    ma, mc = 2, 1
    base = sequential_1f1b(placement, ma, mc)
    per_rank = []
    for r in range(2):
        orders = []
        for perm in itertools.permutations(base[r]):
            pos = {a: i for i, a in enumerate(perm)}
            ok = all(
                pos[a] < pos[b]
                for a in perm
                for b in perm
                if (a.model, a.stage) == (b.model, b.stage)
                and (
                    (a.kind == b.kind and a.microbatch < b.microbatch)
                    or (a.kind == "F" and b.kind == "B" and a.microbatch == b.microbatch)
                )
            )
            if ok:
                orders.append(list(perm))
        per_rank.append(orders)
    best = min(
        (
            res.makespan
            for o0 in per_rank[0]
            for o1 in per_rank[1]
            for res in [_try(simulate, {0: o0, 1: o1}, placement, costs, ma, mc)]
            if res is not None
        ),
    )
    bound = lower_bound(placement, costs, ma, mc)
    plan = fused_schedule(placement, costs, ma, mc, budget_s=0.5, seed=0, memory_limit=1e9)
    assert bound <= best + 1e-9 <= plan.makespan + 1e-9
    assert plan.makespan == pytest.approx(best)  # tiny problem: the search finds the optimum


def _try(fn, *args):
    try:
        return fn(*args)
    except ScheduleError:
        return None


def test_cost_model_constructors():
    placement = Placement(4, 2)
    costs = CostModel.from_flavors(placement, "debug_large", "debug_large", tokens_per_microbatch=4096)
    assert len(costs.actor.f) == 4 and len(costs.critic.f) == 2
    assert costs.critic.f[0] == pytest.approx(2 * costs.actor.f[1])  # 4 of 8 layers vs 2 of 8
    assert costs.actor.f[-1] > costs.actor.f[0]  # LM head on the last stage
    assert all(b == pytest.approx(2 * f) for b, f in zip(costs.actor.b, costs.actor.f))
    # weight gradients: one matmul per weight matmul (the forward's matmul FLOPs); attention adds to I only
    assert all(f * 0.5 < w < f for w, f in zip(costs.actor.w, costs.actor.f))
    assert costs.actor.w[-1] / costs.actor.f[-1] > costs.actor.w[0] / costs.actor.f[0]  # the LM head has weights only
    assert StageCosts((1.0,), (3.0,), (1.0,)).w == (1.5,) and StageCosts((1.0,), (3.0,), (1.0,)).i == (1.5,)
    with pytest.raises(ValueError, match="must be below the backward times"):
        StageCosts((1.0,), (2.0,), (1.0,), (2.0,))
    with pytest.raises(ValueError, match="one f, b, mem"):
        StageCosts((1.0,), (2.0,), (1.0,), (0.5, 0.5))
    profiled = CostModel.from_profile({ACTOR: {"f": [1.0], "w": [0.25]}, CRITIC: {"f": [2.0]}})
    assert (profiled.actor.i, profiled.critic.w) == ((1.75,), (2.0,))
    with pytest.raises(ValueError, match="unknown model flavor"):
        CostModel.from_flavors(placement, "nope", "debug", tokens_per_microbatch=8)
    with pytest.raises(ValueError, match="profile needs per-stage forward times"):
        CostModel.from_profile({ACTOR: {"f": [1.0]}})


# ---------------------------------------------------------------- split backward (I/W)


def _split(schedule):
    """Each B of a schedule as its I directly followed by its W."""
    return {
        r: [x for a in acts for x in ((replace(a, kind="I"), replace(a, kind="W")) if a.kind == "B" else (a,))]
        for r, acts in schedule.items()
    }


def test_split_simulation_by_hand():
    # pp=2, one micro-batch each, f=1, b=2 split into i=1 and w=1, latency 0.5; sequential order, each B as I then W.
    placement, costs, _, _ = _problem(2, 2, 1, 1, p2p_latency=0.5)
    res = simulate(_split(sequential_1f1b(placement, 1, 1)), placement, costs, 1, 1)
    start = {e.action: e.start for e in res.timeline}
    # actor: F0 [0,1] r0; F1 [1.5,2.5] r1; I1 [2.5,3.5], W1 [3.5,4.5] r1; I0 waits for I1 only: [4,5], W0 [5,6] r0
    assert start[Action(ACTOR, 0, 0, "I")] == pytest.approx(4.0)  # not 5.0, after W1 as a B would be
    # critic: F0 [4.5,5.5] r1; F1 [6,7], I1 [7,8], W1 [8,9] r0; I0 [8.5,9.5], W0 [9.5,10.5] r1
    assert res.makespan == pytest.approx(10.5)  # 12.5 with unsplit backwards (test above)
    assert res.busy == pytest.approx([6.0, 6.0])


def test_split_activations_stay_until_the_weight_backward():
    placement, costs, _, _ = _problem(1, 1, 2, 1, f_critic=0.5, mem_actor=2.0, mem_critic=1.0)
    a = lambda m, k: Action(ACTOR, 0, m, k)  # noqa: E731
    crit = [Action(CRITIC, 0, 0, k) for k in "FIW"]
    deferred = {0: [a(0, "F"), a(0, "I"), a(1, "F"), a(0, "W"), a(1, "I"), a(1, "W")] + crit}
    res = simulate(deferred, placement, costs, 2, 1)
    assert res.peak_memory == pytest.approx([4.0])  # micro-batch 0 holds its 2.0 until W0, after F1
    assert res.makespan == pytest.approx(2 * 3.0 + 1.5)
    adjacent = {0: [a(0, "F"), a(0, "I"), a(0, "W"), a(1, "F"), a(1, "I"), a(1, "W")] + crit}
    assert simulate(adjacent, placement, costs, 2, 1).peak_memory == pytest.approx([2.0])


def test_split_schedule_errors_are_named():
    placement, costs, ma, mc, sched = _valid()
    split = _split(sched)
    w, i = Action(ACTOR, 1, 0, "W"), Action(ACTOR, 1, 0, "I")
    bad = {0: split[0], 1: [w] + [x for x in split[1] if x != w]}
    with pytest.raises(ScheduleError, match=r"weight backward actor:W1\.mb0 runs before its input backward actor:I1\.mb0"):
        simulate(bad, placement, costs, ma, mc)
    mixed = {0: split[0], 1: [x for x in split[1] if x != w and x != i] + [Action(ACTOR, 1, 0, "B")]}
    with pytest.raises(ScheduleError, match=r"actor:B1\.mb0: the schedule splits other backwards into I and W; split this one"):
        simulate(mixed, placement, costs, ma, mc)
    missing = {0: split[0], 1: [x for x in split[1] if x != w]}
    with pytest.raises(ScheduleError, match=r"missing action actor:W1\.mb0 \(rank 1\); every F, I, W action"):
        simulate(missing, placement, costs, ma, mc)
    # rank 0 waits for the Critic's input backward that rank 1 only runs after the Actor's, which waits for rank 0
    cyc = {0: [x for x in split[0] if x.model == CRITIC] + [x for x in split[0] if x.model == ACTOR], 1: split[1]}
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at critic:F1\.mb0 waits for critic:F0\.mb0"):
        simulate(cyc, placement, costs, ma, mc)


@pytest.mark.parametrize("pp,pc,ma,mc,fc", CONFIGS)
def test_split_search_is_valid_faster_and_bounded(pp, pc, ma, mc, fc, monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)  # only the deterministic work budget may stop it
    placement, costs, _, _ = _problem(pp, pc, ma, mc, f_critic=fc, mem_critic=fc, p2p_latency=0.1)
    fb = fused_schedule(placement, costs, ma, mc, budget_s=0.3, seed=1)
    plan = fused_schedule(placement, costs, ma, mc, budget_s=0.3, seed=1, split_backward=True)
    assert plan.split_backward and not fb.split_backward
    assert {a.kind for acts in plan.schedule.values() for a in acts} == {"F", "I", "W"}
    res = simulate(plan.schedule, placement, costs, ma, mc)  # raises if invalid
    assert res.makespan == pytest.approx(plan.makespan)
    assert plan.split_lower_bound == pytest.approx(lower_bound(placement, costs, ma, mc, split_backward=True))
    assert plan.split_lower_bound <= plan.makespan + 1e-9
    assert plan.split_lower_bound <= plan.lower_bound + 1e-9 == fb.lower_bound + 1e-9
    assert plan.makespan <= fb.makespan + 1e-9
    assert res.max_peak_memory <= plan.memory_limit + 1e-9
    greedy = fused_schedule(placement, costs, ma, mc, budget_s=0, split_backward=True)
    assert simulate(greedy.schedule, placement, costs, ma, mc).makespan == pytest.approx(greedy.makespan)
    assert greedy.makespan <= fused_schedule(placement, costs, ma, mc, budget_s=0).makespan + 1e-9


def test_split_search_goes_below_the_fb_bound_where_fill_and_drain_force_idle_time(monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)
    # pp=8, 8 micro-batches: the F/B bound (52.2) lies above every rank's work (43.2); splitting reaches its own bound
    placement, costs, ma, mc = _problem(8, 8, 8, 8, f_critic=0.8, mem_critic=0.8)
    plan = fused_schedule(placement, costs, ma, mc, budget_s=0.5, split_backward=True)
    work = max(Problem(placement, costs, ma, mc).rank_work(r) for r in range(8))
    assert (plan.lower_bound, work, plan.split_lower_bound) == pytest.approx((52.2, 43.2, 46.2))
    assert plan.makespan < plan.lower_bound
    assert plan.makespan == pytest.approx(plan.split_lower_bound)


def test_split_order_keeps_work_and_memory_and_is_never_slower():
    placement, costs, ma, mc = _problem(4, 2, 8, 4, f_critic=1.25, mem_critic=1.25, p2p_latency=0.1)
    problem, split = Problem(placement, costs, ma, mc), Problem(placement, costs, ma, mc, split_backward=True)
    for order in (problem.to_order(sequential_1f1b(placement, ma, mc)), greedy_order(problem, 1e9, extra_in_flight=2)):
        out = search_mod.split_order(problem, split, order)
        assert problem.to_schedule(order) == {
            r: [replace(a, kind="B") if a.kind == "I" else a for a in acts if a.kind != "W"]
            for r, acts in split.to_schedule(out).items()
        }
        assert split.peak_memory(out) == pytest.approx(problem.peak_memory(order))
        assert split.makespan(out) <= problem.makespan(order) + 1e-9


def test_every_greedy_variant_and_justification_valid_on_the_split_problem():
    placement, costs, ma, mc = _problem(4, 2, 6, 3, f_critic=0.8, mem_critic=0.8, p2p_latency=0.1)
    split = Problem(placement, costs, ma, mc, split_backward=True)
    limit = 1.5 * local_search.single_model_1f1b_peak(split)
    bound = lower_bound(placement, costs, ma, mc, split_backward=True)
    for (extra, bias, active, pressure), balanced in search_mod.SPLIT_GREEDY_SETTINGS:
        weight = search_mod.balanced_critic_weight(split) if balanced else 1.0
        order = greedy_order(
            split, limit, extra_in_flight=extra, backward_bias=bias, active=active, memory_pressure=pressure, critic_weight=weight
        )
        res = simulate(split.to_schedule(order), placement, costs, ma, mc)  # raises if invalid
        assert res.makespan >= bound - 1e-9
        if res.max_peak_memory <= limit + 1e-9:
            out = local_search.justify_order(split, order, limit)
            justified = simulate(split.to_schedule(out), placement, costs, ma, mc)
            assert justified.makespan <= res.makespan + 1e-9 and justified.max_peak_memory <= limit + 1e-9
            assert all(seq == sorted(seq) for seq in _stage_orders(out, split).values())


def test_split_lower_bound_below_exhaustive_optimum(monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)
    # pp=2, one micro-batch per model, uneven costs and weight-gradient shares: try every valid per-rank order.
    placement = Placement(2)
    costs = CostModel.from_profile(
        {ACTOR: {"f": [1.0, 2.0], "b": [2.5, 3.0], "w": [0.5, 2.0]}, CRITIC: {"f": [0.7, 1.3], "w": [1.0, 0.4]}},
        p2p_latency=0.2,
    )
    pred = {"B": "F", "I": "F", "W": "I"}

    def optimum(schedule):
        def ordered(p):  # every B or I after its F, every W after its I
            return all(p.index(replace(a, kind=pred[a.kind])) < p.index(a) for a in p if a.kind in pred)

        per_rank = [[list(p) for p in itertools.permutations(schedule[r]) if ordered(p)] for r in range(2)]
        results = [_try(simulate, {0: o0, 1: o1}, placement, costs, 1, 1) for o0 in per_rank[0] for o1 in per_rank[1]]
        return min(res.makespan for res in results if res is not None)

    best, fb_best = optimum(_split(sequential_1f1b(placement, 1, 1))), optimum(sequential_1f1b(placement, 1, 1))
    bound = lower_bound(placement, costs, 1, 1, split_backward=True)
    assert bound <= best + 1e-9 < fb_best  # splitting beats every F/B schedule here
    plan = fused_schedule(placement, costs, 1, 1, budget_s=0.3, memory_limit=1e9, split_backward=True)
    assert plan.makespan == pytest.approx(best)


# ---------------------------------------------------------------- CLI


def test_cli_json_and_trace(tmp_path, capsys):
    trace = tmp_path / "t.json"
    rc = plan_main(
        [
            "--pp-actor",
            "4",
            "--pp-critic",
            "2",
            "--mb-actor",
            "8",
            "--mb-critic",
            "4",
            "--f-actor",
            "5",
            "--f-critic",
            "4",
            "--mem-actor",
            "1.95",
            "--mem-critic",
            "2",
            "--budget-s",
            "0.3",
            "--json",
            "--trace",
            str(trace),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "makespan",
        "lower_bound",
        "sequential_1f1b_makespan",
        "speedup_vs_sequential",
        "bubble_ratio",
        "peak_memory",
        "peak_memory_1f1b_single",
        "search_seconds",
    ):
        assert key in out
    assert out["lower_bound"] <= out["makespan"] <= out["sequential_1f1b_makespan"]
    assert out["peak_memory_1f1b_single"] == pytest.approx(4 * 1.95)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 * 4 * 8 + 2 * 2 * 2 * 4


def test_cli_split_backward_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)
    trace = tmp_path / "t.json"
    argv = "--pp-actor 4 --pp-critic 2 --mb-actor 4 --mb-critic 2 --f-actor 5 --f-critic 4 --budget-s 0.3 --json"
    assert plan_main([*argv.split(), "--split-backward", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["split_backward"] is True
    assert out["split_lower_bound"] <= out["makespan"] < out["lower_bound"]  # below the F/B bound (105 here)
    assert out["makespan_over_split_lower_bound"] == pytest.approx(out["makespan"] / out["split_lower_bound"])
    assert out["peak_memory"] <= out["memory_limit"]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * 4 * 4 + 3 * 2 * 2 * 2  # F, I and W of every stage and micro-batch
    assert plan_main(argv.split()) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["split_backward"] is False


def test_cli_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "g.png"
    assert (
        plan_main(
            [
                "--pp-actor",
                "2",
                "--mb-actor",
                "2",
                "--mb-critic",
                "2",
                "--f-actor",
                "1",
                "--f-critic",
                "1",
                "--budget-s",
                "0.1",
                "--png",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_input_exits_with_message(capsys):
    assert (
        plan_main(
            ["--pp-actor", "4", "--pp-critic", "3", "--mb-actor", "4", "--mb-critic", "4", "--f-actor", "1", "--f-critic", "1"]
        )
        == 2
    )
    assert "must divide pp" in capsys.readouterr().err


# ---------------------------------------------------------------- memory pass and memory cap


@pytest.mark.parametrize("split", [False, True])
def test_memory_pass_lowers_the_peak_at_equal_makespan(monkeypatch, split):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)
    placement, costs, ma, mc = _problem(4, 4, 8, 8)
    problem = Problem(placement, costs, ma, mc)
    single = local_search.single_model_1f1b_peak(problem)
    order = greedy_order(problem, 1.5 * single, extra_in_flight=search_mod.UNCAPPED)
    order = local_search.justify_order(problem, order, 1.5 * single)
    if split:  # I and W actions: the memory is freed by W
        split_problem = Problem(placement, costs, ma, mc, split_backward=True)
        problem, order = split_problem, search_mod.split_order(problem, split_problem, order)
    makespan, peak = problem.makespan(order), max(problem.peak_memory(order))
    assert peak == pytest.approx(1.5 * single)
    out = memory_pass_mod.memory_pass(problem, order, makespan, local_search.Evaluator(problem, 0.5))
    res = simulate(problem.to_schedule(out), placement, costs, ma, mc)  # raises if invalid
    assert res.makespan <= makespan + 1e-9
    assert res.max_peak_memory < peak - 1e-9
    assert res.max_peak_memory == pytest.approx(single)  # this problem fits in one model's 1F1B peak


def test_memory_cap_holds_every_rank_within_it(monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)
    placement, ma = Placement(4, 2), 8
    costs = CostModel.from_flavors(placement, "debug_large", "debug_large", tokens_per_microbatch=512)  # memory in GiB
    seq_peak = simulate(sequential_1f1b(placement, ma, ma // 2), placement, costs, ma, ma // 2).max_peak_memory
    default = fused_schedule(placement, costs, ma, ma // 2, budget_s=0.3)
    for cap in (seq_peak, (seq_peak + default.result.max_peak_memory) / 2):
        assert default.result.max_peak_memory > cap  # the cap binds
        plan = fused_schedule(placement, costs, ma, ma // 2, budget_s=0.3, memory_limit=cap)
        assert plan.memory_limit == cap
        assert plan.result.max_peak_memory <= cap + 1e-12
        assert plan.makespan <= plan.sequential_1f1b_makespan + 1e-12


def test_schedule_memory_cap_from_the_config(monkeypatch):
    from pathlib import Path

    from fusedrl.config import ConfigError, load_config, run_checks
    from fusedrl.rlhf import pipeline_costs, plan_program, program, schedule_memory_limit

    root = Path(__file__).resolve().parents[1]
    config = str(root / "train_configs" / "debug_ppo.toml")
    base = ["--job.config_file", config, "--parallelism.pp=2", "--fusion.schedule_search_budget_s=0.2"]
    cfg = load_config(base)
    seq_len = cfg.sequence_budget
    placement, costs, counts = pipeline_costs(cfg, seq_len)
    n_mb = counts["actor"]
    need = simulate(sequential_1f1b(placement, n_mb, n_mb), placement, costs, n_mb, n_mb).max_peak_memory
    assert schedule_memory_limit(cfg, seq_len) is None  # unset: the search's default
    limits = []
    real_search = program.fused_schedule

    def spy(*args, **kwargs):
        limits.append(kwargs["memory_limit"])
        return real_search(*args, **kwargs)

    monkeypatch.setattr(program, "fused_schedule", spy)  # what plan_program calls
    plan_program(load_config([*base, f"--fusion.schedule_memory_gib={need}"]), seq_len)
    assert limits == [need]
    low = load_config([*base, f"--fusion.schedule_memory_gib={need / 2}"])
    with pytest.raises(ConfigError, match=r"schedule_memory_gib = .*: below the .* GiB .* sequential 1F1B .*raise it") as err:
        schedule_memory_limit(low, seq_len)
    assert "\n" not in str(err.value)
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError, match="fusion.schedule_memory_gib"):
        run_checks(low, 4)  # the trainer's startup checks refuse it before any process group exists
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config([*base, "--fusion.schedule_memory_gib=0"])


# ---------------------------------------------------------------- critic-free: the Actor alone (mb_critic = 0)


def _actor_alone(pp, stages_critic=None):
    """pp = 2 uniform; pp = 4 with uneven per-stage costs and weight-gradient shares (the Critic's costs unused)."""
    placement = Placement(pp, stages_critic)
    if pp == 2:
        return placement, CostModel.uniform(placement, 1.0, 1.0, p2p_latency=0.1)
    profile = {"f": [1.2, 1.0, 1.0, 1.4], "b": [2.4, 2.0, 2.2, 2.6], "w": [1.0, 1.0, 0.8, 1.2], "mem": [1.0, 1.0, 1.0, 1.5]}
    return placement, CostModel.from_profile({ACTOR: profile, CRITIC: {"f": [1.0] * placement.num_stages(CRITIC)}}, 0.1)


@pytest.mark.parametrize("pp,ma,budget_s", [(2, 4, 0.0), (2, 4, 0.3), (4, 8, 0.0), (4, 8, 0.3)])
def test_critic_free_split_schedule_is_valid_actor_only_and_beats_1f1b(pp, ma, budget_s, monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)  # only the deterministic work budget may stop it
    placement, costs = _actor_alone(pp)
    seq_schedule = sequential_1f1b(placement, ma, 0)
    assert {a.model for acts in seq_schedule.values() for a in acts} == {ACTOR}
    seq = simulate(seq_schedule, placement, costs, ma, 0)
    plan = fused_schedule(placement, costs, ma, 0, budget_s=budget_s, seed=1, split_backward=True)
    actions = [a for acts in plan.schedule.values() for a in acts]
    assert {a.model for a in actions} == {ACTOR}
    assert {a.kind for a in actions} == {"F", "I", "W"} and len(actions) == 3 * pp * ma
    res = simulate(plan.schedule, placement, costs, ma, 0)  # raises if invalid
    program = lower(plan.schedule, placement, {ACTOR: ma, CRITIC: 0})  # raises unless the verifier accepts it
    verify_program(program.programs, placement, {ACTOR: ma, CRITIC: 0})
    assert res.makespan == pytest.approx(plan.makespan)
    assert res.makespan < seq.makespan  # the weight backwards fill the bubbles that 1F1B leaves
    assert plan.sequential_1f1b_makespan == pytest.approx(seq.makespan)
    split_bound = lower_bound(placement, costs, ma, 0, split_backward=True)
    assert plan.split_lower_bound == pytest.approx(split_bound)
    assert split_bound <= res.makespan + 1e-9
    assert lower_bound(placement, costs, ma, 0) <= seq.makespan + 1e-9
    assert res.max_peak_memory <= plan.memory_limit + 1e-9


def test_critic_free_fb_search_and_unused_critic_placement():
    # the F/B search of the Actor alone: valid, bounded, never slower than 1F1B
    placement, costs = _actor_alone(2)
    plan = fused_schedule(placement, costs, 4, 0, budget_s=0.2)
    assert simulate(plan.schedule, placement, costs, 4, 0).makespan == pytest.approx(plan.makespan)
    assert lower_bound(placement, costs, 4, 0) - 1e-9 <= plan.makespan <= plan.sequential_1f1b_makespan + 1e-9
    assert {a.model for acts in plan.schedule.values() for a in acts} == {ACTOR}
    assert search_mod.balanced_critic_weight(Problem(placement, costs, 4, 0)) == 1.0
    # a placement with Critic replicas: the Critic's stages stay unused
    placement, costs = _actor_alone(4, stages_critic=2)
    plan = fused_schedule(placement, costs, 8, 0, budget_s=0, split_backward=True)
    assert {a.model for acts in plan.schedule.values() for a in acts} == {ACTOR}
    lower(plan.schedule, placement, {ACTOR: 8, CRITIC: 0})


def test_critic_free_errors_are_named():
    placement, costs = _actor_alone(2)
    with pytest.raises(ValueError, match=r">= 1 for the Actor and >= 0 for the Critic .*mb_actor=2, mb_critic=-1"):
        Problem(placement, costs, 2, -1)
    with pytest.raises(ValueError, match=r">= 1 for the Actor .*mb_actor=0, mb_critic=0"):
        Problem(placement, costs, 0, 0)
    schedule = sequential_1f1b(placement, 2, 1)  # one Critic micro-batch too many (its stage 1 on rank 0 comes first)
    with pytest.raises(ScheduleError, match=r"critic:F1\.mb0: the Critic has 0 micro-batches \(the Actor trains alone\)"):
        simulate(schedule, placement, costs, 2, 0)


def test_cli_critic_free(capsys, monkeypatch):
    monkeypatch.setattr(local_search, "WALL_CLOCK_FACTOR", 1e6)
    argv = "--critic-free --pp-actor 4 --mb-actor 8 --f-actor 2 --budget-s 0.2 --json".split()
    assert plan_main([*argv, "--split-backward"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["critic_free"] is True and out["split_backward"] is True
    assert out["split_lower_bound"] <= out["makespan"] < out["sequential_1f1b_makespan"]
    assert out["peak_memory_1f1b_single"] == pytest.approx(4.0)  # the Actor's stage 0 under 1F1B
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["makespan"] == pytest.approx(out["sequential_1f1b_makespan"])
    assert plan_main([*argv, "--mb-critic", "2"]) == 2
    assert "--critic-free plans the Actor alone: drop --mb-critic" in capsys.readouterr().err
    assert plan_main("--pp-actor 2 --mb-actor 2 --f-actor 1".split()) == 2
    assert "--mb-critic and --f-critic required (or --critic-free" in capsys.readouterr().err
