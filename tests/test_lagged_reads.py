"""Lagged reads (the CUDA decode path, forced on here on a CPU): the host reads a decode step's tokens while the next
step runs, so a finished request is found one step late; every request's tokens and log-probs stay those of reading
each step at once."""

import pytest
import torch
from test_generation import _prompt

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.generation.slots import reads_lag_a_step
from fusedrl.models import build_model

STOPS = list(range(0, 512, 9))  # ~1 in 9 of the debug model's ids: some requests stop early, some run to their limit


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("debug").eval()


def _requests() -> list[Request]:
    """More requests than slots, of mixed lengths and limits: slots free up mid-batch (the last one moves into them)."""
    out = []
    for i in range(10):
        if i % 3 == 0:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=3 + i)
        elif i % 3 == 1:
            sampling = SamplingParams(temperature=1.2, max_new_tokens=12, stop_token_ids=STOPS)
        else:
            sampling = SamplingParams(temperature=0.9, top_k=50, target_len=2 + i)
        out.append(Request(i, _prompt(2 + 3 * i % 11, i), sampling, seed=5))
    return out


def _same(a, b) -> None:
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_the_cuda_path_lags_reads_by_default_and_a_cpu_engine_does_not(model):
    assert reads_lag_a_step(torch.device("cuda", 0)) and not reads_lag_a_step(torch.device("cpu"))
    assert not GenerationEngine(model, max_slots=2, max_len=32).lagged_reads
    assert GenerationEngine(model, max_slots=2, max_len=32, lagged_reads=True).lagged_reads


def test_a_lagged_engine_finds_a_finished_request_one_step_later(model):
    request = Request(0, _prompt(4, 0), SamplingParams(temperature=0.0, max_new_tokens=2))
    at_once = GenerationEngine(model, max_slots=2, max_len=32)
    at_once.add_request(request)
    assert [r.id for r in at_once.step()] == [0]  # prefill samples token 1, the decode step token 2
    lagged = GenerationEngine(model, max_slots=2, max_len=32, lagged_reads=True)
    lagged.add_request(request)
    assert lagged.step() == [] and lagged.has_work()  # token 2 is on its way
    (result,) = lagged.step()  # read while a second step ran on the finished row
    assert result.tokens == at_once.generate([Request(1, request.prompt, request.sampling)])[0].tokens
    assert not lagged.has_work() and lagged.stats().active == 0


BUCKETS = dict(max_len=48, len_buckets=range(1, 49))  # a length bucket per length: one position short shows


def test_lagged_reads_give_every_request_the_tokens_of_reads_at_once(model):
    at_once = GenerationEngine(model, max_slots=4, **BUCKETS).generate(_requests())
    assert {r.finish_reason for r in at_once} == {"stop", "length"}  # both ends of a request occur
    _same(GenerationEngine(model, max_slots=4, lagged_reads=True, **BUCKETS).generate(_requests()), at_once)


def _twice_speculated(model, lagged: bool) -> tuple[list, int]:
    """``_requests`` twice through one speculating engine (the second pass drafts from the first's responses), and
    the drafts it accepted."""
    engine = GenerationEngine(model, max_slots=4, speculative="history", lagged_reads=lagged, **BUCKETS)
    assert engine.speculator is not None
    engine.speculator.gate = None  # every step verifies (a lagged engine has no gate: its steps are not timed)
    first = engine.generate(_requests())
    again = [Request(f"again-{r.id}", r.prompt, r.sampling, seed=r.seed) for r in _requests()]
    return first + engine.generate(again), engine.speculator.stats.accepted


def test_speculative_steps_of_a_lagged_engine_draft_from_every_token_sampled(model):
    at_once, accepted = _twice_speculated(model, lagged=False)
    assert accepted > 0
    lagged, lagged_accepted = _twice_speculated(model, lagged=True)
    _same(lagged, at_once)
    assert lagged_accepted == accepted


def _migrated_mid_batch(model, lagged: bool) -> list:
    """Every request of ``_requests`` into one engine, three steps, the ones that sample more than 4 tokens without a
    stop token exported (KV) into a second engine, both run to the end."""
    first = GenerationEngine(model, max_slots=10, max_len=48, lagged_reads=lagged)
    second = GenerationEngine(model, max_slots=10, max_len=48, lagged_reads=lagged)
    for r in _requests():
        first.add_request(r)
    results = [res for _ in range(3) for res in first.step()]
    for rid in (3, 5, 6, 8, 9):
        state = first.export_request(rid)
        assert len(state.generated) == 4  # the prefill's token and one per step
        second.import_request(state)
    for engine in (first, second):
        while engine.has_work():
            results += engine.step()
    return sorted(results, key=lambda r: r.id)


def test_a_request_exported_from_a_lagged_engine_carries_every_token_it_sampled(model):
    _same(_migrated_mid_batch(model, lagged=True), _migrated_mid_batch(model, lagged=False))


def _two_turns(model, lagged: bool):
    engine = GenerationEngine(model, max_slots=3, max_len=64, lagged_reads=lagged)
    turn = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=STOPS)
    for i in range(3):
        engine.add_request(Request(i, _prompt(5 + i, 20 + i), turn, seed=3, multi_turn=True))
    ended, turns = [], {i: 0 for i in range(3)}
    while engine.has_work():
        for res in engine.step():
            turns[res.id] += 1
            if turns[res.id] < 3:
                engine.continue_request(res.id, [7, 8, res.id + 1])
            else:
                ended.append(engine.end_request(res.id))
    return sorted(ended, key=lambda r: r.id)


def test_multi_turn_requests_park_and_continue_the_same_under_lagged_reads(model):
    at_once = _two_turns(model, lagged=False)
    assert all(len(r.observations) == 2 for r in at_once)
    _same(_two_turns(model, lagged=True), at_once)
