import pytest
import torch

from fusedrl.rlhf.advantages import gae, kl_estimate, kl_shaped_rewards, last_token_index, masked_mean_var, whiten
from fusedrl.rlhf.experience import Experience


def _mask(rows):
    # rows: list of (start, end, seq)
    seq = rows[0][2]
    m = torch.zeros(len(rows), seq)
    for i, (s, e, _) in enumerate(rows):
        m[i, s:e] = 1
    return m


def _gae_reference(r, v, start, end, gamma, lam):
    adv = [0.0] * len(r)
    nxt_a, nxt_v = 0.0, 0.0
    for t in range(end - 1, start - 1, -1):
        delta = r[t] + gamma * nxt_v - v[t]
        nxt_a = delta + gamma * lam * nxt_a
        nxt_v = v[t]
        adv[t] = nxt_a
    return adv


def test_gae_matches_loop_reference():
    torch.manual_seed(0)
    spans = [(2, 7, 9), (3, 4, 9), (1, 9, 9)]
    mask = _mask(spans)
    r = torch.randn(3, 9)
    v = torch.randn(3, 9)
    for gamma, lam in [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)]:
        adv, ret = gae(r, v, mask, gamma, lam)
        for i, (s, e, _) in enumerate(spans):
            ref = _gae_reference(r[i].tolist(), v[i].tolist(), s, e, gamma, lam)
            assert torch.allclose(adv[i], torch.tensor(ref), atol=1e-5), (i, gamma, lam)
        assert torch.allclose(ret, (adv + v) * mask)
        assert (adv[mask == 0] == 0).all()


def test_gae_hand_computed():
    # one response of 2 tokens at positions 1, 2; gamma=1, lam=1: A_t = sum of future rewards - V_t
    r = torch.tensor([[9.0, 0.5, 2.0, 7.0]])
    v = torch.tensor([[5.0, 1.0, 3.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(r, v, mask, 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 2.5 - 1.0, 2.0 - 3.0, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.0, 2.5, 2.0, 0.0]]))


def test_kl_estimators():
    torch.manual_seed(0)
    logp = torch.randn(1000) - 2
    ref = logp + 0.3 * torch.randn(1000)
    k1 = kl_estimate(logp, ref, "k1")
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.allclose(k1, logp - ref)
    assert (k3 >= 0).all() and (k1 < 0).any()
    r = (ref - logp).exp()
    assert torch.allclose(k3, (r - 1) - r.log(), atol=1e-5)
    assert torch.equal(kl_estimate(logp, logp, "k3"), torch.zeros(1000))
    # both are unbiased estimators of KL(p||q): check with samples from p = N(0,1), q = N(0.5,1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g, dtype=torch.float64)
    lp = -0.5 * x**2
    lq = -0.5 * (x - 0.5) ** 2
    true_kl = 0.5 * 0.5**2
    assert kl_estimate(lp, lq, "k1").mean().item() == pytest.approx(true_kl, abs=0.01)
    assert kl_estimate(lp, lq, "k3").mean().item() == pytest.approx(true_kl, abs=0.01)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k9")


def test_kl_shaped_rewards():
    mask = _mask([(1, 4, 6), (2, 3, 6)])
    logp = torch.full((2, 6), -1.0)
    ref = torch.full((2, 6), -1.5)
    scores = torch.tensor([2.0, -1.0])
    rewards, kl = kl_shaped_rewards(scores, logp, ref, mask, kl_coef=0.1, estimator="k1")
    expected = -0.1 * 0.5 * mask
    expected[0, 3] += 2.0
    expected[1, 2] += -1.0
    assert torch.allclose(rewards, expected)
    assert torch.allclose(kl, 0.5 * mask)
    assert last_token_index(mask).tolist() == [3, 2]
    with pytest.raises(ValueError, match="empty response mask"):
        last_token_index(torch.zeros(2, 3))


def test_whiten_with_mask():
    torch.manual_seed(0)
    x = torch.randn(4, 10) * 3 + 5
    mask = (torch.rand(4, 10) > 0.4).float()
    x_garbage = torch.where(mask.bool(), x, torch.full_like(x, 1e6))  # masked-out values must not matter
    w = whiten(x_garbage, mask)
    sel = w[mask.bool()]
    assert sel.mean().abs() < 1e-5
    assert sel.var(unbiased=False).sub(1).abs() < 1e-4
    assert (w[mask == 0] == 0).all()
    ref = (x[mask.bool()] - x[mask.bool()].mean()) / x[mask.bool()].std(unbiased=False)
    assert torch.allclose(sel, ref, atol=1e-4)
    kept = whiten(x, mask, shift_mean=False)[mask.bool()]
    assert torch.allclose(kept, ref + x[mask.bool()].mean(), atol=1e-4)


def _whiten_ranks(x, mask):
    import torch.distributed as dist

    rank = dist.get_rank()
    local = whiten(x[rank * 2 : rank * 2 + 2], mask[rank * 2 : rank * 2 + 2], group=dist.group.WORLD)
    expected = whiten(x, mask)[rank * 2 : rank * 2 + 2]
    assert torch.allclose(local, expected, atol=1e-5), (local, expected)


def test_whiten_across_ranks(rank_pools):
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    rank_pools(2).run(_whiten_ranks, x, mask, timeout_s=90)


def test_masked_mean_var_empty_mask():
    with pytest.raises(ValueError, match="empty mask"):
        masked_mean_var(torch.ones(2, 2), torch.zeros(2, 2))


def test_experience_split_concat():
    torch.manual_seed(0)
    a = Experience(
        torch.randint(0, 9, (4, 5)),
        _mask([(1, 3, 5)] * 4),
        logprobs=torch.randn(4, 5),
        scores=torch.randn(4),
        sample_ids=torch.arange(4),
    )
    b = Experience(
        torch.randint(0, 9, (2, 7)),
        _mask([(1, 6, 7)] * 2),
        logprobs=torch.randn(2, 7),
        scores=torch.randn(2),
        sample_ids=torch.arange(4, 6),
    )
    c = Experience.concat([a, b], pad_token_id=3)
    assert c.tokens.shape == (6, 7) and c.sample_ids.tolist() == list(range(6))
    assert (c.tokens[:4, 5:] == 3).all() and (c.response_mask[:4, 5:] == 0).all()
    assert torch.equal(c.logprobs[4:], b.logprobs) and c.values is None
    parts = c.split(2)
    assert [p.sample_ids.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    mbs = c.minibatches(3, generator=torch.Generator().manual_seed(0))
    assert sorted(sum((m.sample_ids.tolist() for m in mbs), [])) == list(range(6))
    for m in mbs:
        for i, sid in enumerate(m.sample_ids.tolist()):
            assert torch.equal(m.tokens[i], c.tokens[sid])
    assert set(c.targets("tokens", "logprobs")) == {"tokens", "logprobs"}
    with pytest.raises(ValueError, match="not computed"):
        c.targets("advantages")
    with pytest.raises(ValueError, match="divisor"):
        c.split(4)
    with pytest.raises(ValueError, match="must match tokens"):
        Experience(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="set in some"):
        Experience.concat([a, Experience(a.tokens, a.response_mask)])
    padded = a.pad_to(8, pad_token_id=3)
    assert padded.tokens.shape == padded.logprobs.shape == (4, 8)
    assert (padded.tokens[:, 5:] == 3).all() and (padded.logprobs[:, 5:] == 0).all() and (padded.response_mask[:, 5:] == 0).all()
    assert torch.equal(padded.tokens[:, :5], a.tokens) and torch.equal(padded.scores, a.scores) and padded.values is None
    with pytest.raises(ValueError, match="cannot pad"):
        a.pad_to(4)


def test_gae_skips_the_observations_inside_a_response():
    # a multi-turn sample's response mask has a gap (the environment's observation): GAE runs over the sampled tokens
    # as if the gap were not there, so the first turn's tokens see the final reward
    torch.manual_seed(0)
    rewards, values = torch.randn(1, 9), torch.randn(1, 9)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)  # prompt, turn, observation, turn, padding
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0].bool()
    compact_adv, compact_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, keep], compact_adv)
    torch.testing.assert_close(ret[:, keep], compact_ret)
    assert (adv[:, ~keep] == 0).all() and (ret[:, ~keep] == 0).all()
