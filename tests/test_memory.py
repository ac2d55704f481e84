"""``fusedrl.memory`` and its command line ``python -m fusedrl.bench.memory``: per-rank estimates from the layouts
built on meta, checked by hand, against autograd's saved tensors, against gen_tp = 1, and against the real trainer on
4 CPU ranks (``--measure``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusedrl import memory
from fusedrl.bench.memory import main
from fusedrl.config import load_config
from fusedrl.models import FLAVORS, build_model
from fusedrl.models.figures import layer_activation_bytes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "train_configs" / "debug_ppo.toml")
FAST = ["--fusion.schedule_search_budget_s=0"]  # the greedy fused schedule, no search


def _estimate(*overrides: str) -> memory.Estimate:
    cfg = load_config(["--job.config_file", CONFIG, *FAST, *overrides])
    return memory.estimate(cfg, config_name="debug", progress=None)


@pytest.fixture(scope="module")
def debug() -> memory.Estimate:
    return _estimate()


def _layer_numel(f) -> int:
    hd = f.embed_dim // f.num_heads
    attn = 2 * f.embed_dim * f.num_heads * hd + 2 * f.embed_dim * f.num_kv_heads * hd
    return attn + 3 * f.embed_dim * f.intermediate_dim + 2 * f.embed_dim  # + the two norms


def _chunk(n: int, parts: int, index: int) -> int:
    """torch.chunk semantics (FSDP2's dim-0 shards): ceil-sized chunks, the last ones short or empty."""
    size = -(-n // parts)
    return max(0, min(n, (index + 1) * size) - index * size)


def test_debug_persistent_categories_match_hand_computed_values(debug):
    """Rank 0 of debug_ppo.toml (pp=2 x dp_shard=2, gen_tp=1, float32): Actor stage 0 (embedding + layer 0) and
    Critic stage 1 (layer 1 + final norm + value head), each FSDP2-sharded over 2 dp ranks along dim 0."""
    f = FLAVORS["debug"]
    d, v = f.embed_dim, f.vocab_size
    r0 = next(r for r in debug.ranks if r.rank == 0)
    r1 = next(r for r in debug.ranks if r.rank == 1)
    assert [r.rank for r in debug.ranks] == [0, 1, 2, 3]
    # even shards: the stage's parameter count / dp_shard x 4 bytes
    actor_stage0 = v * d + _layer_numel(f)
    assert r0.persistent["train_params_actor"] == actor_stage0 // 2 * 4
    # the value head [1, D] cannot be split over 2 ranks: dp rank 0 holds it whole, dp rank 1 nothing
    critic_rows = _layer_numel(f) + d  # layer 1 + final norm, all evenly divisible
    for rank, dp in ((r0, 0), (r1, 1)):
        assert rank.persistent["train_params_critic"] == (critic_rows // 2 + _chunk(1, 2, dp) * d) * 4
        assert rank.persistent["optimizer_critic"] == 2 * rank.persistent["train_params_critic"]
        assert rank.details["gradients"]["gradients_critic"] == rank.persistent["train_params_critic"]
    # rollout copies: whole models (gen_tp = 1), float32
    policy = 2 * v * d + f.num_layers * _layer_numel(f) + d
    value = v * d + f.num_layers * _layer_numel(f) + d + d
    assert r0.persistent["rollout_actor"] == r0.persistent["rollout_reference"] == policy * 4
    assert r0.persistent["rollout_critic"] == r0.persistent["rollout_reward"] == value * 4
    # KV cache: layers x (K, V) x max_slots x (64 + 96 + 1) positions x KV heads x head dim x 4 bytes
    assert r0.persistent["kv_cache"] == f.num_layers * 2 * 16 * 161 * f.num_kv_heads * (d // f.num_heads) * 4
    # pipeline buffers: M = 32 / 2 / 4 = 4 micro-batches of [4, T, D] float32 for the two longest sequence buckets
    # (T = 140 and 160: buckets of 20; the executor keeps two stage pairs); rank 0 has the Actor's first stage
    # (gradient receive buffers) and the Critic's last stage (activation receive buffers)
    assert r0.details["microbatches"] == 4
    assert r0.persistent["pipeline_buffers"] == 2 * 4 * 4 * (140 + 160) * d * 4
    # the training phase holds the sharded gradients or the unsharded stages, never less than the persistent state
    for r in debug.ranks:
        assert r.phase_peak("training") > r.persistent_total
        assert r.peak[0] == max(r.phase_peak(p) for p in memory.PHASES)


def test_gen_tp_2_halves_the_tensor_parallel_rollout_weights(debug):
    """gen_tp = 2 shards every attention and MLP weight of the four rollout copies, their embeddings and LM heads
    (by vocabulary rows) and the KV cache over 2 ranks; norms and value heads stay whole on every rank."""
    f = FLAVORS["debug"]
    d, v = f.embed_dim, f.vocab_size
    tp2 = _estimate("--parallelism.gen_tp=2")
    one, two = debug.ranks[0].persistent, tp2.ranks[0].persistent
    layers = f.num_layers * (_layer_numel(f) - 2 * d) * 4  # the sharded part of the layers (norms are whole)
    norms = (2 * f.num_layers + 1) * d
    vocab_rows = {"actor": 2 * v * d, "reference": 2 * v * d, "critic": v * d, "reward": v * d}
    for name, rows in vocab_rows.items():
        whole = norms + (d if name in ("critic", "reward") else 0)  # + the value head [1, D]
        assert one[f"rollout_{name}"] == layers + (rows + whole) * 4
        assert two[f"rollout_{name}"] == (layers + rows * 4) // 2 + whole * 4, name
    assert two["kv_cache"] * 2 == one["kv_cache"]
    # the training layout does not change
    for key in ("train_params_actor", "train_params_critic", "optimizer_actor", "optimizer_critic"):
        assert two[key] == one[key]


def test_memory_savers_move_bytes_out_of_the_training_phase(debug):
    """offload_frozen: Reference and Reward bytes leave the weight-sync and training phases and become host bytes;
    activation_checkpointing = full: each in-flight micro-batch keeps one hidden state per layer, and the backward
    rebuilds one layer at a time."""
    saver = _estimate("--training.offload_frozen=true", "--training.activation_checkpointing=full")
    base, r = debug.ranks[0], saver.ranks[0]
    frozen = base.persistent["rollout_reference"] + base.persistent["rollout_reward"]
    assert r.host_total == frozen > 0
    for phase in ("weight_sync", "training"):
        assert "rollout_reference" not in r.phases[phase] and "rollout_reward" not in r.phases[phase]
    for phase in ("generation", "scoring"):
        assert r.phase_peak(phase) == base.phase_peak(phase)
    assert r.persistent_total == base.persistent_total - frozen
    f = FLAVORS["debug"]
    tokens = 4 * 160  # microbatch_size rows x the longest bucket
    layers = base.details["stage_layers"]["actor"]
    saved = base.details["activation_bytes_per_microbatch"]["actor"] - r.details["activation_bytes_per_microbatch"]["actor"]
    assert saved == layers * (layer_activation_bytes(f, tokens, 4, 1) - 4 * tokens * f.embed_dim) > 0
    assert r.transients["recompute"] == layer_activation_bytes(f, tokens, 4, 1)


GRPO_CONFIG = str(ROOT / "train_configs" / "debug_grpo.toml")


def _grpo_estimate(*overrides: str) -> memory.Estimate:
    cfg = load_config(["--job.config_file", GRPO_CONFIG, *FAST, *overrides])
    return memory.estimate(cfg, config_name="debug_grpo", progress=None)


def test_critic_free_estimate_counts_no_critic_and_no_unused_reference():
    """debug_grpo.toml (critic-free, KL as a loss term) against the same job as PPO (``advantage_estimator=gae``: a
    Critic of the Actor's flavor): every Actor, Reference and engine figure stays, the Critic's training shards,
    AdamW states, gradients, rollout copy, RoPE tables and receive buffers go, and so do the rollout phases' peaks.
    Without a
    KL term there is no Reference either, and with the rule scoring alone no scoring model runs at all."""
    f = FLAVORS["debug"]
    grpo, ppo = _grpo_estimate(), _grpo_estimate("--ppo.advantage_estimator=gae")
    rope = 4 * (f.max_seq_len * f.head_dim + f.head_dim // 2)  # one model copy's RoPE table
    buffers = 4 * 4 * (140 + 160) * f.embed_dim * 4  # M = 32 / 2 / 4 micro-batches, one receive kind, two buckets
    for g, p in zip(grpo.ranks, ppo.ranks):
        assert p.persistent["train_params_critic"] > 0 and p.persistent["rollout_critic"] > 0
        critic = sum(p.persistent[k] for k in ("train_params_critic", "optimizer_critic", "rollout_critic"))
        assert p.persistent_total - g.persistent_total == critic + 2 * rope + buffers
        for key in ("train_params_actor", "optimizer_actor", "rollout_actor", "rollout_reference", "kv_cache"):
            assert g.persistent[key] == p.persistent[key] > 0, key
        assert g.persistent["rollout_critic"] == 0
        assert not [k for k in (*g.persistent, *g.details["gradients"]) if "critic" in k and k != "rollout_critic"]
        assert set(g.details["activation_bytes_per_microbatch"]) == set(g.details["in_flight_max"]) == {"actor"}
        assert g.transients["scoring_logits"] == p.transients["scoring_logits"] > 0  # the Reference's head
        for phase in memory.PHASES:
            assert not [k for k, v in g.phases[phase].items() if "critic" in k and v], phase
        # not the training phase: the Actor's split-backward program alone may hold more micro-batches in flight
        for phase in ("weight_sync", "generation", "scoring"):
            assert g.phase_peak(phase) < p.phase_peak(phase), phase
    table = memory.format_table(grpo, 80.0)
    assert "critic" not in table.split("\n\n")[0] and "the Critic (ppo.advantage_estimator = 'grpo'" in table
    assert all(set(r["in_flight_max"]) == {"actor"} for r in memory.to_json(grpo, 80.0)["ranks"].values())
    alone = _grpo_estimate("--ppo.kl_loss_coef=0")  # no KL term: no Reference; the task's rule scores
    for a, g in zip(alone.ranks, grpo.ranks):
        assert a.persistent["rollout_reference"] == 0 and g.persistent["rollout_reference"] > 0
        assert a.persistent_total == g.persistent_total - g.persistent["rollout_reference"] - rope
        assert a.transients["scoring_activations"] == a.transients["scoring_logits"] == 0
        assert a.phase_peak("scoring") == a.persistent_total


def test_one_layer_activation_formula_matches_autograds_saved_tensors():
    """layer_activation_bytes against the bytes autograd saves for one torchtune layer (parameters and buffers left
    out), in float32 and bfloat16: what the training estimate multiplies by layers and micro-batches in flight."""
    f = FLAVORS["debug_large"]
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model("debug_large", "policy").to(dtype)
        layer = model.layers[0]
        skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        x = torch.randn(2, 48, f.embed_dim, dtype=dtype, requires_grad=True)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, skip: set[int] = skip, saved: dict[int, int] = saved) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                saved[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        assert sum(saved.values()) == layer_activation_bytes(f, 2 * 48, dtype.itemsize, 1), dtype


def test_the_planner_and_the_estimate_share_one_activation_model(debug):
    """The schedule search's memory per micro-batch (``pipeline_costs``: its memory limit and memory pass) is the
    estimate's in-flight figure of the same stage: one function, :func:`fusedrl.models.figures.stage_activation_bytes`."""
    from fusedrl.rlhf import pipeline_costs

    cfg = load_config(["--job.config_file", CONFIG, *FAST])
    r0 = next(r for r in debug.ranks if r.rank == 0)  # the Actor's first stage and the Critic's last
    _, costs, _ = pipeline_costs(cfg, r0.details["seq_len"])
    per_mb = r0.details["activation_bytes_per_microbatch"]
    assert costs.actor.mem[0] * 2**30 == pytest.approx(per_mb["actor"], rel=1e-12)
    assert costs.critic.mem[-1] * 2**30 == pytest.approx(per_mb["critic"], rel=1e-12)
    saver = load_config(["--job.config_file", CONFIG, *FAST, "--training.activation_checkpointing=full"])
    assert pipeline_costs(saver, r0.details["seq_len"])[1].actor.mem[0] < costs.actor.mem[0]


def test_cli_json_and_training_walk(capsys):
    """The table, the verdict line and the last-line JSON; in-flight counts follow the lowered program."""
    assert main(["--config", CONFIG, "--json", "--device-gib", "1", *FAST]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["world"] == 4 and result["device_gib"] == 1.0 and result["fits"] is True
    assert set(result["phases"]) == set(memory.PHASES)
    assert result["per_rank_peak_gib"] >= result["per_rank_persistent_gib"] > 0
    assert set(result["ranks"]) == {"0", "1", "2", "3"}
    assert any(line.startswith("per-rank persistent") and "fits in 1 GiB" in line for line in out)
    # 4 micro-batches per model on pp=2: at most 4 in flight, and at least one on each stage
    for rank in result["ranks"].values():
        assert 1 <= rank["in_flight_max"]["actor"] <= 4 and 1 <= rank["in_flight_max"]["critic"] <= 4


DEBUG_MODELS = ["--model.actor=debug", "--model.critic=debug", "--model.reward=debug"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        DEBUG_MODELS,
        [*DEBUG_MODELS, "--parallelism.pp_critic=1"],
        ["--critic-free"],
        [*DEBUG_MODELS, '--lora.models=["actor", "critic"]', "--lora.rank=8"],
    ],
    ids=["critic-pp2", "critic-replicas", "critic-free", "lora"],
)
def test_measured_trainer_memory_matches_the_estimate(capsys, args, four_ranks):
    """--measure: the debug flavors through the real trainer on 4 CPU ranks; every compared category (persistent
    state, gradients, unsharded stages, in-flight activations, weight-sync units, the transient tensors of a training
    step, a prefill, a decode step and a scoring micro-batch) within 10% on every rank. Also with the Critic as 2
    replicas of one stage (each rank then holds the whole Critic, hybrid-sharded over (replica, dp_shard)), and
    critic-free (``--critic-free``: GRPO, the Actor alone on split-backward schedules, no Critic anywhere; in the
    command's ``debug_large`` flavor: with the ``debug`` one the Actor's last stage measures 0.875x on the training
    step, as PPO does with ``--fusion.split_backward=true``, see docs/memory.md), and with LoRA on both trained models
    (frozen bases: gradients and optimizer state of the adapters and the value head only; no Reference copy: the
    Actor's base is the Reference). Every figure is counted from
    tensors, so the verdict does not depend on how the OS schedules gloo's threads."""
    code = main(["--measure", "--json", *args], pool=four_ranks)
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    off = [c for c in result["comparison"] if c["gated"] and abs(c["ratio"] - 1) > memory.TOLERANCE]
    assert code == 0 and result["comparison_ok"] and not off, off
    categories = {c["category"].split(" (")[0].split(",")[0] for c in result["comparison"] if c["gated"]}
    for name in (
        "train_params_actor",
        "optimizer_actor",
        "rollout_reference",
        "kv_cache",
        "pipeline_buffers",
        "gradients_actor",
        "unsharded_grads",
        "activations",
        "training step",
        "prefill",
        "decode step",
        "scoring micro-batch",
    ):
        if name == "rollout_reference" and "--lora.models" in " ".join(args):  # the base with the adapters off
            assert not any(c.startswith(name) for c in categories), categories
            continue
        assert any(c.startswith(name) for c in categories), (name, categories)
    critic = {c for c in categories if "critic" in c}
    assert critic == set() if "--critic-free" in args else {"optimizer_critic", "gradients_critic"} <= critic, critic


def test_multi_turn_requests_waiting_for_their_environment_hold_kv_in_the_generation_phase(debug):
    """With an environment every request of an instance may wait between turns at once, its KV read off the slots:
    the generation phase counts them (64 requests over 4 instances, 16 each, at the engine's full length), and the
    scoring phase of a fused rollout, which scores while they wait."""
    f = FLAVORS["debug"]
    env = _estimate("--env.env=fusedrl.tasks.word_problems_tools:word_problems_calc", "--env.max_tokens=96")
    r = env.ranks[0]
    per_request = r.persistent["kv_cache"] // 16  # max_slots = 16 in the debug config
    assert (
        r.transients["parked_kv"]
        == 16 * per_request
        == 16 * f.num_layers * 2 * 161 * f.num_kv_heads * (f.embed_dim // f.num_heads) * 4
    )
    assert r.phase_peak("generation") - debug.ranks[0].phase_peak("generation") == r.transients["parked_kv"]
    assert debug.ranks[0].transients["parked_kv"] == 0
    # a fused rollout scores while they wait; an unfused one scores after every episode ended
    assert r.phase_peak("scoring") - debug.ranks[0].phase_peak("scoring") == r.transients["parked_kv"]
    unfused = _estimate(
        "--env.env=fusedrl.tasks.word_problems_tools:word_problems_calc", "--env.max_tokens=96", "--fusion.inter_stage=false"
    )
    assert unfused.ranks[0].phase_peak("scoring") == debug.ranks[0].phase_peak("scoring")
