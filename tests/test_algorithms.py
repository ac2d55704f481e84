"""Critic-free estimators (GRPO, RLOO, REINFORCE++), loss aggregation, asymmetric clipping, KL loss and DAPO's options,
against values computed by hand on small batches."""

import math

import pytest
import torch

from fusedrl.config import ConfigError, JobConfig, validate_config
from fusedrl.pipelining import ACTOR, LocalSchedule, StageModule
from fusedrl.rlhf import (
    Experience,
    KLLoss,
    compute_advantages,
    discounted_returns,
    group_advantages,
    loss_weights,
    overlong_penalty,
    policy_loss,
    zero_variance_groups,
)


def test_grpo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: all equal -> 0
    std = math.sqrt((4 * 0.25) / 3)
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 0.0, 0.0]
    torch.testing.assert_close(group_advantages(scores, groups, "grpo"), torch.tensor(expected))
    # Dr.GRPO: no std division
    torch.testing.assert_close(
        group_advantages(scores, groups, "grpo", std_norm=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0])
    )


def test_rloo_advantages_by_hand():
    scores = torch.tensor([3.0, 1.0, 2.0, 5.0, 7.0])
    groups = torch.tensor([4, 4, 4, 9, 9])  # ids need not be contiguous from 0
    # each sample minus the mean of the others of its group
    expected = [3 - 1.5, 1 - 2.5, 2 - 2.0, 5 - 7, 7 - 5]
    torch.testing.assert_close(group_advantages(scores, groups, "rloo"), torch.tensor(expected))
    with pytest.raises(ValueError, match="unknown estimator"):
        group_advantages(scores, groups, "gae")


def test_zero_variance_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, -1.0, -1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert zero_variance_groups(scores, groups).tolist() == [True, True, False, False, True, True]


def test_discounted_returns_by_hand():
    r = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    # tokens 1..3: G3 = 3, G2 = 2 + 0.5 * 3, G1 = 1 + 0.5 * 3.5; outside the mask 0
    torch.testing.assert_close(discounted_returns(r, mask, 0.5), torch.tensor([[0.0, 2.75, 3.5, 3.0, 0.0]]))


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 12, 14, 16])
    # max 16, buffer 4: free up to 12, then linear to the full penalty at 16
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4, 2.0), torch.tensor([0.0, 0.0, 1.0, 2.0]))


def _batch(scores, lengths, seq=6, ids=None):
    b = len(scores)
    mask = torch.zeros(b, seq)
    for i, n in enumerate(lengths):
        mask[i, 1 : 1 + n] = 1
    return Experience(
        tokens=torch.ones(b, seq, dtype=torch.long),
        response_mask=mask,
        logprobs=torch.full((b, seq), -1.0) * mask,
        ref_logprobs=torch.full((b, seq), -1.5) * mask,
        scores=torch.tensor(scores),
        sample_ids=torch.tensor(ids if ids is not None else list(range(b))),
        finished=torch.ones(b, dtype=torch.bool),
    )


def _cfg(**ppo):
    cfg = JobConfig()
    cfg.generation.n = 2
    for k, v in ppo.items():
        setattr(cfg.ppo, k, v)
    return cfg


def test_compute_advantages_grpo_broadcasts_and_reports_groups():
    cfg = _cfg(advantage_estimator="grpo", kl_coef=0.0)
    exp, stats = compute_advantages(cfg, _batch([1.0, 0.0, 1.0, 1.0], [2, 3, 1, 4], ids=[10, 11, 12, 13]))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([a, -a, 0.0, 0.0])[:, None] * exp.response_mask
    torch.testing.assert_close(exp.advantages, expected)
    assert stats["zero_std_groups_frac"] == 0.5 and exp.values is None


def test_compute_advantages_rloo_kl_in_reward():
    # KL in the reward: each sample's return is its score minus kl_coef x its summed k1 KL (0.5 per token)
    cfg = _cfg(advantage_estimator="rloo", kl_coef=0.1, kl_estimator="k1")
    exp, _ = compute_advantages(cfg, _batch([1.0, 1.0], [2, 4]))
    returns = torch.tensor([1.0 - 0.1 * 0.5 * 2, 1.0 - 0.1 * 0.5 * 4])
    torch.testing.assert_close(exp.advantages[:, 1], torch.stack([returns[0] - returns[1], returns[1] - returns[0]]))


def test_compute_advantages_reinforce_pp_whitens_discounted_returns():
    cfg = _cfg(advantage_estimator="reinforce_pp", kl_coef=0.0, gamma=1.0)
    exp, _ = compute_advantages(cfg, _batch([2.0, 0.0], [1, 2]))
    # returns: sample 0 [2], sample 1 [0, 0] -> mean 2/3 over 3 tokens, population std sqrt(8/9)
    mean, std = 2 / 3, math.sqrt(8 / 9)
    m = exp.response_mask.bool()
    torch.testing.assert_close(exp.advantages[m], (torch.tensor([2.0, 0.0, 0.0]) - mean) / math.sqrt(std**2 + 1e-8))


def test_overlong_buffer_lowers_scores_before_the_estimator():
    cfg = _cfg(advantage_estimator="grpo", kl_coef=0.0, overlong_buffer=2)
    cfg.generation.max_new_tokens = 4
    exp, stats = compute_advantages(cfg, _batch([1.0, 1.0], [2, 4]))
    assert exp.scores.tolist() == [1.0, 0.0]  # length 4 = max: the whole penalty (1.0)
    assert stats["zero_std_groups_frac"] == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_weights_by_hand(mode):
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)  # the last row is masked out
    w = loss_weights(mask, mode, max_new_tokens=8)
    per_token = torch.tensor([[0, 1.0, 3.0, 0], [0, 2.0, 2.0, 5.0], [0, 7.0, 7.0, 7.0]])
    expected = {
        "token-mean": (1 + 3 + 2 + 2 + 5) / 5,
        "seq-mean-token-mean": ((1 + 3) / 2 + (2 + 2 + 5) / 3) / 2,
        "seq-mean-token-sum-norm": ((1 + 3) / 8 + (2 + 2 + 5) / 8) / 2,
    }[mode]
    assert (per_token * w).sum().item() == pytest.approx(expected)


def test_loss_weights_independent_of_the_split():
    """Each ppo.loss_agg_mode's loss of a whole minibatch (computed here from its definition) is the weighted sum that
    loss_weights gives, and the gradient that the executor accumulates over 1, 2, 4 or 8 micro-batches with those
    weights (scaled by the micro-batch count, as the update scales them) is the same for every split."""
    torch.manual_seed(0)
    mask = (torch.rand(8, 10) < 0.6).float()
    mask[:, 0] = 0
    mask[3] = 0  # a sequence without a response token counts for none
    per_token = torch.randn(8, 10)
    lengths, sequences = mask.sum(1), int((mask.sum(1) > 0).sum())
    masked = per_token * mask
    definitions = {
        "token-mean": masked.sum() / mask.sum(),
        "seq-mean-token-mean": sum(masked[r].sum() / lengths[r] for r in range(8) if lengths[r] > 0) / sequences,
        "seq-mean-token-sum-norm": masked.sum() / (9 * sequences),
    }
    for mode, expected in definitions.items():
        weights = loss_weights(mask, mode, 9)
        torch.testing.assert_close((per_token * weights).sum(), expected)
        grads = []
        for parts in (1, 2, 4, 8):
            scale = torch.nn.Parameter(torch.ones(()))
            module = _Scaled(scale)

            def loss_fn(out: torch.Tensor, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
                return (out * targets["loss_weight"]).sum(), {}

            schedule = LocalSchedule(StageModule(module, loss_fn, hidden_dim=1, output_dim=1), None, {ACTOR: parts})
            schedule.step(per_token, None, {"loss_weight": weights * parts}, None)
            grads.append(scale.grad)
        for grad in grads:
            torch.testing.assert_close(grad, expected)


class _Scaled(torch.nn.Module):
    """``scale * x``: its gradient is the loss's value at scale 1."""

    def __init__(self, scale: torch.nn.Parameter) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _targets():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    return {
        "tokens": torch.zeros(1, 4, dtype=torch.long),
        "response_mask": mask,
        "logprobs": torch.zeros(1, 4),
        "advantages": torch.tensor([[0.0, 1.0, 1.0, -1.0]]),
        "ref_logprobs": torch.zeros(1, 4),
    }


def _logits_for(logp_token0: list[float]) -> torch.Tensor:
    """Logits [1, 4, 2] whose log-prob of token 0 at positions 1..3 is ``logp_token0`` (position p-1 predicts p)."""
    logits = torch.zeros(1, 4, 2)
    for i, lp in enumerate(logp_token0):
        p = math.exp(lp)
        logits[0, i, 0] = math.log(p)
        logits[0, i, 1] = math.log(1 - p)
    return logits


def test_asymmetric_clip_by_hand():
    # ratios (old log-prob 0 = prob 1: the ratio is the new prob): 0.5 (adv 1), 0.7 (adv 1), 0.5 (adv -1)
    logits = _logits_for([math.log(0.5), math.log(0.7), math.log(0.5)])
    t = _targets()
    loss, stats = policy_loss(logits, t, clip_eps=(0.4, 0.1))
    # token 3: adv -1, ratio 0.5 < 1 - 0.4: clipped to 0.6 -> max(0.5, 0.6) = 0.6; tokens 1, 2: -0.5, -0.7
    assert loss.item() == pytest.approx((-0.5 - 0.7 + 0.6) / 3, abs=1e-6)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 3) and stats["clip_frac_high"].item() == 0.0
    loss_sym, _ = policy_loss(logits, t, clip_eps=0.1)
    assert loss_sym.item() == pytest.approx((-0.5 - 0.7 + 0.9) / 3, abs=1e-6)


def test_kl_loss_term_by_hand():
    logits = _logits_for([math.log(0.5)] * 3)
    t = _targets()
    t["advantages"] = torch.zeros(1, 4)
    t["ref_logprobs"] = torch.tensor([[0.0, math.log(0.25), math.log(0.25), math.log(0.25)]])
    loss, stats = policy_loss(logits, t, kl=KLLoss(0.5, "k1"))
    kl = math.log(0.5) - math.log(0.25)  # k1 per token
    assert loss.item() == pytest.approx(0.5 * kl, abs=1e-6) and stats["kl_loss"].item() == pytest.approx(kl, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logits, {k: v for k, v in t.items() if k != "ref_logprobs"}, kl=KLLoss(0.5))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"ppo.advantage_estimator": "grpo", "generation.n": 1}, "set --generation.n=2"),
        ({"ppo.advantage_estimator": "rloo", "generation.n": 1}, "set --generation.n=2"),
        ({"ppo.advantage_estimator": "grpo", "generation.n": 4, "model.critic_path": "x"}, "model.critic_path"),
        ({"ppo.advantage_estimator": "grpo", "generation.n": 4, "parallelism.pp_critic": 1}, "trains no Critic"),
        ({"generation.n": 3}, "multiple of generation.n = 3"),
        ({"ppo.dynamic_sampling": True}, "only grpo and rloo"),
        ({"ppo.overlong_buffer": 256}, "must be below generation.max_new_tokens"),
    ],
)
def test_bad_algorithm_keys_are_one_line_errors(overrides, expected):
    cfg = JobConfig()
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
        cfg.sources[key] = "command line"
    with pytest.raises(ConfigError, match=expected) as e:
        validate_config(cfg)
    assert "\n" not in str(e.value)
