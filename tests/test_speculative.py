"""Speculative decoding from history: the engine verifies drafted tokens with its own seeded sampler, so every sample
is the one decoding without speculation gives (float32), whatever the drafts are."""

from pathlib import Path

import pytest
import torch

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.generation.drafts import Draft
from fusedrl.generation.speculation import SpeculationGate
from fusedrl.generation.state import pack_states, unpack_states
from fusedrl.models import build_model
from fusedrl.testing.configs import TINY_DEBUG_RUN

PROMPTS = [[5, 17, 3, 99, 250, 7], [8, 1, 44, 2]]
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=24),
    "sampled": SamplingParams(temperature=0.3, max_new_tokens=24),
    "filtered": SamplingParams(temperature=0.5, top_k=30, top_p=0.9, max_new_tokens=24),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("debug").eval()


def _requests(params: SamplingParams, seed: int) -> list[Request]:
    """4 samples of each prompt: a group's later samples draft from the earlier ones' tokens."""
    return [Request(p * 4 + k, prompt, params, seed=seed) for p, prompt in enumerate(PROMPTS) for k in range(4)]


def _generate(model, requests, **engine_args) -> tuple[dict, GenerationEngine]:
    engine = _ungated(GenerationEngine(model, max_slots=2, max_len=64, **engine_args))
    return {r.id: (r.tokens, r.logprobs) for r in engine.generate(requests)}, engine


def _ungated(engine: GenerationEngine) -> GenerationEngine:
    """Every step at most ``speculative_rows`` verifies, whatever the steps' timings (the gate: its own tests)."""
    if engine.speculator is not None:
        engine.speculator.gate = None
    return engine


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", [0, 7])
def test_speculation_gives_the_samples_of_plain_decoding(model, setting, seed):
    requests = _requests(SETTINGS[setting], seed)
    plain, _ = _generate(model, requests)
    spec, engine = _generate(model, requests, speculative="history", max_draft=6, speculative_rows=2)
    for rid, (tokens, logprobs) in plain.items():
        assert spec[rid][0] == tokens, rid
        torch.testing.assert_close(torch.tensor(spec[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)
    s = engine.speculator.stats
    assert s.verify_steps > 0 and s.drafted > 0
    if setting == "greedy":  # a greedy sibling repeats the first one: its drafts are all right
        assert s.accepted > s.drafted / 2 and s.produced > s.verify_steps


def test_wrong_drafts_cost_no_sample(model, monkeypatch):
    requests = _requests(SETTINGS["sampled"], 3)
    plain, _ = _generate(model, requests)
    engine = _ungated(GenerationEngine(model, max_slots=2, max_len=64, speculative="history", max_draft=5, speculative_rows=2))
    assert engine.speculator is not None
    monkeypatch.setattr(
        engine.speculator.drafter, "propose", lambda rid, limit=None: Draft((1, 2, 3, 4, 5)[: limit or 5], "prompt")
    )
    spec = {r.id: (r.tokens, r.logprobs) for r in engine.generate(requests)}
    assert {rid: t for rid, (t, _) in spec.items()} == {rid: t for rid, (t, _) in plain.items()}
    assert engine.speculator.stats.verify_steps > 0 and engine.speculator.stats.accepted < engine.speculator.stats.drafted


def test_a_migrated_request_continues_identically_under_speculation(model):
    params = SETTINGS["sampled"]
    (expected,), _ = _generate(model, [Request(9, PROMPTS[0], params, seed=5)])[0].values(), None
    source = _ungated(GenerationEngine(model, max_slots=1, max_len=64, speculative="history", speculative_rows=1))
    source.add_request(Request(9, PROMPTS[0], params, seed=5))
    for _ in range(5):
        source.step()
    (state,) = unpack_states(pack_states([source.export_request(9)])[1:])
    target = _ungated(GenerationEngine(model, max_slots=1, max_len=64, speculative="history", speculative_rows=1))
    target.import_request(state)
    results = []
    while target.has_work():
        results += target.step()
    (result,) = results
    assert result.tokens == expected[0]


def _episode(engines: list[GenerationEngine], observation: list[int]) -> tuple[list[int], list[float]]:
    """A two-turn request on ``engines[0]``, exported while it waits for its observation and imported into the next
    engine (if any), continued there and ended."""
    turn = SamplingParams(temperature=0.3, max_new_tokens=8)
    engine = engines[0]
    engine.add_request(Request(3, PROMPTS[0], turn, seed=7, multi_turn=True))
    while not engine.step():
        pass
    for other in engines[1:]:
        (state,) = unpack_states(pack_states([engine.export_request(3)])[1:])
        other.import_request(state)
        engine = other
    engine.continue_request(3, observation)
    while not engine.step():
        pass
    result = engine.end_request(3)
    return result.tokens, result.logprobs


def test_a_request_migrated_between_turns_continues_identically_under_speculation(model):
    # imported while it waits for its environment, the request is not in the receiving drafter yet: continuing it
    # appends the observation to its tokens and the drafter starts from them when it takes a slot
    plain = _episode([GenerationEngine(model, max_slots=1, max_len=64)], [40, 41, 42])
    engines = [
        _ungated(GenerationEngine(model, max_slots=1, max_len=64, speculative="history", speculative_rows=1)) for _ in range(2)
    ]
    tokens, logprobs = _episode(engines, [40, 41, 42])
    assert tokens == plain[0]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(plain[1]), atol=1e-4, rtol=0)
    assert engines[1].num_unfinished == 0


def test_bad_speculation_settings_are_refused(model):
    with pytest.raises(ValueError, match="unknown speculative mode 'model'"):
        GenerationEngine(model, max_slots=1, max_len=16, speculative="model")
    for speculative in ("history", "off"):  # a bad value is refused even where it is not used yet
        with pytest.raises(ValueError, match="max_draft and speculative_rows must be >= 1"):
            GenerationEngine(model, max_slots=1, max_len=16, speculative=speculative, max_draft=0)


# -- a trainer run: fusions on and off with speculation --------------------------------------------------------------

# The GRPO debug run on 2 ranks (2 generation instances), groups of 4 at temperature 0.05: a random model's siblings
# then share many tokens, so the drafts from them are accepted often (at 0.2 they part at the first token). One id in 16
# stops a response (lengths vary and the tail migrates).
SPECULATIVE_RUN = [
    *(
        a
        for a in TINY_DEBUG_RUN
        if not a.startswith(
            ("--generation.stop_token_ids", "--generation.max_new_tokens", "--generation.max_slots", "--model.c", "--model.rew")
        )
    ),
    "--generation.stop_token_ids=" + ",".join(map(str, range(0, 512, 16))),
    "--generation.max_new_tokens=24",
    "--generation.temperature=0.05",
    "--generation.max_slots=2",  # two of a group's samples decode first, the others draft from their tokens
    "--generation.speculative=history",
    "--generation.n=4",
    "--parallelism.pp=2",
    "--parallelism.dp_shard=1",
    "--fusion.inter_stage=true",  # both rollouts fused ("auto" runs the first unfused)
    "--fusion.migration_threshold=0.25",  # 2 unfinished: what one instance's 2 slots take
    "--fusion.migration_check_interval=1",
    "--fusion.schedule_search_budget_s=0.2",
    "--training.steps=2",
    "--checkpoint.interval=0",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--lr_scheduler.warmup_steps=0",
    "--optimizer.actor_lr=1e-3",
]
UNFUSED = ("--fusion.inter_stage=false", "--fusion.intra_stage=false")
SAME = ("reward_mean", "response_len_mean", "policy_loss", "kl_loss", "grad_norm_actor", "entropy")


def _speculative_runs(out: str) -> dict:
    from fusedrl.config import load_config
    from fusedrl.train import run

    config = str(Path(__file__).resolve().parents[1] / "train_configs" / "debug_grpo.toml")

    def cfg(name: str, *extra: str):
        return load_config(["--job.config_file", config, *SPECULATIVE_RUN, f"--job.output_dir={out}/{name}", *extra])

    # every step at most speculative_rows verifies, whatever the gate would measure (timings are the machine's)
    speculate, SpeculationGate.speculate = SpeculationGate.speculate, lambda self, rows: True
    try:
        return {
            "on": run(cfg("on")),
            "off": run(cfg("off", *UNFUSED)),
            "plain": run(cfg("plain", *UNFUSED, "--generation.speculative=off")),
        }
    finally:
        SpeculationGate.speculate = speculate


@pytest.mark.slow
def test_fused_and_unfused_training_with_speculation_sample_and_train_as_plain_decoding(tmp_path, rank_pools):
    runs = rank_pools(2).run(_speculative_runs, str(tmp_path), timeout_s=300)[0]
    on, off, plain = runs["on"], runs["off"], runs["plain"]
    assert len(on) == len(off) == len(plain) == 2
    for step, (a, b, c) in enumerate(zip(on, off, plain), start=1):
        assert a["samples_digest"] == b["samples_digest"] == c["samples_digest"], step  # the same token ids
        for key in SAME:
            assert a[key] == pytest.approx(c[key], rel=1e-4, abs=1e-6), ("fused", step, key, a[key], c[key])
            assert b[key] == pytest.approx(c[key], rel=1e-4, abs=1e-6), ("unfused", step, key, b[key], c[key])
        for r in (a, b):  # speculation ran and verified drafts in both modes
            assert r["spec_drafted"] > 0 and r["spec_accepted"] > 0 and r["spec_verify_steps"] > 0, r
    assert any(r["migration_moved"] > 0 for r in on) and all(r["migration_moved"] == 0 for r in off)


def test_the_gate_measures_both_ways_then_takes_the_faster_and_probes_the_other():
    gate = SpeculationGate()
    taken = []
    for _ in range(2 * SpeculationGate.MIN_STEPS):  # alternately until each way has its steps
        verify = gate.speculate(2)
        taken.append(verify)
        gate.observe(verify, 2, 6 if verify else 2, 0.1)  # verify steps: 60 tokens/s, decode steps 20
    assert taken == [True, False] * SpeculationGate.MIN_STEPS
    assert gate.speculate(3)  # another row count is measured on its own
    taken = []
    for _ in range(SpeculationGate.PROBE_EVERY + 1):
        verify = gate.speculate(2)
        taken.append(verify)
        gate.observe(verify, 2, 6 if verify else 2, 0.1)
    assert all(taken[:-1]) and not taken[-1]  # the faster way, then one step the other way
    for _ in range(20):  # verify steps turn slow (drafts no longer accepted): decode steps take over
        verify = gate.speculate(2)
        gate.observe(verify, 2, 1 if verify else 2, 0.1)
    assert not gate.speculate(2)
    warm = SpeculationGate()  # each way's first step at a row count (new shapes: slow once) does not count
    for step in range(2 * SpeculationGate.MIN_STEPS):
        verify = warm.speculate(1)
        warm.observe(verify, 1, 6 if verify else 2, 100.0 if step == 0 else 0.1)
    assert warm.speculate(1)


def test_an_engine_that_reads_each_step_times_both_kinds_and_follows_its_gate(model, monkeypatch):
    requests = _requests(SETTINGS["sampled"], 3)
    plain, _ = _generate(model, requests)
    engine = GenerationEngine(model, max_slots=2, max_len=64, speculative="history", max_draft=5, speculative_rows=2)
    assert engine.speculator is not None and engine.speculator.gate is not None  # a CPU engine reads each step at once
    seen: list[tuple[bool, int, int]] = []
    monkeypatch.setattr(engine.speculator.gate, "observe", lambda verify, rows, tokens, s: seen.append((verify, rows, tokens)))
    monkeypatch.setattr(engine.speculator.gate, "speculate", lambda rows: False)  # as where verify steps are slower
    spec = {r.id: r.tokens for r in engine.generate(requests)}
    assert spec == {rid: t for rid, (t, _) in plain.items()} and engine.speculator.stats.verify_steps == 0
    assert seen and all(not verify and tokens == rows <= 2 for verify, rows, tokens in seen)
    monkeypatch.setattr(engine.speculator.gate, "speculate", lambda rows: True)
    seen.clear()
    spec = {r.id: r.tokens for r in engine.generate(_requests(SETTINGS["sampled"], 3))}
    assert spec == {rid: t for rid, (t, _) in plain.items()}
    verified = [(rows, tokens) for verify, rows, tokens in seen if verify]
    assert len(verified) == engine.speculator.stats.verify_steps > 0 and all(tokens >= rows for rows, tokens in verified)
