"""Inter-stage fusion: migration plans, the rollout simulator, and fused vs unfused rollouts on 2 and 4 ranks."""

import time
from dataclasses import asdict, dataclass, replace

import pytest
import torch

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.models import build_model
from fusedrl.rlhf import Experience, Scorer, ScoringModels
from fusedrl.rollout_fusion import MigrationController
from fusedrl.rollout_fusion.controller import PROBE_ROWS
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
from fusedrl.rollout_fusion.simulator import (
    DEFAULT_FRACTIONS,
    STATS_LAG,
    RolloutConfig,
    RolloutCosts,
    SimRequest,
    _check_clock,
    admitted,
    best_migration,
    simulate_rollout,
    split_round_robin,
)
from fusedrl.rollout_fusion.workload import lmsys_lengths

# ------------------------------------------------------------------------------------------------ plans


def _stats(unfinished, remaining, slots=4):
    return [
        InstanceStats(r, u, rem, slots, slots * 100, 10 * u + rem, 100 if u else 0)
        for r, (u, rem) in enumerate(zip(unfinished, remaining))
    ]


def test_plan_keeps_fewest_instances_with_most_work_and_verifies():
    stats = _stats([2, 1, 1, 0], [30, 5, 8, 0])
    kept = choose_kept(stats)
    assert kept == [0]  # 4 unfinished fit into rank 0's 4 slots
    moved = [MovedRequest(10, 1, 7, 5), MovedRequest(11, 2, 9, 8)]
    samples = {0: [(1, 12), (2, 30)]}
    plan = build_plan(stats, kept, moved, samples, {1: 50.0, 2: 10.0, 3: 0.0})
    verify_plan(plan, stats, moved, samples)
    assert sorted(plan.moved_ids) == [10, 11] and plan.freed == (1, 2, 3)
    assert {t.dst for t in plan.transfers if t.kind == "samples"} <= {2, 3}  # least-loaded freed ranks


def test_plan_needs_more_instances_when_slots_run_out():
    stats = _stats([3, 3, 1], [30, 20, 1], slots=4)
    assert choose_kept(stats) == [0, 1]


def test_verifier_rejects_lost_duplicated_overfull_and_unpaired_plans():
    stats = _stats([1, 1], [5, 3], slots=2)
    moved = [MovedRequest(7, 1, 4, 3)]
    good = build_plan(stats, [0], moved, {0: []}, {1: 0.0})
    verify_plan(good, stats, moved, {0: []})
    with pytest.raises(PlanError, match="loses ids"):
        verify_plan(MigrationPlan((0,), (1,), ()), stats, moved, {0: []})
    dup = MigrationPlan((0,), (1,), good.transfers * 2)
    with pytest.raises(PlanError, match="duplicates"):
        verify_plan(dup, stats, moved, {0: []})
    full = _stats([2, 1], [5, 3], slots=2)
    with pytest.raises(PlanError, match="capacity"):
        verify_plan(good, full, moved, {0: []})
    # Two ranks each sending before receiving from the other would block forever with blocking P2P.
    stats3 = _stats([0, 1, 1], [0, 3, 3], slots=3)
    moved3 = [MovedRequest(1, 1, 4, 3), MovedRequest(2, 2, 4, 3)]
    a, b = Transfer(0, 1, "samples", (5,)), Transfer(1, 0, "request", (1,))
    crossed = MigrationPlan((0,), (1, 2), (b, Transfer(2, 0, "request", (2,)), a))
    verify_plan(crossed, stats3, moved3, {0: [(5, 3)]})  # one global order: fine

    class Reordered(MigrationPlan):
        def program(self, rank):
            ops = super().program(rank)
            return ops[::-1] if rank == 0 else ops

    with pytest.raises(PlanError, match="deadlock"):
        verify_plan(Reordered(crossed.kept, crossed.freed, crossed.transfers), stats3, moved3, {0: [(5, 3)]})


# ------------------------------------------------------------------------------------------------ simulator

PAPER_COSTS = RolloutCosts.for_models(actor_params=13e9, scorer_params=79e9, kv_bytes_per_token=819200)
PAPER_CONFIG = RolloutConfig(max_slots=128, kv_capacity_tokens=128 * 2200, check_interval=8, micro_batch_size=8)
SIM_COSTS = RolloutCosts(1e-3, 1e-5, 1e-7, 1e-5, 2e-3, 5e-5, 1e-4, 1e9, 1024.0)


def test_step_times_match_a_direct_sum():
    reqs = [SimRequest(5, 3), SimRequest(2, 7), SimRequest(9, 1)]
    times = simulate_rollout([reqs], PAPER_COSTS, PAPER_CONFIG, fused=False)
    want = PAPER_COSTS.prefill_per_token_s * 16
    for step in range(1, 8):
        active = [r for r in reqs if r.remaining >= step]
        want += PAPER_COSTS.decode_step_s(len(active), sum(r.ctx + step - 1 for r in active))
    assert times.decode_end_s == pytest.approx(want)
    assert times.total_s == pytest.approx(want + PAPER_COSTS.score_s([8, 9, 10], 8))


def test_requests_waiting_for_a_slot_decode_once_one_frees():
    reqs = admitted([(5, 4), (2, 2), (9, 3), (3, 1)], slots=2)
    assert [(r.start, r.end) for r in reqs] == [(0, 4), (0, 2), (2, 5), (4, 5)]  # the earliest free slot, in order
    costs = replace(SIM_COSTS, len_buckets=(4, 8, 16, 32), batch_buckets=(1, 2, 4))
    times = simulate_rollout([reqs], costs, PAPER_CONFIG, fused=False)
    want = costs.prefill_per_token_s * 19
    for step in range(1, 6):  # a request decodes in steps start + 1 .. end, its context grown by the steps it decoded
        active = [r for r in reqs if r.start < step <= r.end]
        ctx = [r.ctx + step - 1 - r.start for r in active]
        want += costs.decode_step_s(len(active), sum(ctx), max(ctx) - 1)
    assert times.decode_end_s == pytest.approx(want)
    # a second wave alone on its slot (its context offset from the start is negative), beside an instance done long
    # before the last step, which lies past the largest length bucket
    wave = admitted([(2, 10), (2, 10)], slots=1)
    short = replace(costs, len_buckets=(4, 8, 16))
    both = simulate_rollout([[SimRequest(2, 3)], wave], short, PAPER_CONFIG, fused=False)
    want = short.prefill_per_token_s * 6 + sum(short.decode_step_s(1, 2 + i, 1 + i) for i in range(3))
    want_wave = short.prefill_per_token_s * 4 + sum(short.decode_step_s(1, 2 + i % 10, 1 + i % 10) for i in range(20))
    assert both.decode_end_s == pytest.approx(max(want, want_wave))
    # migrating at step 3 (every check decides; 4 unfinished) with one request still queued on instance 0, which
    # keeps its tail: the queued one decodes its step after the migration, as it would have
    config = RolloutConfig(max_slots=2, kv_capacity_tokens=64, check_interval=1, micro_batch_size=8)
    fused = simulate_rollout([reqs, admitted([(4, 1)], 2)], costs, config, fused=True, threshold=4)
    assert (fused.migration_step, fused.kept) == (3, (0,)) and fused.decode_end_s >= times.decode_end_s


def test_scoring_of_one_micro_batch_size_is_fitted_per_token():
    decode = [(1, 10, 0.01), (2, 20, 0.012), (4, 40, 0.015)]
    costs = RolloutCosts.fit(decode, [(8, 100, 0.8), (8, 104, 0.84)])  # no fixed cost can be told apart
    assert costs.score_base_s == 0 and costs.score_per_token_s == pytest.approx(1.64 / 1632)
    varied = RolloutCosts.fit(decode, [(1, 100, 0.2), (8, 100, 0.9), (8, 50, 0.5)])
    assert varied.score_base_s > 0


def test_fused_is_no_slower_and_gains_grow_with_scoring_cost():
    instances = split_round_robin(lmsys_lengths(512, seed=0), 70, 16)
    gains = []
    for factor in (0.5, 1.0, 2.0, 4.0):
        costs = RolloutCosts(**{**PAPER_COSTS.__dict__, "score_per_token_s": PAPER_COSTS.score_per_token_s * factor})
        unfused = simulate_rollout(instances, costs, PAPER_CONFIG, fused=False)
        *_, fused = best_migration(instances, costs, PAPER_CONFIG)
        assert fused.total_s <= unfused.total_s
        assert fused.migration_step is not None and len(fused.kept) < len(instances)
        gains.append(unfused.total_s / fused.total_s)
    assert gains == sorted(gains) and gains[-1] > gains[0]


def test_a_migration_costing_more_than_it_hides_is_not_chosen():
    instances = split_round_robin(lmsys_lengths(512, seed=0), 70, 16)
    threshold, kept, fused = best_migration(instances, PAPER_COSTS, PAPER_CONFIG)
    gain = simulate_rollout(instances, PAPER_COSTS, PAPER_CONFIG, fused=True, threshold=0).total_s - fused.total_s
    assert fused.migration_step is not None and gain > 0
    # a migration's own cost holds every instance back by as much
    dearer = replace(PAPER_COSTS, migration_s=gain / 2)
    again = simulate_rollout(instances, dearer, PAPER_CONFIG, fused=True, threshold=threshold, min_kept=kept)
    assert again.total_s == pytest.approx(fused.total_s + gain / 2)
    threshold, _, never = best_migration(instances, replace(PAPER_COSTS, migration_s=2 * gain), PAPER_CONFIG)
    assert threshold == 0 and never.migration_step is None


def test_auto_keeps_more_instances_when_the_tails_kv_reads_dominate():
    # TP1 13B instances: a decode step reads the batch's KV cache (800 KB per token), so 26 long requests on
    # one instance decode ~2x slower than the weights alone; keeping 4-8 instances is faster.
    instances = split_round_robin(lmsys_lengths(512, seed=0), 70, 32)
    config = RolloutConfig(max_slots=256, kv_capacity_tokens=57_000, check_interval=8, micro_batch_size=8)
    fewest = min(
        (simulate_rollout(instances, PAPER_COSTS, config, fused=True, threshold=c) for c in (3, 5, 10, 26, 41)),
        key=lambda t: t.total_s,
    )
    threshold, min_kept, best = best_migration(instances, PAPER_COSTS, config)
    assert min_kept > 1 and len(best.kept) >= min_kept
    assert best.total_s < 0.98 * fewest.total_s  # 2.9% faster
    again = simulate_rollout(instances, PAPER_COSTS, config, fused=True, threshold=threshold, min_kept=min_kept)
    assert again.total_s == best.total_s


def test_checks_wait_only_for_an_instance_stats_lag_intervals_behind():
    assert STATS_LAG == 2  # the hand-computed clocks below
    # Slow intervals that alternate between two instances: in lockstep each interval would take the slower
    # one's 3 s (12 s for four checks); deciding on the all-gather of two checks before, neither waits.
    assert _check_clock(torch.tensor([[1.0, 3.0, 1.0, 3.0], [3.0, 1.0, 3.0, 1.0]]), [0.0, 0.0], 0.0, 3) == 8.0
    # A slow instance holds a fast one back: at check 3 the fast one (3 s) waits for the slow one's check 1 (5 s),
    # so its long last interval ends at 5 + 10 s, not at 3 + 10 s (lockstep: 5 + 5 + 5 + 10 s).
    assert _check_clock(torch.tensor([[1.0, 1.0, 1.0, 10.0], [5.0, 5.0, 5.0, 0.0]]), [0.0, 0.0], 0.0, 3) == 15.0
    # check_s is paid at every check: two checks of 1 + 0.5 s
    assert _check_clock(torch.tensor([[1.0, 1.0]]), [0.25], 0.5, 1) == 3.25


def test_migration_decides_on_the_count_of_stats_lag_checks_before():
    config = RolloutConfig(max_slots=8, kv_capacity_tokens=10_000, check_interval=1, micro_batch_size=8)
    instances = [[SimRequest(10, 1), SimRequest(10, 1), SimRequest(10, 30)], [SimRequest(10, 1), SimRequest(10, 40)]]
    # 2 unfinished from step 1 on: the check after step 1 + STATS_LAG decides on the count after step 1.
    assert simulate_rollout(instances, SIM_COSTS, config, fused=True, threshold=2).migration_step == 1 + STATS_LAG
    # A fresh rollout decides first at check STATS_LAG + 1, even on a threshold the whole batch meets ...
    assert simulate_rollout(instances, SIM_COSTS, config, fused=True, threshold=5).migration_step == 1 + STATS_LAG
    # ... a rollout resumed mid-way ("auto" simulating from a check) takes its starting count for earlier checks.
    resumed = RolloutConfig(**{**config.__dict__, "prefill": False})
    assert simulate_rollout(instances, SIM_COSTS, resumed, fused=True, threshold=5).migration_step == 1


def test_kept_instance_scores_its_share_of_its_last_step():
    # Instance 0 decodes three equal requests that end at the same step; the others' requests are done by the
    # migration. Instance 0 scores one of the three itself and each freed instance one: one sample's scoring is
    # exposed after decoding (three on one freed instance, or two, without the kept instance's share).
    config = RolloutConfig(max_slots=8, kv_capacity_tokens=10_000, check_interval=2, micro_batch_size=8)
    instances = [[SimRequest(10, 40)] * 3, [SimRequest(10, 2)], [SimRequest(10, 2)]]
    t = simulate_rollout(instances, SIM_COSTS, config, fused=True, threshold=3)
    assert t.kept == (0,) and t.moved == 0
    assert t.total_s == pytest.approx(t.decode_end_s + SIM_COSTS.score_s([50], 8))
    assert [s for s in t.spans if s[:2] == (0, "score")] == [(0, "score", t.decode_end_s, t.total_s)]


def test_tail_samples_are_scored_by_whoever_is_free_first():
    # Instance 0 keeps a tail of three requests ending at different steps; instance 1's request is done by the
    # migration. Free at once, instance 1 scores the tail samples as they finish (two before the tail ends); busy with
    # a long backlog, it leaves them all to instance 0, which scores them once its tail has ended.
    config = RolloutConfig(max_slots=8, kv_capacity_tokens=10_000, check_interval=2, micro_batch_size=8)
    instances = [[SimRequest(10, n) for n in (20, 30, 40)], [SimRequest(10, 2)]]
    idle = simulate_rollout(instances, SIM_COSTS, config, fused=True, threshold=3)
    assert idle.kept == (0,)
    scored = [s for s in idle.spans if s[:2] == (1, "score") and s[2] < s[3]]
    assert len(scored) == 3 and all(s[2] < idle.decode_end_s for s in scored)  # its own sample + 2 of the tail
    assert len([s for s in idle.spans if s[:2] == (0, "score")]) == 1  # the last, free at its end as instance 1 is
    busy = simulate_rollout(instances, SIM_COSTS, config, fused=True, threshold=3, backlog=[[], [50] * 40])
    kept_scores = [s for s in busy.spans if s[:2] == (0, "score")]
    assert len(kept_scores) == 3 and all(s[2] >= busy.decode_end_s for s in kept_scores)
    assert busy.total_s == pytest.approx(max(s[3] for s in busy.spans if s[:2] == (1, "score")))


def test_more_instances_decode_faster_and_threshold_zero_never_migrates():
    lengths = lmsys_lengths(256, seed=1)
    t = [simulate_rollout(split_round_robin(lengths, 70, n), PAPER_COSTS, PAPER_CONFIG, fused=False).total_s for n in (2, 4, 8)]
    assert t[0] > t[1] > t[2]
    inst = split_round_robin(lengths, 70, 4)
    never = simulate_rollout(inst, PAPER_COSTS, PAPER_CONFIG, fused=True, threshold=0)
    assert never.migration_step is None and never.moved == 0


def test_fit_recovers_costs():
    truth = RolloutCosts(2e-3, 1e-4, 1e-7, 5e-6, 3e-3, 2e-6, 1e-4, 1e9, 1000.0)
    decode = [(b, c, truth.decode_step_s(b, c)) for b, c in [(1, 10), (4, 300), (8, 100), (16, 2000), (3, 50)]]
    score = [(r, w, truth.score_base_s + truth.score_per_token_s * r * w) for r, w in [(1, 20), (8, 40), (4, 100)]]
    fit = RolloutCosts.fit(
        decode,
        score,
        transfers=[(1e6, 1e-4 + 1e-3), (1e7, 1e-4 + 1e-2), (4e6, 1e-4 + 4e-3)],
        kv_bytes_per_token=1000.0,
        migrations=[0.01, 0.03],
    )
    assert fit.migration_s == pytest.approx(0.02) and RolloutCosts.fit(decode, score).migration_s == 0.0
    for name in ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s", "score_base_s", "score_per_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fit.transfer_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert fit.transfer_latency_s == pytest.approx(1e-4, rel=1e-6)
    same_size = RolloutCosts.fit(decode, score, transfers=[(5000, 1e-3), (5001, 3e-3), (5000, 2e-3)])
    assert same_size.transfer_bytes_per_s == float("inf") and same_size.transfer_latency_s == pytest.approx(2e-3)


def test_bucketed_step_times_match_the_engine_padding():
    costs = RolloutCosts(
        **{**SIM_COSTS.__dict__, "decode_per_row_s": 3e-5, "batch_buckets": (1, 2, 4, 8), "len_buckets": (8, 16, 32)}
    )
    reqs = [SimRequest(5, 3), SimRequest(7, 9), SimRequest(2, 12)]
    times = simulate_rollout([reqs], costs, PAPER_CONFIG, fused=False)
    want = costs.prefill_per_token_s * 14
    for step in range(1, 13):
        active = [r for r in reqs if r.remaining >= step]
        longest = max(r.ctx + step - 2 for r in active)  # cached positions: all but the pending token
        rows = {1: 1, 2: 2, 3: 4}[len(active)]
        attended = rows * next(b for b in (8, 16, 32) if b > longest)
        want += costs.decode_base_s + costs.decode_per_seq_s * len(active) + 3e-5 * rows + costs.decode_per_ctx_token_s * attended
        assert costs.decode_step_s(len(active), sum(r.ctx + step - 2 for r in active), longest) == pytest.approx(
            costs.decode_base_s + costs.decode_per_seq_s * len(active) + 3e-5 * rows + costs.decode_per_ctx_token_s * attended
        )
    assert times.decode_end_s == pytest.approx(want)


def test_fit_recovers_bucketed_costs_and_the_attention_term():
    truth = RolloutCosts(
        2e-3,
        4e-5,
        3e-8,
        0.0,
        3e-3,
        2e-6,
        0.0,
        float("inf"),
        0.0,
        decode_per_row_s=1e-4,
        score_per_token_sq_s=4e-9,
        batch_buckets=(1, 2, 4, 8, 16),
        len_buckets=(64, 128, 256),
    )
    # Requests that started together share one context length, as in an unfused stage.
    decode = [
        (n, n * c, truth.decode_step_s(n, n * c))
        for n, c in [(16, 40), (13, 70), (9, 100), (5, 130), (3, 200), (2, 230), (1, 250), (7, 90)]
    ]
    score = [(r, w, truth.score_s([w] * r, r)) for r, w in [(1, 20), (8, 40), (4, 100), (2, 300), (6, 10)]]
    fit = RolloutCosts.fit(decode, score, batch_buckets=truth.batch_buckets, len_buckets=truth.len_buckets)
    for name in (
        "decode_base_s",
        "decode_per_seq_s",
        "decode_per_row_s",
        "decode_per_ctx_token_s",
        "score_base_s",
        "score_per_token_s",
        "score_per_token_sq_s",
    ):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_fit_drops_negative_coefficients_and_keeps_the_measured_sum():
    # Step times that fall with the context (load noise) would give a negative per-token cost: it is
    # dropped, not clamped after the fit, so the refitted model still sums to the measured time.
    decode = [(4, 100, 0.010), (4, 400, 0.008), (2, 300, 0.006), (8, 200, 0.015), (1, 500, 0.004)]
    fit = RolloutCosts.fit(decode, [(1, 10, 1e-3), (2, 10, 2e-3)])
    assert fit.decode_per_ctx_token_s == 0.0 and fit.decode_per_seq_s > 0
    assert sum(fit.decode_step_s(b, c) for b, c, _ in decode) == pytest.approx(sum(s for *_, s in decode))


def test_balanced_unfused_scoring_is_no_slower_and_tensor_parallel_costs_scale():
    lengths = lmsys_lengths(256, seed=2)
    inst = split_round_robin(lengths, 70, 8)
    own = simulate_rollout(inst, PAPER_COSTS, PAPER_CONFIG, fused=False)
    balanced = simulate_rollout(
        inst, PAPER_COSTS, RolloutConfig(**{**PAPER_CONFIG.__dict__, "unfused_scoring": "balanced"}), fused=False
    )
    assert balanced.decode_end_s == own.decode_end_s and balanced.total_s <= own.total_s
    tp4 = RolloutCosts.for_models(
        actor_params=13e9, scorer_params=79e9, kv_bytes_per_token=819200, gpus_per_instance=4, actor_layers=40
    )
    assert tp4.score_per_token_s == pytest.approx(PAPER_COSTS.score_per_token_s / 4)
    assert tp4.transfer_bytes_per_s == pytest.approx(4 * PAPER_COSTS.transfer_bytes_per_s)
    weights_tp1 = PAPER_COSTS.decode_base_s - 2e-3
    assert tp4.decode_base_s == pytest.approx(2e-3 + 80 * 15e-6 + weights_tp1 / 4)
    with pytest.raises(ValueError, match="gpus_per_instance"):
        RolloutCosts.for_models(actor_params=1e9, scorer_params=1e9, kv_bytes_per_token=1.0, gpus_per_instance=0)


def test_bench_paper_scale_grpo_mix_scores_with_the_reference_alone():
    """bench.fusion's GRPO rows: each PPO setting's Actor, KV cache and lengths, scored by the Reference alone (no
    Critic, no Reward model): the same decoding, less scoring, a lower bound; each setting reports the share of its
    own possible gain (a small batch: the simulation takes a few seconds)."""
    from fusedrl.bench import fusion

    models = {name: rest for name, *rest in fusion.PAPER_MODELS}
    assert set(models) == set(fusion.GRPO_MIX) | set(fusion.GRPO_MIX.values())
    rows = fusion.paper_scale(batch=32)
    for ppo_name, grpo_name in fusion.GRPO_MIX.items():
        (actor, ppo_scorer, kv, layers), grpo = models[ppo_name], models[grpo_name]
        assert grpo == [actor, actor, kv, layers] and ppo_scorer > actor  # the Reference is Actor-sized
        for gpu in fusion.HARDWARE:
            for tp in fusion.PAPER_TP:
                p, g = (
                    next(r for r in rows if (r["hardware"], r["models"], r["tp"]) == (gpu.name, m, tp))
                    for m in (ppo_name, grpo_name)
                )
                assert g["decode_s"] == p["decode_s"] and 0 < g["scoring_s"] < p["scoring_s"]
            ppo, mix = (fusion.setting_figures(rows, gpu.name, m) for m in (ppo_name, grpo_name))
            assert 1 < mix["bound"] < ppo["bound"] and mix["speedup"] >= 1
            assert mix["gain_share"] == pytest.approx((mix["speedup"] - 1) / (mix["bound"] - 1))


# ------------------------------------------------------------------------------------------------ multi-rank

SAMPLED = dict(temperature=0.9, top_k=50, top_p=0.95)


@dataclass(frozen=True)
class Scenario:
    lengths: tuple[int, ...]
    threshold: float | str
    mode: str = "kv"
    check_interval: int = 2
    costs: RolloutCosts | None = None
    max_slots: int | None = None  # default: the whole batch fits
    own_group: bool = False  # the controller on a separate gloo group (what the trainer does under NCCL)
    slow_rank: int | None = None  # fused, this rank's scoring of several samples at once takes SLOW_BATCH_S longer


SLOW_BATCH_S = 1.0  # ~10x a debug tail's decoding on a loaded machine (~40 steps of a few ms)


def _models():
    torch.manual_seed(0)
    actor = build_model("debug", "policy").eval()
    scoring = ScoringModels(
        build_model("debug", "policy").eval(), build_model("debug", "value").eval(), build_model("debug", "value").eval()
    )
    return actor, scoring


def _requests(lengths, rank, world):
    g = torch.Generator().manual_seed(42)
    prompts = [torch.randint(0, 512, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist() for _ in lengths]
    return [Request(i, prompts[i], SamplingParams(target_len=n, **SAMPLED)) for i, n in enumerate(lengths) if i % world == rank]


def _slowed(score):
    def slow_score(batch):
        if len(batch) > 1:  # a backlog's micro-batch; the tail's samples are scored one at a time
            time.sleep(SLOW_BATCH_S)
        return score(batch)

    return slow_score


def _run_scenarios(scenarios: dict) -> dict:
    import torch.distributed as dist

    actor, scoring = _models()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, sc in scenarios.items():
        res = {}
        for fusion in (False, True):
            engine = GenerationEngine(actor, max_slots=sc.max_slots or len(sc.lengths), max_len=64, seed=11)
            group = dist.new_group(backend="gloo") if sc.own_group else None
            score = Scorer(scoring).score
            if fusion and sc.slow_rank == rank:
                score = _slowed(score)
            ctl = MigrationController(
                engine,
                score,
                micro_batch_size=3,
                fusion=fusion,
                threshold=sc.threshold,
                mode=sc.mode,
                check_interval=sc.check_interval,
                costs=sc.costs,
                group=group,
            )
            r = ctl.run(_requests(sc.lengths, rank, world), gather=True)
            e = Experience.concat(r.scored)
            e = e.select(e.sample_ids.argsort())
            spans = {ev["name"] for ev in r.trace.events if ev["ph"] == "X"}
            # each rank's own end of the migration (the ranks leave it at different times)
            migrate_end = {ev["pid"]: ev["ts"] + ev["dur"] for ev in r.trace.events if ev["name"] == "migrate"}
            scored_after: dict[int, int] = {}  # rank -> samples it scored after its migration
            for ev in r.trace.events:
                if ev["name"] == "score" and ev["ts"] >= migrate_end.get(ev["pid"], float("inf")):
                    scored_after[ev["pid"]] = scored_after.get(ev["pid"], 0) + ev["args"]["samples"]
            res[fusion] = dict(
                scored_after=scored_after,
                migration_costs=list(r.measurements.migrations),
                exp={
                    k: getattr(e, k)
                    for k in ("tokens", "response_mask", "logprobs", "ref_logprobs", "values", "scores", "sample_ids")
                },
                migration=None if r.migration is None else r.migration.as_dict(),
                auto=None if r.auto is None else asdict(r.auto),
                spans=spans,
            )
        out[name] = res
    return out


def _check_same_outputs(off, on):
    a, b = off["exp"], on["exp"]
    assert a["sample_ids"].tolist() == b["sample_ids"].tolist()
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["response_mask"], b["response_mask"])
    # Decode batches differ in size once requests move, so log-probs may differ by float reassociation
    # (~1e-7); re-prefilled KV adds the same kind of difference.
    for k in ("logprobs", "ref_logprobs", "values", "scores"):
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)


# With check_interval 2, a check decides on the count of STATS_LAG checks earlier: the first to decide (on the
# count after step 2) is the one after step DECIDE_STEP. A request of length n has n - s - 1 tokens left then.
DECIDE_STEP = 2 * (STATS_LAG + 1)
TAIL_LAST_STEP = (2, DECIDE_STEP + 2, DECIDE_STEP + 2, 2, 2, 2, 2, 2)  # ids 1, 2 (ranks 1, 0): one token left then
TAIL_ON_ONE_RANK = (DECIDE_STEP + 4, 2, DECIDE_STEP + 4, 2, 2, 2, 2, 2)  # the tail (ids 0, 2) is all on rank 0
LENGTHS_2 = (40, 3, 5, 30, 1, 1, 5, 6, 3, 1, 12, 2, 5, 24, 3, 5)  # LMSYS-like; a tail on both ranks outlasting the lag
SCENARIOS_2 = {
    "kv": Scenario(LENGTHS_2, 0.3, "kv"),
    "reprefill": Scenario(LENGTHS_2, 0.3, "reprefill"),
    "last_step": Scenario(TAIL_LAST_STEP, 0.25, "kv"),
    "nothing_to_move": Scenario(TAIL_ON_ONE_RANK, 0.25, "kv"),
    "never_reached": Scenario((5,) * 8, 0.1, "kv"),
    # the freed rank (0) still scores its backlog when the tail ends: the kept rank scores the tail's samples itself
    "slow_backlog": Scenario(LENGTHS_2, 0.3, "kv", slow_rank=0),
    # 2 slots per rank: at the first deciding check each rank holds 3 unfinished requests (one queued), at most the
    # threshold of 6, but neither rank has a free slot for the other's, so migration is skipped.
    "no_room": Scenario((8, 8, 8, 8, 3, 3), 0.99, "kv", max_slots=2),
}


@pytest.fixture(scope="module")
def two_ranks(rank_pools):
    return rank_pools(2).run(_run_scenarios, SCENARIOS_2, timeout_s=240)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kv", "reprefill"])
def test_two_ranks_fusion_changes_no_output(two_ranks, name):
    off, on = two_ranks[name][False], two_ranks[name][True]
    _check_same_outputs(off, on)
    assert off["migration"] is None
    m = on["migration"]
    assert m["moved"] > 0 and m["moved_bytes"] > 0 and len(m["kept"]) == 1
    assert m["unfinished"] <= m["threshold"] == round(0.3 * 16)
    assert {"decode", "migrate", "score"} <= on["spans"]
    assert off["migration_costs"] == [] and len(on["migration_costs"]) == 1 and on["migration_costs"][0] > 0


def test_two_ranks_a_kept_rank_scores_its_tail_while_the_freed_one_is_busy(two_ranks):
    off, on = two_ranks["slow_backlog"][False], two_ranks["slow_backlog"][True]
    _check_same_outputs(off, on)
    m = on["migration"]
    assert m["kept"] == [1] and m["moved"] > 0
    # the freed rank asks for tail samples only once its backlog (a micro-batch or more, SLOW_BATCH_S each) is scored
    assert on["scored_after"].get(1, 0) >= 1 and on["scored_after"][0] > 1


def test_two_ranks_migration_at_the_last_step(two_ranks):
    off, on = two_ranks["last_step"][False], two_ranks["last_step"][True]
    _check_same_outputs(off, on)
    m = on["migration"]
    assert m["step"] == DECIDE_STEP and m["moved"] == 1 and m["kept"] == [0] and m["unfinished"] == 2
    assert on["exp"]["sample_ids"].tolist() == list(range(8))


def test_two_ranks_threshold_with_nothing_to_move(two_ranks):
    off, on = two_ranks["nothing_to_move"][False], two_ranks["nothing_to_move"][True]
    _check_same_outputs(off, on)
    m = on["migration"]
    assert m["moved"] == 0 and m["moved_bytes"] == 0 and m["kept"] == [0] and m["sample_bytes"] > 0


def test_two_ranks_no_room_to_migrate_skips_migration(two_ranks):
    off, on = two_ranks["no_room"][False], two_ranks["no_room"][True]
    _check_same_outputs(off, on)
    assert on["migration"] is None and "migrate" not in on["spans"]
    assert on["exp"]["sample_ids"].tolist() == list(range(6))


def test_two_ranks_threshold_never_reached(two_ranks):
    off, on = two_ranks["never_reached"][False], two_ranks["never_reached"][True]
    _check_same_outputs(off, on)
    assert on["migration"] is None and on["exp"]["sample_ids"].tolist() == list(range(8))


def _lengths_of_two_rollouts() -> tuple[list, list, list]:
    import torch.distributed as dist

    from fusedrl.rollout_fusion import controller

    actor, _ = _models()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = GenerationEngine(actor, max_slots=8, max_len=64, seed=3)
    # "auto" with known costs, checked every 2 steps: the tail's remaining lengths are estimated in both rollouts
    ctl = MigrationController(
        engine,
        lambda samples: [(s.num_tokens - len(s.prompt), s.finish_reason) for s in samples],
        check_interval=2,
        costs=SIM_COSTS,
    )
    estimate, observed = controller.remaining_lengths, []

    def recording(instances, finished):
        observed.append(list(finished))
        return estimate(instances, finished)

    controller.remaining_lengths = recording  # this worker process serves later tests: restored below
    try:
        seen, before = [], []
        for rollout in range(2):
            g = torch.Generator().manual_seed(rollout)
            prompts = [torch.randint(0, 512, (4,), generator=g).tolist() for _ in range(8)]
            # stop tokens a sampled response meets at varied lengths; some run to their budget of 12
            sampling = SamplingParams(max_new_tokens=12, stop_token_ids=tuple(range(0, 512, 9)), **SAMPLED)
            before.append((list(ctl._last_lengths), len(observed)))
            r = ctl.run([Request(i, p, sampling) for i, p in enumerate(prompts) if i % world == rank], gather=True)
            seen.append(sorted((n, reason == "length") for part in r.scored for n, reason in part))
    finally:
        controller.remaining_lengths = estimate
    # the lengths the second rollout's first estimate started from (rank 0 simulates), and the first rollout's
    seeded = observed[before[1][1]] if rank == 0 and len(observed) > before[1][1] else None
    return seen, ctl._last_lengths, [before[1][0], seeded]


@pytest.mark.slow
def test_a_rollout_leaves_every_ranks_lengths_for_the_next_ones_estimate(rank_pools):
    seen, last, (first_rollouts, seeded) = rank_pools(2).run(_lengths_of_two_rollouts, timeout_s=120)[0]
    assert sorted(last) == seen[1] != seen[0]  # the last rollout's, not the first's, from both ranks
    assert {cut for _, cut in last} == {True, False}  # stopped and cut samples, told apart
    # the second rollout's estimate starts from the first rollout's lengths, then adds its own
    assert sorted(first_rollouts) == seen[0]
    assert seeded is not None, "the second rollout estimated no remaining lengths"
    assert seeded[: len(first_rollouts)] == first_rollouts


def _first_scoring_measurements() -> list[int]:
    import torch.distributed as dist

    actor, scoring = _models()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = GenerationEngine(actor, max_slots=8, max_len=160, seed=3)
    ctl = MigrationController(engine, Scorer(scoring).score, micro_batch_size=8, check_interval=2)  # "auto", no costs
    lengths = (3, 120, 4, 120, 5, 120, 6, 120, 7, 120, 8, 120, 110, 120)  # rank 0's short ones end 100+ steps early
    r = ctl.run(_requests(lengths, rank, world))
    return [rows for rows, _, _ in r.measurements.score]


@pytest.mark.slow
def test_auto_measures_scoring_on_one_sample_then_on_a_micro_batch(rank_pools):
    # the first rollout knows no scoring cost: rank 0 scores one of its 6 short samples at once, then PROBE_ROWS of
    # the other 5 (without that second measurement it would score all 5 together, later)
    rank0, _ = rank_pools(2).run(_first_scoring_measurements, timeout_s=120)
    assert rank0[:2] == [1, PROBE_ROWS]


LENGTHS_4 = tuple(lmsys_lengths(24, seed=5, max_len=48)[:4]) + (40, 36, 30, 24) + tuple(lmsys_lengths(24, seed=5, max_len=48)[8:])
SCENARIOS_4 = {
    "auto_kv": Scenario(LENGTHS_4, "auto", "kv", costs=SIM_COSTS),
    "reprefill": Scenario(LENGTHS_4, 0.25, "reprefill"),
    "own_group": Scenario(LENGTHS_4, 0.25, "kv", own_group=True),
}


@pytest.mark.slow
def test_four_ranks_fusion_changes_no_output(rank_pools):
    results = rank_pools(4).run(_run_scenarios, SCENARIOS_4, timeout_s=240)[0]
    for name in SCENARIOS_4:
        off, on = results[name][False], results[name][True]
        _check_same_outputs(off, on)
        assert on["exp"]["sample_ids"].tolist() == list(range(24))
    m = results["own_group"][True]["migration"]
    assert m["moved"] > 0 and 1 <= len(m["kept"]) < 4
    m = results["reprefill"][True]["migration"]
    assert m["moved"] > 0 and 1 <= len(m["kept"]) < 4 and m["unfinished"] <= m["threshold"]  # tail on all 4 ranks
    auto = results["auto_kv"][True]["migration"]
    assert auto is not None, "with these costs the simulator finds migrating worthwhile"
    candidates = {0} | {max(1, round(f * 24)) for f in DEFAULT_FRACTIONS}
    assert auto["threshold"] in candidates and auto["unfinished"] <= auto["threshold"]  # chosen by the simulator
    decision = results["auto_kv"][True]["auto"]  # the simulator's choice and prediction, reported with the rollout
    assert decision["threshold"] == auto["threshold"] and 1 <= decision["min_kept"] < 4
    # causal order only: when the migration runs against the predicted end depends on the machine's load
    assert 0 < decision["at_s"] <= auto["time_s"] and decision["predicted_s"] > decision["at_s"]
    assert all(results[name][fusion]["auto"] is None for name in ("reprefill", "own_group") for fusion in (False, True))


def _score_on_one_rank(lengths: list[int], micro_batch_size: int) -> tuple[list[list[tuple[int, int]]], list, list]:
    """One rank, fusion off: what the score callable is handed, what the controller measured, what it returns."""
    import torch.distributed as dist

    from fusedrl.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        actor, _ = _models()
        calls: list[list[tuple[int, int]]] = []

        def score(samples):
            calls.append([(s.id, s.num_tokens) for s in samples])
            return len(calls)

        ctl = MigrationController(
            GenerationEngine(actor, max_slots=4, max_len=32), score, micro_batch_size=micro_batch_size, fusion=False
        )
        result = ctl.run([Request(i, [1, 2, 3], SamplingParams(target_len=n)) for i, n in enumerate(lengths)])
        return calls, result.measurements.score, result.scored
    finally:
        dist.destroy_process_group()


def test_controller_scores_length_sorted_micro_batches_and_times_each():
    calls, timings, scored = _score_on_one_rank([5, 2, 9, 1, 4], micro_batch_size=2)
    assert [[sid for sid, _ in call] for call in calls] == [[3, 1], [4, 0], [2]]  # shortest first, at most 2 each
    assert [(rows, width) for rows, width, _ in timings] == [(2, 5), (2, 8), (1, 12)]  # padded to the longest
    assert scored == [1, 2, 3]  # the callable's outputs, in call order, uninspected


def test_bad_controller_arguments():
    actor, scoring = _models()
    engine = GenerationEngine(actor, max_slots=2, max_len=32)
    with pytest.raises(ValueError, match="threshold"):
        MigrationController(engine, Scorer(scoring).score, threshold=1.5)
    with pytest.raises(ValueError, match="mode"):
        MigrationController(engine, Scorer(scoring).score, mode="copy")
    with pytest.raises(ValueError, match="micro_batch_size"):
        MigrationController(engine, Scorer(scoring).score, micro_batch_size=0)
    with pytest.raises(RuntimeError, match="needs a process group .* engine.generate and scorer.score"):
        MigrationController(engine, Scorer(scoring).score).run([Request(0, [1, 2], SamplingParams(max_new_tokens=2))])
    assert engine.num_unfinished == 0  # refused before any request entered the engine
    fresh = MigrationController(engine, Scorer(scoring).score, fusion="auto")
    state = fresh.state_dict()  # no process group: this process's own state, no collective
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def _two_gated_rollouts() -> list:
    import torch.distributed as dist

    actor, scoring = _models()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = GenerationEngine(actor, max_slots=16, max_len=64, seed=11)
    # SIM_COSTS slowed 1000x: the simulator promises a gain of a rollout it predicts ~40 s long; the measured one
    # takes well under a second (10 s on a machine 100x slower would still be 3x off)
    costs = RolloutCosts(1.0, 1e-2, 1e-4, 1e-2, 2.0, 5e-2, 0.1, 1e6, 1024.0)
    ctl = MigrationController(engine, Scorer(scoring).score, micro_batch_size=3, min_gain=0.05, check_interval=2, costs=costs)
    out = []
    for _ in range(2):
        r = ctl.run(_requests(LENGTHS_2, rank, world))
        out.append((r.migration is not None, ctl.prediction_error, ctl.required_gain()))
    return out


def _auto_fusion_rollouts() -> list:
    import torch.distributed as dist

    actor, scoring = _models()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = GenerationEngine(actor, max_slots=4, max_len=64, seed=11)  # 8 requests a rank: half of them queue
    ctl = MigrationController(engine, Scorer(scoring).score, micro_batch_size=3, fusion="auto", threshold=0.25, check_interval=2)
    out = []
    for calibrated in (None, None, 1e3, 1e-3):  # measured / simulated fused: nothing yet, then far slower, far faster
        if calibrated is not None:
            ctl.calibration[True].clear()
            ctl.calibration[True].append(calibrated)
        r = ctl.run(_requests(LENGTHS_2, rank, world), gather=True)
        e = Experience.concat(r.scored)
        e = e.select(e.sample_ids.argsort())
        c = r.fusion_choice
        out.append((r.fused, c and (c.fused, c.fused_s, c.unfused_s), r.migration is not None, e.tokens, e.ref_logprobs))
    resumed = MigrationController(GenerationEngine(actor, max_slots=4, max_len=64, seed=11), Scorer(scoring).score, fusion="auto")
    resumed.load_state_dict(ctl.state_dict())
    return out, ctl.state_dict(), resumed.state_dict()


@pytest.mark.slow
def test_auto_fusion_measures_both_ways_then_fuses_where_the_calibrated_simulation_is_shorter(rank_pools):
    (rollouts, state, resumed), (rank1, state1, _) = rank_pools(2).run(_auto_fusion_rollouts, timeout_s=120)
    (u, c1, m1, tokens, ref), (f, c2, m2, *_), (slow, c3, _, *_), (fast, c4, _, *_) = rollouts
    assert [r[:3] for r in rank1] == [r[:3] for r in rollouts]  # every rank took rank 0's choice
    assert state == state1 == resumed  # what a checkpoint saves: rank 0's on every rank, and restored whole
    assert (u, c1, m1) == (False, (False, 0.0, 0.0), False)  # nothing measured: unfused, measuring
    assert (f, c2, m2) == (True, (True, 0.0, 0.0), True)  # then fused (it migrates at 0.25 of the batch), measuring
    assert not slow and not c3[0] and c3[1] > c3[2] > 0  # fused scaled 1000x: the unfused rollout is shorter
    assert fast and c4[0] and 0 < c4[1] < c4[2]
    for _, _, _, t, r in rollouts[1:]:  # the same samples and scores whichever way
        assert torch.equal(t, tokens) and torch.allclose(r, ref, atol=1e-5)


@pytest.mark.slow
def test_auto_stops_trusting_a_simulator_far_off(rank_pools):
    (first, error, required), (second, *_) = rank_pools(2).run(_two_gated_rollouts, timeout_s=120)[0]
    assert first and error > 5 and required == error  # migrated on the promised gain; the prediction was far off
    assert not second  # no gain the simulator promises is larger than its last error


# ------------------------------------------------------------------------------------ instances of 2 TP ranks

TP_LENGTHS = tuple(lmsys_lengths(16, seed=7, max_len=40))


def _tp_rollouts(gen_tp: int) -> dict:
    """16 seeded-sampling requests on 4 ranks as 4 // gen_tp instances of gen_tp tensor-parallel ranks, with
    fusion off, on (kv) and on (reprefill); models: the same random weights, TP-sharded when gen_tp = 2."""
    import torch.distributed as dist

    from fusedrl.distributed import ParallelDims, apply_tp

    mesh = ParallelDims(dp_shard=dist.get_world_size(), gen_tp=gen_tp).build_gen_mesh("cpu")
    actor, scoring = _models()
    if gen_tp > 1:
        for m in (actor, scoring.reference, scoring.reward, scoring.critic):
            apply_tp(m, mesh["gen_tp"])
    instance, instances = mesh["gen_dp"].get_local_rank(), mesh["gen_dp"].size()
    out = {}
    for name, fusion, mode in (("off", False, "kv"), ("kv", True, "kv"), ("reprefill", True, "reprefill")):
        engine = GenerationEngine(actor, max_slots=8, max_len=64, seed=11)
        ctl = MigrationController(
            engine,
            Scorer(scoring).score,
            micro_batch_size=3,
            fusion=fusion,
            threshold=0.4,
            mode=mode,
            check_interval=2,
            group=mesh["gen_dp"].get_group(),
            instance_group=mesh["gen_tp"].get_group(),
        )
        r = ctl.run(_requests(TP_LENGTHS, instance, instances), gather=True)
        e = Experience.concat(r.scored)
        e = e.select(e.sample_ids.argsort())
        out[name] = dict(
            exp={
                k: getattr(e, k)
                for k in ("tokens", "response_mask", "logprobs", "ref_logprobs", "values", "scores", "sample_ids")
            },
            migration=None if r.migration is None else r.migration.as_dict(),
        )
    return out


@pytest.mark.slow
def test_instances_of_two_tp_ranks_give_the_samples_and_scores_of_single_rank_instances(rank_pools):
    single = rank_pools(4).run(_tp_rollouts, 1, timeout_s=300)
    tp2 = rank_pools(4).run(_tp_rollouts, 2, timeout_s=300)
    reference = single[0]["off"]
    for rank, runs in enumerate(tp2):
        for name in ("off", "kv", "reprefill"):
            _check_same_outputs(reference, runs[name])  # identical tokens; scores to float reassociation
            assert runs[name]["exp"]["sample_ids"].tolist() == list(range(16))
        for name in ("kv", "reprefill"):
            m = runs[name]["migration"]
            assert m is not None and m["moved"] > 0 and m["kept"] == [0], (rank, name, m)  # 2 instances: one kept
            assert m == tp2[0][name]["migration"]  # every rank reports the same migration


# ------------------------------------------------------------------------------------------------ multi-turn


class _SlowSecondTurn:
    """An environment (built lazily: fusedrl.envs is imported in the ranks) that answers a first turn after
    ``row["sleep"]`` seconds with " again:" and ends the episode at the second turn, rewarding its length."""

    def __new__(cls, row):
        import time

        from fusedrl.envs import Environment, EnvStep

        class Env(Environment):
            turns = 0

            def step(self, text):
                self.turns += 1
                if self.turns == 1:
                    time.sleep(row["sleep"])
                    return EnvStep(observation=" again:")
                return EnvStep(reward=float(len(text)), done=True)

        return Env()


MULTI_TURN_SLEEPS = (0.0, 0.0, 0.0, 0.0, 0.6, 0.0, 0.6, 0.0)  # ids 4 and 6 (rank 0) wait while 0 and 2 are done


def _multi_turn_rollouts() -> dict:
    import torch.distributed as dist

    from fusedrl.components import ByteTokenizer
    from fusedrl.envs import EnvRunner
    from fusedrl.rlhf import Episodes

    actor, scoring = _models()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for fusion in (False, True):
        engine = GenerationEngine(actor, max_slots=8, max_len=64, seed=11)
        episodes = Episodes(engine, EnvRunner(_SlowSecondTurn, workers=4), ByteTokenizer(), max_tokens=40)
        requests = _requests((3,) * len(MULTI_TURN_SLEEPS), rank, world)
        requests = episodes.begin(requests, [{"sleep": MULTI_TURN_SLEEPS[int(r.id)]} for r in requests])
        ctl = MigrationController(
            engine, Scorer(scoring, env_rewards=True).score, micro_batch_size=3, fusion=fusion, episodes=episodes
        )
        r = ctl.run(requests, gather=True)
        observed = episodes.take_figures()["observation"]
        episodes.close()
        e = Experience.concat(r.scored)
        e = e.select(e.sample_ids.argsort())
        mine = [ev for ev in r.trace.events if ev["ph"] == "X" and ev["pid"] == rank]
        decode_end = max(ev["ts"] + ev["dur"] for ev in mine if ev["name"] == "decode")
        out[fusion] = dict(
            exp={
                k: getattr(e, k)
                for k in ("tokens", "response_mask", "logprobs", "ref_logprobs", "values", "scores", "sample_ids")
            },
            scored_while_waiting=sum(ev["args"]["samples"] for ev in mine if ev["name"] == "score" and ev["ts"] < decode_end),
            observed=observed,
        )
    return out


@pytest.mark.slow
def test_a_fused_multi_turn_rollout_scores_while_its_requests_wait_and_changes_no_output(rank_pools):
    """Rank 0's episodes 0 and 2 end while 4 and 6 wait 0.6 s for their environment: fused, rank 0 scores the ended
    ones in that gap (none unfused: it scores after every instance is done); the samples and scores are the same."""
    per_rank = rank_pools(2).run(_multi_turn_rollouts, timeout_s=240)
    for rank in per_rank:
        _check_same_outputs(rank[False], rank[True])
        assert rank[False]["scored_while_waiting"] == 0
    for rank in per_rank:  # every episode had two turns: " again:" (7 byte tokens) was appended to each
        assert rank[True]["observed"] == rank[False]["observed"] == 4 * len(" again:")
    assert per_rank[0][True]["scored_while_waiting"] >= 2
