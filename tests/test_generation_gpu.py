"""GPU-only generation tests (skipped without CUDA): CUDA-graph decode, NCCL weight sync."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.models import build_model
from fusedrl.testing import free_port

SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=12)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager():
    torch.manual_seed(0)
    model = build_model("debug", device="cuda").eval()
    g = torch.Generator().manual_seed(1)
    requests = [Request(i, torch.randint(0, 512, (2 + 5 * i,), generator=g).tolist(), SAMPLED) for i in range(5)]
    eager = GenerationEngine(model, max_slots=4, max_len=64).generate(requests)
    graphs = GenerationEngine(model, max_slots=4, max_len=64, compile=True, compile_scope="step", mode="reduce-overhead")
    compiled = graphs.generate([Request(r.id, r.prompt, r.sampling) for r in requests])
    for e, c in zip(eager, compiled):
        assert c.tokens == e.tokens
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=1e-3, rtol=0)


def _nccl_sync(rank: int, world_size: int, port: int) -> None:
    from fusedrl.distributed import ParallelDims, apply_fsdp, split_decoder
    from fusedrl.generation import WeightSync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    dims = ParallelDims(pp=2, dp_shard=world_size // 2, world_size=world_size)
    mesh = dims.build_mesh("cuda")
    torch.manual_seed(0)
    full = build_model("debug", device="cuda").eval()
    stage = split_decoder(full, 2)[mesh["pp"].get_local_rank()]
    apply_fsdp(stage, mesh["dp_shard"])
    torch.manual_seed(1)
    engine = GenerationEngine(build_model("debug", device="cuda"), max_slots=2, max_len=32)
    stats = WeightSync(stage, engine).sync()
    # each rank receives the whole model once, except what it holds itself (its FSDP shard of its stage)
    assert 0 < stats.bytes < sum(t.numel() * t.element_size() for t in full.state_dict().values())
    tokens = torch.randint(0, 512, (2, 9), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(engine.model(tokens), full(tokens))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpu
def test_weight_sync_over_nccl():
    world_size = 4 if torch.cuda.device_count() >= 4 else 2
    if torch.cuda.device_count() < world_size:
        pytest.skip("NCCL weight sync needs at least 2 GPUs (one per rank)")
    mp.spawn(_nccl_sync, args=(world_size, free_port()), nprocs=world_size, join=True)
