"""Scoring of finished samples equals a direct forward of each model over each sample alone."""

import pytest
import torch

from fusedrl.generation import Request, RequestResult
from fusedrl.models import build_model
from fusedrl.rlhf import Scorer, ScoringModels, decoder_hidden_states, scoring_micro_batches


def _models(flavor: str = "debug") -> ScoringModels:
    torch.manual_seed(0)
    return ScoringModels(
        build_model(flavor, "policy").eval(), build_model(flavor, "value").eval(), build_model(flavor, "value").eval()
    )


def _sample(sid: int, prompt: list[int], response: list[int], logprobs: list[float] = ()) -> RequestResult:
    return RequestResult(Request(sid, prompt), response, list(logprobs), "length")


def _samples() -> list[RequestResult]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, r) in enumerate([(5, 3), (2, 9), (7, 1), (3, 4), (1, 6)]):
        ids = torch.randint(0, 512, (p + r,), generator=g).tolist()
        out.append(_sample(100 + i, ids[:p], ids[p:], [-0.5 * (j + 1) for j in range(r)]))
    return out


# sample lengths are 8, 11, 8, 7, 7: max_tokens=20 cuts [7, 7] [8, 8] [11]; 9 scores every sample alone
# (11 > 9 forms its own micro-batch); logits_budget_bytes=1 applies the LM head one position at a time
@pytest.mark.parametrize(
    "flavor, micro_batch_size, max_tokens, budget",
    [
        ("debug", 1, None, None),
        ("debug", 2, None, None),
        ("debug", 8, None, None),
        ("debug", 8, 20, None),
        ("debug", 8, 9, 1),
        ("debug_qwen", 3, 20, 2 * 512 * 4 * 3),
    ],
)
def test_scores_equal_direct_forward(flavor, micro_batch_size, max_tokens, budget):
    models = _models(flavor)
    samples = _samples()
    extra = {} if budget is None else {"logits_budget_bytes": budget}
    exp = Scorer(models, micro_batch_size=micro_batch_size, temperature=0.7, max_tokens=max_tokens, **extra).score(samples)
    assert exp.sample_ids.tolist() == [s.id for s in samples]
    with torch.no_grad():
        for row, s in enumerate(samples):
            seq = torch.tensor([[*s.prompt, *s.tokens]])
            p, n = len(s.prompt), seq.shape[1]
            logp = torch.log_softmax(models.reference(seq)[0].float() / 0.7, -1)
            want_ref = torch.stack([logp[t - 1, seq[0, t]] for t in range(p, n)])
            want_values = models.critic(seq)[0, p - 1 : n - 1, 0]
            want_score = models.reward(seq)[0, n - 1, 0]
            torch.testing.assert_close(exp.ref_logprobs[row, p:n], want_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(exp.values[row, p:n], want_values, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(exp.scores[row], want_score, atol=1e-5, rtol=1e-5)
            assert exp.tokens[row, :n].tolist() == seq[0].tolist()
            assert exp.response_mask[row].sum() == len(s.tokens) and exp.response_mask[row, p:n].all()
            assert exp.logprobs[row, p:n].tolist() == list(s.logprobs)
            # padding and prompt positions carry nothing
            assert exp.ref_logprobs[row, :p].abs().sum() == 0 and exp.values[row, n:].abs().sum() == 0


def test_bad_inputs_raise_clear_errors():
    scorer = Scorer(_models())
    with pytest.raises(ValueError, match="empty response"):
        scorer.score([_sample(1, [1, 2], [])])
    with pytest.raises(ValueError, match="log-probs"):
        scorer.score([_sample(1, [1, 2], [3, 4], [0.1])])
    with pytest.raises(ValueError, match="no samples"):
        scorer.score([])
    with pytest.raises(ValueError, match="micro_batch_size"):
        Scorer(_models(), micro_batch_size=0)
    with pytest.raises(ValueError, match="max_tokens"):
        Scorer(_models(), max_tokens=0)
    with pytest.raises(ValueError, match="logits_budget_bytes"):
        Scorer(_models(), logits_budget_bytes=0)


def test_micro_batch_cutting_rule():
    lengths = [3, 4, 4, 5, 9, 20, 21]
    cuts = scoring_micro_batches(lengths, max_rows=3, max_tokens=16)
    assert cuts == [[0, 1, 2], [3], [4], [5], [6]]
    assert scoring_micro_batches(lengths, max_rows=2) == [[0, 1], [2, 3], [4, 5], [6]]
    assert scoring_micro_batches(lengths, max_rows=100, max_tokens=40) == [[0, 1, 2, 3], [4, 5], [6]]
    for max_rows in (1, 2, 3, 8):
        for max_tokens in (None, 1, 8, 12, 20, 45, 1000):
            cuts = scoring_micro_batches(lengths, max_rows, max_tokens)
            assert [i for cut in cuts for i in cut] == list(range(len(lengths)))  # order kept, nothing lost
            for cut in cuts:
                assert 1 <= len(cut) <= max_rows
                padded = len(cut) * max(lengths[i] for i in cut)
                # only a sample longer than max_tokens may exceed it, and then it is alone
                assert max_tokens is None or padded <= max_tokens or len(cut) == 1
    assert scoring_micro_batches([], 4, 10) == []
    # unsorted input: padded width is the longest of the cut
    assert scoring_micro_batches([10, 1, 1], 4, 20) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="max_rows"):
        scoring_micro_batches(lengths, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        scoring_micro_batches(lengths, 2, 0)


@pytest.mark.parametrize("flavor, role", [("debug", "policy"), ("debug_qwen", "policy"), ("debug", "value")])
def test_decoder_hidden_states_are_the_forward_up_to_the_head(flavor, role):
    torch.manual_seed(0)
    model = build_model(flavor, role).eval()
    tokens = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = decoder_hidden_states(model, tokens)
        torch.testing.assert_close(model.output(hidden).float(), model(tokens), atol=0, rtol=0)
        # causal: changing later tokens (e.g. padding) leaves earlier positions unchanged
        other = tokens.clone()
        other[:, 6:] = 0
        torch.testing.assert_close(decoder_hidden_states(model, other)[:, :6], hidden[:, :6], atol=1e-6, rtol=1e-5)
        assert not torch.allclose(decoder_hidden_states(model, other)[:, 6:], hidden[:, 6:])
    with pytest.raises(ValueError, match="max_seq_len"):
        decoder_hidden_states(model, torch.zeros(1, model.max_seq_len + 1, dtype=torch.long))
    model.setup_caches(batch_size=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="KV caches"):
        decoder_hidden_states(model, tokens)


def _score_tensor_parallel() -> None:
    from fusedrl.distributed import ParallelDims, apply_tp

    plain = _models("debug_qwen")
    sharded = _models("debug_qwen")
    mesh = ParallelDims(tp=2).build_mesh("cpu")["tp"]
    for m in (sharded.reference, sharded.reward, sharded.critic):
        apply_tp(m, mesh)
    samples = _samples()
    want = Scorer(plain, micro_batch_size=2, max_tokens=20).score(samples)
    got = Scorer(sharded, micro_batch_size=2, max_tokens=20, logits_budget_bytes=1).score(samples)
    for name in ("tokens", "response_mask", "logprobs", "ref_logprobs", "values", "scores", "sample_ids"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_scorer_accepts_tensor_parallel_models(two_ranks):
    two_ranks.run(_score_tensor_parallel)
