"""Migration plans when a kept instance already queues requests beyond its slots."""

import pytest

from fusedrl.rollout_fusion.plan import (
    InstanceStats,
    MigrationPlan,
    MovedRequest,
    PlanError,
    Transfer,
    build_plan,
    choose_kept,
    verify_plan,
)


def _stats(rank: int, unfinished: int, remaining: int, max_slots: int = 8) -> InstanceStats:
    return InstanceStats(
        rank,
        unfinished,
        remaining,
        max_slots,
        kv_capacity_tokens=10_000,
        kv_reserved_tokens=unfinished * 50,
        largest_request_tokens=50 if unfinished else 0,
    )


def test_queued_instance_is_kept_without_receiving_requests():
    # Rank 0 holds 9 unfinished requests for 8 slots (one queued) and the most work: it is kept, but its queue
    # must not grow, so rank 1's requests go to another kept instance.
    stats = [_stats(0, 9, 900), _stats(1, 2, 100), _stats(2, 1, 300)]
    kept = choose_kept(stats)
    assert kept == [0, 2]
    moved = [MovedRequest(100, 1, 20, 30), MovedRequest(101, 1, 20, 10)]
    plan = build_plan(stats, kept, moved, kept_samples={}, freed_load={})
    verify_plan(plan, stats, moved, kept_samples={})
    assert {t.ids[0]: t.dst for t in plan.transfers} == {100: 2, 101: 2}


def test_plan_sending_to_a_full_instance_is_rejected():
    stats = [_stats(0, 9, 900), _stats(1, 1, 100)]
    moved = [MovedRequest(100, 1, 20, 30)]
    plan = build_plan(stats, [0, 1], [], kept_samples={}, freed_load={})  # nothing freed: valid
    verify_plan(plan, stats, [], kept_samples={})
    bad = MigrationPlan(kept=(0,), freed=(1,), transfers=(Transfer(1, 0, "request", (100,)),))
    with pytest.raises(PlanError, match="over capacity"):
        verify_plan(bad, stats, moved, kept_samples={})


def test_everything_kept_when_nothing_fits_elsewhere():
    stats = [_stats(0, 8, 500), _stats(1, 8, 400)]
    assert choose_kept(stats) == [0, 1]


def test_at_least_keeps_the_instances_with_the_most_work():
    stats = [_stats(0, 2, 100), _stats(1, 3, 700), _stats(2, 1, 300), _stats(3, 0, 0)]
    assert choose_kept(stats) == [1]
    assert choose_kept(stats, at_least=2) == [1, 2]
    assert choose_kept(stats, at_least=9) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="at_least"):
        choose_kept(stats, at_least=0)


def test_kept_room_counts_whole_requests_not_summed_kv():
    # Ranks 0 and 1 have 150 free KV tokens each (300 in all) and ranks 2-3 hold three 100-token requests
    # (300 KV tokens): summed KV fits, but each of 0 and 1 takes only one request; rank 2 must stay too.
    def st(rank, unfinished, remaining, reserved, largest):
        return InstanceStats(
            rank, unfinished, remaining, 8, kv_capacity_tokens=1000, kv_reserved_tokens=reserved, largest_request_tokens=largest
        )

    stats = [st(0, 4, 900, 850, 300), st(1, 4, 800, 850, 300), st(2, 2, 100, 200, 100), st(3, 1, 50, 100, 100)]
    kept = choose_kept(stats)
    assert kept == [0, 1, 2]
    moved = [MovedRequest(10, 3, 60, 40)]
    plan = build_plan(stats, kept, moved, kept_samples={}, freed_load={})
    verify_plan(plan, stats, moved, kept_samples={})
    assert [t.dst for t in plan.transfers] == [2]
    with pytest.raises(PlanError, match="fits on no kept instance"):  # what the summed-KV rule led to
        build_plan(
            stats,
            [0, 1],
            [MovedRequest(10, 3, 60, 40), MovedRequest(11, 2, 60, 40), MovedRequest(12, 2, 60, 40)],
            kept_samples={},
            freed_load={},
        )


def test_tail_streams_deal_the_freed_ranks_over_the_kept_ones():
    plan = MigrationPlan(kept=(1, 3), freed=(0, 2, 4), transfers=())
    assert plan.tail_streams(1) == (0, 4) and plan.tail_streams(3) == (2,)
    fewer_freed = MigrationPlan(kept=(0, 1, 2), freed=(3,), transfers=())
    assert [fewer_freed.tail_streams(k) for k in (0, 1, 2)] == [(3,), (3,), (3,)]
    # a freed rank asks the kept ranks that stream to it
    assert [plan.tail_sources(f) for f in (0, 2, 4)] == [[1], [3], [1]] and fewer_freed.tail_sources(3) == [0, 1, 2]
