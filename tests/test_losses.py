import pytest
import torch

from fusedrl.rlhf.losses import (
    PolicyLoss,
    ValueLoss,
    explained_variance,
    policy_loss,
    shift_to_tokens,
    token_entropy,
    token_logprobs,
    value_loss,
)


def _setup(seed=0, b=3, s=6, v=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g, requires_grad=True)
    tokens = torch.randint(0, v, (b, s), generator=g)
    mask = torch.zeros(b, s)
    mask[0, 2:5] = 1
    mask[1, 3:6] = 1
    mask[2, 1:3] = 1
    old = token_logprobs(logits.detach(), tokens) + 0.3 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, s, generator=g)
    return logits, {"tokens": tokens, "response_mask": mask, "logprobs": old, "advantages": adv}


def test_logprob_alignment():
    logits, t = _setup()
    lp = token_logprobs(logits, t["tokens"])
    b, s = 1, 4
    manual = torch.log_softmax(logits[b, s - 1], -1)[t["tokens"][b, s]]
    assert torch.allclose(lp[b, s], manual)
    assert (lp[:, 0] == 0).all()
    ent = token_entropy(logits)
    p = torch.softmax(logits[b, s - 1], -1)
    assert torch.allclose(ent[b, s], -(p * p.log()).sum())
    assert torch.equal(shift_to_tokens(torch.arange(4.0)[None]), torch.tensor([[0.0, 0.0, 1.0, 2.0]]))


def test_policy_loss_matches_manual():
    logits, t = _setup()
    eps = 0.2
    loss, stats = policy_loss(logits, t, clip_eps=eps, entropy_coef=0.0)
    m = t["response_mask"].bool()
    new = torch.log_softmax(logits[:, :-1], -1).gather(-1, t["tokens"][:, 1:, None]).squeeze(-1)[m[:, 1:]]
    old, adv = t["logprobs"][m], t["advantages"][m]
    ratio = (new - old).exp()
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    assert torch.allclose(loss, per.mean(), atol=1e-6)
    frac = ((-adv * ratio.clamp(1 - eps, 1 + eps)) > (-adv * ratio)).float().mean()
    assert torch.allclose(stats["clip_frac"], frac)
    assert 0 < frac < 1  # the setup exercises both branches
    lr = new - old
    assert torch.allclose(stats["approx_kl"], (lr.exp() - 1 - lr).mean(), atol=1e-6)
    # entropy bonus
    loss_e, stats_e = PolicyLoss(eps, entropy_coef=0.1)(logits, t)
    assert torch.allclose(loss_e, loss - 0.1 * stats_e["entropy"], atol=1e-6)
    # global token mean via loss_denom
    denom = torch.full((3,), 40.0)
    loss_d, _ = policy_loss(logits, {**t, "loss_denom": denom}, clip_eps=eps)
    assert torch.allclose(loss_d, per.sum() / 40.0, atol=1e-6)


def test_policy_clipping_stops_gradient():
    # ratio far above 1 + eps with positive advantage: the clipped branch is active, no gradient
    logits, t = _setup()
    t = dict(t)
    t["logprobs"] = token_logprobs(logits.detach(), t["tokens"]) - 2.0
    t["advantages"] = torch.ones_like(t["advantages"])
    loss, stats = policy_loss(logits, t, clip_eps=0.2)
    assert torch.allclose(stats["clip_frac"], torch.tensor(1.0))
    assert torch.allclose(loss, torch.tensor(-1.2))
    loss.backward()
    assert logits.grad.abs().max() == 0
    # negative advantage with large ratio: unclipped branch (pessimistic), gradient flows
    logits.grad = None
    t["advantages"] = -torch.ones_like(t["advantages"])
    loss, stats = policy_loss(logits, t, clip_eps=0.2)
    assert stats["clip_frac"] == 0
    loss.backward()
    assert logits.grad.abs().max() > 0
    # ratio 1 (old == new): loss is -mean(adv), no clipping
    t["logprobs"] = token_logprobs(logits.detach(), t["tokens"])
    t["advantages"] = torch.randn(3, 6)
    loss, stats = policy_loss(logits, t)
    m = t["response_mask"].bool()
    assert torch.allclose(loss, -t["advantages"][m].mean(), atol=1e-6) and stats["clip_frac"] == 0


def test_value_loss_clipping():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    out = torch.tensor([[[0.0], [2.0], [0.05], [5.0]]], requires_grad=True)  # token t sees out[:, t-1]
    old = torch.zeros(1, 4)
    ret = torch.tensor([[0.0, 1.0, 1.5, 1.0]])
    targets = {"response_mask": mask, "values": old, "returns": ret}
    loss, stats = value_loss(out, targets, value_clip_eps=0.1)
    v = torch.tensor([0.0, 2.0, 0.05])
    r = torch.tensor([1.0, 1.5, 1.0])
    vc = v.clamp(-0.1, 0.1)
    expected = 0.5 * torch.maximum((v - r) ** 2, (vc - r) ** 2).mean()
    assert torch.allclose(loss, expected)
    # token 2's value moved past its return beyond the clip range: the clipped (larger) error is used
    assert torch.allclose(stats["value_clip_frac"], torch.tensor(1 / 3))
    loss.backward()
    g = out.grad[0, :, 0]
    assert g[1] == 0 and g[0] != 0 and g[2] != 0 and g[3] == 0  # out[3] predicts no token
    unclipped_loss, _ = ValueLoss(None)(out, targets)
    assert torch.allclose(unclipped_loss, 0.5 * ((v - r) ** 2).mean())
    assert unclipped_loss < loss
    with pytest.raises(ValueError, match="lack"):
        value_loss(out, {"response_mask": mask})


def test_explained_variance():
    mask = torch.ones(1, 5)
    target = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    assert torch.allclose(explained_variance(target, target, mask), torch.tensor(1.0))
    assert torch.allclose(explained_variance(torch.full_like(target, 3.0), target, mask), torch.tensor(0.0))
    half = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 100.0]])
    m = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    assert torch.allclose(explained_variance(torch.cat([target, torch.zeros(1, 1)], 1), half, m), torch.tensor(1.0))
