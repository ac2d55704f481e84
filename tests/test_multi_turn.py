"""Multi-turn requests in the engine: a turn ends, the request keeps its KV off the decode batch, an observation is
appended and only it is computed, the next turn decodes from there; every id of the sample is exactly what was sampled
or appended."""

import pytest
import torch
from test_generation import _reference_greedy

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.generation.state import pack_states, unpack_states
from fusedrl.models import build_model

GREEDY_TURN = SamplingParams(temperature=0.0, max_new_tokens=5)
SAMPLED_TURN = SamplingParams(temperature=0.9, top_k=40, max_new_tokens=6)
PROMPT = [5, 17, 3, 99, 250, 7, 31]
OBSERVATION = [11, 12, 13, 400]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("debug").eval()


def _turn(engine: GenerationEngine):
    """Step until a result comes."""
    while True:
        results = engine.step()
        if results:
            return results


def test_a_request_continues_in_place_after_an_observation_as_a_full_recompute_would(model):
    engine = GenerationEngine(model, max_slots=2, max_len=64)
    engine.add_request(Request(0, PROMPT, GREEDY_TURN, multi_turn=True))
    (first,) = _turn(engine)
    assert first.awaiting and first.finish_reason == "length" and len(first.tokens) == 5
    assert engine.num_awaiting == 1 and not engine.has_work() and engine.unfinished_ids() == [0]
    engine.continue_request(0, OBSERVATION)
    (second,) = _turn(engine)
    assert second.awaiting and second.observations == [(5, 9)]
    result = engine.end_request(0)
    assert not result.awaiting and engine.num_awaiting == 0 and engine.unfinished_ids() == []
    turn1, obs, turn2 = result.tokens[:5], result.tokens[5:9], result.tokens[9:]
    assert obs == OBSERVATION and len(turn2) == 5
    assert result.sampled_mask == [True] * 5 + [False] * 4 + [True] * 5
    assert result.logprobs[5:9] == [0.0] * 4
    expected, logprobs = _reference_greedy(model, PROMPT + turn1 + OBSERVATION, 5)
    assert turn2 == expected and turn1 == _reference_greedy(model, PROMPT, 5)[0]
    torch.testing.assert_close(torch.tensor(result.logprobs[9:]), torch.tensor(logprobs), atol=1e-4, rtol=0)


def _two_turns(engine: GenerationEngine, migrate=None) -> tuple[list[int], list[float]]:
    engine.add_request(Request(3, PROMPT, SAMPLED_TURN, seed=11, multi_turn=True))
    _turn(engine)
    if migrate is not None:
        engine = migrate(engine)
    engine.continue_request(3, OBSERVATION)
    _turn(engine)
    result = engine.end_request(3)
    return result.tokens, result.logprobs


def _continued(model) -> GenerationEngine:
    """An engine whose request 3 has ended its first turn and been given ``OBSERVATION`` (queued for its second)."""
    engine = GenerationEngine(model, max_slots=2, max_len=64)
    engine.add_request(Request(3, PROMPT, SAMPLED_TURN, seed=11, multi_turn=True))
    _turn(engine)
    engine.continue_request(3, OBSERVATION)
    return engine


def _same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> None:
    assert a[0] == b[0]
    torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-5, rtol=0)


def test_a_sampled_continuation_is_the_same_from_kept_kv_as_from_a_reprefill_or_a_migrated_request(model):
    # the random stream counts sampled tokens only: the observation moves no counter, wherever the turn decodes
    kept = _two_turns(GenerationEngine(model, max_slots=2, max_len=64))

    def reprefilled(engine):  # waiting between turns, exported without KV, continued elsewhere from its tokens
        other = GenerationEngine(model, max_slots=2, max_len=64, seed=123)
        (state,) = unpack_states(pack_states([engine.export_request(3, mode="reprefill")])[1:])
        assert state.awaiting and state.k is None
        other.import_request(state)
        return other

    def migrated(engine):  # with its KV, through the wire format
        other = GenerationEngine(model, max_slots=1, max_len=64)
        (state,) = unpack_states(pack_states([engine.export_request(3)])[1:])
        other.import_request(state)
        return other

    _same(_two_turns(GenerationEngine(model, max_slots=2, max_len=64), reprefilled), kept)
    _same(_two_turns(GenerationEngine(model, max_slots=2, max_len=64), migrated), kept)


def test_a_continued_request_migrates_mid_turn_with_its_partial_kv(model):
    expected = _two_turns(GenerationEngine(model, max_slots=2, max_len=64))
    engine = _continued(model)
    (state,) = unpack_states(pack_states([engine.export_request(3)])[1:])  # queued: KV of turn 1 only
    assert state.k is not None and state.k.shape[1] < state.cache_len and state.observations == [(6, 10)]
    other = GenerationEngine(model, max_slots=2, max_len=64)
    other.import_request(state)
    _turn(other)
    result = other.end_request(3)
    _same((result.tokens, result.logprobs), expected)


def test_a_request_between_turns_holds_no_slot(model):
    # one slot: while the first request waits for its environment, another takes the slot and decodes to its end
    engine = GenerationEngine(model, max_slots=1, max_len=64)
    engine.add_request(Request(0, PROMPT, GREEDY_TURN, multi_turn=True))
    engine.add_request(Request(1, [8, 9, 10], SamplingParams(temperature=0.0, max_new_tokens=3)))
    (first,) = _turn(engine)
    assert first.id == 0 and first.awaiting
    (other,) = _turn(engine)
    assert other.id == 1 and not other.awaiting and engine.num_awaiting == 1
    engine.continue_request(0, OBSERVATION)
    (second,) = _turn(engine)
    assert second.id == 0 and second.tokens[:5] == first.tokens


def test_a_stop_token_ends_a_turn_and_max_len_ends_the_request(model):
    stop = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=tuple(range(512)))
    engine = GenerationEngine(model, max_slots=1, max_len=16)
    engine.add_request(Request(0, PROMPT, stop, multi_turn=True))
    (turn,) = _turn(engine)
    assert turn.finish_reason == "stop" and turn.awaiting and len(turn.tokens) == 1
    engine.continue_request(0, [1, 2, 3])
    long = SamplingParams(temperature=0.0, max_new_tokens=20)
    engine.add_request(Request(1, PROMPT, long, multi_turn=True))
    results = {r.id: r for r in [*_turn(engine), *_turn(engine)]}
    assert results[1].finish_reason == "max_len" and not results[1].awaiting  # no room for another turn


def test_bad_continuations_are_one_line_errors(model):
    engine = GenerationEngine(model, max_slots=1, max_len=16)
    with pytest.raises(ValueError, match="multi_turn requests .* continue_request"):
        engine.generate([Request(0, PROMPT, GREEDY_TURN, multi_turn=True)])
    engine.add_request(Request(1, PROMPT, GREEDY_TURN, multi_turn=True))
    with pytest.raises(KeyError, match="not waiting between turns"):
        engine.continue_request(1, [1])
    _turn(engine)
    with pytest.raises(ValueError, match="empty observation"):
        engine.continue_request(1, [])
    with pytest.raises(ValueError, match="outside"):
        engine.continue_request(1, [10**6])
    with pytest.raises(ValueError, match="past the engine's max_len 16 .* end the episode"):
        engine.continue_request(1, [1, 2, 3, 4])
    engine.continue_request(1, [1, 2, 3])  # exactly room for one more token
    assert engine.num_awaiting == 0


def test_a_request_decoding_its_second_turn_migrates_with_its_turn_state(model):
    expected = _two_turns(GenerationEngine(model, max_slots=2, max_len=64))
    engine = _continued(model)
    engine.step()  # the observation computed, one token of the second turn sampled: decoding
    (state,) = unpack_states(pack_states([engine.export_request(3)])[1:])
    assert state.observations == [(6, 10)] and state.turn_start == 10 and len(state.generated) == 11
    other = GenerationEngine(model, max_slots=2, max_len=64)
    other.import_request(state)
    (turn,) = _turn(other)
    assert turn.awaiting and len(turn.tokens) == 16  # the turn's budget counts from its start, not from the import
    result = other.end_request(3)
    _same((result.tokens, result.logprobs), expected)


def test_a_request_s_max_tokens_caps_every_turn_forced_and_speculated_ones_too(model):
    # a turn cut at the cap ends the request; one that stops on its last allowed token waits for its environment,
    # which then has no room for an observation
    engine = GenerationEngine(model, max_slots=2, max_len=64)
    engine.add_request(Request(0, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=20), multi_turn=True, max_tokens=9))
    engine.add_request(Request(1, PROMPT, GREEDY_TURN, multi_turn=True, max_tokens=7))
    (first,) = _turn(engine)
    assert first.id == 1 and first.awaiting and len(first.tokens) == 5
    engine.continue_request(1, [11])  # 6 of 7: room for one more token
    done = {r.id: r for r in [*_turn(engine), *_turn(engine)]}
    assert len(done[0].tokens) == 9 and done[0].finish_reason == "max_len" and not done[0].awaiting
    assert len(done[1].tokens) == 7 and done[1].finish_reason == "max_len" and not done[1].awaiting
    stop_all = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=tuple(range(512)))
    engine.add_request(Request(2, PROMPT, stop_all, multi_turn=True, max_tokens=1))
    (stopped,) = _turn(engine)
    assert stopped.finish_reason == "stop" and stopped.awaiting and len(stopped.tokens) == 1
    with pytest.raises(ValueError, match="max_tokens 1, leaving no token for its next turn: end the episode"):
        engine.continue_request(2, [11])
    # a forced length stops at the cap too, and what is left never goes below zero
    forced = Request(3, PROMPT, SamplingParams(target_len=10), max_tokens=4)
    engine.add_request(forced)
    budgets = []
    while engine.has_work():
        budgets += [p.budget - p.generated for p in engine.progress() if p.id == 3]
        results = engine.step()
    assert [len(r.tokens) for r in results] == [4] and results[0].finish_reason == "max_len"
    assert min(budgets) >= 0
    # speculation (verify steps produce several tokens at once) stops at the cap as plain decoding does
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    requests = [Request(10 + k, PROMPT, greedy, max_tokens=13) for k in range(4)]
    plain = GenerationEngine(model, max_slots=2, max_len=64).generate(requests)
    spec = GenerationEngine(model, max_slots=2, max_len=64, speculative="history", speculative_rows=2)
    assert spec.speculator is not None
    spec.speculator.gate = None  # every step verifies, whatever the timings
    speculated = spec.generate(requests)
    assert spec.speculator.stats.accepted > 0
    assert [r.tokens for r in speculated] == [r.tokens for r in plain] and {len(r.tokens) for r in plain} == {13}
