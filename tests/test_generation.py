import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusedrl.config import GenerationSection
from fusedrl.generation import (
    GenerationEngine,
    Request,
    RequestState,
    SamplingParams,
    pack_states,
    request_seed,
)
from fusedrl.generation.state import unpack_states
from fusedrl.models import LoRASpec, add_lora, build_model, init_adapters, switch_adapters

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=10)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("debug").eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Full recompute: the torchtune forward over the growing sequence, no cache."""
    seq, tokens, logprobs = list(prompt), [], []
    for _ in range(n):
        logp = torch.log_softmax(model(torch.tensor([seq]))[0, -1].float(), dim=-1)
        tok = int(logp.argmax())
        tokens.append(tok)
        logprobs.append(float(logp[tok]))
        seq.append(tok)
    return tokens, logprobs


def test_greedy_matches_full_recompute_with_mixed_prompt_lengths(model):
    prompts = [_prompt(n, seed) for seed, n in enumerate([3, 17, 1, 9, 30])]
    engine = GenerationEngine(model, max_slots=3, max_len=64)  # fewer slots than requests
    results = engine.generate([Request(i, p, GREEDY) for i, p in enumerate(prompts)])
    for res, prompt in zip(results, prompts):
        ref_tokens, ref_logprobs = _reference_greedy(model, prompt, GREEDY.max_new_tokens)
        assert res.finish_reason == "length"
        assert res.tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)


def test_sampled_output_does_not_depend_on_the_batch(model):
    target = Request("target", _prompt(6, 1), SAMPLED)
    alone = GenerationEngine(model, max_slots=4, max_len=64, seed=7).generate([target])[0]
    others = [
        Request(f"o{i}", _prompt(3 + 5 * i, 10 + i), SamplingParams(temperature=1.3, max_new_tokens=4 + i)) for i in range(5)
    ]
    batch = others[:2] + [Request("target", target.prompt, SAMPLED)] + others[2:]
    together = GenerationEngine(model, max_slots=4, max_len=64, seed=7).generate(batch)[2]
    assert together.tokens == alone.tokens
    torch.testing.assert_close(torch.tensor(together.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    # A different seed gives a different stream (the RNG really is per (seed, id)).
    other_seed = GenerationEngine(model, max_slots=4, max_len=64, seed=8).generate([target])[0]
    assert other_seed.tokens != alone.tokens
    assert request_seed(7, "target") != request_seed(7, "target2")


@torch.no_grad()
def test_samples_of_one_prompt_share_a_prefill_and_equal_separate_prefills(model, monkeypatch):
    """A GRPO group (n requests of one prompt) is prefilled once per distinct prompt, and every request's tokens and
    log-probs equal those of a request prefilled on its own."""
    prompts = [_prompt(5, 1), _prompt(9, 2), _prompt(5, 3)]
    requests = [Request(f"p{p}s{s}", prompts[p], SAMPLED) for p in range(3) for s in range(4)]
    engine = GenerationEngine(model, max_slots=16, max_len=64, seed=7)
    rows: list[int] = []
    prefill = engine._prefill_fn
    monkeypatch.setattr(engine, "_prefill_fn", lambda tokens, *a: rows.append(tokens.shape[0]) or prefill(tokens, *a))
    together = engine.generate(requests)
    assert rows == [3]  # 12 requests, 3 distinct prompts: one prefill row each
    for request, got in zip(requests, together):
        alone = GenerationEngine(model, max_slots=16, max_len=64, seed=7).generate([request])[0]
        assert got.tokens == alone.tokens, request.id
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert len({tuple(r.tokens) for r in together[:4]}) > 1  # the group's samples differ: their own random streams


def test_continuous_batching_with_more_requests_than_slots(model):
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (2, 9, 4, 1, 7, 3, 5)]
    requests = [Request(i, _prompt(2 + i, 100 + i), p) for i, p in enumerate(params)]
    engine = GenerationEngine(model, max_slots=2, max_len=64)
    batched = engine.generate(requests)
    assert [len(r.tokens) for r in batched] == [p.max_new_tokens for p in params]
    for req, res in zip(requests, batched):
        alone = GenerationEngine(model, max_slots=1, max_len=64).generate([req])[0]
        assert res.tokens == alone.tokens
    assert engine.num_unfinished == 0 and engine.stats().free_slots == 2
    for r in requests:
        engine.add_request(r)
    done = engine.step()  # admits 0 and 1 (prefill + one decode each): 0 (2 tokens) is done
    assert [r.id for r in done] == [0]
    progress = engine.progress()
    assert [p.id for p in progress] == engine.unfinished_ids() == [1, 2, 3, 4, 5, 6]
    assert [p.generated for p in progress] == [2, 0, 0, 0, 0, 0] and progress[0].active and not progress[1].active
    assert engine.stats().remaining_tokens == sum(p.max_new_tokens for p in params) - 2 - 2


def test_stop_tokens_and_forced_target_length(model):
    prompt = _prompt(5, 3)
    free_run, _ = _reference_greedy(model, prompt, 8)
    stop = free_run[3]
    first = free_run.index(stop)
    engine = GenerationEngine(model, max_slots=2, max_len=64)
    stopped, forced = engine.generate(
        [
            Request("stop", prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))),
            Request("forced", prompt, SamplingParams(temperature=0.0, max_new_tokens=2, stop_token_ids=(stop,), target_len=8)),
        ]
    )
    assert stopped.finish_reason == "stop" and stopped.tokens == free_run[: first + 1]
    assert forced.finish_reason == "length" and forced.tokens == free_run


def test_max_len_finishes_the_request_explicitly(model):
    engine = GenerationEngine(model, max_slots=1, max_len=12)
    res = engine.generate([Request(0, _prompt(10, 4), SamplingParams(temperature=0.0, max_new_tokens=50))])[0]
    assert res.finish_reason == "max_len" and len(res.tokens) == 2


def test_bad_requests_get_an_error_and_do_not_disturb_the_others(model):
    good = [Request(f"g{i}", _prompt(4 + i, 20 + i), GREEDY) for i in range(3)]
    bad = [
        Request("empty", [], GREEDY),
        Request("too_long", _prompt(40, 5), GREEDY),
        Request("big_id", [1, 2, 512], GREEDY),
        Request("negative_id", [1, -1], GREEDY),
    ]
    clean = GenerationEngine(model, max_slots=2, max_len=32).generate(good)
    mixed = GenerationEngine(model, max_slots=2, max_len=32).generate([bad[0], good[0], bad[1], good[1], bad[2], bad[3], good[2]])
    by_id = {r.id: r for r in mixed}
    assert "empty prompt" in by_id["empty"].error
    assert "40 tokens" in by_id["too_long"].error and "max_len is 32" in by_id["too_long"].error
    assert "512" in by_id["big_id"].error and "vocabulary" in by_id["big_id"].error
    assert "-1" in by_id["negative_id"].error
    for name in ("empty", "too_long", "big_id", "negative_id"):
        assert by_id[name].finish_reason == "error" and not by_id[name].ok and by_id[name].tokens == []
    for ref in clean:
        assert (
            by_id[ref.id].ok
            and by_id[ref.id].tokens == ref.tokens
            and by_id[ref.id].logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        )


def test_invalid_engine_and_sampling_arguments(model):
    with pytest.raises(ValueError, match="max_len"):
        GenerationEngine(model, max_len=10_000)
    with pytest.raises(ValueError, match="batch_buckets"):
        GenerationEngine(model, max_slots=4, max_len=64, batch_buckets=[2, 8])
    with pytest.raises(ValueError, match="quantize"):
        GenerationEngine(model, max_len=64, quantize="int4")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ImportError, match=r"pip install fusedrl\[tensorrt\]"):
        GenerationEngine(model, max_len=64, compile=True, backend="tensorrt")
    engine = GenerationEngine(model, max_len=32)
    engine.add_request(Request(1, [1, 2]))
    with pytest.raises(ValueError, match="already in this engine"):
        engine.add_request(Request(1, [3]))


def _run_with_migration(model, mode: str, split_after: int, via_bytes: bool):
    """Decode a sampled batch on engine A for a few steps, move one request to engine B, finish both."""
    requests = [Request(i, _prompt(3 + 4 * i, 50 + i), SAMPLED) for i in range(3)]
    a = GenerationEngine(model, max_slots=3, max_len=64, seed=3)
    b = GenerationEngine(model, max_slots=2, max_len=64, seed=99)  # the seed of the target engine must not matter
    b.add_request(Request("resident", _prompt(5, 77), SAMPLED))
    for r in requests:
        a.add_request(r)
    results = {}
    for _ in range(split_after):
        results.update({r.id: r for r in a.step()})
    state = a.export_request(1, mode=mode)
    assert (state.k is not None) == (mode == "kv") and len(state.generated) == split_after + 1  # prefill samples one too
    if via_bytes:
        state = pickle.loads(pickle.dumps(state))
    b.import_request(state)
    for engine in (a, b):
        while engine.has_work():
            results.update({r.id: r for r in engine.step()})
    return results


@pytest.mark.parametrize("mode", ["kv", "reprefill"])
def test_export_import_continues_identically(model, mode):
    reference = GenerationEngine(model, max_slots=3, max_len=64, seed=3).generate(
        [Request(i, _prompt(3 + 4 * i, 50 + i), SAMPLED) for i in range(3)]
    )
    migrated = _run_with_migration(model, mode, split_after=4, via_bytes=True)
    for ref in reference:
        got = migrated[ref.id]
        assert got.tokens == ref.tokens, ref.id
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    assert migrated["resident"].ok


def test_request_state_wire_form_round_trips(model):
    engine = GenerationEngine(model, max_slots=3, max_len=64)
    engine.add_request(Request("x", _prompt(7, 1), SamplingParams(temperature=1.0, top_k=5, stop_token_ids=(3, 4))))
    engine.add_request(Request(5, _prompt(4, 2), SamplingParams(target_len=2)))
    done = engine.step() + engine.step()
    state = engine.export_request("x")
    finished = RequestState.of_result(next(r for r in done if r.id == 5))
    waiting = RequestState(Request(9, [1, 2]), [], [])
    tensors = pack_states([state, finished, waiting])
    assert all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors)
    back, back_finished, back_waiting = unpack_states(tensors[1:])
    assert back.request == state.request and back.generated == state.generated and back.logprobs == state.logprobs
    assert torch.equal(back.k, state.k) and torch.equal(back.v, state.v)
    assert back.finish_reason is None and back_finished.to_result() == finished.to_result()
    assert not back_finished.has_kv
    assert back_waiting.request == waiting.request and back_waiting.generated == [] and not back_waiting.has_kv
    with pytest.raises(ValueError, match="has not finished"):
        back.to_result()
    # Two steps = prefill + 2 decodes: 3 tokens generated, 7 + 3 - 1 cached (the last one is pending).
    assert len(state.generated) == 3 and state.cache_len == 9
    # k and v: 2 layers x 9 cached tokens x 2 kv heads x 16 head dim x 4 bytes each.
    assert state.k.shape == (2, 9, 2, 16)
    assert state.nbytes == state.without_kv().nbytes + 2 * (2 * 9 * 2 * 16 * 4)
    with pytest.raises(KeyError, match="not unfinished"):
        engine.export_request("x")


def test_int8_weight_only_engine_matches_its_quantized_model(model):
    engine = GenerationEngine(model, max_slots=2, max_len=64, quantize="int8_weight_only")
    assert engine.model is not model  # the training copy stays full precision
    prompts = [_prompt(4, 1), _prompt(11, 2)]
    results = engine.generate([Request(i, p, GREEDY) for i, p in enumerate(prompts)])
    for res, prompt in zip(results, prompts):
        tokens, logprobs = _reference_greedy(engine.model, prompt, GREEDY.max_new_tokens)
        assert res.tokens == tokens
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_decode_and_prefill_equal_eager(model, tmp_path, monkeypatch):
    """Both compiled: the prefill of 3 prompts of 2-12 tokens is one graph (symbolic rows and length), the decode
    step with its sampling another (batch bucket 4, length bucket 32): two graphs in all, no graph break. Inductor
    writes them to the cache directory set before the engine compiles (what generation.compile_cache_dir sets)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    requests = [Request(i, _prompt(2 + 5 * i, 30 + i), SAMPLED) for i in range(3)]
    eager = GenerationEngine(model, max_slots=4, max_len=32).generate(requests)
    compiled_engine = GenerationEngine(
        model, max_slots=4, max_len=32, compile=True, compile_scope="step", batch_buckets=[4], len_buckets=[32]
    )
    compiled = compiled_engine.generate([Request(r.id, r.prompt, r.sampling) for r in requests])
    for e, c in zip(eager, compiled):
        assert c.tokens == e.tokens
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)
    assert compiled_engine.compile_stats.graphs == 2
    # prompts of other lengths reuse the prefill graph
    more = [Request(10 + i, _prompt(7 + 3 * i, 40 + i), SAMPLED) for i in range(2)]
    compiled_engine.generate(more)
    assert compiled_engine.compile_stats.graphs == 2 and compiled_engine.compile_stats.seconds > 0
    assert any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def _op_calls(fn) -> dict[str, int]:
    """Operator name -> calls while ``fn()`` runs (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.slow
def test_per_layer_compiled_decode_equals_eager_in_two_graphs(model):
    """compile_scope="layer": the decode step with its sampling is one graph, each layer a nested compile region, with
    symbolic batch and attended length, and a single row's step a graph of its own whose CPU products and attention
    are fused element-wise loops (no linear operator or SDPA calls): two graphs in all while 5 requests of different
    lengths run through 3 slots (batches of 3, 2 and 1 rows, two length buckets, prefills of 1-3 rows; the model's
    q/k/v stacked by an eager engine before); the tokens are eager's. Greedy requests (other sampling flags) compile
    two more."""
    requests = [
        Request(i, _prompt(3 + 6 * i, 50 + i), SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=4 + 3 * i))
        for i in range(5)
    ]
    buckets = dict(max_slots=3, max_len=64, len_buckets=[16, 32, 64])
    eager = GenerationEngine(model, **buckets).generate(requests)
    engine = GenerationEngine(model, **buckets, compile=True, compile_scope="layer")
    compiled = engine.generate([Request(r.id, r.prompt, r.sampling) for r in requests])
    for e, c in zip(eager, compiled):
        assert c.tokens == e.tokens
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)
    assert engine.compile_stats.graphs == 2
    layers, six = len(model.layers), SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=6)
    # 5 decode steps each; one row: only the (eager) prefill calls SDPA, once per layer, and no product is an operator
    # call; two rows: the many-row graph calls SDPA and the oneDNN linear operator
    one = _op_calls(lambda: engine.generate([Request(20, _prompt(9, 40), six)]))
    two = _op_calls(lambda: engine.generate([Request(21 + i, _prompt(9, 41 + i), six) for i in range(2)]))
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert one[sdpa] == layers and one.get("fusedrl::cpu_linear", 0) == 0
    assert two[sdpa] > layers and two["fusedrl::cpu_linear"] > 0
    assert engine.compile_stats.graphs == 2
    greedy = [Request(10 + i, _prompt(5 + 7 * i, 60 + i), GREEDY) for i in range(4)]  # no sampling: the argmax graphs
    engine.generate(greedy)
    assert engine.compile_stats.graphs == 4


def test_cuda_graphs_need_the_whole_step_compiled(model):
    with pytest.raises(ValueError, match="compile_scope='step'"):
        GenerationEngine(model, max_len=32, compile=True, compile_scope="layer", mode="reduce-overhead")
    with pytest.raises(ValueError, match="unknown compile scope"):
        GenerationEngine(model, max_len=32, compile=True, compile_scope="block")  # type: ignore[arg-type]


@pytest.mark.parametrize("quantize", [None, "int8_weight_only"])
def test_load_weights_replaces_the_generation_weights(model, quantize):
    torch.manual_seed(123)
    target = build_model("debug").eval()
    engine = GenerationEngine(build_model("debug").eval(), max_slots=2, max_len=32, quantize=quantize)
    engine.load_weights(target.state_dict())
    expected_model = target if quantize is None else engine.model
    if quantize is not None:  # the re-quantized copy is a quantization of the new weights
        logits = engine.model(torch.tensor([[1, 2, 3]]))
        torch.testing.assert_close(logits, target(torch.tensor([[1, 2, 3]])), atol=0.05, rtol=0.05)
    prompt = _prompt(6, 9)
    res = engine.generate([Request(0, prompt, GREEDY)])[0]
    assert res.tokens == _reference_greedy(expected_model, prompt, GREEDY.max_new_tokens)[0]


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_weights_changed_in_place_after_decoding_are_used(compile):
    # The engine may cache derived copies of the weights (the CPU linears' transposed and packed layouts); an in-place update
    # (an optimizer step, load_state_dict, weight sync) after a first decode must reach the next decode.
    torch.manual_seed(5)
    model = build_model("debug").eval()
    buckets = dict(batch_buckets=[1], len_buckets=[32], compile_scope="step") if compile else {}
    engine = GenerationEngine(model, max_slots=1, max_len=32, compile=compile, **buckets)
    prompt = _prompt(5, 11)
    first = engine.generate([Request(0, prompt, GREEDY)])[0]
    assert first.tokens == _reference_greedy(model, prompt, GREEDY.max_new_tokens)[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    second = engine.generate([Request(1, prompt, GREEDY)])[0]
    ref_tokens, ref_logprobs = _reference_greedy(model, prompt, GREEDY.max_new_tokens)
    assert second.tokens == ref_tokens and second.tokens != first.tokens
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)


def _greedy_in_eval(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    modes = {m: m.training for m in model.modules()}
    try:
        return _reference_greedy(model.eval(), prompt, GREEDY.max_new_tokens)
    finally:
        for m, training in modes.items():
            m.training = training


@pytest.mark.parametrize(
    "optimizer,compile",
    [
        ("fused", False),
        ("foreach", False),
        ("plain", False),
        ("data", False),
        pytest.param("fused", True, marks=pytest.mark.slow),
    ],
)
def test_an_engine_sharing_the_trained_model_samples_from_its_current_weights(optimizer, compile):
    # A loop that trains the engine's own model: after any optimizer step (AdamW's fused kernel moves no version
    # counter), or a write through .data followed by weights_updated(), the next rollout decodes with the new weights,
    # the CPU layouts (one row and many rows; compiled: the many-row product node) rebuilt. The model keeps its mode.
    torch.manual_seed(5)
    model = build_model("debug")  # training mode, as a loop leaves it
    modes = {name: m.training for name, m in model.named_modules()}  # (torchtune shares one SiLU across models)
    buckets = dict(batch_buckets=[1, 2], len_buckets=[32], compile_scope="step") if compile else {}
    engine = GenerationEngine(model, max_slots=2, max_len=32, compile=compile, **buckets)
    prompts = [_prompt(5, 11), _prompt(7, 12)]
    before = [r.tokens for r in engine.generate([Request(i, p, GREEDY) for i, p in enumerate(prompts)])]
    before += [engine.generate([Request(2, prompts[0], GREEDY)])[0].tokens]  # one row too
    assert {name: m.training for name, m in model.named_modules()} == modes  # decoded in eval mode, modes given back
    params = list(model.parameters())
    if optimizer == "data":
        for p in params:
            p.data.add_(torch.randn_like(p) * 0.5)  # unseen by autograd's version counters
        engine.weights_updated()
    else:
        kinds = {"fused": dict(fused=True), "foreach": dict(foreach=True), "plain": dict(foreach=False)}
        opt = torch.optim.AdamW(params, lr=0.05, **kinds[optimizer])
        model(torch.tensor([prompts[0]])).float().logsumexp(-1).mean().backward()
        opt.step()
    after = engine.generate([Request(3 + i, p, GREEDY) for i, p in enumerate(prompts)])
    after += engine.generate([Request(5, prompts[0], GREEDY)])
    assert [r.tokens for r in after] != before  # the weights moved enough to change greedy tokens
    for r, prompt in zip(after, [*prompts, prompts[0]]):
        tokens, logprobs = _greedy_in_eval(model, prompt)
        assert r.tokens == tokens
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_a_quantized_engine_over_a_trained_model_requantizes_before_its_next_rollout():
    torch.manual_seed(5)
    model = build_model("debug")
    engine = GenerationEngine(model, max_slots=2, max_len=32, quantize="int8_weight_only")
    prompt = _prompt(6, 9)
    engine.generate([Request(0, prompt, GREEDY)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    model(torch.tensor([prompt])).float().logsumexp(-1).mean().backward()
    opt.step()
    fresh = GenerationEngine(copy.deepcopy(model), max_slots=2, max_len=32, quantize="int8_weight_only")
    got, expected = (e.generate([Request(1, prompt, GREEDY)])[0] for e in (engine, fresh))
    assert got.tokens == expected.tokens and got.logprobs == expected.logprobs


def test_an_engine_refuses_a_model_sharded_by_fully_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fusedrl.distributed.compat import init_fake_process_group

    init_fake_process_group(0, 1)
    try:
        model = build_model("debug")
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match="sharded by fully_shard .* an unsharded copy .* WeightSync"):
            GenerationEngine(model, max_slots=1, max_len=16)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("in_one_storage", [False, True])
def test_stacked_cpu_linear_follows_each_weight_of_its_group(rows, in_one_storage):
    # q/k/v (and gate/up) run as one product of their stacked weights, cached; an in-place change of any one weight
    # of the group (not only the first) must rebuild the stacked copy. The engine first moves a group's weights into
    # one storage (the same Parameter objects, the same values), which the stacked layout then reads as one tensor.
    from fusedrl.generation.cpu_kernels import linear as _linear_cpu
    from fusedrl.generation.cpu_kernels import stack_projections as _stack_projections

    torch.manual_seed(0)
    linears = [torch.nn.Linear(16, n, bias=False) for n in (16, 4, 4)]
    weights = [m.weight for m in linears]
    if in_one_storage:
        values = [w.detach().clone() for w in weights]
        _stack_projections(linears)
        assert [m.weight for m in linears] == weights and all(torch.equal(w, v) for w, v in zip(weights, values))
        assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    biases = [torch.randn(16), None, torch.randn(4)]
    x = torch.randn(rows, 16)

    def expected():
        return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)

    torch.testing.assert_close(_linear_cpu(x, weights, biases), expected())
    with torch.no_grad():
        weights[2].mul_(-3.0)
        if in_one_storage:
            linears[1].load_state_dict({"weight": torch.randn(4, 16)})  # as a weight sync writes: in place
    torch.testing.assert_close(_linear_cpu(x, weights, biases), expected())


def test_weight_sync_checks_the_stages_and_the_layout(model):
    from fusedrl.distributed import split_decoder
    from fusedrl.generation import WeightSync

    engine = GenerationEngine(build_model("debug").eval(), max_slots=1, max_len=16)
    torch.manual_seed(5)
    trained = build_model("debug").eval()
    stages = split_decoder(trained, 2)
    with pytest.raises(ValueError, match="layers.1.attn.q_proj.weight: the destination .* the source no tensor"):
        WeightSync(stages[0], engine)  # one stage alone does not make a model
    stats = WeightSync(stages, engine).sync()  # both stages on one process: no collectives needed
    assert stats.bytes == 0  # nothing came from another rank
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        torch.testing.assert_close(engine.model(tokens), trained(tokens))


def test_counter_based_sampling_is_per_request_and_follows_the_distribution():
    from fusedrl.generation.sampling import exponential_noise, sample_tokens

    seeds, counters = torch.tensor([7, 2**62 + 5, 7]), torch.tensor([0, 3, 1])
    both = exponential_noise(seeds, counters, 50)
    assert torch.equal(both[1], exponential_noise(seeds[1:2], counters[1:2], 50)[0])  # a row is its own
    assert not torch.equal(both[0], both[2])  # the next token of the same request draws anew
    many = exponential_noise(torch.arange(400), torch.zeros(400, dtype=torch.int64), 500)
    assert abs(many.mean().item() - 1.0) < 0.01 and abs(many.var().item() - 1.0) < 0.02  # Exp(1): mean = var = 1
    # 20000 draws (one per counter) from p = (0.5, 0.3, 0.2, 0): frequencies within 1.5% of p
    n = 20000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0])).expand(n, 4)
    ones = torch.ones(n)
    tokens, logprobs = sample_tokens(logits, ones, torch.zeros(n, dtype=torch.int64), ones, torch.full((n,), 11), torch.arange(n))
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64), atol=0.015), freq
    assert torch.allclose(logprobs, logits.gather(-1, tokens[:, None]).squeeze(-1))
    greedy, _ = sample_tokens(
        logits[:3],
        torch.zeros(3),
        torch.zeros(3, dtype=torch.int64),
        torch.ones(3),
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64),
        any_sampled=False,
    )
    assert greedy.tolist() == [0, 0, 0]


def test_int8_engine_requantizes_synced_weights_in_place():
    """A weight sync into a quantized engine writes a fresh quantization of the new weights into the same tensors
    (a compiled decode keeps its graphs): equal to quantizing the new model from scratch, every tensor the same object."""
    import copy

    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    source = build_model("debug").eval()
    engine = GenerationEngine(source, max_slots=2, max_len=32, quantize="int8_weight_only")
    before = {name: id(p) for name, p in engine.model.named_parameters()}
    torch.manual_seed(1)
    target = build_model("debug").eval()
    engine.load_weights(target.state_dict())
    assert {name: id(p) for name, p in engine.model.named_parameters()} == before
    fresh = copy.deepcopy(target)
    quantize_(fresh, Int8WeightOnlyConfig())
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        assert torch.equal(engine.model(tokens), fresh(tokens))


def _steady_decode_steps(model, steps: int, count) -> None:
    """Four sampled requests decoding (no admission, no finish) for ``steps`` engine steps inside ``count``."""
    engine = GenerationEngine(model, max_slots=4, max_len=64, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=steps + 4)
    for i in range(4):
        engine.add_request(Request(i, _prompt(5 + i, i), params))
    engine.step()  # admission: prefill and the first decode
    with count():
        for _ in range(steps):
            assert engine.step() == []


def test_a_decode_step_sends_nothing_to_the_device_and_reads_back_once(model, monkeypatch):
    """Each slot's token, position, seed, counter and sampling parameters stay on the device between steps: a
    steady decode step builds no tensor from host values and reads the sampled tokens back once."""
    import contextlib

    created, reads = [], []
    real_tensor, real_tolist = torch.tensor, torch.Tensor.tolist

    @contextlib.contextmanager
    def count():
        monkeypatch.setattr(torch, "tensor", lambda *a, **k: created.append(1) or real_tensor(*a, **k))
        monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
        yield
        monkeypatch.undo()

    _steady_decode_steps(model, 5, count)
    assert created == [] and len(reads) == 5


def test_decode_attention_is_a_call_cuda_serves_without_the_math_backend(model, monkeypatch):
    """CUDA's SDPA serves a masked call with GQA (``enable_gqa``, fewer KV heads than query heads) only with its
    math backend (float32 upcast, K/V repeated per query head). Every masked call the engine makes (its decode steps)
    must have as many query heads as KV heads, and its unmasked ones (the prefill) be causal: the calls a GPU runs,
    checked here on the CPU."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[1], k.shape[1], attn_mask is not None, kwargs.get("enable_gqa", False), kwargs.get("is_causal")))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    GenerationEngine(model, max_slots=2, max_len=32).generate([Request(i, _prompt(3 + i, i), GREEDY) for i in range(3)])
    masked = [c for c in calls if c[2]]
    unmasked = [c for c in calls if not c[2]]
    assert model.layers[0].attn.num_kv_heads < model.layers[0].attn.num_heads  # the debug model has GQA
    assert masked and all(q_heads == kv_heads and not gqa for q_heads, kv_heads, _, gqa, _ in masked)
    assert unmasked and all(causal for *_, causal in unmasked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_generation_runs_without_the_math_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    cuda_model = build_model("debug").eval().to("cuda", torch.bfloat16)
    requests = [Request(i, _prompt(3 + 5 * i, i), GREEDY) for i in range(5)]
    free = GenerationEngine(cuda_model, max_slots=4, max_len=64).generate(requests)
    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fast):  # raises "No available kernel" where a call would need the math backend
        restricted = GenerationEngine(cuda_model, max_slots=4, max_len=64).generate(requests)
    assert [r.tokens for r in restricted] == [r.tokens for r in free]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_decode_step_synchronizes_once():
    import contextlib
    import warnings

    torch.manual_seed(0)
    cuda_model = build_model("debug").eval().cuda()

    @contextlib.contextmanager
    def count():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 5, [str(w.message) for w in syncs]

    _steady_decode_steps(cuda_model, 5, count)


def _reference_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """The counter-based exponentials as first written, in int64 with 16-bit halves for the products."""
    m = 0xFFFFFFFF

    def mul(x, c):
        return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & m

    def mix(x):
        x = x ^ (x >> 16)
        x = mul(x, 0x85EBCA6B)
        x = x ^ (x >> 13)
        x = mul(x, 0xC2B2AE35)
        return x ^ (x >> 16)

    key = mix(mix(seeds & m) ^ ((seeds >> 32) & m))
    key = mix(key ^ mul(counters & m, 0x9E3779B1))
    bits = mix(key[:, None] ^ mul(torch.arange(vocab, dtype=torch.int64), 0x632BE5AB)[None, :])
    return -torch.log(((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24)))


def test_32_bit_hash_draws_the_same_exponentials_as_the_64_bit_one():
    """The sampling noise in int32 arithmetic (wrapping products, logical shifts) is bit for bit the int64 original's,
    extreme seeds and counters included: every request samples the tokens it always did."""
    from fusedrl.generation.sampling import exponential_noise

    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.tensor([0, 1, 2**31, 2**32 - 1, 2**63 - 1]), torch.randint(0, 2**63 - 1, (27,), generator=g)])
    counters = torch.cat([torch.tensor([0, 1, 2**31, 2**32 - 1, 2**32]), torch.randint(0, 2**40, (27,), generator=g)])
    assert torch.equal(exponential_noise(seeds, counters, 1000), _reference_noise(seeds, counters, 1000))


def test_compile_cache_dir_points_inductor_at_it(model, tmp_path, monkeypatch):
    """``generation.compile_cache_dir`` sets inductor's cache directory before the engine compiles anything (that
    inductor then writes there: test_compiled_decode_and_prefill_equal_eager)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))  # restored after the test
    section = GenerationSection(max_slots=1, compile=True, compile_cache_dir=str(tmp_path / "cache"))
    GenerationEngine.from_config(model, section, max_len=16, seed=0)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")


@pytest.mark.parametrize("compile", [False, True])
def test_an_engine_over_unmerged_lora_adapters_decodes_as_the_adapted_model(compile):
    """A rollout copy with LoRA adapters (``lora.rollout_weights = "adapters"``): the engine adds each projection's
    low-rank update to its base product, eager and compiled per layer, and decodes the adapted model's greedy tokens."""
    torch.manual_seed(5)
    model = add_lora(build_model("debug"), LoRASpec(4, 8.0, 0.0, ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")))
    init_adapters(model, seed=3)
    with torch.no_grad():  # B starts at zero: give the adapters an effect
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.5)
    model.eval()
    engine = GenerationEngine(model, max_slots=2, max_len=32, compile=compile, compile_scope="layer")
    prompts = [_prompt(5, 11), _prompt(9, 12)]
    results = engine.generate([Request(i, p, GREEDY) for i, p in enumerate(prompts)])
    for prompt, result in zip(prompts, results):
        tokens, logprobs = _reference_greedy(model, prompt, GREEDY.max_new_tokens)
        assert result.tokens == tokens
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
    switch_adapters(model, False)
    assert _reference_greedy(model, prompts[0], GREEDY.max_new_tokens)[0] != results[0].tokens  # the adapters matter


@torch.no_grad()
def test_resumed_siblings_of_one_prompt_share_a_prefill_only_where_their_tokens_are_equal(model, monkeypatch):
    """Requests re-prefilled from their tokens (a "reprefill" migration imports them so; partial rollouts resume their
    carried requests so): siblings of one prompt whose generated tokens differ get a prefill row each and continue
    exactly as an uninterrupted engine decodes them; siblings whose tokens are equal (greedy) still share one row, and
    a fresh sibling (the prompt alone) has its own, all in one prefill."""
    prompt, other = _prompt(6, 5), _prompt(4, 6)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    requests = [Request(f"s{k}", prompt, SAMPLED, seed=7) for k in range(4)]
    requests += [Request(f"g{k}", prompt, greedy, seed=7) for k in range(2)] + [Request("q", other, SAMPLED, seed=7)]
    fresh = Request("f", prompt, SAMPLED, seed=7)
    reference = GenerationEngine(model, max_slots=8, max_len=64, seed=1).generate([*requests, fresh])
    source = GenerationEngine(model, max_slots=8, max_len=64, seed=2)
    for r in requests:
        source.add_request(r)
    for _ in range(3):
        assert source.step() == []
    states = [pickle.loads(pickle.dumps(source.export_request(r.id, mode="reprefill"))) for r in requests]
    assert all(not s.has_kv and len(s.generated) == 4 for s in states)
    seqs = {s.id: tuple(s.request.prompt + s.generated[:-1]) for s in states}  # what a prefill computes (pending: not)
    assert len({seqs[f"s{k}"] for k in range(4)}) == 4 and seqs["g0"] == seqs["g1"]
    engine = GenerationEngine(model, max_slots=8, max_len=64, seed=3)
    rows: list[int] = []
    prefill = engine._prefill_fn
    monkeypatch.setattr(engine, "_prefill_fn", lambda tokens, *a: rows.append(tokens.shape[0]) or prefill(tokens, *a))
    for state in states:
        engine.import_request(state)
    engine.add_request(fresh)
    results = {}
    while engine.has_work():
        results.update({r.id: r for r in engine.step()})
    for ref in reference:
        assert results[ref.id].tokens == ref.tokens, ref.id
        torch.testing.assert_close(torch.tensor(results[ref.id].logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    distinct = set(seqs.values()) | {tuple(prompt)}
    assert rows == [len(distinct)] == [7]  # one prefill: 4 sampled siblings, the greedy pair once, "q", the fresh one
    assert engine.prefill_stats.tokens == sum(len(seq) for seq in distinct)
