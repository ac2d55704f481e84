import pytest
import torch

from fusedrl.models import build_model
from fusedrl.rlhf.losses import (
    DEFAULT_LOGITS_BUDGET_BYTES,
    KLLoss,
    PolicyLoss,
    ValueLoss,
    chunked_policy_loss,
    chunked_token_logprobs,
    chunked_token_logprobs_entropy,
    explained_variance,
    head_vocab_size,
    logits_chunk_positions,
    policy_loss,
    shift_to_tokens,
    token_entropy,
    token_logprobs,
    value_loss,
)
from fusedrl.rlhf.scoring import decoder_hidden_states


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


# ---- chunked LM head: log-probs, entropy and the policy loss from hidden states ----

_B, _S = 2, 9


def _decoder(flavor: str):
    torch.manual_seed(0)
    model = build_model(flavor, "policy")
    tokens = torch.randint(0, 512, (_B, _S), generator=torch.Generator().manual_seed(3))
    return model, tokens


def _chunk_targets(tokens: torch.Tensor, logp: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    mask = torch.zeros(tokens.shape)
    mask[0, 3:8] = 1
    mask[1, 5:9] = 1
    old = logp.detach() + 0.3 * torch.randn(tokens.shape, generator=g)
    return {"tokens": tokens, "response_mask": mask, "logprobs": old, "advantages": torch.randn(tokens.shape, generator=g)}


def test_logits_chunk_positions_follows_the_budget():
    assert logits_chunk_positions(2, 512, 2 * 512 * 4 * 3) == 3
    assert logits_chunk_positions(2, 512, 2 * 512 * 4 * 3 + 100) == 3
    assert logits_chunk_positions(64, 128_256, 1) == 1  # one position is the smallest chunk
    assert logits_chunk_positions(1, 128_256) * 128_256 * 4 <= DEFAULT_LOGITS_BUDGET_BYTES
    with pytest.raises(ValueError, match="budget_bytes"):
        logits_chunk_positions(1, 10, 0)
    assert head_vocab_size(build_model("debug", "policy").output) == 512
    assert head_vocab_size(build_model("debug_qwen", "policy").output) == 512  # TiedLinear
    with pytest.raises(TypeError, match="chunk_positions"):
        head_vocab_size(torch.nn.ReLU())


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen"])
def test_chunked_logprobs_equal_unchunked(flavor):
    model, tokens = _decoder(flavor)
    with torch.no_grad():
        logits = model(tokens)
        hidden = decoder_hidden_states(model, tokens)
        for temperature in (1.0, 0.7):
            want_lp, want_ent = token_logprobs(logits, tokens, temperature), token_entropy(logits, temperature)
            for chunk in (1, 2, 3, _S - 1, 100):
                lp, ent = chunked_token_logprobs_entropy(hidden, model.output, tokens, temperature, chunk_positions=chunk)
                torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
                assert lp.dtype == torch.float32 and (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
            # by token budget: 4 positions x 2 rows x 512 x 4 bytes per chunk
            lp = chunked_token_logprobs(hidden, model.output, tokens, temperature, budget_bytes=4 * _B * 512 * 4)
            torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
            # masked: the head runs on the masked tokens alone (uneven per row, a row without any), zeros elsewhere
            mask = torch.zeros(tokens.shape)
            mask[0, 3:6] = 1
            mask[0, 8] = 1  # row 1 has none
            for chunk in (1, 3, 100):
                lp, ent = chunked_token_logprobs_entropy(
                    hidden, model.output, tokens, temperature, chunk_positions=chunk, mask=mask
                )
                torch.testing.assert_close(lp, want_lp * mask, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ent, want_ent * mask, atol=1e-5, rtol=1e-5)
                assert (lp[mask == 0] == 0).all() and (lp[mask != 0] != 0).all()
        one = chunked_token_logprobs(hidden[:, :1], model.output, tokens[:, :1])
        assert torch.equal(one, torch.zeros(_B, 1))


class _SavedShapes(torch.autograd.graph.saved_tensors_hooks):
    """Records the shapes of tensors autograd saves for backward outside checkpointed regions."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(t.shape))
        return t


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_chunked_policy_loss_gradients_equal_unchunked(flavor, entropy_coef):
    model, tokens = _decoder(flavor)
    head = model.output
    weight = model.tok_embeddings.weight if flavor == "debug_qwen" else model.output.weight
    with torch.no_grad():
        base = decoder_hidden_states(model, tokens)
        targets = _chunk_targets(tokens, token_logprobs(model(tokens), tokens))
    targets["loss_denom"] = torch.full((_B,), 12.0)

    def run(chunked: bool):
        hidden = base.clone().requires_grad_(True)
        weight.grad = None
        saved = _SavedShapes()
        with saved:
            if chunked:
                loss, stats = chunked_policy_loss(hidden, head, targets, 0.2, entropy_coef, 0.9, chunk_positions=3)
            else:
                loss, stats = policy_loss(head(hidden).float(), targets, 0.2, entropy_coef, 0.9)
        loss.backward()
        vocab_sized = [s for s in saved.shapes if len(s) == 3 and s[-1] == 512]
        return loss.detach(), stats, hidden.grad, weight.grad.clone(), vocab_sized

    loss, stats, g_hidden, g_weight, full_saved = run(False)
    c_loss, c_stats, c_hidden, c_weight, chunk_saved = run(True)
    torch.testing.assert_close(c_loss, loss, atol=1e-6, rtol=1e-5)
    for k in stats:
        torch.testing.assert_close(c_stats[k], stats[k], atol=1e-6, rtol=1e-5)
    assert g_hidden.abs().sum() > 0 and g_weight.abs().sum() > 0
    torch.testing.assert_close(c_hidden, g_hidden, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(c_weight, g_weight, atol=1e-6, rtol=1e-4)
    # memory proxy (CPU has no allocator stats): the unchunked loss keeps [B, S, V] tensors for backward,
    # the checkpointed chunks keep none of vocabulary width
    assert full_saved and not chunk_saved
    # the module wrapper and the chunked loss agree with the logits path at the default budget
    loss_default, _ = chunked_policy_loss(base, head, targets, 0.2, entropy_coef, 0.9)
    torch.testing.assert_close(loss_default, loss, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kl", [None, KLLoss(0.1, "k3")])
def test_old_logprobs_from_the_forward_equal_a_separate_pass(kl):
    """On-policy (one update with the weights that sampled): the loss with the forward's own detached log-probs as
    the old ones equals the loss with a separate pass's (the same log-probs) in value, stats and gradients; the
    targets' log-probs are then the engine's, and the gap stats compare the forward with them."""
    model, tokens = _decoder("debug")
    head = model.output
    with torch.no_grad():
        base = decoder_hidden_states(model, tokens)
        separate = token_logprobs(head(base).float(), tokens)  # the recompute pass
    targets = _chunk_targets(tokens, separate)
    engine = targets["logprobs"]  # off by ~0.3: an engine of other arithmetic
    targets["ref_logprobs"] = separate + 0.05
    mask = targets["response_mask"]

    def run(old: torch.Tensor, from_forward: bool):
        hidden = base.clone().requires_grad_(True)
        head.weight.grad = None
        loss, stats = chunked_policy_loss(
            hidden, head, {**targets, "logprobs": old}, 0.2, 0.0, 1.0, kl, old_from_forward=from_forward
        )
        loss.backward()
        return loss.detach(), stats, hidden.grad, head.weight.grad.clone()

    loss, stats, g_hidden, g_weight = run(separate * mask, False)
    f_loss, f_stats, f_hidden, f_weight = run(engine, True)
    torch.testing.assert_close(f_loss, loss, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(f_hidden, g_hidden, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(f_weight, g_weight, atol=1e-7, rtol=1e-5)
    assert g_hidden.abs().sum() > 0
    for k in ("policy_loss", "clip_frac", "approx_kl", "ratio_mean", "entropy", *(("kl_loss",) if kl else ())):
        torch.testing.assert_close(f_stats[k], stats[k], atol=1e-6, rtol=1e-5)
    assert f_stats["ratio_mean"] == 1.0 and f_stats["clip_frac"] == 0.0
    gap = ((separate - engine) * mask).abs()
    torch.testing.assert_close(f_stats["logprob_diff"], gap.sum() / mask.sum(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(f_stats["logprob_diff_max"], gap.amax(), atol=1e-6, rtol=1e-5)
    ratio = ((separate - engine).exp() * mask).sum() / mask.sum()
    torch.testing.assert_close(f_stats["importance_ratio"], ratio, atol=1e-6, rtol=1e-5)
    assert "importance_ratio" not in stats
