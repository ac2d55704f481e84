"""Scoring of finished samples equals a direct forward of each model over each sample alone."""

import pytest
import torch

from fusedrl.models import build_model
from fusedrl.generation import Request, RequestResult
from fusedrl.rlhf import Scorer, ScoringModels


def _models() -> ScoringModels:
    torch.manual_seed(0)
    return ScoringModels(build_model("debug", "policy").eval(), build_model("debug", "value").eval(),
                         build_model("debug", "value").eval())


def _sample(sid: int, prompt: list[int], response: list[int], logprobs: list[float] = ()) -> RequestResult:
    return RequestResult(Request(sid, prompt), response, list(logprobs), "length")


def _samples() -> list[RequestResult]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, r) in enumerate([(5, 3), (2, 9), (7, 1), (3, 4), (1, 6)]):
        ids = torch.randint(0, 512, (p + r,), generator=g).tolist()
        out.append(_sample(100 + i, ids[:p], ids[p:], [-0.5 * (j + 1) for j in range(r)]))
    return out


@pytest.mark.parametrize("micro_batch_size", [1, 2, 8])
def test_scores_equal_direct_forward(micro_batch_size):
    models = _models()
    samples = _samples()
    exp = Scorer(models, micro_batch_size=micro_batch_size, temperature=0.7).score(samples)
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
