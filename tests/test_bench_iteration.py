"""The paper-scale iteration model (fusedrl.bench.iteration): its arithmetic on small workloads, no timings."""

import json
import math

import pytest

from fusedrl.bench import iteration as it
from fusedrl.hardware import H100_SXM, MFU
from fusedrl.models import ModelFlavor
from fusedrl.rollout_fusion.workload import lmsys_lengths

SMALL = it.Workload(batch=64, minibatch=16, microbatch=2, max_len=256)


def test_llama_sizes_and_paper_layouts():
    for model, nominal in ((it.LLAMA_13B, 13e9), (it.LLAMA_33B, 32.5e9), (it.LLAMA_65B, 65.2e9)):
        assert abs(model.num_params("policy") / nominal - 1) < 0.01, model
    layouts = {s.name: it.training_layout(s) for s in it.SETTINGS}
    assert layouts == {
        "13B/33B": it.TrainingLayout(tp=8, pp=4, pp_critic=4, dp=1),
        "33B/33B": it.TrainingLayout(tp=8, pp=4, pp_critic=4, dp=1),
        "65B/33B": it.TrainingLayout(tp=8, pp=8, pp_critic=4, dp=1),
        "65B/65B": it.TrainingLayout(tp=8, pp=8, pp_critic=8, dp=1),
    }
    # more GPUs than the state needs go to data parallelism
    assert it.training_layout(it.Setting(it.LLAMA_13B, it.LLAMA_13B, 64)) == it.TrainingLayout(8, 2, 2, 4)


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="give the setting more GPUs"):
        it.training_layout(it.Setting(it.LLAMA_65B, it.LLAMA_65B, 8))
    with pytest.raises(ValueError, match="must divide batch"):
        it.Workload(batch=64, minibatch=24)
    with pytest.raises(ValueError, match="pick a micro-batch size"):  # 1 micro-batch per step, 2 Critic replicas
        it.iteration(
            it.Setting(it.LLAMA_13B, it.LLAMA_13B, 32),
            it.Workload(batch=64, minibatch=16, microbatch=16, max_len=256),
            layout=it.TrainingLayout(8, 4, 2, 1),
            budget_s=0,
        )


def test_training_costs_keep_the_batch_work():
    """Token-balanced micro-batches: the mean micro-batch's forward times, times the number of micro-batches, equal
    the whole batch's forward FLOPs (linear + causal attention + LM head) over the GPUs' rate."""
    setting, layout = it.Setting(it.LLAMA_33B, it.LLAMA_13B, 32), it.TrainingLayout(8, 4, 2, 1)
    lengths = lmsys_lengths(SMALL.batch, seed=0, max_len=SMALL.max_len)
    costs = it.training_costs(setting, layout, H100_SXM, SMALL, lengths)
    assert (len(costs.actor.f), len(costs.critic.f)) == (4, 2)
    assert costs.actor.b == tuple(2 * f for f in costs.actor.f)
    rate = layout.tp * H100_SXM.flops_per_s * MFU
    seqs = [SMALL.prompt_len + n for n in lengths]
    for model, stages, head in ((setting.actor, costs.actor, setting.actor.vocab_size), (setting.critic, costs.critic, 1)):
        d = model.embed_dim
        layer_params = 4 * d * d + 3 * d * model.intermediate_dim  # q, k, v, o (as many KV heads as heads); gate, up, down
        flops = sum(model.num_layers * (2 * s * layer_params + 2 * s * s * d) + 2 * s * d * head for s in seqs)
        assert math.isclose(sum(stages.f) * len(seqs) / SMALL.microbatch, flops / rate, rel_tol=1e-9)


@pytest.mark.parametrize("layout", [None, it.TrainingLayout(8, 4, 2, 1)])
def test_iteration_sums_and_bounds(layout):
    r = it.iteration(it.Setting(it.LLAMA_13B, it.LLAMA_33B, 32), SMALL, layout=layout, budget_s=0)
    stages = ("weight_sync", "rollout", "training")
    for variant in ("unfused_s", "fused_s"):
        assert math.isclose(r["total"][variant], sum(r[s][variant] for s in stages), rel_tol=1e-12)
    for s in (*stages, "total"):
        assert math.isclose(r[s]["speedup"], r[s]["unfused_s"] / r[s]["fused_s"], rel_tol=1e-12)
    tr, ro = r["training"], r["rollout"]
    assert tr["microbatches"] == SMALL.minibatch // r["layout"]["dp"] // SMALL.microbatch
    steps = SMALL.batch // SMALL.minibatch
    assert math.isclose(tr["unfused_s"], steps * (tr["minibatch_sequential_s"] + tr["optimizer_step_s"]), rel_tol=1e-12)
    assert math.isclose(tr["fused_s"], steps * (tr["minibatch_fused_s"] + tr["optimizer_step_s"]), rel_tol=1e-12)
    # the fused schedule search never returns worse than sequential 1F1B, nor better than its lower bound
    assert tr["lower_bound_s"] <= tr["fused_s"] * (1 + 1e-9) and tr["fused_s"] <= tr["unfused_s"] * (1 + 1e-12)
    assert 1.0 <= tr["speedup"] <= tr["bound"] * (1 + 1e-9)
    # the rollout cannot end before its fastest decoding, so neither can the iteration beat its bound
    assert ro["fused_s"] >= ro["decode_floor_s"] and ro["speedup"] <= ro["bound"]
    assert r["total"]["speedup"] <= r["total"]["bound"]
    assert r["weight_sync"]["unfused_s"] == it.weight_sync_s(
        it.Setting(it.LLAMA_13B, it.LLAMA_33B, 32), it.TrainingLayout(**r["layout"]), H100_SXM, ro["unfused_tp"]
    )


def test_one_stage_has_nothing_to_fuse():
    tiny = ModelFlavor("llama", 32_000, 4, 4, 4, 256, 688, 2048, name="tiny")
    r = it.iteration(it.Setting(tiny, tiny, 16), SMALL, budget_s=0)
    assert r["layout"] == {"tp": 8, "pp": 1, "pp_critic": 1, "dp": 2}
    assert r["weight_sync"] == {"unfused_s": 0.0, "fused_s": 0.0, "speedup": 1.0}  # every node holds every layer
    assert math.isclose(r["training"]["speedup"], 1.0, rel_tol=1e-9)  # both models on one rank: no bubble to fill


def test_cli_json_last_line(monkeypatch, capsys):
    monkeypatch.setattr(it, "SETTINGS", (it.Setting(it.LLAMA_13B, it.LLAMA_33B, 32),))
    monkeypatch.setattr(it, "ROLLOUT_TP", (8,))  # one instance size: the paper batch is simulated once
    it.main(["--json", "--budget-s", "0", "--microbatch-samples", "8"])
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert set(out) == {"settings", "speedup_range", "paper", "budget_s"}
    assert out["paper"] == {"total": [1.2, 1.4], "rollout": [1.2, 1.6], "training": [1.2, 1.3]}
    (s,) = out["settings"]
    assert s["setting"] == "13B/33B" and s["workload"]["batch"] == 512 and s["workload"]["microbatch"] == 8
    assert s["training"]["microbatches"] == 8
    for stage in ("weight_sync", "rollout", "training", "total"):
        assert {"unfused_s", "fused_s", "speedup"} <= set(s[stage])
    for stage, (lo, hi) in out["speedup_range"].items():
        assert lo == hi == s[stage]["speedup"]
    assert any(line.startswith("    total ") and "1.2-1.4x" in line for line in lines)
