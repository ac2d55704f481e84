"""Over-provisioned rollouts ([rollout] over_provision): a rollout stopped at its group target and resumed gives the
tokens of an uninterrupted one (fusion off and on, 2 ranks); the selection trains whole groups only, never a token
staler than rollout.max_staleness, loses no prompt (discarded groups start again; a checkpoint restarts the groups in
flight); the trainer's run on 2 ranks; the config refuses the option without its importance correction."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from test_fusion import SAMPLED, _models

from fusedrl.components import DataReport, PromptDataset, PromptLoader
from fusedrl.config import ConfigError, JobConfig, load_config, run_checks
from fusedrl.generation import GenerationEngine, Request, RequestState, SamplingParams
from fusedrl.rlhf import Experience, PartialRollouts, RolloutPlan, Scorer
from fusedrl.rollout_fusion import GroupTarget, MigrationController, RolloutResult
from fusedrl.rollout_fusion.controller import Measurements

ROOT = Path(__file__).resolve().parents[1]

# 12 groups of 2 samples, forced lengths from 1 to 30 tokens: the first whole groups finish while others run long
GROUP_LENGTHS = [(3, 5), (30, 2), (6, 4), (1, 28), (7, 7), (22, 3), (2, 2), (12, 18), (4, 9), (26, 1), (5, 3), (16, 11)]


def _interrupted_and_whole() -> dict:
    """Per fusion setting: the tokens of a rollout stopped at 4 whole groups and then resumed, and of one left whole."""
    import torch.distributed as dist

    actor, scoring = _models()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    requests = [
        Request(gid * 2 + k, torch.randint(0, 512, (4,), generator=g).tolist(), SamplingParams(target_len=n, **SAMPLED))
        for gid, pair in enumerate(GROUP_LENGTHS)
        for k, n in enumerate(pair)
    ]
    mine = [r for r in requests if (r.id // 2) % world == rank]  # whole groups per instance, as the trainer plans them

    def tokens(scored: list[Experience]) -> dict[int, list[int]]:
        e = Experience.concat(scored)
        return {int(i): row[m.bool()].tolist() for i, row, m in zip(e.sample_ids, e.tokens, e.response_mask)}

    def controller(fusion: bool) -> MigrationController:
        engine = GenerationEngine(actor, max_slots=4, max_len=64, seed=11)
        return MigrationController(
            engine, Scorer(scoring).score, micro_batch_size=3, fusion=fusion, threshold=0.25, check_interval=2
        )

    out: dict = {"whole": tokens(controller(False).run(mine, gather=True).scored)}
    for fusion in (False, True):
        ctl = controller(fusion)
        first = ctl.run(mine, target=GroupTarget(2, 4), gather=True)
        carried: list = [None] * world
        dist.all_gather_object(carried, [(int(s.id), len(s.generated), s.has_kv) for s in first.carried])
        second = ctl.run([], resume=first.carried, gather=True)
        out[fusion] = {
            "first": tokens(first.scored),
            "second": tokens(second.scored),
            "carried": [c for part in carried for c in part],
            "migrated": first.migration is not None,
        }
    return out


@pytest.fixture(scope="module")
def interrupted(rank_pools):
    return rank_pools(2).run(_interrupted_and_whole, timeout_s=240)[0]


@pytest.mark.parametrize("fusion", [False, True])
def test_a_stopped_rollout_resumes_to_the_tokens_of_an_uninterrupted_one(interrupted, fusion):
    whole, run = interrupted["whole"], interrupted[fusion]
    first, second = run["first"], run["second"]
    assert not set(first) & set(second) and set(first) | set(second) == set(whole)  # each sample once
    assert {i: first.get(i, second.get(i)) for i in whole} == whole
    complete = {i // 2 for i in first if i ^ 1 in first}
    assert len(complete) >= 4  # the target: 4 whole groups before it stopped
    assert all(n < GROUP_LENGTHS[i // 2][i % 2] and not kv for i, n, kv in run["carried"])  # tokens, no KV
    assert any(n > 0 for _, n, _ in run["carried"])  # some stopped mid-response
    assert sorted(i for i, _, _ in run["carried"]) == sorted(set(whole) - set(first))
    assert not run["migrated"]  # the target came first: nothing migrated


def test_group_target_counts_whole_groups_with_earlier_samples_and_needs_a_new_one():
    target = GroupTarget(2, 2, frozenset({0, 1, 4}))  # group 0 finished earlier, group 2 half
    assert not target.reached({0, 1, 4, 2})  # group 1 half
    assert target.reached({0, 1, 4, 5})  # groups 0 and 2
    assert not GroupTarget(2, 1, frozenset({0, 1})).reached({0, 1})  # nothing finished in this rollout yet
    with pytest.raises(ValueError, match="groups >= 1"):
        GroupTarget(2, 0)


# ------------------------------------------------------------------------------------------------ the selection
def _partial(over: float, staleness: int, prompts: int = 64, unfinished: str = "carry") -> PartialRollouts:
    cfg = JobConfig()
    cfg.generation.n, cfg.ppo.batch_size = 4, 16
    cfg.rollout.over_provision, cfg.rollout.max_staleness = over, staleness
    cfg.rollout.unfinished = unfinished  # type: ignore[assignment]
    data = PromptDataset(
        [str(i) for i in range(prompts)], [[1, 2 + i % 7, 3] for i in range(prompts)], list(range(prompts)), DataReport("fake")
    )
    loader = PromptLoader(data, 4, seed=0)
    return PartialRollouts(cfg, loader, (0,), instance=0, instances=1, pad_id=0)


def _pending(plan: RolloutPlan) -> dict[int, RequestState]:
    """The plan's requests by id, fresh ones as empty states: an id planned twice (a group started again while its
    stale states are still resumed, or a request planned twice) fails here rather than one state silently winning."""
    fresh = {r.id: RequestState(r, [], []) for r in plan.requests}
    resumed = {s.id: s for s in plan.resume}
    assert len(fresh) == len(plan.requests) and len(resumed) == len(plan.resume), "a request planned twice"
    assert not fresh.keys() & resumed.keys(), f"fresh and resumed requests share ids {sorted(fresh.keys() & resumed.keys())}"
    return fresh | resumed


def _fake_rollout(
    partial: PartialRollouts, step: int, rng: random.Random, left: dict[int, int], started: dict[int, int]
) -> Experience:
    """One rollout of a fake engine: each request has ``left[id]`` tokens to go; requests finish in a random order
    and the rollout stops once its target is reached (as the controller does; without one, all finish), the rest
    carried with their progress. ``started``: prompt id -> the iteration its fresh requests (its current attempt) were
    planned in."""
    plan = partial.plan(step)
    started.update({r.id // 4: step for r in plan.requests})
    pending = _pending(plan)
    for r in plan.requests:
        left[r.id] = rng.choice([2, 3, 5, 40])  # a few long ones
    finished: set[int] = set() if plan.target is None else set(plan.target.finished)
    done: list[tuple[int, int]] = []  # (id, response length)
    order = sorted(pending, key=lambda i: left[i] + rng.random())
    budget = left[order[0]]
    for rid in order:
        if plan.target is not None and plan.target.reached(finished):
            break
        budget = max(budget, left[rid])
        finished.add(rid)
        done.append((rid, len(pending.pop(rid).generated) + left.pop(rid)))
    for rid, state in pending.items():  # decoded ``budget`` more tokens, unfinished
        step_tokens = min(budget, left[rid] - 1)
        state.generated += [5] * step_tokens
        state.logprobs += [0.0] * step_tokens
        left[rid] -= step_tokens
    width = 3 + max(n for _, n in done)
    tokens = torch.zeros(len(done), width, dtype=torch.long)
    mask = torch.zeros(len(done), width)
    for row, (_, n) in enumerate(done):
        mask[row, 3 : 3 + n] = 1
    scored = Experience(tokens, mask, scores=torch.zeros(len(done)), sample_ids=torch.tensor([i for i, _ in done]))
    result = RolloutResult([], 0.0, 0.0, 0.0, None, None, Measurements(), carried=list(pending.values()))  # type: ignore[arg-type]
    return partial.collect(step, result, scored)


def _in_one_process(fn, *args):
    import torch.distributed as dist

    from fusedrl.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def _no_prompt_lost(partial: PartialRollouts, trained: list[int]) -> set[int]:
    """Assert that every prompt drawn so far was trained (``trained``: sample ids) or is pending (in flight, queued or
    deferred), never both; the drawn prompt ids."""
    drawn = set(range(partial.loader.position))
    pending = set(partial.groups) | {p[0] for p in (*partial.queue, *partial.long)}
    assert {i // 4 for i in trained} | pending == drawn and not {i // 4 for i in trained} & pending
    return drawn


def _iterate(over: float, staleness: int, steps: int, seed: int) -> dict:
    partial, rng, left = _partial(over, staleness), random.Random(seed), {}
    started: dict[int, int] = {}  # prompt id -> iteration that started its current attempt
    trained: list[int] = []
    figures = []
    for step in range(1, steps + 1):
        batch = _fake_rollout(partial, step, rng, left, started)
        ids = batch.sample_ids.tolist()
        groups = [i // 4 for i in ids]
        assert ids == sorted(ids) and len(ids) == 16
        assert all(groups.count(g) == 4 for g in groups)  # whole groups only
        assert max(step - started[g] for g in set(groups)) <= staleness
        f = partial.figures()
        assert f["rollout_staleness_max"] <= staleness
        tagged = sum(f[f"rollout_staleness_{k}_tokens"] for k in range(staleness + 1))
        assert tagged == int(batch.response_mask.sum())
        trained += ids
        figures.append(f)
    assert len(trained) == len(set(trained))  # no sample trained twice
    drawn = _no_prompt_lost(partial, trained)
    state = partial.state_dict()
    resumed = _partial(over, staleness)
    resumed.load_state_dict(state)
    resumed.loader.position = partial.loader.position
    first = resumed.plan(steps + 1)
    in_flight = sorted(partial.groups, key=lambda g: (partial.groups[g].started, g))
    saved = in_flight + [p[0] for p in partial.queue]  # started again first, then the stream goes on
    restarted = [r.id // 4 for r in first.requests[::4]]
    assert restarted[: len(saved)] == saved[: len(restarted)] and min(restarted[len(saved) :], default=len(drawn)) >= len(drawn)
    return {
        "discarded": sum(f["rollout_discarded_groups"] for f in figures),
        "wasted": sum(f["rollout_wasted_tokens"] for f in figures),
        "stale": sum(f["rollout_staleness_1_tokens"] for f in figures),
    }


@pytest.mark.parametrize("over,staleness", [(0.5, 1), (1.0, 1), (1.0, 3)])
def test_selection_trains_whole_groups_within_the_staleness_bound_and_loses_no_prompt(over, staleness):
    result = _in_one_process(_iterate, over, staleness, 12, 7)
    assert result["stale"] > 0  # carried tokens were trained
    if staleness == 1:
        assert result["discarded"] > 0 and result["wasted"] > 0  # the 40-token requests outlive the bound


def _iterate_deferred(over: float, steps: int, seed: int) -> dict:
    partial, rng, left = _partial(over, 1, prompts=256, unfinished="defer"), random.Random(seed), {}
    started: dict[int, int] = {}
    trained: list[int] = []
    deferred: set[int] = set()  # prompts ever sent to the long queue
    long_rounds = 0
    for step in range(1, steps + 1):
        long_round = len(partial.long) >= 4
        waiting = [p[0] for p in partial.long][:4]
        batch = _fake_rollout(partial, step, rng, left, started)
        ids = batch.sample_ids.tolist()
        groups = sorted({i // 4 for i in ids})
        assert ids == sorted(ids) and len(ids) == 16 and all([i // 4 for i in ids].count(g) == 4 for g in groups)
        f = partial.figures()
        assert f["rollout_staleness_max"] == 0 and f["rollout_stale_tokens_frac"] == 0  # on-policy
        assert f["rollout_staleness_0_tokens"] == int(batch.response_mask.sum())
        assert f["rollout_long_rounds"] == long_round and f["rollout_long_queue"] == len(partial.long)
        if long_round:  # the four oldest deferred prompts, alone, each decoded to its end
            long_rounds += 1
            assert groups == sorted(waiting) and f["rollout_deferred_groups"] == 0
        assert not partial.groups and not partial.states and partial.rows is None  # nothing carried
        deferred |= {p[0] for p in partial.long}
        trained += ids
    assert len(trained) == len(set(trained))
    _no_prompt_lost(partial, trained)
    resumed = _partial(over, 1, prompts=256, unfinished="defer")
    resumed.load_state_dict(partial.state_dict())
    assert list(resumed.long) == list(partial.long) and list(resumed.queue) == list(partial.queue)
    return {"long_rounds": long_rounds, "deferred_trained": len(deferred & {i // 4 for i in trained})}


@pytest.mark.parametrize("over", [0.5, 1.0])
def test_tail_batching_trains_on_policy_whole_groups_and_finishes_deferred_prompts_in_long_rounds(over):
    result = _in_one_process(_iterate_deferred, over, 16, 7)
    assert result["long_rounds"] > 0 and result["deferred_trained"] > 0


def _scripted_rollout(partial: PartialRollouts, step: int, finish: Callable[[int], bool]) -> tuple[RolloutPlan, Experience]:
    """One rollout whose outcome the test dictates: the requests for which ``finish(request id)`` holds finish with
    3 more tokens (several past the group target, as an engine's decode step may finish them), the others decode 2
    more and are carried. The plan and the batch trained."""
    plan = partial.plan(step)
    pending = _pending(plan)
    done = [(rid, len(pending[rid].generated) + 3) for rid in sorted(pending) if finish(rid)]
    carried = [pending[rid] for rid in sorted(pending) if not finish(rid)]
    for state in carried:
        state.generated += [5, 5]
        state.logprobs += [0.0, 0.0]
    tokens = torch.zeros(len(done), 3 + max(n for _, n in done), dtype=torch.long)
    mask = torch.zeros_like(tokens, dtype=torch.float)
    for row, (_, n) in enumerate(done):
        mask[row, 3 : 3 + n] = 1
    scored = Experience(tokens, mask, scores=torch.zeros(len(done)), sample_ids=torch.tensor([i for i, _ in done]))
    result = RolloutResult([], 0.0, 0.0, 0.0, None, None, Measurements(), carried=carried)  # type: ignore[arg-type]
    return plan, partial.collect(step, result, scored)


def _groups(ids: Iterable[int]) -> list[int]:
    return sorted({int(i) // 4 for i in ids})


def _defer_restarting_whole_groups_past_the_batch() -> None:
    partial = _partial(1.0, 1, unfinished="defer")
    trained: list[int] = []
    # 1: groups 0-7 in flight; 0-5 finish whole (2 past the batch of 4), 6 and 7 half (2 samples finished, 2 not)
    first, batch = _scripted_rollout(partial, 1, lambda rid: rid // 4 < 6 or rid % 4 < 2)
    assert [r.id // 4 for r in first.requests[::4]] == list(range(8))
    assert _groups(batch.sample_ids) == [0, 1, 2, 3]
    f = partial.figures()
    assert f["rollout_discarded_groups"] == 2 and f["rollout_deferred_groups"] == 2 and f["rollout_long_queue"] == 2
    assert f["rollout_wasted_tokens"] == 8 * 3 + 4 * 3 + 4 * 2  # groups 4-5 whole; 6-7: finished and unfinished
    assert [p[0] for p in partial.queue] == [4, 5] and [p[0] for p in partial.long] == [6, 7]  # in order, first
    assert not partial.groups and not partial.states and partial.rows is None and not partial.carried_lengths
    assert not partial.stretches
    trained += batch.sample_ids.tolist()
    # 2: groups 4 and 5 start again first, fresh (new requests under this iteration's seed, nothing resumed)
    prompts = {r.id: r.prompt for r in first.requests}
    second, batch = _scripted_rollout(partial, 2, lambda rid: rid // 4 not in (12, 13))
    assert [r.id // 4 for r in second.requests[::4]] == [4, 5, 8, 9, 10, 11, 12, 13] and second.resume == []
    assert all(r.prompt == prompts[r.id] and r.seed != first.requests[0].seed for r in second.requests[:8])
    assert second.target is not None and second.target.finished == frozenset()
    assert _groups(batch.sample_ids) == [4, 5, 8, 9]  # the restarted groups trained, whole, on-policy
    f = partial.figures()
    assert f["rollout_staleness_max"] == 0 and f["rollout_discarded_groups"] == 2 and f["rollout_deferred_groups"] == 2
    assert [p[0] for p in partial.queue][:2] == [10, 11] and [p[0] for p in partial.long] == [6, 7, 12, 13]
    trained += batch.sample_ids.tolist()
    # 3: the long round (the deferred prompts alone, to their end); 4: the restarted groups 10 and 11 start first
    third, batch = _scripted_rollout(partial, 3, lambda rid: True)
    assert third.target is None and _groups(batch.sample_ids) == [6, 7, 12, 13] and not partial.long
    trained += batch.sample_ids.tolist()
    assert len(trained) == len(set(trained)) == 48
    _no_prompt_lost(partial, trained)
    assert [r.id // 4 for r in partial.plan(4).requests[::4]][:2] == [10, 11]


def test_tail_batching_starts_whole_groups_past_the_batch_again_first_and_defers_the_unfinished():
    _in_one_process(_defer_restarting_whole_groups_past_the_batch)


def _carry_oldest_first() -> None:
    partial = _partial(1.0, 1)
    # 1: groups 0-7 in flight; 0-4 finish whole (group 4 past the batch: carried as samples), 5-7 carried requests
    _, batch = _scripted_rollout(partial, 1, lambda rid: rid // 4 < 5)
    assert _groups(batch.sample_ids) == [0, 1, 2, 3]
    f = partial.figures()
    assert (f["rollout_staleness_0_tokens"], f["rollout_staleness_1_tokens"]) == (16 * 3, 0)
    assert f["rollout_carried_samples"] == 4 and f["rollout_carried_requests"] == 12
    # 2: groups 8-12 start; 5 and 8-12 finish. Whole: 4 and 5 (started at 1), 8-12 (at 2): the two oldest go first
    plan, batch = _scripted_rollout(partial, 2, lambda rid: rid // 4 not in (6, 7))
    assert [r.id // 4 for r in plan.requests[::4]] == [8, 9, 10, 11, 12] and _groups(s.id for s in plan.resume) == [5, 6, 7]
    assert _groups(batch.sample_ids) == [4, 5, 8, 9]
    f = partial.figures()
    # group 4: 4 x 3 tokens of iteration 1; group 5: 4 x 2 of iteration 1 and 4 x 3 of 2; groups 8, 9: 8 x 3 of 2
    assert (f["rollout_staleness_0_tokens"], f["rollout_staleness_1_tokens"]) == (4 * 3 + 8 * 3, 4 * 3 + 4 * 2)
    # 3: groups 6 and 7 (started at 1) are too stale: discarded, they start again with 13-18. Finished whole: 10-12
    # (carried, started at 2) and 6, 7, 13 (started at 3): the carried ones first, then the lowest id of the newest
    plan, batch = _scripted_rollout(partial, 3, lambda rid: rid // 4 in (6, 7, 13))
    assert [r.id // 4 for r in plan.requests[::4]] == [6, 7, 13, 14, 15, 16, 17, 18] and plan.resume == []  # in order
    assert _groups(batch.sample_ids) == [6, 10, 11, 12]
    f = partial.figures()
    assert f["rollout_discarded_groups"] == 2 and f["rollout_wasted_tokens"] == 8 * 4
    assert (f["rollout_staleness_0_tokens"], f["rollout_staleness_1_tokens"]) == (4 * 3, 12 * 3)
    assert _groups(partial._sample_ids(partial.rows)) == [7, 13] and {partial.groups[g].started for g in (7, 13)} == {3}


def test_selection_trains_the_oldest_whole_groups_first_and_tags_each_token_with_its_iteration():
    _in_one_process(_carry_oldest_first)


# ------------------------------------------------------------------------------------------------ the trainer
def _train_and_resume(out: str, unfinished: str, saved_at: int) -> dict:
    """3 iterations on 2 ranks with a checkpoint after iteration ``saved_at``; then a run that resumes from it
    (requests in flight, or prompts deferred, at the checkpoint) for the rest."""
    from test_grpo_train import CONFIG, TINY

    from fusedrl.train import Trainer

    def cfg(*extra: str):
        args = ["--job.config_file", CONFIG, *TINY, f"--job.output_dir={out}", "--parallelism.dp_shard=1"]
        args += ["--rollout.over_provision=1.0", f"--rollout.unfinished={unfinished}"]
        args += ["--ppo.tis_cap=2.0", "--ppo.recompute_logprobs=true"]
        return load_config([*args, "--fusion.inter_stage=false", f"--checkpoint.interval={saved_at}", *extra])

    first = Trainer(cfg(f"--training.steps={saved_at}"))
    history = first.train()
    assert first.partial is not None
    saved = first.partial.state_dict()
    resumed = Trainer(cfg("--training.steps=3", "--checkpoint.resume=true"))
    assert resumed.partial is not None and resumed.resume_from == saved_at
    resumed.ckpt.load(saved_at)
    restored = resumed.partial.state_dict()
    history += resumed.train()
    pending = len(first.partial.groups) + len(first.partial.long)
    return {"history": history, "saved": saved, "restored": restored, "pending": pending, "long": len(first.partial.long)}


def test_trainer_runs_over_provisioned_rollouts_and_resumes_the_groups_in_flight(rank_pools, tmp_path):
    out = rank_pools(2).run(_train_and_resume, str(tmp_path), "carry", 2, timeout_s=300)[0]
    history = out["history"]
    assert len(history) == 3
    assert all(r["rollout_staleness_max"] <= 1 for r in history)
    assert history[0]["rollout_carried_requests"] + history[0]["rollout_carried_samples"] > 0
    assert sum(r["rollout_staleness_1_tokens"] for r in history[1:]) > 0  # carried tokens were trained
    assert out["pending"] > 0 and out["restored"] == out["saved"]  # the groups in flight start again


def test_trainer_runs_tail_batching_on_policy_and_keeps_the_long_queue(rank_pools, tmp_path):
    out = rank_pools(2).run(_train_and_resume, str(tmp_path), "defer", 1, timeout_s=300)[0]
    history = out["history"]
    assert len(history) == 3 and all(r["rollout_staleness_max"] == 0 for r in history)
    assert history[0]["rollout_deferred_groups"] > 0 and history[0]["rollout_long_rounds"] == 0
    assert out["long"] == history[0]["rollout_long_queue"] > 0 and out["restored"] == out["saved"]  # kept by the checkpoint
    # the resumed run starts with the long round of the saved prompts once they fill a batch (4 groups)
    assert history[1]["rollout_long_rounds"] == (out["long"] >= 4)
    assert sum(r["rollout_long_rounds"] for r in history) >= 1


def test_config_refuses_over_provisioning_without_its_importance_correction():
    argv = ["--job.config_file", str(ROOT / "train_configs" / "debug_grpo.toml"), "--rollout.over_provision=0.5"]
    cfg = load_config(argv)
    with pytest.raises(ConfigError, match="ppo.tis_cap"):
        run_checks(cfg, 4)
    run_checks(load_config([*argv, "--rollout.unfinished=defer"]), 4)  # tail batching trains on-policy tokens only
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(["--job.config_file", str(ROOT / "train_configs" / "debug_grpo.toml"), "--rollout.max_staleness=0"])
