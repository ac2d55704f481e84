"""Fused and sequential programs through FusedPipelineSchedule give the gradients of a single-process reference."""

import copy
import weakref
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from fusedrl.distributed import (
    ParallelDims,
    TiedEmbeddings,
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tp,
    split_decoder,
    transformer_layers,
)
from fusedrl.models import build_model, flavor_from_hf_config, resolve_flavor
from fusedrl.pipelining import (
    FusedPipelineSchedule,
    LocalSchedule,
    LoweredProgram,
    ProgramError,
    StageModule,
    StepObserver,
    lower,
)
from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.executor import STAGE_CACHE_SIZE
from fusedrl.pipelining.ir import ACTOR, CRITIC, Placement
from fusedrl.pipelining.search import fused_schedule, sequential_1f1b
from fusedrl.testing import run_multirank
from fusedrl.testing.architectures import TINY_ARCHITECTURES

SEQ = 6


def actor_loss(logits, t):
    """PPO clipped policy loss, masked token mean."""
    logp = torch.log_softmax(logits.float(), -1).gather(-1, t["tokens"].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - t["old_logprobs"])
    pg = -torch.min(ratio * t["advantages"], ratio.clamp(0.8, 1.2) * t["advantages"])
    return (pg * t["mask"]).sum() / t["mask"].sum(), {"ratio": ratio.mean().detach()}


def critic_loss(values, t):
    v = values.squeeze(-1)
    return (((v - t["returns"]) ** 2) * t["mask"]).sum() / t["mask"].sum(), {"value": v.mean().detach()}


def make_batch(batch, seq, seed=1, device="cpu", vocab=512):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    actor_t = {
        "tokens": torch.randint(0, vocab, (batch, seq), generator=g),
        "old_logprobs": -6.0 + 0.1 * torch.randn(batch, seq, generator=g),
        "advantages": torch.randn(batch, seq, generator=g),
        "mask": (torch.rand(batch, seq, generator=g) > 0.2).float(),
    }
    critic_t = {"returns": torch.randn(batch, seq, generator=g), "mask": (torch.rand(batch, seq, generator=g) > 0.2).float()}
    move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return tokens.to(device), move(actor_t), move(critic_t)


def _micro(tokens, targets, m):
    n = tokens.shape[0] // m
    return [(tokens[i * n : (i + 1) * n], {k: v[i * n : (i + 1) * n] for k, v in targets.items()}) for i in range(m)]


def _program(kind, pp, ma, mc, critic_stages=None):
    placement = Placement(pp, critic_stages)
    if kind == "sequential":
        schedule = sequential_1f1b(placement, ma, mc)
    elif kind == "split_backward":  # every B as an input backward I followed by a weight backward W
        schedule = {
            r: [x for a in acts for x in ((replace(a, kind="I"), replace(a, kind="W")) if a.kind == "B" else (a,))]
            for r, acts in sequential_1f1b(placement, ma, mc).items()
        }
    elif kind == "planned_split":  # the planner's split-backward schedule (budget 0: deterministic greedy)
        costs = CostModel.uniform(placement, 1.0, 0.4, p2p_latency=1.0)
        schedule = fused_schedule(placement, costs, ma, mc, budget_s=0, split_backward=True).schedule
    else:
        schedule = fused_schedule(placement, CostModel.uniform(placement, 1.0, 0.7), ma, mc, budget_s=0.2).schedule
    return lower(schedule, placement, {ACTOR: ma, CRITIC: mc})


def _check_gradients(
    programs,
    pp,
    dp,
    ma,
    mc,
    per_dp_batch,
    seq_lens,
    boundaries=None,
    device="cpu",
    tp=1,
    flavor="debug",
    recompute=False,
    critic_stages=None,
):
    """``critic_stages`` < pp: the Critic runs as pp / critic_stages replicas of ``mc`` micro-batches each, hybrid-
    sharded over them (the reference takes all replicas' micro-batches)."""
    rank = dist.get_rank()
    dims = ParallelDims(pp=pp, dp_shard=dp, tp=tp, world_size=pp * dp * tp, pp_critic=critic_stages)
    replicas, cs = dims.critic_replicas, dims.pp_critic
    if device == "cpu":
        mesh = dims.build_mesh("cpu")
        pp_rank, dp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank(), mesh.get_group("pp")
    else:  # NCCL pipeline group next to run_multirank's gloo default group (dp_shard=1)
        pp_rank, dp_rank, pp_group = rank, 0, dist.new_group(backend="nccl")
    critic_mesh = dims.build_critic_mesh("cpu") if replicas > 1 else None
    models = {}
    for i, (m, role) in enumerate(((ACTOR, "policy"), (CRITIC, "value"))):
        torch.manual_seed(i)
        models[m] = build_model(flavor, role, device=device)
        if flavor != "debug":  # torchtune's init leaves the embedding's gradient at ~1e-17 here: make it count
            with torch.no_grad():
                for p in models[m].parameters():
                    p.normal_(0.0, 0.1)
    refs = {m: copy.deepcopy(mod) for m, mod in models.items()}
    placement = Placement(pp, cs)
    stage_of = {m: placement.stage_at(m, pp_rank)[0] for m in (ACTOR, CRITIC)}
    last_of = {ACTOR: pp - 1, CRITIC: cs - 1}
    stages = {
        ACTOR: split_decoder(models[ACTOR], pp, boundaries)[stage_of[ACTOR]],
        CRITIC: split_decoder(models[CRITIC], cs, boundaries if cs == pp else None)[stage_of[CRITIC]],
    }
    for m, mod in stages.items():
        if tp > 1:  # tensor parallel first, then FSDP2 over the TP-sharded parameters (torchtitan's order)
            apply_tp(mod, (critic_mesh if m == CRITIC and critic_mesh is not None else mesh)["tp"])
        if recompute:
            apply_activation_checkpointing(mod)
        if m == CRITIC and critic_mesh is not None:  # replicas: hybrid sharding averages their gradients
            apply_fsdp(mod, critic_mesh["critic_replica", "dp_shard"])
        elif dp > 1 or tp > 1:  # FSDP2 over TP shards even at dp_shard = 1, as the trainer's layout does
            apply_fsdp(mod, mesh["dp_shard"])
    forwards = []  # a recomputed layer runs its forward twice per micro-batch
    for mod in stages.values():
        for layer in transformer_layers(mod)[:1]:
            layer.register_forward_pre_hook(lambda *_: forwards.append(1))
    layered = sum(n for m, n in ((ACTOR, ma), (CRITIC, mc)) if transformer_layers(stages[m]))  # mc: per replica
    f = resolve_flavor(flavor)
    tied = TiedEmbeddings(mesh, stages[ACTOR], f.tie_word_embeddings) if device == "cpu" else None
    specs = {ACTOR: StageModule(stages[ACTOR], actor_loss), CRITIC: StageModule(stages[CRITIC], critic_loss)}

    for kind in programs:
        for mod in list(stages.values()) + list(refs.values()):
            mod.zero_grad(set_to_none=True)
        ex = FusedPipelineSchedule(programs[kind], specs[ACTOR], specs[CRITIC], group=pp_group)
        built: dict[tuple, weakref.ref] = {}
        for step, seq in enumerate(seq_lens):
            tokens, actor_t, critic_t = make_batch(per_dp_batch * dp, seq, seed=step + 1, device=device, vocab=f.vocab_size)
            mine = slice(dp_rank * per_dp_batch, (dp_rank + 1) * per_dp_batch)
            result = ex.step(
                tokens[mine], tokens[mine], {k: v[mine] for k, v in actor_t.items()}, {k: v[mine] for k, v in critic_t.items()}
            )
            if tied is not None:
                tied.sum_gradients()
            for m in (ACTOR, CRITIC):  # one stage per micro-batch shape, at most STAGE_CACHE_SIZE kept per model
                kept = [k for k in ex._stages if k[0] == m]
                assert len(kept) == min(len({*seq_lens[: step + 1]}), STAGE_CACHE_SIZE) and kept[-1][2][1] == seq, kept
            built.update({k: weakref.ref(st) for k, st in ex._stages.items() if k not in built or built[k]() is None})
            assert all((ref() is not None) == (k in ex._stages) for k, ref in built.items())  # evicted ones are freed
            # reference: every dp shard's micro-batch losses, averaged over micro-batches and dp ranks; the loss
            # a last stage reports is the mean over its own micro-batches (a Critic replica's: its share)
            for m, targets, fn, n_mb in ((ACTOR, actor_t, actor_loss, ma), (CRITIC, critic_t, critic_loss, replicas * mc)):
                replica = placement.stage_at(CRITIC, pp_rank)[1]
                mine_mb = range(n_mb) if m == ACTOR else range(replica * mc, (replica + 1) * mc)
                total = 0.0
                for d in range(dp):
                    shard = slice(d * per_dp_batch, (d + 1) * per_dp_batch)
                    for i, (x, t) in enumerate(_micro(tokens[shard], {k: v[shard] for k, v in targets.items()}, n_mb)):
                        loss = fn(refs[m](x), t)[0] / (n_mb * dp)
                        loss.backward()
                        if d == dp_rank and i in mine_mb:
                            total += loss.item() * dp * n_mb / len(mine_mb)
                if stage_of[m] == last_of[m]:
                    assert result[m].loss == pytest.approx(total, rel=1e-5, abs=1e-6), (kind, m)
                    assert set(result[m].stats) == ({"ratio"} if m == ACTOR else {"value"})
                else:
                    assert result[m].loss is None
        assert len(forwards) == (2 if recompute else 1) * layered * len(seq_lens), kind
        forwards.clear()
        for m in models:  # stage parameter names are the full model's names (a tied head is the embedding)
            got = dict(stages[m].named_parameters())
            want = dict(refs[m].named_parameters())
            if "output.weight" not in want:
                want["output.weight"] = want["tok_embeddings.weight"]
            assert got and set(got) <= set(want)
            for name, p in got.items():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                torch.testing.assert_close(
                    g, want[name].grad, rtol=1e-4, atol=1e-6, msg=lambda s: f"rank {rank} {kind} {m} {name}: {s}"
                )


@pytest.mark.slow
@pytest.mark.parametrize(
    "pp,dp,ma,mc,boundaries",
    # the debug decoder has 2 layers: at pp=4 the first stage holds only the embedding, the last only the head
    [(2, 1, 4, 2, None), (2, 2, 2, 2, None), (4, 1, 4, 2, (0, 1, 2))],
    ids=["pp2-dp1", "pp2-dp2", "pp4-dp1"],
)
def test_gradients_match_single_process_reference(rank_pools, pp, dp, ma, mc, boundaries):
    # programs are planned once here: a search cut short by its wall-clock guard could differ between ranks
    kinds = ("sequential", "fused") + (("split_backward",) if pp == 2 and dp == 1 else ())
    kinds += ("planned_split",) if pp == 2 else ()
    programs = {kind: _program(kind, pp, ma, mc) for kind in kinds}
    if pp == 2 and dp == 1:  # the planned split runs W's of both models later than right after their I
        compute = [a for a in programs["planned_split"].programs[1] if a.kind in ("F", "I", "W")]
        deferred = {a.model for a, nxt in zip(compute, compute[1:]) if a.kind == "I" and nxt != replace(a, kind="W")}
        assert deferred == {ACTOR, CRITIC}
    # pp2-dp1 also runs minibatches of several padded lengths (accumulated gradients): three shapes, then the first
    # again, which the stage cache (two per model) evicted and rebuilds
    seq_lens = (SEQ, SEQ + 2, SEQ + 4, SEQ) if pp == 2 and dp == 1 else (SEQ,)
    rank_pools(pp * dp).run(_check_gradients, programs, pp, dp, ma, mc, 4, seq_lens, boundaries, timeout_s=240.0)


def _every_architecture(program, flavors) -> None:
    for flavor in flavors:
        _check_gradients({"fused": program}, 2, 1, 2, 2, 2, (SEQ,), flavor=flavor)


def test_every_architecture_gives_the_reference_gradients_at_pp2(rank_pools):
    """Llama (biases, head_dim != hidden / heads, 9 heads), llama3 RoPE, Mistral, Qwen2 (odd vocabulary), Qwen3 (q/k
    norms, with and without biases), tied and untied: the fused pp=2 program's gradients are the single process's."""
    flavors = [flavor_from_hf_config(config) for config in TINY_ARCHITECTURES.values()]
    rank_pools(2).run(_every_architecture, _program("fused", 2, 2, 2), flavors, timeout_s=240.0)


def test_tied_embedding_gradients_match_the_reference_at_pp2(rank_pools):
    """debug_qwen ties its LM head to the embedding: at pp=2 the two copies live on different ranks and their
    gradients are summed (TiedEmbeddings) into the unsplit model's one gradient."""
    programs = {kind: _program(kind, 2, 2, 2) for kind in ("sequential", "fused")}
    rank_pools(2).run(_check_gradients, programs, 2, 1, 2, 2, 4, (SEQ,), None, "cpu", 1, "debug_qwen", timeout_s=240.0)


def _tensor_parallel_cases(programs, qwen3) -> None:
    _check_gradients(programs, 2, 1, 2, 2, 4, (SEQ,), None, "cpu", 2)
    _check_gradients({"fused": programs["fused"]}, 2, 1, 2, 2, 4, (SEQ,), None, "cpu", 2, flavor=qwen3)


@pytest.mark.slow
def test_tensor_parallel_training_gradients_match_the_reference(rank_pools):
    """pp=2 x tp=2 (4 ranks, FSDP2 over the TP shards as in the trainer; vocabulary-parallel embedding and LM head),
    fp32: gradients equal the single-process ones to rtol 1e-4 / atol 1e-6 (the TP all-reduces sum the heads'
    partial products in another order than one matmul does: float reassociation). Also a Qwen3 (per-head q/k norms,
    whose weight gradient each TP rank holds only for its heads until the plan sums it) with biases."""
    programs = {kind: _program(kind, 2, 2, 2) for kind in ("sequential", "fused")}
    qwen3 = flavor_from_hf_config(TINY_ARCHITECTURES["qwen3_biased"])
    rank_pools(4).run(_tensor_parallel_cases, programs, qwen3, timeout_s=300.0)


@pytest.mark.slow
def test_activation_checkpointing_gives_the_reference_gradients(rank_pools):
    """training.activation_checkpointing = "full" on pp=2 x dp_shard=2 with FSDP2: layers recomputed in the
    backward give the single-process gradients, and parameter names are unchanged (checked in _check_gradients)."""
    programs = {"fused": _program("fused", 2, 2, 2)}
    rank_pools(4).run(_check_gradients, programs, 2, 2, 2, 2, 4, (SEQ,), None, "cpu", 1, "debug", True, timeout_s=240.0)


def test_stage_module_takes_its_dims_from_the_decoder_stage():
    """Activation shapes come from the stage: hidden width between stages, the head's width on a last stage that
    applies it (vocabulary, 1 for a value head; the tied head too), the hidden width when the loss applies it."""
    dims = lambda stage: (StageModule(stage, actor_loss).hidden_dim, StageModule(stage, actor_loss).output_dim)  # noqa: E731
    for flavor in ("debug", "debug_qwen"):
        first, last = split_decoder(build_model(flavor, "policy", device="meta"), 2)
        assert dims(first) == (64, 64) and dims(last) == (64, 512)
    assert dims(split_decoder(build_model("debug", "policy", device="meta"), 2, apply_head=False)[1]) == (64, 64)
    assert dims(split_decoder(build_model("debug", "value", device="meta"), 1)[0]) == (64, 1)
    with pytest.raises(ValueError, match="a Linear does not state its hidden_dim; pass hidden_dim="):
        StageModule(torch.nn.Linear(2, 2), actor_loss)


def test_misordered_program_is_rejected_before_running():
    placement, counts = Placement(2), {ACTOR: 2, CRITIC: 2}
    program = lower(sequential_1f1b(placement, 2, 2), placement, counts)
    progs = {r: list(p) for r, p in program.programs.items()}
    # swap two back-to-back activations on the receiving end: same shapes, so gloo would silently swap them
    i = next(i for i, (a, b) in enumerate(zip(progs[1], progs[1][1:])) if a.kind == b.kind == "RECV_F")
    progs[1][i], progs[1][i + 1] = progs[1][i + 1], progs[1][i]
    bad = LoweredProgram(placement, counts, progs)
    spec = StageModule(torch.nn.Linear(2, 2), actor_loss, hidden_dim=2, output_dim=2)
    # raised before any communication: no process group is needed to reject it
    with pytest.raises(ProgramError, match=r"message #\d+ between ranks 0 and 1 differs"):
        FusedPipelineSchedule(bad, spec, spec)


def test_split_program_with_recomputed_layers_is_refused():
    from fusedrl.distributed.compat import recompute_in_backward

    stage = torch.nn.Sequential(torch.nn.Linear(2, 2))
    recompute_in_backward(stage[0])
    spec = StageModule(stage, actor_loss, hidden_dim=2, output_dim=2)
    with pytest.raises(ValueError, match="splits backwards into I and W, which torch cannot run on layers recomputed"):
        FusedPipelineSchedule(_program("split_backward", 2, 2, 2), spec, spec)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pp,dp,tp,critic_stages,boundaries",
    # pp=4: the Actor's first stage holds only the embedding, its last only the head; the Critic's 2 stages 1 layer each
    [(2, 1, 1, 1, None), (4, 1, 1, 2, (0, 1, 2)), (2, 2, 1, 1, None), (2, 1, 2, 1, None)],
    ids=["pp2-critic1", "pp4-critic2", "pp2-dp2-critic1", "pp2-tp2-critic1"],
)
def test_critic_replicas_give_the_reference_gradients(rank_pools, pp, dp, tp, critic_stages, boundaries):
    """A Critic with fewer stages than the Actor runs as pp / critic_stages replicas, each on its share of the
    micro-batches; hybrid sharding averages their gradients: every replica holds the single-process gradients (also
    with the replicas tensor-parallel, FSDP2 over the TP shards as in the trainer's layout)."""
    ma, mc = 4, 4 * critic_stages // pp  # the Critic's micro-batches per replica: the same micro-batch size
    kinds = ("sequential", "fused") + (("planned_split",) if pp == 2 and dp == tp == 1 else ())
    programs = {kind: _program(kind, pp, ma, mc, critic_stages) for kind in kinds}
    args = (programs, pp, dp, ma, mc, 4, (SEQ,), boundaries, "cpu", tp)
    rank_pools(pp * dp * tp).run(_check_gradients, *args, critic_stages=critic_stages, timeout_s=240.0)


def test_critic_replicas_without_hybrid_sharding_are_refused():
    placement = Placement(2, critic_stages=1)
    program = lower(sequential_1f1b(placement, 2, 1), placement, {ACTOR: 2, CRITIC: 1})
    spec = StageModule(torch.nn.Linear(2, 2), actor_loss, hidden_dim=2, output_dim=2)
    with pytest.raises(ValueError, match="2 Critic replicas, but Critic parameter 'weight' is not replicated over them"):
        FusedPipelineSchedule(program, spec, spec)


def _nccl_gradients(programs):
    torch.cuda.set_device(dist.get_rank())
    _check_gradients(programs, 2, 1, 2, 2, 2, (SEQ,), device=f"cuda:{dist.get_rank()}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")
def test_gradients_match_reference_over_nccl():
    programs = {kind: _program(kind, 2, 2, 2) for kind in ("sequential", "fused")}
    run_multirank(_nccl_gradients, 2, programs, timeout_s=180.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_minibatch_moves_to_the_gpu_once():
    from fusedrl.pipelining.executor import _minibatch_to_device

    tokens, mask = torch.randint(0, 9, (4, 6)), torch.ones(4, 6)
    (actor, critic), (targets,) = _minibatch_to_device(torch.device("cuda"), (tokens, tokens), ({"mask": mask},))
    torch.cuda.synchronize()
    assert actor is critic and actor.is_cuda and torch.equal(actor.cpu(), tokens)
    assert targets["mask"].is_cuda and torch.equal(targets["mask"].cpu(), mask)


def _chunked_head_gradients(program) -> None:
    """pp=2: the Actor's last stage returns hidden states and PolicyLoss applies the LM head in chunks of 3
    positions; gradients must equal a single process's with the full-logits PolicyLoss."""
    from fusedrl.rlhf import PolicyLoss, ValueLoss

    rank = dist.get_rank()
    torch.manual_seed(0)
    actor, critic = build_model("debug", "policy"), build_model("debug", "value")
    ref_actor, ref_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    a_stage = split_decoder(actor, 2, apply_head=False)[rank]
    c_stage = split_decoder(critic, 2)[1 - rank]
    loss = PolicyLoss(head=a_stage.output, chunk_positions=3) if rank == 1 else PolicyLoss()
    ex = FusedPipelineSchedule(program, StageModule(a_stage, loss), StageModule(c_stage, ValueLoss()))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 512, (4, SEQ), generator=g)
    mask = (torch.rand(4, SEQ, generator=g) > 0.3).float()
    actor_t = {
        "tokens": tokens,
        "response_mask": mask,
        "logprobs": -6.0 + 0.1 * torch.randn(4, SEQ, generator=g),
        "advantages": torch.randn(4, SEQ, generator=g),
    }
    critic_t = {"response_mask": mask, "values": torch.randn(4, SEQ, generator=g), "returns": torch.randn(4, SEQ, generator=g)}
    ex.step(tokens, tokens, actor_t, critic_t)
    for x, t in _micro(tokens, actor_t, 2):
        (PolicyLoss()(ref_actor(x), t)[0] / 2).backward()
    for x, t in _micro(tokens, critic_t, 2):
        (ValueLoss()(ref_critic(x), t)[0] / 2).backward()
    for stage, ref in ((a_stage, ref_actor), (c_stage, ref_critic)):
        want = dict(ref.named_parameters())
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-6, msg=lambda s: f"{name}: {s}")


def test_chunked_lm_head_in_the_loss_gives_the_full_logits_gradients(rank_pools):
    rank_pools(2).run(_chunked_head_gradients, _program("fused", 2, 2, 2), timeout_s=120.0)


# ---------------------------------------------------------------- critic-free: the Actor alone (critic=None)


class _ModelsSeen(StepObserver):
    def __init__(self) -> None:
        self.models: list[str] = []

    def forward_started(self, model, microbatch):
        self.models.append(model)

    def backward_finished(self, model, microbatch, released):
        self.models.append(model)

    def reduce_started(self, model, stage):
        self.models.append(model)


def _reference_actor(model, tokens, actor_t, m):
    """Gradients of the whole model run locally, each micro-batch loss divided by ``m``; returns the mean loss."""
    total = 0.0
    for x, t in _micro(tokens, actor_t, m):
        loss = actor_loss(model(x), t)[0] / m
        loss.backward()
        total += loss.item()
    return total


def _critic_free_gradients(programs, ma):
    """pp=2, the Actor alone: each program's gradients and loss are those of the whole model run locally."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model("debug", "policy")
    ref = copy.deepcopy(model)
    stage = split_decoder(model, 2)[rank]
    tokens, actor_t, critic_t = make_batch(4, SEQ)
    want_loss = _reference_actor(ref, tokens, actor_t, ma)
    want = dict(ref.named_parameters())
    for kind, program in programs.items():
        stage.zero_grad(set_to_none=True)
        ex = FusedPipelineSchedule(program, StageModule(stage, actor_loss))  # critic: None
        ex.observer = watch = _ModelsSeen()
        assert list(ex.models) == [ACTOR]
        with pytest.raises(ValueError, match="trains no Critic .*pass critic_inputs=None and critic_targets=None"):
            ex.step(tokens, tokens, actor_t, critic_t)  # refused before any communication, on every rank
        result = ex.step(tokens, None, actor_t, None)
        assert set(result) == {ACTOR} and {key[0] for key in ex.stages} == {ACTOR}
        assert watch.models and set(watch.models) == {ACTOR}, kind
        if rank == 1:
            assert result[ACTOR].loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6), kind
        else:
            assert result[ACTOR].loss is None
        for name, p in stage.named_parameters():
            torch.testing.assert_close(
                p.grad, want[name].grad, rtol=1e-4, atol=1e-6, msg=lambda s: f"rank {rank} {kind} {name}: {s}"
            )


def test_critic_free_split_backward_gives_the_reference_gradients(rank_pools):
    """critic=None with the planner's split-backward program of the Actor alone (I and W, W's deferred into the
    bubbles) and with sequential 1F1B: the gradients of the whole model run in one process."""
    ma = 4
    programs = {kind: _program(kind, 2, ma, 0) for kind in ("sequential", "planned_split")}
    compute = [a for a in programs["planned_split"].programs[1] if a.kind in ("F", "I", "W")]
    assert {a.model for a in compute} == {ACTOR} and {a.kind for a in compute} == {"F", "I", "W"}
    assert any(a.kind == "I" and nxt != replace(a, kind="W") for a, nxt in zip(compute, compute[1:]))  # a W deferred
    rank_pools(2).run(_critic_free_gradients, programs, ma, timeout_s=120.0)


def test_critic_none_needs_a_program_without_critic_microbatches():
    spec = StageModule(torch.nn.Linear(2, 2), actor_loss, hidden_dim=2, output_dim=2)
    # refused before any communication: no process group is needed
    with pytest.raises(ValueError, match="the program has 2 Critic micro-batches but no Critic StageModule was given"):
        FusedPipelineSchedule(_program("sequential", 2, 2, 2), spec)
    with pytest.raises(ValueError, match="the program has 0 Critic micro-batches but a Critic StageModule was given"):
        FusedPipelineSchedule(_program("sequential", 2, 2, 0), spec, spec)
    with pytest.raises(ValueError, match="microbatches has 1 Critic micro-batches but no Critic StageModule was given"):
        LocalSchedule(spec, None, {ACTOR: 2, CRITIC: 1})
    with pytest.raises(ValueError, match="microbatches has 0 Critic micro-batches but a Critic StageModule was given"):
        LocalSchedule(spec, spec, {ACTOR: 2, CRITIC: 0})


def test_local_schedule_trains_the_actor_alone():
    torch.manual_seed(0)
    model = build_model("debug", "policy")
    ref = copy.deepcopy(model)
    (whole,) = split_decoder(model, 1)
    local = LocalSchedule(StageModule(whole, actor_loss), None, {ACTOR: 2})
    assert list(local.models) == [ACTOR]
    tokens, actor_t, critic_t = make_batch(4, SEQ)
    with pytest.raises(ValueError, match="trains no Critic"):
        local.step(tokens, None, actor_t, critic_t)
    result = local.step(tokens, None, actor_t, None, record=True)
    assert set(result) == {ACTOR}
    assert local.timeline is not None and {e.action.model for e in local.timeline.events} == {ACTOR}
    assert result[ACTOR].loss == pytest.approx(_reference_actor(ref, tokens, actor_t, 2), rel=1e-5, abs=1e-6)
    want = dict(ref.named_parameters())
    for name, p in whole.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-6, msg=lambda s: f"{name}: {s}")
