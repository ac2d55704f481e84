"""ParallelDims, FSDP2, TP and pipeline splitting against single-process references."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fusedrl.distributed import ParallelDims, apply_fsdp, apply_tp, split_decoder, stage_layer_ranges
from fusedrl.layouts import HostCopies
from fusedrl.models import build_model
from fusedrl.testing import run_multirank

VOCAB = 512


def _batch(batch_size: int = 4, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # torch 2.11's stages check input strides


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_params_match(model: torch.nn.Module, ref: torch.nn.Module, *, grads: bool, atol: float = 1e-5) -> None:
    ref_params = dict(ref.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert names, "no parameters compared"
    for name, p in model.named_parameters():
        q = ref_params[name]
        actual, expected = (_full(p.grad), q.grad) if grads else (_full(p.detach()), q.detach())
        torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- ParallelDims


def test_parallel_dims_rejects_bad_layouts_before_any_collective():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"parallelism.tp = 2 \* 2 \* 1 = 4: must equal the world size 3"):
        ParallelDims(pp=2, dp_shard=2, world_size=3)
    with pytest.raises(ValueError, match=r"gen_tp = 3: must divide the world size 4"):
        ParallelDims(dp_shard=4, gen_tp=3, world_size=4)
    with pytest.raises(ValueError, match=r"parallelism.tp must be an integer >= 1, got 0"):
        ParallelDims(tp=0, world_size=1)
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        ParallelDims(world_size=1).build_mesh("cpu")
    with pytest.raises(ValueError, match=r"parallelism.pp_critic = 3: must divide parallelism.pp = 4"):
        ParallelDims(pp=4, pp_critic=3, world_size=4)


def test_init_distributed_without_launcher_builds_a_one_rank_mesh():
    script = (
        "import pytest, torch.distributed as dist\n"
        "from fusedrl.distributed import ParallelDims, init_distributed\n"
        "assert init_distributed().type == 'cpu' and dist.get_backend() == 'gloo'\n"
        "assert init_distributed().type == 'cpu'  # idempotent\n"
        "mesh = ParallelDims().build_mesh('cpu')\n"
        "assert tuple(mesh.shape) == (1, 1, 1) and mesh.mesh_dim_names == ('pp', 'dp_shard', 'tp')\n"
        "with pytest.raises(ValueError, match='made for world size 2 but the process group has 1'):\n"
        "    ParallelDims(dp_shard=2, world_size=2).build_mesh('cpu')\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_parallel_dims_generation_layout():
    dims = ParallelDims(pp=2, dp_shard=2, tp=2, gen_tp=2, world_size=8)
    assert dims.num_gen_instances == 4
    assert dims.gen_tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [dims.gen_instance_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


# ----------------------------------------------------------------------------- pipeline split


def test_stage_layer_ranges_balanced_and_custom():
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert stage_layer_ranges(4, 3, [0, 3]) == [range(0, 0), range(0, 3), range(3, 4)]
    assert stage_layer_ranges(2, 3, [1, 2]) == [range(0, 1), range(1, 2), range(2, 2)]


@pytest.mark.parametrize(
    ("boundaries", "message"),
    [
        ([1], r"must hold num_stages - 1 = 2 layer indices"),
        ([2, 1], r"strictly increasing"),
        ([1, 1], r"strictly increasing"),
        ([1, 5], r"integers in \[0, 4\]"),
    ],
)
def test_stage_layer_ranges_rejects_bad_boundaries(boundaries, message):
    with pytest.raises(ValueError, match=message):
        stage_layer_ranges(4, 3, boundaries)


def test_stage_layer_ranges_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot balance 2 layers over 3 pipeline stages"):
        stage_layer_ranges(2, 3)


@pytest.mark.parametrize(
    ("flavor", "role", "num_stages", "boundaries"),
    [
        ("debug", "policy", 2, None),
        ("debug", "policy", 3, [1, 2]),  # last stage: norm + head only
        ("debug", "policy", 2, [0]),  # first stage: embedding only
        ("debug", "value", 2, None),
        ("debug", "value", 3, [1, 2]),
        ("debug_qwen", "policy", 2, None),  # tied embedding: head shares the embedding weight
    ],
)
def test_chained_stages_equal_full_model(flavor, role, num_stages, boundaries):
    torch.manual_seed(0)
    model = build_model(flavor, role)
    tokens, _ = _batch()
    ref = copy.deepcopy(model)
    stages = split_decoder(model, num_stages, boundaries)

    assert stages[0].tok_embeddings is model.tok_embeddings  # references, not copies
    layer_ids = [int(k) for s in stages for k in s.layers]
    assert layer_ids == list(range(len(model.layers)))

    h = tokens
    for stage in stages:
        h = stage(h)
    expected = ref(tokens)
    torch.testing.assert_close(h, expected)
    assert h.shape == (4, 16, 1 if role == "value" else VOCAB)

    h.square().mean().backward()
    expected.square().mean().backward()
    _assert_params_match(model, ref, grads=True, atol=1e-6)


def test_split_rejects_non_decoder():
    with pytest.raises(TypeError, match="needs a torchtune TransformerDecoder"):
        split_decoder(torch.nn.Linear(2, 2), 2)


# ----------------------------------------------------------------------------- multi-rank


def _fsdp_training_step() -> None:
    torch.manual_seed(0)
    model = build_model("debug")
    ref = copy.deepcopy(model)
    tokens, labels = _batch()
    mesh = ParallelDims(dp_shard=2).build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_shard", "tp") and tuple(mesh.shape) == (1, 2, 1)
    apply_fsdp(model, mesh["dp_shard"])
    assert all(isinstance(p, DTensor) for p in model.parameters())

    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _lm_loss(model(tokens.chunk(2)[rank]), labels.chunk(2)[rank]).backward()
    opt.step()

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _lm_loss(ref(tokens), labels).backward()
    ref_opt.step()
    _assert_params_match(model, ref, grads=True)
    _assert_params_match(model, ref, grads=False)


def test_fsdp_training_step_equals_single_process(two_ranks):
    two_ranks.run(_fsdp_training_step)


def _fsdp_on_pipeline_stages() -> None:
    rank = dist.get_rank()
    dp_mesh = ParallelDims(dp_shard=2).build_mesh("cpu")["dp_shard"]
    tokens, labels = _batch()

    torch.manual_seed(0)
    model = build_model("debug")
    ref = copy.deepcopy(model)
    stages = split_decoder(model, 2)
    for stage in stages:
        apply_fsdp(stage, dp_mesh, reshard_after_forward=False)
    h = tokens.chunk(2)[rank]
    for stage in stages:
        h = stage(h)
    _lm_loss(h, labels.chunk(2)[rank]).backward()
    _lm_loss(ref(tokens), labels).backward()
    _assert_params_match(model, ref, grads=True)

    # bf16 compute with fp32 master weights and fp32 gradient reduction, on a stage module.
    torch.manual_seed(0)
    model = build_model("debug")
    ref_loss = _lm_loss(model(tokens.chunk(2)[rank]), labels.chunk(2)[rank]).item()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stages = split_decoder(model, 2)
    for stage in stages:
        apply_fsdp(stage, dp_mesh, mp_policy=policy)
    h = tokens.chunk(2)[rank]
    for stage in stages[:-1]:
        h = stage(h)
        assert h.dtype == torch.bfloat16
    loss = _lm_loss(stages[-1](h), labels.chunk(2)[rank])
    loss.backward()
    assert abs(loss.item() - ref_loss) < 2e-2 * abs(ref_loss)
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad.full_tensor()).all()

    # A value model under the same policy: its head computes in float32 on the bf16 model's last hidden state.
    torch.manual_seed(0)
    model = build_model("debug", "value")
    (stage,) = split_decoder(model, 1)
    apply_fsdp(stage, dp_mesh, mp_policy=policy)
    seen = {}
    model.output.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    model.norm.register_forward_hook(lambda m, args, out: seen.update(hidden=out))
    values = stage(tokens.chunk(2)[rank])
    assert seen["hidden"].dtype == torch.bfloat16 and seen["x"].dtype == torch.float32 and values.dtype == torch.float32
    head = model.output.weight.full_tensor()  # the float32 master weight
    torch.testing.assert_close(seen["out"], seen["hidden"].float() @ head.T, rtol=1e-6, atol=1e-6)
    values.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_fsdp_on_pipeline_stages_and_mixed_precision(two_ranks):
    two_ranks.run(_fsdp_on_pipeline_stages)


def _replicated_critic_exports_once(folder: str) -> None:
    """pp=2 with a one-stage Critic: both pipeline ranks hold the whole Critic, hybrid-sharded over its two
    replicas. Its full state dict is the model's, gathered with one broadcast (one replica's copy), and the HF export
    writes that one copy."""
    from fusedrl.components.checkpoint import export_hf
    from fusedrl.distributed import gather_full_state_dict
    from fusedrl.models import load_hf_checkpoint

    dims = ParallelDims(pp=2, pp_critic=1)
    pp_group = dims.build_mesh("cpu").get_group("pp")
    torch.manual_seed(0)
    model = build_model("debug", "value")
    ref = copy.deepcopy(model)
    (stage,) = split_decoder(model, 1)
    apply_fsdp(stage, dims.build_critic_mesh("cpu")["critic_replica", "dp_shard"])
    broadcasts = []
    real_broadcast = dist.broadcast

    def counted(*args, **kwargs):
        broadcasts.append(1)
        return real_broadcast(*args, **kwargs)

    dist.broadcast = counted
    try:
        full = gather_full_state_dict(stage, pp_group)
    finally:
        dist.broadcast = real_broadcast
    assert len(broadcasts) == 1  # one float32 buffer, from the first replica only
    want = ref.state_dict()
    assert set(full) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(full[name], t, rtol=0, atol=0)
    path = export_hf(stage, folder, "debug", "value", pp_group)
    if dist.get_rank() == 0:
        loaded = build_model("debug", "value")
        load_hf_checkpoint(loaded, path, "debug", "value")
        for name, t in loaded.state_dict().items():
            torch.testing.assert_close(t, want[name], rtol=0, atol=0)


def test_replicated_critic_gathers_and_exports_one_copy(two_ranks, tmp_path):
    two_ranks.run(_replicated_critic_exports_once, str(tmp_path / "critic_hf"))


def _tp_forward_backward(flavor: str) -> None:
    torch.manual_seed(0)
    model = build_model(flavor)
    ref = copy.deepcopy(model)
    tokens, labels = _batch()
    tp_mesh = ParallelDims(tp=2).build_mesh("cpu")["tp"]
    apply_tp(model, tp_mesh)
    attn = model.layers[0].attn
    ref_attn = ref.layers[0].attn
    assert (attn.num_heads, attn.num_kv_heads) == (ref_attn.num_heads // 2, ref_attn.num_kv_heads // 2)
    assert attn.q_proj.weight.to_local().shape[0] == ref.layers[0].attn.q_proj.weight.shape[0] // 2
    # vocabulary-parallel embedding and LM head, unless tied (debug_qwen): then both stay replicated
    embedding = model.tok_embeddings.weight
    assert isinstance(embedding, DTensor) == (flavor == "debug")
    if flavor == "debug":
        assert embedding.to_local().shape[0] * 2 == embedding.shape[0] == model.output.weight.to_local().shape[0] * 2

    logits = model(tokens)
    expected = ref(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    _lm_loss(logits, labels).backward()
    _lm_loss(expected, labels).backward()
    _assert_params_match(model, ref, grads=True)


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen"])
def test_tp_forward_and_gradients_equal_single_process(two_ranks, flavor):
    two_ranks.run(_tp_forward_backward, flavor)


def _host_copies_round_trip() -> None:
    torch.manual_seed(0)
    model = build_model("debug")
    ref = copy.deepcopy(model)
    apply_tp(model, ParallelDims(tp=2).build_mesh("cpu")["tp"])
    copies = HostCopies([model])
    copies.release()
    params = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    assert any(isinstance(p, DTensor) for p in model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    copies.restore()
    _assert_params_match(model, ref, grads=False)
    tokens, _ = _batch()
    torch.testing.assert_close(model(tokens), ref(tokens), atol=1e-5, rtol=1e-4)


def test_offloaded_frozen_weights_are_freed_and_restored_exactly(two_ranks):
    """training.offload_frozen: HostCopies frees the device storage of tensor-parallel parameters (DTensors stay)
    and restores the same values."""
    two_ranks.run(_host_copies_round_trip)


def _pipeline_gpipe() -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = dist.get_rank()
    mesh = ParallelDims(pp=2).build_mesh("cpu")
    torch.manual_seed(0)
    model = build_model("debug")
    ref = copy.deepcopy(model)
    tokens, labels = _batch()

    stage_module = split_decoder(model, 2)[rank]
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=_lm_loss)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(tokens)
    else:
        schedule.step(target=labels, losses=losses)

    ref_loss = _lm_loss(ref(tokens), labels)
    ref_loss.backward()
    if rank == 1:
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
    _assert_params_match(stage_module, ref, grads=True)


def test_pipeline_schedule_over_split_stages_matches_full_model_gradients(two_ranks):
    two_ranks.run(_pipeline_gpipe)


# ----------------------------------------------------------------------------- GPU


def _nccl_collectives() -> None:
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t, group=group)
    assert torch.equal(t.cpu(), torch.full((4,), 3.0))
    gathered = torch.empty(2, 4, device="cuda")
    dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank), device="cuda"), group=group)
    assert torch.equal(gathered.cpu(), torch.tensor([[0.0] * 4, [1.0] * 4]))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_process_group_collectives():
    run_multirank(_nccl_collectives, 2)


def _fsdp_bf16_cuda_step() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    torch.cuda.set_device(dist.get_rank())
    group = dist.new_group(backend="nccl")
    dp_mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = build_model("debug", device="cuda")
    tokens, labels = (t.cuda() for t in _batch())
    ref_loss = _lm_loss(model(tokens), labels).item()
    apply_fsdp(model, dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.full_tensor().clone() for p in model.parameters()]
    loss = _lm_loss(model(tokens), labels)
    loss.backward()
    opt.step()
    assert abs(loss.item() - ref_loss) < 2e-2 * abs(ref_loss)
    for p in model.parameters():
        assert p.dtype == torch.float32 and torch.isfinite(p.full_tensor()).all()
    assert any(not torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.gpu
def test_fsdp_bf16_mixed_precision_step_on_cuda():
    run_multirank(_fsdp_bf16_cuda_step, min(2, torch.cuda.device_count()))


# ----------------------------------------------------------------------------- one update, any layout


def _one_update(pp: int, dp_shard: int, tp: int, actor: str) -> dict[str, object]:
    """One PPO update (``train_minibatch``: fused Actor + Critic program, gradient sums over stages and shards, global
    clipping, both AdamW steps) of the float32 debug config from the same random weights. Returns this rank's trained
    parameters by role and name (whole tensors): after the step, their change and AdamW's first moment (0.1 x the
    clipped gradient); the global gradient norms and the loss stats."""
    from test_packing import _minibatch, debug_update_layout

    from fusedrl.rlhf.update import build_optimizers, train_minibatch

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same random initial weights in every layout
    cfg, layout, executor, _ = debug_update_layout(
        f"--parallelism.pp={pp}", f"--parallelism.dp_shard={dp_shard}", f"--parallelism.tp={tp}", f"--model.actor={actor}"
    )
    named = {
        f"{role}.{name}": p
        for role, stage in (("actor", layout.actor_stage), ("critic", layout.critic_stage))
        for name, p in stage.named_parameters()
    }
    before = {name: _full(p.detach()).clone() for name, p in named.items()}
    opt = build_optimizers(cfg, layout, 1)
    result = train_minibatch(cfg, layout, executor, opt, _minibatch(cfg.ppo.minibatch_size, 500), step=1)
    state = {**opt.actor.state, **opt.critic.state}
    stats = {k: v.clone() for k, v in result.stats.items()}
    for v in stats.values():
        dist.all_reduce(v)  # a figure's minibatch mean is the sum over ranks / (dp * tp)
    out = {
        "params": {name: _full(p.detach()).clone() for name, p in named.items()},
        "moments": {name: _full(state[p]["exp_avg"]).clone() for name, p in named.items()},
        "norms": (float(result.grad_norm_actor), float(result.grad_norm_critic)),
        "stats": {k: float(v) / (layout.dp * tp) for k, v in stats.items()},
        "skipped": result.skipped,
    }
    out["changed"] = {name: float((out["params"][name] - p).abs().max()) for name, p in before.items()}
    dist.barrier()
    return out


def _merged(ranks: list[dict[str, object]]) -> dict[str, object]:
    """One layout's ranks as one model: the union of the stages' tensors (one that several ranks hold: equal on all),
    the norms and stats every rank agrees on."""
    merged: dict[str, object] = {**ranks[0]}
    for key in ("params", "moments", "changed"):
        union: dict[str, object] = {}
        for r in ranks:
            for name, t in r[key].items():
                if name in union:
                    torch.testing.assert_close(t, union[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
                union[name] = t
        merged[key] = union
    for r in ranks:
        assert r["norms"] == ranks[0]["norms"] and r["stats"] == ranks[0]["stats"] and not r["skipped"]
    return merged


@pytest.mark.parametrize(
    ("pp", "dp_shard", "tp", "actor"),
    [(1, 2, 1, "debug"), (2, 1, 1, "debug"), (1, 1, 2, "debug"), (2, 1, 1, "debug_qwen")],
    ids=["dp_shard2", "pp2", "tp2", "pp2_tied_embeddings"],
)
def test_one_update_gives_the_same_weights_on_every_layout(rank_pools, pp, dp_shard, tp, actor):
    """The recipes switch layouts (data parallel on 2 cores, pp = 2 with a Critic): an update of the same minibatch
    must not depend on it. Two ranks against one, float32, the whole update: losses, gradient norms, the clipped
    gradients (AdamW's first moments) and the stepped weights. ``debug_qwen``: an embedding tied to the head, split
    over the two stages."""
    (one,) = rank_pools(1).run(_one_update, 1, 1, 1, actor)
    two = _merged(rank_pools(2).run(_one_update, pp, dp_shard, tp, actor))
    # a tied embedding split over pipeline stages: the last stage's head is a copy of the one model's embedding
    same = {"actor.output.weight": "actor.tok_embeddings.weight"} if actor == "debug_qwen" and pp == 2 else {}
    assert {same.get(n, n) for n in two["params"]} == one["params"].keys() and len(one["params"]) > 20
    assert all(change > 0 for change in one["changed"].values()), "the update moved no weight: nothing compared"
    assert two["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert two["stats"].keys() == one["stats"].keys()
    for k, v in one["stats"].items():
        assert two["stats"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for name in two["params"]:
        for key in ("moments", "params"):
            expected = one[key][same.get(name, name)]
            atol = 1e-5 * float(expected.abs().max())
            torch.testing.assert_close(
                two[key][name], expected, rtol=1e-4, atol=atol, msg=lambda m, n=name, k=key: f"{k} {n}: {m}"
            )
