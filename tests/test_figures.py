"""The derived figures of a flavor (fusedrl.models.figures) against hand computations, and their users."""

from pathlib import Path

import pytest

from fusedrl.config import load_config, microbatch_count
from fusedrl.distributed.pipeline import stage_layer_ranges
from fusedrl.models import FLAVORS
from fusedrl.models.figures import (
    kv_bytes_per_token,
    layer_matmul_params,
    stage_activation_bytes,
    stage_forward_flops,
    stage_layer_counts,
)
from fusedrl.pipelining import ACTOR, CRITIC, CostModel, Placement
from fusedrl.rlhf import pipeline_costs

DEBUG = FLAVORS["debug"]  # vocab 512, 2 layers, 4 heads of 16, 2 KV heads, dim 64, intermediate 192


def test_debug_flavor_figures_by_hand():
    # q and o: 64 x 64 each; k and v: 64 x 32 each; gate, up, down: 64 x 192 each
    assert layer_matmul_params(DEBUG) == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 == 49_152
    # one sequence of 10 tokens: per layer 2 x 10 x 49152 matmul FLOPs + causal attention 2 x 10^2 x 64
    layer_mm, layer = 983_040, 983_040 + 12_800
    lm_head, value_head = 2 * 10 * 64 * 512, 2 * 10 * 64 * 1
    assert stage_forward_flops(DEBUG, "policy", 1, 10, 100) == [(2 * layer + lm_head, 2 * layer_mm + lm_head)]
    assert stage_forward_flops(DEBUG, "value", 2, 10, 100) == [(layer, layer_mm), (layer + value_head, layer_mm + value_head)]
    assert kv_bytes_per_token(DEBUG, 2) == 2 * 2 * 2 * 16 * 2  # layers x (k, v) x KV heads x head_dim x bytes


def test_llama3_8b_layer_is_218m_matmul_weights():
    assert layer_matmul_params(FLAVORS["llama3_1_8b"]) == 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14_336 == 218_103_808


def test_layer_split_is_one_rule_for_planner_and_stages():
    assert stage_layer_counts(10, 4) == [3, 3, 2, 2]
    assert stage_layer_counts(8, 8) == [1] * 8
    for layers, stages in ((10, 4), (7, 3), (32, 8)):
        assert [len(r) for r in stage_layer_ranges(layers, stages)] == stage_layer_counts(layers, stages)
    with pytest.raises(ValueError, match="use fewer stages"):
        stage_layer_counts(2, 3)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        stage_layer_counts(2, 0)


def test_cost_model_times_are_the_figures_over_the_rate():
    large = FLAVORS["debug_large"]
    costs = CostModel.from_flavors(Placement(4, 2), large, large, tokens_per_microbatch=512, seq_len=128, flops_per_second=1e12)
    for stages, role, n in ((costs.actor, "policy", 4), (costs.critic, "value", 2)):
        flops = stage_forward_flops(large, role, n, 512, 512 * 128)
        assert stages.f == tuple(total / 1e12 for total, _ in flops)
        assert stages.w == tuple(matmul / 1e12 for _, matmul in flops)
        # the activation model the memory estimate uses too (tests/test_memory.py checks it against autograd)
        held = [
            stage_activation_bytes(large, k, first=s == 0, last=s == n - 1, role=role, tokens=512, itemsize=2)
            for s, k in enumerate(stage_layer_counts(8, n))
        ]
        assert stages.mem == tuple(b / 2**30 for b in held)


def test_microbatch_count_is_one_rule_for_config_and_planner():
    assert microbatch_count(64, 2, 4) == 8  # 64 samples over 2 data-parallel shards, 4 per micro-batch
    config = str(Path(__file__).resolve().parents[1] / "train_configs" / "debug_ppo.toml")
    cfg = load_config(["--job.config_file", config, "--parallelism.pp=2", "--parallelism.pp_critic=1"])
    expected = cfg.ppo.minibatch_size // cfg.parallelism.dp_shard // cfg.ppo.microbatch_size
    assert cfg.microbatches == expected
    assert pipeline_costs(cfg, cfg.sequence_budget)[2] == {ACTOR: expected, CRITIC: expected // 2}  # two Critic replicas
