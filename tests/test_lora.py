"""[lora]: adapters on the Actor and the Critic, base weights frozen; every layout and schedule trains the same adapters,
the engine samples from the merged weights, resume is exact, and an exported adapter loads with peft."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from fusedrl.models import (
    LoRASpec,
    ModelFlavor,
    adapter_modules,
    add_lora,
    build_model,
    init_adapters,
    merge_adapters,
    save_hf_checkpoint,
    save_peft_adapter,
    trainable_counts,
)
from fusedrl.rlhf.losses import token_logprobs
from fusedrl.testing.configs import TINY_DEBUG_RUN

if TYPE_CHECKING:
    from fusedrl.config import JobConfig
    from fusedrl.layouts import RolloutLayout, TrainingLayout

ROOT = Path(__file__).resolve().parents[1]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# lora.alpha / lora.rank of the specs and configs below, written out: LoRASpec.scale is code under test
HAND_SCALE = 8.0 / 4


def _merged_by_hand(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain model's state computing what the adapted one does: each adapted weight W + (alpha / rank) B A."""
    out = {n: t.float() if t.is_floating_point() else t for n, t in state.items() if not n.endswith((".lora_a", ".lora_b"))}
    for name, a in state.items():
        if name.endswith(".lora_a"):
            base = name.removesuffix(".lora_a")
            out[f"{base}.weight"] = out[f"{base}.weight"] + HAND_SCALE * state[f"{base}.lora_b"].float() @ a.float()
    return out


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-zero adapters (a fresh B is zero: the adapted model would equal its base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapter_modules(model).values():
            m.lora_a.copy_(torch.randn(m.lora_a.shape, generator=gen) * 0.2)
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.2)


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen"])  # Llama (q/k rows permuted for HF), Qwen2 (q/k/v biases)
def test_adapters_start_as_the_base_train_alone_and_merge_exactly(flavor):
    torch.manual_seed(0)
    model = build_model(flavor, "policy")
    plain = build_model(flavor, "policy")
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 256, (2, 9))
    spec = LoRASpec(rank=4, alpha=8.0, dropout=0.0, targets=ALL)
    add_lora(model, spec)
    init_adapters(model, seed=3)
    assert torch.equal(model(tokens), plain(tokens))  # B starts at zero
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith((".lora_a", ".lora_b")) for n in trained)
    assert len(adapter_modules(model)) == 7 * len(model.layers)
    _randomize(model, 1)
    adapted = model(tokens)
    assert not torch.allclose(adapted, plain(tokens), atol=1e-3)  # the adapters change the output
    by_hand = _merged_by_hand(model.state_dict())
    merged = merge_adapters(model.state_dict(), spec.scale)
    assert sorted(merged) == sorted(by_hand)  # the adapters dropped, every other tensor kept
    for n, t in by_hand.items():
        torch.testing.assert_close(merged[n], t, atol=1e-6, rtol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    plain.load_state_dict(by_hand)
    torch.testing.assert_close(plain(tokens), adapted, atol=1e-4, rtol=1e-4)


def test_value_model_adapters_train_the_scalar_head_too_and_counts_are_small():
    value = add_lora(build_model("debug", "value", device="meta"), LoRASpec(4, 8.0, 0.0, ("q_proj", "v_proj")))
    trained = {n for n, p in value.named_parameters() if p.requires_grad}
    assert "output.weight" in trained and "layers.0.attn.k_proj.weight" not in trained
    # SmolLM2-135M's shape (its config.json): rank 8 on all seven projections trains under 2% of it
    f = ModelFlavor("llama", 49152, 30, 9, 3, 576, 1536, 8192, tie_word_embeddings=True, name="SmolLM2-135M")
    smollm = add_lora(build_model(f, "policy", device="meta"), LoRASpec(8, 16.0, 0.0, ALL))
    trained_n, total = trainable_counts([smollm])
    d, kv, mlp = f.embed_dim, f.num_kv_heads * f.embed_dim // f.num_heads, f.intermediate_dim
    per_layer = 2 * (d + d) + 2 * (d + kv) + 3 * (d + mlp)  # q, o; k, v; gate, up, down: (in + out) x rank
    assert trained_n == f.num_layers * 8 * per_layer and trained_n / total < 0.02, (trained_n, total)


def test_a_bf16_base_runs_with_float32_adapters_outside_fsdp():
    model = add_lora(build_model("debug", "policy"), LoRASpec(4, 8.0, 0.0, ALL), base_dtype=torch.bfloat16)
    init_adapters(model, seed=0)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if not n.endswith((".lora_a", ".lora_b"))} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if n.endswith((".lora_a", ".lora_b"))} == {torch.float32}
    logits = model(torch.randint(0, 256, (1, 5)))
    assert logits.shape[:2] == (1, 5) and torch.isfinite(logits).all()  # float32 adapters met bf16 activations


def test_a_second_add_lora_is_refused():
    model = add_lora(build_model("debug", "policy", device="meta"), LoRASpec(4, 8.0, 0.0, ("q_proj",)))
    with pytest.raises(ValueError, match="found adapters already"):
        add_lora(model, LoRASpec(4, 8.0, 0.0, ("q_proj",)))


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen"])
def test_peft_loads_the_exported_adapter_and_gives_the_merged_models_logits(tmp_path, flavor):
    peft = pytest.importorskip("peft", reason="peft is a dev dependency (pip install -e '.[dev]')")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build_model(flavor, "policy")
    save_hf_checkpoint(model, tmp_path / "base", flavor)
    spec = LoRASpec(rank=4, alpha=8.0, dropout=0.0, targets=ALL)
    add_lora(model, spec)
    _randomize(model, 2)
    save_peft_adapter(model.state_dict(), tmp_path / "adapter", flavor, spec, str(tmp_path / "base"))
    save_hf_checkpoint(merge_adapters(model.state_dict(), spec.scale), tmp_path / "merged", flavor)
    tokens = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        ours = model(tokens)
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
        assert not torch.allclose(base(tokens).logits, ours, atol=1e-3)
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
        merged_logits = merged(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(merged_logits, ours, atol=5e-5, rtol=1e-4)


# ------------------------------------------------------------------------------- the trainer's pieces, 1 rank
# The quick loop's LoRA checks of what the trainer wires up (the 2-rank runs below are slow): its layouts, its
# weight sync into the engine and its base Reference, on one process in a one-rank gloo group.


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    from fusedrl.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _one_rank_lora_layouts(*overrides: str) -> tuple[JobConfig, TrainingLayout, RolloutLayout]:
    """The debug config with a LoRA Actor (rank 4, alpha 8) on one rank: its config and its training and rollout
    layouts, built and filled as the trainer does (the adapters' B zero)."""
    from fusedrl.config import load_config
    from fusedrl.layouts import build_rollout_layout, build_training_layout, load_initial_weights

    one_rank = ("--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.tp=1", "--parallelism.gen_tp=1")
    lora = ('--lora.models=["actor"]', "--lora.rank=4", "--lora.alpha=8")
    cfg = load_config(
        ["--job.config_file", str(ROOT / "train_configs/debug_ppo.toml"), *TINY_DEBUG_RUN, *one_rank, *lora, *overrides]
    )
    device = torch.device("cpu")
    layout, rollout = build_training_layout(cfg, device), build_rollout_layout(cfg, device)
    load_initial_weights(cfg, layout, rollout)
    return cfg, layout, rollout


def _train_adapters(stage: torch.nn.Module, seed: int) -> None:
    """Stands in for an update: every adapter of the (FSDP2-sharded, one-rank) stage random, B non-zero."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if name.endswith((".lora_a", ".lora_b")):
                local = p.to_local() if isinstance(p, DTensor) else p  # one rank: the whole tensor
                local.copy_(torch.randn(local.shape, generator=gen) * 0.2)


def _policy(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain debug policy holding ``state`` (full-model names, no adapters)."""
    model = build_model("debug", "policy")
    model.load_state_dict(state)
    return model.eval()


def _logprobs_of(model: torch.nn.Module, sequences: list[list[int]], start: int, temperature: float) -> list[torch.Tensor]:
    """``model``'s log-probs of each sequence's tokens from position ``start`` on."""
    with torch.no_grad():
        return [token_logprobs(model(torch.tensor([s])), torch.tensor([s]), temperature)[0, start:] for s in sequences]


@pytest.mark.parametrize("rollout_weights", ["merged", "adapters"])
def test_a_lora_weight_sync_gives_the_engine_the_trained_actors_logprobs(single_rank_group, rollout_weights):
    from fusedrl.distributed import gather_full_state_dict
    from fusedrl.generation import GenerationEngine, Request, SamplingParams, WeightSync

    cfg, layout, rollout = _one_rank_lora_layouts(f"--lora.rollout_weights={rollout_weights}")
    assert bool(adapter_modules(rollout.actor)) == (rollout_weights == "adapters")  # a merged copy is a plain model
    engine = GenerationEngine.from_config(rollout.actor, cfg.generation, max_len=cfg.sequence_budget, seed=0)
    sync = WeightSync(layout.actor_stage, engine)  # as the trainer builds it
    temperature = cfg.generation.temperature
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 256, (5,), generator=gen).tolist() for _ in range(3)]
    start = len(prompts[0])  # the first sampled token's position

    def sample() -> tuple[list[list[int]], list[torch.Tensor]]:
        params = SamplingParams(temperature=temperature, max_new_tokens=8)
        results = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)], progress=False)
        return [p + r.tokens for p, r in zip(prompts, results)], [torch.tensor(r.logprobs) for r in results]

    def assert_close(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")

    sync.sync()  # the first iteration's: B = 0, the base
    base = _policy(_merged_by_hand(gather_full_state_dict(layout.actor_stage)))
    sequences, engine_logprobs = sample()
    assert_close(engine_logprobs, _logprobs_of(base, sequences, start, temperature), "first sync (the base)")

    _train_adapters(layout.actor_stage, seed=1)
    sync.sync()  # a later iteration's: only the adapters changed
    trained = gather_full_state_dict(layout.actor_stage)
    lora = add_lora(build_model("debug", "policy"), LoRASpec(4, 8.0, 0.0, ALL))  # the trained Actor, unmerged
    lora.load_state_dict(trained)
    sequences, engine_logprobs = sample()
    assert_close(engine_logprobs, _logprobs_of(lora.eval(), sequences, start, temperature), "after the sync")
    assert_close(engine_logprobs, _logprobs_of(_policy(_merged_by_hand(trained)), sequences, start, temperature), "by hand")
    stale = _logprobs_of(base, sequences, start, temperature)
    assert max(float((e - s).abs().max()) for e, s in zip(engine_logprobs, stale)) > 1e-2, "the engine kept the base"


def test_the_base_reference_scores_with_the_adapters_off_and_turns_them_back_on(single_rank_group):
    from fusedrl.components.tokenizer import load_tokenizer
    from fusedrl.distributed import gather_full_state_dict
    from fusedrl.models import reference_from_base
    from fusedrl.rlhf import Experience, base_reference_logprobs, pad_to_bucket, recompute_logprobs

    cfg, layout, rollout = _one_rank_lora_layouts()  # lora.reference = "base", the default
    assert reference_from_base(cfg) and rollout.reference is None  # no Reference copy: the Actor's stages score
    _train_adapters(layout.actor_stage, seed=2)
    trained = gather_full_state_dict(layout.actor_stage)
    base = _policy({n: t for n, t in trained.items() if not n.endswith((".lora_a", ".lora_b"))})
    adapted = _policy(_merged_by_hand(trained))
    tokens = torch.randint(1, 256, (cfg.ppo.batch_size, 13), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(tokens.shape)
    mask[:, 6:] = 1.0
    temperature = cfg.generation.temperature
    with torch.no_grad():
        expected_base = token_logprobs(base(tokens), tokens, temperature) * mask
        expected_adapted = token_logprobs(adapted(tokens), tokens, temperature) * mask
    assert (expected_adapted - expected_base).abs().max() > 1e-2  # the adapters matter

    exp = Experience(tokens=tokens, response_mask=mask)
    device, pad_id, length = torch.device("cpu"), load_tokenizer(cfg.model.tokenizer_path).pad_id, tokens.shape[1]
    padded = pad_to_bucket(exp, cfg.sequence_budget, pad_id)
    for with_old in (False, True):  # True: the same pass runs the micro-batches again with the adapters on
        reference, old = base_reference_logprobs(cfg, layout, exp, device, cfg.sequence_budget, pad_id, with_old=with_old)
        torch.testing.assert_close(reference, expected_base, atol=1e-5, rtol=1e-5, msg=lambda m: f"{with_old=}: {m}")
        if with_old:
            assert old is not None
            torch.testing.assert_close(old[:, :length], expected_adapted, atol=1e-5, rtol=1e-5)
        else:
            assert old is None
        # the update that follows trains the adapted Actor: the adapters are on again
        after = recompute_logprobs(cfg, layout, padded, device)
        torch.testing.assert_close(after[:, :length], expected_adapted, atol=1e-5, rtol=1e-5, msg=lambda m: f"{with_old=}: {m}")


# ------------------------------------------------------------------------------------------- trainer, 2 ranks

TINY = [
    "--job.config_file=train_configs/debug_ppo.toml",
    *TINY_DEBUG_RUN,
    "--fusion.schedule_search_budget_s=0.2",
    "--training.steps=2",
    "--checkpoint.keep=0",
    "--checkpoint.interval=1",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--eval.interval=0",
    "--lr_scheduler.warmup_steps=0",
    "--optimizer.actor_lr=3e-3",
    "--optimizer.critic_lr=3e-3",
    '--lora.models=["actor", "critic"]',
    "--lora.rank=4",
    "--lora.alpha=8",
]
COMPARED = ("policy_loss", "value_loss", "kl", "reward_mean", "entropy", "grad_norm_actor", "grad_norm_critic", "return_mean")
LAYOUTS = {
    "pp": ("--parallelism.pp=2", "--parallelism.dp_shard=1"),
    "unfused": ("--parallelism.pp=2", "--parallelism.dp_shard=1", "--fusion.inter_stage=false", "--fusion.intra_stage=false"),
    "fsdp": ("--parallelism.pp=1", "--parallelism.dp_shard=2"),
    "tp": ("--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.tp=2", "--parallelism.gen_tp=2"),
}


def _lora_runs(out: str) -> dict:
    """Every layout's history, and from the pipeline run: the engine's and rollout Critic's weights against the merged
    training weights, the base weights before and after, and a resume from its step-1 checkpoint."""
    import torch.distributed as dist

    from fusedrl.config import load_config
    from fusedrl.distributed import gather_full_state_dict
    from fusedrl.train import run
    from fusedrl.trainer import Trainer
    from fusedrl.trainer.trainer import use_device

    def cfg(name: str, *extra: str):
        return load_config([*TINY, f"--job.output_dir={out}/{name}", *extra])

    results: dict = {"placements": _tp_placements()}
    c = cfg("pp", *LAYOUTS["pp"])
    use_device(c)
    trainer = Trainer(c)
    stages = [trainer.layout.actor_stage, trainer.layout.critic_stage]
    before = [gather_full_state_dict(s, trainer.layout.pp_group) for s in stages]
    results["pp"] = trainer.train()
    for sync in trainer.syncs:  # the last update's weights (an iteration syncs before it samples)
        sync.sync()
    after = [gather_full_state_dict(s, trainer.layout.pp_group) for s in stages]
    rollout = [trainer.engine.source_model, trainer.rollout.critic]
    results["copies"] = [{n: p.detach().float().clone() for n, p in m.named_parameters()} for m in rollout]
    results["reference"] = _reference_logprobs(trainer)
    results["before"], results["after"] = before, after
    for name in ("unfused", "fsdp", "tp"):
        results[name] = run(cfg(name, *LAYOUTS[name]))
    results["unmerged"] = _unmerged_run(cfg("unmerged", *LAYOUTS["pp"], "--lora.rollout_weights=adapters"))
    if dist.get_rank() == 0:  # the interrupted run: only the step-1 checkpoint exists in its folder
        step1 = next(p for p in Path(out, "pp", "checkpoints").iterdir() if p.name.startswith("step-") and int(p.name[5:]) == 1)
        shutil.copytree(step1, Path(out, "resumed", "checkpoints", step1.name))
    dist.barrier()
    results["resumed"] = run(cfg("resumed", *LAYOUTS["pp"], "--checkpoint.resume=true"))
    results["reference_copy"] = run(cfg("reference_copy", *LAYOUTS["pp"], "--lora.reference=copy"))
    recompute = ("--ppo.recompute_logprobs=true", "--ppo.minibatch_size=4")  # two updates: not on-policy
    results["recompute"] = run(cfg("recompute", *LAYOUTS["pp"], *recompute))
    results["recompute_copy"] = run(cfg("recompute_copy", *LAYOUTS["pp"], *recompute, "--lora.reference=copy"))
    return results


def _unmerged_run(cfg) -> dict:
    """A run whose rollout copies carry the adapters unmerged: its history, what a sync after training sends, and the
    rollout copies against the training weights."""
    from fusedrl.distributed import gather_full_state_dict
    from fusedrl.trainer import Trainer

    trainer = Trainer(cfg)
    history = trainer.train()
    stats = [sync.sync() for sync in trainer.syncs]  # a later sync: only what trains moves
    stages = [trainer.layout.actor_stage, trainer.layout.critic_stage]
    rollout = [trainer.engine.source_model, trainer.rollout.critic]
    return {
        "history": history,
        "later_bytes": [s.bytes for s in stats],
        "first_bytes": [sync.plan.bytes_received(trainer.rank) for sync in trainer.syncs],
        "after": [gather_full_state_dict(s, trainer.layout.pp_group) for s in stages],
        "copies": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in rollout],
    }


def _reference_logprobs(trainer) -> dict[str, torch.Tensor]:
    """Log-probs of random samples by the trained LoRA Actor's stages: with the adapters off (the Reference of
    ``lora.reference = "base"``) and on."""
    from fusedrl.rlhf import Experience, base_reference_logprobs, pad_to_bucket, recompute_logprobs

    cfg = trainer.cfg
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (cfg.ppo.batch_size, 13), generator=generator)
    mask = torch.zeros(tokens.shape)
    mask[:, 6:] = 1.0
    exp = Experience(tokens=tokens, response_mask=mask)
    args = (cfg, trainer.layout, exp, trainer.device, trainer.max_len, trainer.tokenizer.pad_id)
    base, none = base_reference_logprobs(*args, with_old=False)
    base_too, old = base_reference_logprobs(*args, with_old=True)  # one pass, adapters off then on
    padded = pad_to_bucket(exp, trainer.max_len, trainer.tokenizer.pad_id)
    adapted = recompute_logprobs(cfg, trainer.layout, padded, trainer.device)
    one_pass = {"base": base_too, "old": old, "none": none}
    adapted = adapted[:, : exp.seq_len]
    return {
        "tokens": tokens,
        "mask": mask,
        "base": base,
        "adapted": adapted,
        "one_pass": one_pass,
        "temperature": cfg.generation.temperature,
    }


def _tp_placements() -> dict[str, tuple[str, str, str]]:
    """(weight, A, B) placements of layer 0's adapted projections after apply_tp over both ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from fusedrl.distributed import apply_tp

    model = add_lora(build_model("debug", "policy", device="meta"), LoRASpec(4, 8.0, 0.0, ALL))
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    return {
        name: tuple(str(t.placements[0]) for t in (m.weight, m.lora_a, m.lora_b))
        for name, m in adapter_modules(model.layers[0]).items()
    }


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, rank_pools) -> dict:
    return rank_pools(2).run(_lora_runs, str(tmp_path_factory.mktemp("lora")), timeout_s=600.0)[0]


def _assert_close(a: dict, b: dict, rel: float, what: str) -> None:
    for k in COMPARED:
        if not (math.isnan(a[k]) and math.isnan(b[k])):
            assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-6), f"{what}: {k} differs: {a[k]} vs {b[k]}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["unfused", "fsdp", "tp"])
def test_every_layout_and_schedule_trains_the_same_adapters(lora_runs, layout):
    for step, (a, b) in enumerate(zip(lora_runs["pp"], lora_runs[layout]), start=1):
        _assert_close(a, b, 1e-4, f"step {step} pp (fused schedule) vs {layout}")
    assert len(lora_runs[layout]) == 2 and lora_runs["pp"][0]["grad_norm_actor"] > 0


@pytest.mark.slow
def test_the_rollout_copies_hold_the_merged_adapters_and_the_base_stays_frozen(lora_runs):
    scale = 8.0 / 4  # lora.alpha over lora.rank
    for model, before, after, copy in zip(("actor", "critic"), lora_runs["before"], lora_runs["after"], lora_runs["copies"]):
        adapters = [n for n in after if n.endswith(".lora_b")]
        assert adapters and all(after[n].abs().max() > 0 for n in adapters), model  # B left zero: nothing trained
        head = {"output.weight"} if model == "critic" else set()  # a value model's fresh scalar head trains too
        frozen = [n for n in before if not n.endswith((".lora_a", ".lora_b")) and n not in head]
        assert frozen and all(torch.equal(before[n], after[n]) for n in frozen), model
        merged = merge_adapters(after, scale)
        adapted = [n for n in copy if f"{n.removesuffix('.weight')}.lora_a" in after]
        assert adapted and not any(torch.allclose(copy[n], before[n].float(), atol=1e-6) for n in adapted), (
            f"the rollout {model} still holds base weights: the adapters did not reach it"
        )
        for n, t in copy.items():
            torch.testing.assert_close(
                t, merged[n], atol=1e-6, rtol=1e-5, msg=f"{model} {n}: rollout copy != merged training weights"
            )


@pytest.mark.slow
def test_rollout_copies_with_unmerged_adapters_sample_and_score_as_the_merged_ones(lora_runs):
    """lora.rollout_weights = adapters: the engine adds each projection's low-rank update itself. The run equals the
    merged one to float32 rounding; the copies hold the trained adapters and the frozen base; a sync after the first
    moves the adapters and the value head only."""
    unmerged = lora_runs["unmerged"]
    assert len(unmerged["history"]) == 2
    for step, (a, b) in enumerate(zip(lora_runs["pp"], unmerged["history"]), start=1):
        _assert_close(a, b, 1e-4, f"step {step} merged vs unmerged rollout adapters")
    for model, after, copy in zip(("actor", "critic"), unmerged["after"], unmerged["copies"]):
        assert sorted(copy) == sorted(after), model  # the copy carries the adapters under the training names
        adapters = [n for n in after if n.endswith(".lora_b")]
        assert adapters and all(after[n].abs().max() > 0 for n in adapters), model
        for n, t in copy.items():
            assert torch.equal(t, after[n].to(t.dtype)), f"{model} {n}: rollout copy != training weights"
    for first, later in zip(unmerged["first_bytes"], unmerged["later_bytes"]):
        assert 0 < later < first / 10, (first, later)  # the other stage's adapters (and value head) alone


@pytest.mark.slow
def test_the_reference_is_the_frozen_base_with_the_adapters_off(lora_runs):
    ref = lora_runs["reference"]
    base = build_model("debug", "policy")  # the base weights, as loaded before any adapter trained
    base.load_state_dict(merge_adapters(lora_runs["before"][0], 8.0 / 4))  # B = 0 before training: the base alone
    with torch.no_grad():
        expected = token_logprobs(base(ref["tokens"]), ref["tokens"], ref["temperature"]) * ref["mask"]
    torch.testing.assert_close(ref["base"], expected, atol=1e-5, rtol=1e-5)
    assert (ref["adapted"] - ref["base"]).abs().max() > 1e-3, "the trained adapters changed nothing, or stayed on"
    one_pass = ref["one_pass"]  # reference and old log-probs in one pipeline pass: each as its own pass gives it
    assert ref["one_pass"]["none"] is None and torch.equal(one_pass["base"], ref["base"])
    assert torch.equal(one_pass["old"][:, : ref["tokens"].shape[1]], ref["adapted"])


@pytest.mark.slow
def test_the_base_reference_gives_the_rollout_copys_figures(lora_runs):
    """lora.reference = base (no Reference copy) against copy (a frozen rollout copy of the same checkpoint): the same
    KL, and so the same run, to float32 rounding (the debug config computes in float32)."""
    assert len(lora_runs["reference_copy"]) == 2 and lora_runs["pp"][1]["kl"] > 0
    for step, (a, b) in enumerate(zip(lora_runs["pp"], lora_runs["reference_copy"]), start=1):
        _assert_close(a, b, 1e-4, f"step {step} reference base vs copy")
        assert a["time_reference"] > 0 and b["time_reference"] == 0


@pytest.mark.slow
def test_recomputed_old_logprobs_share_the_base_reference_pass(lora_runs):
    """With the old log-probs recomputed (two updates per iteration), the base Reference's pipeline pass gives them
    too (its micro-batches a second time, adapters on): no pass of their own, and the figures of a run with a
    Reference copy, whose old log-probs take a pass of their own."""
    for step, (a, b) in enumerate(zip(lora_runs["recompute"], lora_runs["recompute_copy"]), start=1):
        _assert_close(a, b, 1e-4, f"step {step} one pass vs a Reference copy and a recompute pass")
        assert "importance_ratio_min" in a and "importance_ratio_min" in b  # the recomputed log-probs' gap
        assert a["time_recompute"] == 0 and a["time_reference"] > 0 and b["time_recompute"] > 0
    assert len(lora_runs["recompute"]) == 2 and lora_runs["recompute"][1]["kl"] > 0


@pytest.mark.slow
def test_tensor_parallel_adapters_follow_their_projections_split(lora_runs):
    # column-wise (rows split): A whole, B's rows split; row-wise (columns split): A's columns split, B whole. Any
    # other placement computes the same (DTensor redistributes) but moves activations between the TP ranks.
    column, row = ("S(0)", "R", "S(0)"), ("S(1)", "S(1)", "R")
    expected = {n: column for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.w1", "mlp.w3")}
    assert lora_runs["placements"] == {**expected, "attn.output_proj": row, "mlp.w2": row}


@pytest.mark.slow
def test_resume_continues_the_adapters_exactly(lora_runs):
    assert len(lora_runs["resumed"]) == 1, "the resumed run must start after the checkpointed step 1"
    _assert_close(lora_runs["resumed"][0], lora_runs["pp"][1], 1e-6, "resumed step 2")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (['--lora.models=["reward"]'], "'reward' is frozen (nothing of it trains)"),
        (["--lora.rank=0"], "lora.rank = 0 (command line): must be >= 1"),
        (['--lora.targets=["qkv"]'], "'qkv' is not a projection LoRA adapts; valid: q_proj"),
        (
            ["debug_grpo", '--lora.models=["critic"]'],
            "builds no Critic; remove critic from lora.models",
        ),
        (['--lora.models=["critic"]', "--lora.export=adapter"], "add actor to lora.models or set --lora.export=merged"),
        (['--lora.models=["actor"]', "--lora.targets=[]"], "lora.targets (command line) is empty"),
        (['--lora.models=["actor"]', "--training.float8=true"], "float8 training replaces the adapted projections"),
        (
            ['--lora.models=["actor"]', "--lora.rollout_weights=adapters", "--generation.quantize=int8_weight_only"],
            "the quantized engine decodes plain projections; set --lora.rollout_weights=merged",
        ),
    ],
    ids=["reward", "rank", "target", "critic-free", "export-without-actor", "no-targets", "float8", "quantized-adapters"],
)
def test_bad_lora_configs_are_one_line_errors(overrides, message, monkeypatch):
    from fusedrl.config import ConfigError
    from fusedrl.train import prepare

    monkeypatch.chdir(ROOT)
    config, *rest = overrides if not overrides[0].startswith("--") else ["debug_ppo", *overrides]
    with pytest.raises(ConfigError) as err:
        prepare(["--job.config_file", f"train_configs/{config}.toml", *rest], world_size=4)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_base_reference_with_another_reference_checkpoint_is_a_one_line_error(tmp_path, monkeypatch):
    from fusedrl.config import ConfigError
    from fusedrl.models import resolve_flavor
    from fusedrl.train import prepare

    monkeypatch.chdir(ROOT)
    save_hf_checkpoint(build_model("debug", "policy").state_dict(), tmp_path / "ref", resolve_flavor("debug"))
    args = [
        "--job.config_file",
        "train_configs/debug_ppo.toml",
        '--lora.models=["actor"]',
        f"--model.reference_path={tmp_path / 'ref'}",
    ]
    with pytest.raises(ConfigError, match=r"set --lora.reference=copy or drop model.reference_path$"):
        prepare(args, world_size=4)
    prepare([*args, "--lora.reference=copy"], world_size=4)  # the Reference as a rollout copy of that checkpoint
