"""Rule-based rewards (``model.reward_fn``): loading, what the function receives, its combination with the Reward
model, every failure mode under ``skip`` and ``stop``, independence from how samples are grouped (what inter-stage
fusion changes), TP-instance consistency, config refusal, the memory estimate without a Reward model, and the
trainer: the debug task's reward function alone (fused == unfused) and added to the Reward model on 2 ranks, and
a failing function under skip and stop on 1 rank."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fusedrl.components import ByteTokenizer
from fusedrl.generation import Request, RequestResult
from fusedrl.models import FLAVORS, build_model
from fusedrl.rlhf import RewardFunctionError, RuleReward, Scorer, ScoringModels, load_reward_fn, reward_fn_metrics
from fusedrl.tasks import debug
from fusedrl.testing import run_multirank
from fusedrl.testing.configs import TINY_DEBUG_RUN

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "train_configs" / "debug_ppo.toml")
DEBUG_FN = "fusedrl.tasks.debug:reward_fn"
TOK = ByteTokenizer()


def _sample(sid: int, prompt: str, response: str, finished: bool = True) -> RequestResult:
    ids = TOK.encode(response, add_bos=False, add_eos=finished)
    return RequestResult(Request(sid, TOK.encode(prompt)), ids, [-0.1] * len(ids), "stop" if finished else "length")


def _models(reward: bool = True) -> ScoringModels:
    """The same Reference and Critic with or without a Reward model."""
    torch.manual_seed(0)
    reference, reward_model, critic = (build_model("debug", role).eval() for role in ("policy", "value", "value"))
    return ScoringModels(reference, reward_model if reward else None, critic)


def _neural_score(models: ScoringModels, s: RequestResult) -> torch.Tensor:
    with torch.no_grad():
        return models.reward(torch.tensor([[*s.prompt, *s.tokens]]))[0, -1, 0]


# ------------------------------------------------------------------------------------------- loading


def test_load_reward_fn_imports_the_named_callable():
    assert load_reward_fn(DEBUG_FN) is debug.reward_fn
    assert load_reward_fn("fusedrl.components:ByteTokenizer.decode") is ByteTokenizer.decode  # dotted attribute


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_package.rewards:score", "cannot import module 'no_such_package.rewards' (ModuleNotFoundError"),
        ("fusedrl.tasks.debug:no_such_fn", "module 'fusedrl.tasks.debug' has no attribute 'no_such_fn'"),
        ("fusedrl.tasks.debug:ALPHABET", "fusedrl.tasks.debug:ALPHABET is a str, not a callable"),
        ("fusedrl.tasks.debug.reward_fn", "is not an import path"),
    ],
    ids=["bad-module", "missing-attribute", "not-callable", "no-colon"],
)
def test_load_reward_fn_refuses_bad_paths_in_one_line(path, message):
    with pytest.raises(ValueError) as err:
        load_reward_fn(path)
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- scoring


def test_the_function_gets_decoded_texts_ids_and_finished_flags():
    calls = []

    def record(prompts, responses, *, prompt_ids, response_ids, finished):
        calls.append((prompts, responses, prompt_ids, response_ids, finished))
        return [0.0] * len(prompts)

    samples = [_sample(4, "repeat ab 2 times:", "abab"), _sample(9, "repeat c 3 times:", "ccccc", finished=False)]
    Scorer(_models(), reward_fn=RuleReward(record, TOK)).score(samples)
    ((prompts, responses, prompt_ids, response_ids, finished),) = calls
    assert prompts == ["repeat ab 2 times:", "repeat c 3 times:"]  # BOS skipped
    assert responses == ["abab", "ccccc"]  # the stop token is not part of the text
    assert prompt_ids == [[TOK.bos_id, *b"repeat ab 2 times:"], [TOK.bos_id, *b"repeat c 3 times:"]]
    assert response_ids == [[*b"abab", TOK.eos_id], [*b"ccccc"]]  # the generated ids, stop token included
    assert finished == [True, False]


def _by_length(prompts, responses, *, prompt_ids, response_ids, finished):
    return [len(r) / 4 for r in responses]


def test_scores_add_the_weighted_function_value_to_the_reward_model():
    samples = [
        _sample(0, "repeat ab 1 times:", "ab"),
        _sample(1, "repeat ab 2 times:", "abab"),
        _sample(2, "repeat x 9 times:", "x", finished=False),
    ]
    models = _models()
    plain = Scorer(models).score(samples)
    exp = Scorer(models, reward_fn=RuleReward(_by_length, TOK, weight=0.5)).score(samples)
    assert exp.reward_fn_scores.tolist() == [0.5, 1.0, 0.25]
    want = torch.stack([_neural_score(models, s) for s in samples]) + torch.tensor([0.25, 0.5, 0.125])
    torch.testing.assert_close(exp.scores, want, atol=1e-5, rtol=1e-5)
    for name in ("ref_logprobs", "values", "logprobs", "tokens", "response_mask"):  # only the scores change
        assert torch.equal(getattr(exp, name), getattr(plain, name)), name

    # alone (no Reward model): the weighted value is the score
    alone = Scorer(_models(reward=False), reward_fn=RuleReward(_by_length, TOK, weight=2.0)).score(samples)
    assert alone.scores.tolist() == [1.0, 2.0, 0.5]
    torch.testing.assert_close(alone.values, plain.values)


def test_debug_reward_fn_is_the_true_score():
    samples = [
        _sample(0, "repeat ab 2 times:", "abab"),
        _sample(1, "repeat ab 2 times:", "aba"),
        _sample(2, "repeat ab 2 times:", "ababab", finished=False),
    ]
    exp = Scorer(_models(reward=False), reward_fn=RuleReward(debug.reward_fn, TOK)).score(samples)
    assert exp.scores.tolist() == [1.0, 0.75 - 0.25, -1.0]  # exact; 3 of 4 characters right, 1 of 4 missing; unfinished


def test_a_scorer_needs_a_reward_model_or_a_function():
    with pytest.raises(ValueError, match="needs a Reward model"):
        Scorer(_models(reward=False))


# ------------------------------------------------------------------------------------------- failures


def _misbehaving(prompts, responses, *, prompt_ids, response_ids, finished):
    """len(response) per sample, except for prompts starting with a failure's name."""
    if any(p.startswith("scalar") for p in prompts):
        return 1.0
    out = []
    for p, r in zip(prompts, responses):
        if p.startswith("raise"):
            raise KeyError(p)
        if p.startswith("drop"):
            continue
        out.append({"nan": math.nan, "inf": math.inf, "text": "abc"}.get(p.split(":")[0], float(len(r))))
    return out


FAILURES = {
    "raise": "raised KeyError: 'raise: bad sample'",
    "drop": "returned 0 values for 1 sample",
    "scalar": "returned a float, not a list of numbers",
    "nan": "returned nan, not a finite number",
    "inf": "returned inf, not a finite number",
    "text": "returned 'abc', not a number",
}


def _with_failure(kind: str) -> list[RequestResult]:
    return [
        _sample(3, "repeat ab 2 times:", "abab"),
        _sample(7, f"{kind}: bad sample", "zz"),
        _sample(5, "repeat q 3 times:", "qqq", finished=False),
    ]


@pytest.mark.parametrize("kind", FAILURES)
def test_skip_scores_a_failed_sample_without_the_function_names_it_and_counts_it(kind, caplog):
    models = _models()
    samples = _with_failure(kind)
    with caplog.at_level(logging.WARNING, logger="fusedrl.rlhf.reward_fn"):
        exp = Scorer(models, reward_fn=RuleReward(_misbehaving, TOK, weight=0.5, on_failure="skip")).score(samples)
    values = exp.reward_fn_scores.tolist()
    assert values[0] == 4.0 and math.isnan(values[1]) and values[2] == 3.0
    neural = torch.stack([_neural_score(models, s) for s in samples])
    torch.testing.assert_close(exp.scores, neural + torch.tensor([2.0, 0.0, 1.5]), atol=1e-5, rtol=1e-5)
    assert reward_fn_metrics(exp) == {"reward_fn_mean": 3.5, "reward_fn_failures": 1}
    warned = [r.getMessage() for r in caplog.records if "failed on 1 of 3 samples" in r.getMessage()]
    assert len(warned) == 1 and f"sample 7 (prompt '{kind}: bad sample'): {FAILURES[kind]}" in warned[0]


@pytest.mark.parametrize("kind", FAILURES)
def test_stop_raises_naming_the_sample_and_the_reason(kind):
    scorer = Scorer(_models(reward=False), reward_fn=RuleReward(_misbehaving, TOK, on_failure="stop"))
    with pytest.raises(RewardFunctionError) as err:
        scorer.score(_with_failure(kind))
    message = str(err.value)
    assert f"failed on 1 of 3 samples: sample 7 (prompt '{kind}: bad sample'): {FAILURES[kind]}" in message
    assert "--training.nan_policy=skip" in message and "\n" not in message


def test_grouping_of_samples_changes_no_value():
    """Inter-stage fusion hands the scorer different subsets of the batch: any grouping gives the same scores,
    failures included."""
    samples = [
        _sample(i, p, r, f)
        for i, (p, r, f) in enumerate(
            [
                ("repeat ab 2 times:", "abab", True),
                ("raise: x", "a", True),
                ("repeat c 4 times:", "cc", False),
                ("nan: y", "bb", True),
                ("drop: z", "zz", False),
                ("repeat d 1 times:", "d", True),
            ]
        )
    ]
    scorer = Scorer(_models(reward=False), reward_fn=RuleReward(_misbehaving, TOK, weight=0.5, on_failure="skip"))
    whole = scorer.score(samples)
    for groups in ([samples[:2], samples[2:]], [samples[:3], samples[3:]], [[s] for s in samples]):
        parts = [scorer.score(g) for g in groups]
        for name in ("scores", "reward_fn_scores"):
            torch.testing.assert_close(
                torch.cat([getattr(p, name) for p in parts]), getattr(whole, name), rtol=0, atol=0, equal_nan=True
            )
    assert reward_fn_metrics(whole)["reward_fn_failures"] == 3


def _instance_worker() -> dict:
    """Two ranks of one instance: the function runs on the first only (its values are rank-dependent here, so a
    second run would show), both ranks get its values; under stop both raise."""
    group = dist.new_group([0, 1], backend="gloo")
    calls = []

    def per_rank(prompts, responses, *, prompt_ids, response_ids, finished):
        calls.append(len(prompts))
        return [float(dist.get_rank() * 10 + i) if not p.startswith("raise") else math.nan for i, p in enumerate(prompts)]

    samples = [_sample(1, "repeat a 1 times:", "a"), _sample(2, "repeat b 2 times:", "bb")]
    values = RuleReward(per_rank, TOK, group=group)(samples).tolist()
    try:
        RuleReward(per_rank, TOK, group=group, on_failure="stop")([samples[0], _sample(8, "raise it", "c")])
        stopped = ""
    except RewardFunctionError as e:
        stopped = str(e)
    return {"values": values, "calls": calls, "stopped": stopped}


@pytest.mark.slow
def test_an_instance_runs_the_function_once_and_shares_its_values(two_ranks):
    results = two_ranks.run(_instance_worker, timeout_s=120.0)
    assert [r["values"] for r in results] == [[0.0, 1.0], [0.0, 1.0]]
    assert results[0]["calls"] == [2, 2] and results[1]["calls"] == []
    assert all("sample 8 (prompt 'raise it'): returned nan, not a finite number" in r["stopped"] for r in results)


# ------------------------------------------------------------------------------------------- config


BAD_CONFIGS = [
    (["--model.reward_fn=no_such_package.rewards:score"], "model.reward_fn = 'no_such_package.rewards:score': cannot import"),
    (["--model.reward_fn=fusedrl.tasks.debug:ALPHABET"], "is a str, not a callable"),
    (["--model.reward_fn=fusedrl.tasks.debug.reward_fn"], 'must be an import path "package.module:function"'),
    (["--model.reward=none", "--model.reward_path="], 'model.reward = "none", model.reward_fn and env.env are unset'),
    (["--model.reward=none", f"--model.reward_fn={DEBUG_FN}"], 'is set but model.reward = "none" builds no Reward model'),
    (["--model.reward_fn_weight=0.5"], "model.reward_fn_weight = 0.5 weighs no function"),
]


@pytest.mark.parametrize(
    "overrides, message",
    BAD_CONFIGS,
    ids=["bad-module", "not-callable", "bad-format", "nothing-scores", "stray-reward-path", "weight-alone"],
)
def test_bad_reward_configs_are_refused_before_any_process_group(overrides, message, monkeypatch):
    from fusedrl.config import ConfigError
    from fusedrl.train import prepare

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        prepare(["--job.config_file", CONFIG, *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not dist.is_initialized()


def test_a_function_alone_passes_the_config_checks(monkeypatch):
    """reward = "none" names no flavor: the Reward flavor's checks (vocabulary, heads, length) are skipped."""
    from fusedrl.config import load_config, run_checks

    cfg = load_config(
        [
            "--job.config_file",
            CONFIG,
            "--model.reward=none",
            f"--model.reward_fn={DEBUG_FN}",
            "--model.reward_path=",
            "--model.reward_fn_weight=2.0",
        ]
    )
    monkeypatch.chdir(ROOT)
    run_checks(cfg, 4)
    assert not dist.is_initialized()


def test_memory_estimate_counts_no_reward_model_when_the_function_scores_alone():
    from fusedrl import memory
    from fusedrl.config import load_config

    def estimate(*overrides: str):
        cfg = load_config(["--job.config_file", CONFIG, "--fusion.schedule_search_budget_s=0", *overrides])
        return memory.estimate(cfg, config_name="debug", ranks=[0], progress=None).ranks[0]

    base = estimate()
    alone = estimate("--model.reward=none", f"--model.reward_fn={DEBUG_FN}", "--model.reward_path=")
    f = FLAVORS["debug"]
    reward_bytes = 4 * sum(p.numel() for p in build_model("debug", "value").parameters())  # float32 frozen_dtype
    head_dim = f.embed_dim // f.num_heads
    rope = 4 * (f.max_seq_len * head_dim + head_dim // 2)  # its RoPE table
    assert base.persistent["rollout_reward"] == reward_bytes and alone.persistent["rollout_reward"] == 0
    assert base.persistent["rope_buffers"] - alone.persistent["rope_buffers"] == rope
    assert alone.persistent_total == base.persistent_total - reward_bytes - rope


# ------------------------------------------------------------------------------------------- the trainer


TINY = [
    *TINY_DEBUG_RUN,
    "--parallelism.pp=2",
    "--parallelism.dp_shard=1",
    "--fusion.schedule_search_budget_s=0",
    "--fusion.migration_threshold=0.5",
    "--fusion.migration_check_interval=1",
    "--checkpoint.interval=0",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--metrics.jsonl=false",
    "--lr_scheduler.warmup_steps=0",
    "--optimizer.actor_lr=1e-3",
    "--optimizer.critic_lr=1e-3",
]
ALONE = ["--model.reward=none", f"--model.reward_fn={DEBUG_FN}"]


def _trainer_runs(out: str) -> dict:
    from fusedrl.config import load_config
    from fusedrl.train import run
    from fusedrl.trainer import Trainer

    def cfg(name: str, steps: int, *extra: str):
        return load_config(
            ["--job.config_file", CONFIG, *TINY, f"--training.steps={steps}", f"--job.output_dir={out}/{name}", *extra]
        )

    alone = Trainer(cfg("alone_on", 2, *ALONE, "--fusion.inter_stage=true", "--fusion.intra_stage=true"))
    built = {"rollout_reward": alone.rollout.reward, "scorer_reward": alone.controller.score.__self__.models.reward}
    return {
        "no_reward_model": all(v is None for v in built.values()),
        "alone_on": alone.train(),
        "alone_off": run(cfg("alone_off", 2, *ALONE, "--fusion.inter_stage=false", "--fusion.intra_stage=false")),
        "neural": run(cfg("neural", 1)),
        "added": run(cfg("added", 1, f"--model.reward_fn={DEBUG_FN}", "--model.reward_fn_weight=0.5")),
    }


COMPARED = ("reward_mean", "reward_fn_mean", "policy_loss", "value_loss", "kl", "grad_norm_actor", "response_len_mean")


@pytest.mark.slow
def test_trainer_with_the_debug_reward_function_alone_and_added(tmp_path, two_ranks):
    runs = two_ranks.run(_trainer_runs, str(tmp_path), timeout_s=400.0)
    r = runs[0]
    assert all(x["no_reward_model"] for x in runs), "reward = 'none' built a Reward model"
    on, off = r["alone_on"], r["alone_off"]
    assert any(h["migration_moved"] > 0 for h in on), "the fused run did not migrate: fusion changed nothing to compare"
    for a, b in zip(on, off, strict=True):  # fused and unfused runs score and train alike
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), f"fused vs unfused: {k} differs: {a[k]} vs {b[k]}"
    for h in on:  # the function alone (weight 1) is the score
        assert h["reward_fn_failures"] == 0 and math.isfinite(h["policy_loss"])
        assert h["reward_mean"] == pytest.approx(h["reward_fn_mean"], abs=1e-6)
    # the first iteration samples the same responses in every run (same initial Actor and seeds, with or without a
    # Reward model): added = the neural-only run's score + 0.5 x the function's value on the same samples
    (neural,), (added,) = r["neural"], r["added"]
    assert "reward_fn_mean" not in neural and added["response_len_mean"] == neural["response_len_mean"]
    assert added["reward_fn_mean"] == pytest.approx(on[0]["reward_fn_mean"], abs=1e-6)
    assert added["reward_mean"] == pytest.approx(neural["reward_mean"] + 0.5 * added["reward_fn_mean"], abs=1e-5)


SINGLE = str(ROOT / "train_configs" / "debug_ppo_single.toml")
FAILING = ["raise: first", "raise: second"]  # _misbehaving raises on these prompts


def _failing_runs(out: str) -> dict:
    """One rank, a batch of 8 prompts of which _misbehaving fails on 2: skip scores them without the function and
    counts them, stop ends the run."""
    import json

    from fusedrl.config import load_config
    from fusedrl.train import run

    data = Path(out, "prompts.jsonl")
    prompts = debug.sample_prompts(6, seed=3) + FAILING
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = [
        *TINY,
        "--parallelism.pp=1",
        "--training.steps=1",
        "--data.format=jsonl",
        f"--data.path={data}",
        "--model.reward=none",
        f"--model.reward_fn={__name__}:_misbehaving",
    ]

    def cfg(name: str, policy: str):
        return load_config(
            ["--job.config_file", SINGLE, *common, f"--training.nan_policy={policy}", f"--job.output_dir={out}/{name}"]
        )

    (skipped,) = run(cfg("skip", "skip"))
    try:
        run(cfg("stop", "stop"))
        stopped = ""
    except RewardFunctionError as e:
        stopped = str(e)
    return {"skip": skipped, "stop": stopped}


@pytest.mark.slow
def test_trainer_failures_are_counted_under_skip_and_end_the_run_under_stop(tmp_path):
    (r,) = run_multirank(_failing_runs, 1, str(tmp_path), timeout_s=300.0)
    skip = r["skip"]
    assert skip["reward_fn_failures"] == 2 and math.isfinite(skip["policy_loss"])
    # the 2 failed samples score 0 (no Reward model): the batch mean is 6/8 of the mean over the 6 scored ones
    assert skip["reward_mean"] == pytest.approx(skip["reward_fn_mean"] * 6 / 8, abs=1e-6)
    assert "failed on" in r["stop"] and "(prompt 'raise: " in r["stop"] and "raised KeyError: 'raise: " in r["stop"]
