"""Multi-process generation tests: request migration between processes, weight sync from the training layout."""

import pytest
import torch
import torch.distributed as dist

from fusedrl.generation import GenerationEngine, Request, SamplingParams, recv_states, send_states
from fusedrl.models import build_model

SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=10)


def _model():
    torch.manual_seed(0)
    return build_model("debug").eval()


def _requests():
    g = torch.Generator().manual_seed(5)
    return [Request(i, torch.randint(0, 512, (3 + 4 * i,), generator=g).tolist(), SAMPLED) for i in range(3)]


def _migrate_between_ranks(mode: str) -> dict:
    """Rank 0 decodes 3 requests, sends request 1 after 4 steps to rank 1, which finishes it."""
    model = _model()
    results = {}
    if dist.get_rank() == 0:
        engine = GenerationEngine(model, max_slots=3, max_len=64, seed=3)
        for r in _requests():
            engine.add_request(r)
        for _ in range(4):
            results.update({r.id: r for r in engine.step()})
        sent = send_states([engine.export_request(1, mode=mode)], 1)
        assert sent > 0
    else:
        engine = GenerationEngine(model, max_slots=2, max_len=64, seed=1234)
        engine.add_request(Request("resident", [1, 2, 3], SAMPLED))
        engine.step()
        src, (state,) = recv_states(0)
        assert src == 0
        assert state.has_kv == (mode == "kv")
        engine.import_request(state)
    while engine.has_work():
        results.update({r.id: r for r in engine.step()})
    return {k: (r.tokens, r.logprobs) for k, r in results.items()}


def _migrate_in_both_modes() -> dict:
    return {mode: _migrate_between_ranks(mode) for mode in ("kv", "reprefill")}


def test_export_on_one_process_import_on_another(rank_pools):
    reference = GenerationEngine(_model(), max_slots=3, max_len=64, seed=3).generate(_requests())
    rank0, rank1 = rank_pools(2).run(_migrate_in_both_modes, timeout_s=120)
    for mode in ("kv", "reprefill"):
        assert set(rank0[mode]) == {0, 2} and set(rank1[mode]) == {1, "resident"}
        merged = {**rank0[mode], **rank1[mode]}
        for ref in reference:
            tokens, logprobs = merged[ref.id]
            assert tokens == ref.tokens, (mode, ref.id)
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)


def _perturbed_training_model():
    model = _model()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(1.0 + 0.01 * (i % 7))  # stand-in for training updates
    return model


def _sync_from_pp2_dp2(tokens: torch.Tensor) -> dict:
    from fusedrl.distributed import ParallelDims, apply_fsdp, split_decoder
    from fusedrl.generation import WeightSync

    mesh = ParallelDims(pp=2, dp_shard=2).build_mesh("cpu")
    stage = split_decoder(_model(), 2)[mesh["pp"].get_local_rank()]
    apply_fsdp(stage, mesh["dp_shard"])
    with torch.no_grad():  # update the sharded training weights in place, as an optimizer step would
        order = {name: i for i, (name, _) in enumerate(_model().named_parameters())}
        for name, p in stage.named_parameters():
            p.mul_(1.0 + 0.01 * (order[name] % 7))
    torch.manual_seed(1234)
    engine = GenerationEngine(build_model("debug").eval(), max_slots=2, max_len=32)
    stats = WeightSync(stage, engine).sync()
    with torch.no_grad():
        logits = engine.model(tokens)
    result = engine.generate([Request("p", tokens[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=5))])[0]
    # Plain lists: tensors returned through run_multirank's queue are shared by fd and can vanish with the rank.
    return {"logits": logits.tolist(), "tokens": result.tokens, "bytes": stats.bytes, "seconds": stats.seconds}


@pytest.mark.slow
def test_weight_sync_from_pp2_dp_shard2_training_layout(rank_pools):
    reference = _perturbed_training_model()
    tokens = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_logits = reference(tokens)
    ref_tokens = (
        GenerationEngine(reference, max_slots=1, max_len=32)
        .generate([Request("p", tokens[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=5))])[0]
        .tokens
    )
    full_bytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    for out in rank_pools(4).run(_sync_from_pp2_dp2, tokens, timeout_s=150):
        torch.testing.assert_close(torch.tensor(out["logits"]), ref_logits)
        assert out["tokens"] == ref_tokens
        # each rank receives every block of the model it does not hold itself, once
        assert 0 < out["bytes"] < full_bytes and out["seconds"] > 0


def _whole_tensors_batched() -> list[int]:
    """``whole_tensors`` on a 2-rank mesh: each tensor as its own ``full_tensor`` gives it (float32), with one gather
    per group of alike DTensors. Returns the number of gathers."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fusedrl.generation.weight_sync import whole_tensors

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    spec = [  # (shape, placement, dtype)
        ((8, 5), Shard(0), torch.float32),  # LoRA A-like: one gather along dim 1 ...
        ((8, 7), Shard(0), torch.float32),  # ... with this one
        ((5, 8), Shard(0), torch.float32),  # B-like, 5 rows over 2 ranks (uneven): one gather along dim 1 ...
        ((5, 3), Shard(0), torch.float32),  # ... with this one
        ((6, 3), Shard(1), torch.float32),  # one gather along dim 0 ...
        ((4, 3), Shard(1), torch.float32),  # ... with this one
        ((8, 5), Shard(0), torch.bfloat16),  # another dtype: a gather of its own
        ((7,), Shard(0), torch.float32),  # no dimension left unsharded: a gather of its own
        ((3, 3), Replicate(), torch.float32),  # a gather of its own (no communication)
        ((8, 5), Shard(0), torch.float32),  # back in the first group
    ]
    full = [torch.randn(shape, generator=g).to(dtype) for shape, _, dtype in spec]
    tensors: list[torch.Tensor] = [distribute_tensor(t, mesh, [p]) for t, (_, p, _) in zip(full, spec)]
    tensors.append(full[0].clone())  # a plain tensor: itself
    gathers = []
    real = DTensor.full_tensor

    def counted(self, *args, **kwargs):
        gathers.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    with mock.patch.object(DTensor, "full_tensor", counted):
        whole = whole_tensors(tensors)
    for got, expected in zip(whole, [*full, full[0]]):
        assert got.dtype == torch.float32 and torch.equal(got, expected.float()), (got.shape, expected.shape)
    dist.barrier()
    return [len(gathers)]


def test_whole_tensors_gathers_alike_dtensors_together_and_each_whole(two_ranks):
    assert two_ranks.run(_whole_tensors_batched) == [[6], [6]]
