"""Weight resharding from training layouts (pipeline stages x FSDP2 x TP) to rollout layouts (TP per instance)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fusedrl.distributed import ParallelDims, apply_fsdp, apply_tp, split_decoder
from fusedrl.distributed.reshard import Box, local_tensor, plan_reshard, reshard
from fusedrl.models import build_model, flavor_from_hf_config
from fusedrl.testing.architectures import TINY_ARCHITECTURES

QWEN3 = flavor_from_hf_config(TINY_ARCHITECTURES["qwen3_biased"])  # q/k norms inside the projections, o_proj bias


def test_box_intersection_and_index():
    a, b = Box((0, 4), (8, 4)), Box((6, 0), (4, 6))
    assert a.intersect(b) == Box((6, 4), (2, 2))
    assert a.intersect(Box((8, 0), (2, 8))) is None
    assert Box((6, 4), (2, 2)).within(a) == (slice(6, 8), slice(0, 2))


def _reference(flavor, role: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(flavor, role)


def _training_layout(flavor, role: str, pp: int, dp: int, tp: int) -> torch.nn.Module:
    """This rank's stage of the reference model: pp stages x FSDP over dp (x TP over tp)."""
    mesh = ParallelDims(pp=pp, dp_shard=dp, tp=tp, world_size=dist.get_world_size()).build_mesh("cpu")
    stage = split_decoder(_reference(flavor, role), pp)[mesh["pp"].get_local_rank()]
    if tp > 1:
        apply_tp(stage, mesh["tp"])
    apply_fsdp(stage, mesh["dp_shard"])
    return stage


def _rollout_layout(flavor, role: str, gen_tp: int, dtype: torch.dtype) -> torch.nn.Module:
    """A TP-sharded copy with other (garbage) values, to be overwritten."""
    torch.manual_seed(99)
    model = build_model(flavor, role).to(dtype)
    if gen_tp > 1:
        apply_tp(model, ParallelDims(dp_shard=dist.get_world_size(), gen_tp=gen_tp).build_gen_mesh("cpu")["gen_tp"])
    return model


def _reshard_case(flavor, role: str, pp: int, dp: int, tp: int, gen_tp: int, dtype: torch.dtype) -> dict:
    src = _training_layout(flavor, role, pp, dp, tp)
    dst = _rollout_layout(flavor, role, gen_tp, dtype)
    src_params, dst_params = dict(src.named_parameters()), dict(dst.named_parameters())
    plan = plan_reshard(src_params, dst_params)
    received = reshard(plan, src_params, dst_params)
    reshard(plan, src_params, dst_params)  # a second sync writes the same values
    ref = dict(_reference(flavor, role).named_parameters())
    mismatched = [
        name
        for name, p in dst_params.items()
        if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), ref[name].detach().to(dtype))
    ]
    local_bytes = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in dst_params.values())
    return {
        "mismatched": mismatched,
        "received": received,
        "planned": plan.bytes_received(dist.get_rank()),
        "local_bytes": local_bytes,
        "max_unit_bytes": max(sum(t.box.numel for t in u) for u in plan.units),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        ("debug", "policy", 2, 2, 1, 2, torch.float32),  # pp2 x FSDP2 -> 2 instances of TP2
        ("debug", "policy", 2, 2, 1, 1, torch.bfloat16),  # -> 4 full replicas, bf16 on the wire
        ("debug_qwen", "policy", 1, 2, 2, 2, torch.float32),  # FSDP2 x TP2 training (strided shards) -> TP2, tied head
        ("debug_large", "value", 4, 1, 1, 2, torch.bfloat16),  # 4 stages, FSDP over 1 -> TP2 value model
        (QWEN3, "policy", 2, 1, 2, 2, torch.float32),  # pp2 x TP2 x FSDP2 over 1 -> TP2 of a Qwen3
    ],
    ids=["pp2-dp2-to-gentp2", "pp2-dp2-to-replicas-bf16", "dp2-tp2-to-gentp2-qwen", "pp4-to-gentp2-value-bf16", "pp2-tp2-qwen3"],
)
def test_reshard_fills_every_rollout_shard_exactly(four_ranks, case):
    results = four_ranks.run(_reshard_case, *case)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], f"rank {rank}: {r['mismatched']}"
        # every destination byte arrives at most once, and what the plan says is what moved
        assert r["received"] == r["planned"] <= r["local_bytes"]


def _mismatched_layouts() -> str:
    src = _training_layout("debug", "policy", 2, 2, 1)
    dst = _rollout_layout("debug_large", "policy", 1, torch.float32)
    try:
        plan_reshard(dict(src.named_parameters()), dict(dst.named_parameters()))
    except ValueError as e:
        return str(e)
    return ""


def test_reshard_refuses_layouts_of_different_models(four_ranks):
    message = four_ranks.run(_mismatched_layouts)[0]
    assert message.startswith("cannot reshard:") and "shape" in message and "same model" in message
