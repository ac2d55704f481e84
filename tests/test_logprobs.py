"""Log-probs of the distribution that sampled: the engine's, the Reference's and the policy loss's at the sampling
temperature, checked against exact values on a small vocabulary."""

import math
from pathlib import Path

import pytest
import torch

from fusedrl.generation.sampling import sample_tokens
from fusedrl.rlhf import kl_estimate
from fusedrl.rlhf.losses import policy_loss, token_entropy, token_logprobs

VOCAB = 7
SINGLE = str(Path(__file__).resolve().parents[1] / "train_configs" / "debug_ppo_single.toml")


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(1, 2, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2.0


def _exact_logp(logits: torch.Tensor, temperature: float) -> list[float]:
    """log softmax(logits / T) by hand, in float64."""
    z = [float(x) / temperature for x in logits]
    top = max(z)
    log_norm = top + math.log(sum(math.exp(x - top) for x in z))
    return [x - log_norm for x in z]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_k1_penalty_is_the_kl_of_the_tempered_distributions(temperature):
    """Over the sampling distribution pi_T, the expected k1 term of fusedrl's log-probs is KL(pi_T || ref_T), the
    divergence of what was sampled (at temperature 1 log-probs it would be neither that nor KL(pi_1 || ref_1))."""
    policy, ref = _logits(0)[0, :1], _logits(1)[0, :1]  # one position: [1, V]
    p = _exact_logp(policy[0], temperature)
    q = _exact_logp(ref[0], temperature)
    exact_kl = sum(math.exp(a) * (a - b) for a, b in zip(p, q))
    tokens = torch.arange(VOCAB)
    # every token of the vocabulary as the sampled one, at position 1 of [prompt, token]
    seq = torch.stack([torch.zeros(VOCAB, dtype=torch.long), tokens], dim=1)
    logp = token_logprobs(policy.expand(VOCAB, 1, VOCAB).repeat(1, 2, 1), seq, temperature)[:, 1]
    ref_logp = token_logprobs(ref.expand(VOCAB, 1, VOCAB).repeat(1, 2, 1), seq, temperature)[:, 1]
    assert logp.tolist() == pytest.approx(p, abs=1e-6) and ref_logp.tolist() == pytest.approx(q, abs=1e-6)
    expected_k1 = float((logp.exp() * kl_estimate(logp, ref_logp, "k1")).sum())
    assert expected_k1 == pytest.approx(exact_kl, abs=1e-6)  # the losses work in float32
    untempered_kl = sum(math.exp(a) * (a - b) for a, b in zip(_exact_logp(policy[0], 1.0), _exact_logp(ref[0], 1.0)))
    assert abs(exact_kl - untempered_kl) > 1e-3  # the two divergences differ: the test would see the old convention


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_engine_log_probs_are_the_tempered_distributions_and_the_ratio_starts_at_one(temperature):
    logits = _logits(2)[0].float()  # [2, V]: two rows sampled at once
    n = 2
    tokens, logprobs = sample_tokens(
        logits,
        torch.full((n,), temperature),
        torch.zeros(n, dtype=torch.long),
        torch.ones(n),
        torch.tensor([11, 12]),
        torch.tensor([0, 5]),
    )
    for row in range(n):
        exact = _exact_logp(logits[row].double(), temperature)[int(tokens[row])]
        assert float(logprobs[row]) == pytest.approx(exact, abs=1e-6)
    # the policy loss at the same temperature: ratio 1 on the sampled tokens, no clipping
    seq_logits = logits[:, None, :].repeat(1, 2, 1)  # position 0 predicts token 1
    seq = torch.stack([torch.zeros(n, dtype=torch.long), tokens], dim=1)
    mask = torch.tensor([[0.0, 1.0]] * n)
    targets = {"tokens": seq, "response_mask": mask, "logprobs": torch.stack([torch.zeros(n), logprobs], 1), "advantages": mask}
    _, stats = policy_loss(seq_logits, targets, temperature=temperature)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0, abs=1e-6) and float(stats["clip_frac"]) == 0.0
    entropy = token_entropy(seq_logits.double(), temperature)[:, 1]
    exact_h = [-sum(math.exp(a) * a for a in _exact_logp(logits[r].double(), temperature)) for r in range(n)]
    assert entropy.tolist() == pytest.approx(exact_h, abs=1e-6)


def test_filtered_and_greedy_rows_report_the_distribution_they_drew_from():
    logits = _logits(3)[0].float()
    tokens, logprobs = sample_tokens(
        logits,
        torch.tensor([1.0, 0.0]),
        torch.tensor([2, 0]),  # row 0: top-2; row 1: greedy
        torch.ones(2),
        torch.tensor([1, 2]),
        torch.tensor([0, 0]),
    )
    kept = logits[0].topk(2).values.double()
    assert float(logprobs[0]) == pytest.approx(float(logits[0, tokens[0]]) - float(torch.logsumexp(kept, 0)), abs=1e-6)
    assert int(tokens[1]) == int(logits[1].argmax())
    assert float(logprobs[1]) == pytest.approx(float(torch.log_softmax(logits[1].double(), 0)[tokens[1]]), abs=1e-6)


# ---------------------------------------------------------------------------- truncated responses


def _scored_batch():
    """Two samples of 2 prompt + 3 response tokens; sample 1 hit the token limit."""
    from fusedrl.rlhf import Experience

    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0]] * 2)
    return Experience(
        tokens=torch.arange(10).view(2, 5),
        response_mask=mask.clone(),
        logprobs=-0.5 * mask,
        ref_logprobs=-0.7 * mask,
        values=torch.zeros(2, 5),
        scores=torch.tensor([1.0, 2.0]),
        finished=torch.tensor([True, False]),
    )


@pytest.mark.parametrize("mode", ["score", "penalty", "mask"])
def test_truncated_responses_follow_ppo_truncated(mode):
    """kl_coef 0.1, k1 = -0.5 - -0.7 = 0.2 per token, so each token's reward is -0.02, plus the score at the last one;
    gamma = lam = 1 and zero values: the advantage of token t is the sum of the rewards from t on."""
    from fusedrl.config import load_config
    from fusedrl.rlhf import compute_advantages

    cfg = load_config(
        [f"--ppo.truncated={mode}", "--ppo.truncation_penalty=3.0", "--ppo.kl_coef=0.1", "--ppo.gamma=1.0", "--ppo.lam=1.0"]
        + ["--ppo.whiten_advantages=false"]
    )
    exp, stats = compute_advantages(cfg, _scored_batch())
    second = {"score": 2.0, "penalty": 2.0 - 3.0, "mask": 2.0}[mode]
    expected = torch.tensor([[0, 0, 1 - 0.06, 1 - 0.04, 1 - 0.02], [0, 0, second - 0.06, second - 0.04, second - 0.02]])
    if mode == "mask":  # computed, then kept out of every loss
        expected[1] = 0.0
        assert exp.response_mask[1].sum() == 0 and exp.response_mask[0].sum() == 3
    torch.testing.assert_close(exp.advantages, expected)
    assert stats["truncated_frac"] == 0.5


# ---------------------------------------------------------------------------- small items


def test_k2_is_half_the_squared_log_ratio():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5]))


def test_stats_are_token_means_of_the_minibatch_and_explained_variance_never_nan():
    """Two micro-batches of 1 and 3 response tokens: with the minibatch's loss_denom their stats average (as the
    executor averages micro-batch stats) to the mean over the 4 tokens, not to the mean of the two means."""
    from fusedrl.rlhf.losses import explained_variance, value_loss

    rows = [(torch.tensor([[0.0, 1.0, 0.0, 0.0]]), 2.0), (torch.tensor([[0.0, 1.0, 1.0, 1.0]]), 6.0)]
    values = []
    for mask, v in rows:
        denom = torch.tensor([4 / 2])  # 4 tokens in the minibatch, 2 micro-batches
        targets = {"response_mask": mask, "values": torch.zeros(1, 4), "returns": torch.zeros(1, 4), "loss_denom": denom}
        output = torch.full((1, 4), v)  # token-aligned after the shift: positions 0..2 score tokens 1..3
        values.append(float(value_loss(output, targets, value_clip_eps=None)[1]["value_mean"]))
    assert sum(values) / 2 == pytest.approx((2.0 + 3 * 6.0) / 4)
    constant = torch.ones(1, 4)
    assert float(explained_variance(torch.zeros(1, 4), constant, torch.ones(1, 4))) == 0.0


def test_grad_norm_of_a_rank_without_gradients_is_on_its_parameters_device():
    from fusedrl.components.optimizer import clip_grad_norm, grad_norm

    meta = torch.nn.Linear(3, 3, device="meta")
    assert grad_norm(list(meta.parameters())).device.type == "meta"
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad, b.grad = torch.full((2,), 3.0), torch.full((2,), 4.0)
    # b's gradient is another rank's copy (a tied head): scaled with the others, not counted
    assert float(clip_grad_norm([a, b], 1.0, uncounted=[b])) == pytest.approx(math.sqrt(18))
    assert float(b.grad[0]) == pytest.approx(4.0 / math.sqrt(18), rel=1e-5)


def test_bf16_copies_cast_parameters_only_and_keep_value_heads_float32():
    """A rollout copy (cast_parameters) differs from the float32 model only in its parameters' dtype: the RoPE tables
    stay float32 and a value head stays float32 (its values the float32 projection of the
    bf16 hidden state)."""
    from fusedrl.models import ValueHead, build_model, cast_parameters, init_rope_buffers

    torch.manual_seed(0)
    policy = build_model("debug_qwen")  # biases, tied embeddings
    init_rope_buffers(policy)
    cast_parameters(policy, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())
    assert all(b.dtype == torch.float32 for b in policy.buffers() if b.is_floating_point())

    critic = build_model("debug", "value")
    init_rope_buffers(critic)
    cast_parameters(critic, torch.bfloat16)
    assert isinstance(critic.output, ValueHead) and critic.output.weight.dtype == torch.float32
    seen = {}
    critic.norm.register_forward_hook(lambda m, args, out: seen.update(hidden=out))
    values = critic(torch.randint(0, 256, (2, 9)))
    assert seen["hidden"].dtype == torch.bfloat16 and values.dtype == torch.float32
    assert torch.equal(values, seen["hidden"].float() @ critic.output.weight.T)


def test_bench_gap_is_float_rounding_for_a_float32_engine_only():
    """bench.logprobs on the debug model at temperature 0.7: the float32 engine's sampled-token log-probs are the
    float32 training forward's to rounding; a bf16 engine's and the int8 engine's are not."""
    from fusedrl.bench.logprobs import measure_gap
    from fusedrl.models import build_model, init_rope_buffers

    torch.manual_seed(0)
    model = build_model("debug").eval()
    init_rope_buffers(model)
    gap = measure_gap(model, samples=2, new_tokens=6, temperature=0.7)
    assert gap["fp32"]["fp32"]["logprob_diff_max"] < 1e-5
    assert gap["fp32"]["fp32"]["importance_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    for engine in ("bf16", "bf16_head_fp32", "int8"):
        assert gap[engine]["fp32"]["logprob_diff_max"] > 1e-4, engine


def test_logprob_gap_counts_response_tokens_only():
    """The trainer's and bench.logprobs' one gap: differences and ratios over the masked tokens alone."""
    from fusedrl.rlhf import logprob_gap

    engine = torch.tensor([[0.0, -1.0, -2.0], [5.0, -0.5, -0.5]])
    trainer = torch.tensor([[0.0, -1.5, -2.0], [-5.0, -0.25, -0.5]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])  # prompt tokens (the 10-nat gap) and padding left out
    gap = logprob_gap(engine, trainer, mask)
    assert gap["logprob_diff_mean"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert gap["logprob_diff_max"] == pytest.approx(0.5)
    assert gap["importance_ratio_min"] == pytest.approx(math.exp(-0.5))
    assert gap["importance_ratio_max"] == pytest.approx(math.exp(0.25))
    assert gap["importance_ratio_mean"] == pytest.approx((math.exp(-0.5) + 1 + math.exp(0.25)) / 3)
    assert logprob_gap(engine, trainer, torch.zeros_like(mask))["importance_ratio_min"] == 1.0


# ---------------------------------------------------------------------------- through the trainer

RUN = [
    "--parallelism.dp_shard=1",
    "--model.actor_path=",
    "--model.critic_path=",
    "--model.reward_path=",
    "--model.reference_path=",
    "--ppo.batch_size=8",
    "--ppo.minibatch_size=8",
    "--ppo.microbatch_size=2",
    "--generation.max_new_tokens=12",
    "--generation.max_slots=4",
    "--data.max_prompt_len=32",
    "--fusion.schedule_search_budget_s=0.2",
    "--training.steps=2",
    "--checkpoint.interval=0",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--generation.temperature=0.7",
]
ENGINES = {
    "bf16": ("--training.rollout_dtype=bfloat16", "--training.kv_cache_dtype=bfloat16"),
    "int8": ("--generation.quantize=int8_weight_only",),
    "bf16_no_recompute": ("--training.rollout_dtype=bfloat16", "--ppo.recompute_logprobs=false"),
    # one update per iteration: the old log-probs are the update's own forward, no pass of their own
    "bf16_on_policy": ("--training.rollout_dtype=bfloat16", "--training.kv_cache_dtype=bfloat16", "--ppo.epochs=1"),
}


def _engine_runs(out: str) -> dict[str, list[dict]]:
    from pathlib import Path

    from fusedrl.config import load_config
    from fusedrl.train import run

    config = str(Path(__file__).resolve().parents[1] / "train_configs" / "debug_ppo.toml")
    return {
        name: run(load_config(["--job.config_file", config, *RUN, *extra, f"--job.output_dir={out}/{name}"]))
        for name, extra in ENGINES.items()
    }


@pytest.mark.slow
def test_recomputed_log_probs_remove_the_gap_of_bf16_and_int8_engines(tmp_path, two_ranks):
    """pp = 2 on 2 ranks, sampling at temperature 0.7: with a bf16 or int8 engine the old log-probs are recomputed
    ("auto"), so the first minibatch's ratio is exactly 1 and nothing clips, while the engine's own log-probs were
    off (the gap is measured and logged); without recomputation the same gap reaches the first minibatch. With one
    update per iteration the update's forward gives the old log-probs: ratio 1, no pass of their own, the gap logged."""
    runs = two_ranks.run(_engine_runs, str(tmp_path), timeout_s=300.0)[0]
    for name in ("bf16", "int8"):
        for h in runs[name]:
            assert h["ratio_mean_first"] == pytest.approx(1.0, abs=1e-6) and h["clip_frac_first"] == 0.0, name
            assert h["logprob_diff_first"] == 0.0 and h["logprob_diff_mean"] > 1e-4 and h["time_recompute"] > 0, name
            assert math.isfinite(h["policy_loss"]) and h["grad_norm_actor"] > 0, name
    for h in runs["bf16_no_recompute"]:
        assert h["logprob_diff_first"] > 1e-4 and h["logprob_diff_mean"] == h["logprob_diff_first"]
        assert h["time_recompute"] == 0.0
    for h in runs["bf16_on_policy"]:
        assert h["ratio_mean_first"] == 1.0 and h["clip_frac_first"] == 0.0 and h["time_recompute"] == 0.0
        assert h["logprob_diff_first"] > 1e-4 and h["logprob_diff_mean"] == h["logprob_diff_first"]
        assert h["importance_ratio_mean"] == h["importance_ratio_first"] != 1.0
        assert math.isfinite(h["policy_loss"]) and h["grad_norm_actor"] > 0


def test_the_gap_guard_warns_or_stops_far_above_rounding_only(caplog):
    from fusedrl.rlhf import LogprobGapError, check_logprob_gap, logprob_gap_limit

    assert logprob_gap_limit([torch.float32, torch.float32]) == 1e-3
    assert logprob_gap_limit([torch.float32, torch.bfloat16]) == 0.5
    assert logprob_gap_limit([torch.float32], quantized=True) == 0.5
    with caplog.at_level("WARNING"):
        assert check_logprob_gap(9e-4, 1e-3)
        assert not caplog.records
        assert not check_logprob_gap(0.7, 0.5, where="step 3")
    (record,) = caplog.records
    assert "\n" not in record.getMessage()
    assert record.getMessage().startswith("step 3: the engine's log-probs differ") and "stale weights" in record.getMessage()
    with pytest.raises(LogprobGapError, match="0.7 on average .* stale weights"):
        check_logprob_gap(0.7, 0.5, stop=True)


def _stale_engine_runs(out: str) -> dict:
    """The one-process debug run, 3 iterations under logprob_gap_check = "stop": as it is, and with the weight sync
    doing nothing (the engine keeps sampling from the initial weights)."""
    from fusedrl.config import load_config
    from fusedrl.generation import WeightSync
    from fusedrl.rlhf import LogprobGapError
    from fusedrl.testing.configs import TINY_DEBUG_RUN
    from fusedrl.train import run

    def cfg(name: str):
        return load_config(
            [
                "--job.config_file",
                SINGLE,
                *TINY_DEBUG_RUN,
                "--training.steps=3",
                "--training.logprob_gap_check=stop",
                "--checkpoint.export_hf=false",
                "--checkpoint.interval=0",
                "--metrics.trace=[]",
                "--lr_scheduler.warmup_steps=0",
                "--optimizer.actor_lr=1e-2",
                f"--job.output_dir={out}/{name}",
            ]
        )

    gaps = [h["logprob_diff_mean"] for h in run(cfg("synced"))]
    sync = WeightSync.sync
    WeightSync.sync = lambda self: None  # type: ignore[method-assign]
    try:
        run(cfg("stale"))
        stopped = ""
    except LogprobGapError as e:
        stopped = str(e)
    finally:
        WeightSync.sync = sync  # type: ignore[method-assign]
    return {"gaps": gaps, "stopped": stopped}


@pytest.mark.slow
def test_the_trainer_stops_on_an_engine_that_samples_from_stale_weights(tmp_path, rank_pools):
    (result,) = rank_pools(1).run(_stale_engine_runs, str(tmp_path), timeout_s=300.0)
    assert len(result["gaps"]) == 3 and max(result["gaps"]) < 1e-4  # float32: rounding
    assert result["stopped"].startswith("step ") and "stale weights" in result["stopped"]
