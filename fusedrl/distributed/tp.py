"""Tensor parallelism for torchtune decoders with DTensor parallelize plans."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtune.modules import TiedLinear

from fusedrl.distributed.fsdp import transformer_layers
from fusedrl.models import LoRALinear, QKNormProjection

VOCAB_MODULES = ("tok_embeddings", "output")


def tp_indivisible(degree: int, num_heads: int, num_kv_heads: int, mlp_width: int) -> tuple[str, int] | None:
    """The first part of a decoder layer that a tensor-parallel ``degree`` cannot split evenly, as (its name, its
    size); None when the degree divides them all. The plan shards attention by heads (query and KV) and the MLP by
    its width."""
    parts = (("attention heads", num_heads), ("KV heads", num_kv_heads), ("MLP width", mlp_width))
    return next(((part, value) for part, value in parts if value % degree), None)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, vocab_parallel: tuple[str, ...] = VOCAB_MODULES) -> nn.Module:
    """Shard every transformer layer of ``model`` (a decoder or a pipeline stage) over the 1-D ``tp_mesh``.

    Attention: q/k/v projections column-wise (each rank owns ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` kv heads), output projection row-wise. MLP: w1/w3 column-wise, w2
    row-wise. Each layer's attention and MLP outputs are all-reduced, so layers exchange plain
    replicated activations. The modules named in ``vocab_parallel`` (the token embedding and the LM
    head: 2 x 1 GB of a 70B model's 17 GB per rank at tp = 8) are split by vocabulary rows when ``tp``
    divides the vocabulary and the two are not tied (pass ``()`` for a pipeline stage of a tied model,
    whose head is a copy): the embedding's lookups are summed over the TP ranks, the head's logits
    gathered whole, so callers see plain tensors. Norms and a value head (one output) stay replicated.
    One plan serves every decoder family fusedrl builds (they share the layer structure; Qwen3's per-head q/k
    norms keep a replicated weight, run on each rank's heads, and sum their weight gradient over the TP ranks).
    Call before ``apply_fsdp``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D tensor-parallel mesh, got dims {tp_mesh.mesh_dim_names}; pass mesh['tp']")
    tp = tp_mesh.size()
    for layer in transformer_layers(model):
        attn, mlp = layer.attn, layer.mlp
        indivisible = tp_indivisible(tp, attn.num_heads, attn.num_kv_heads, mlp.w1.out_features)
        if indivisible is not None:
            part, value = indivisible
            raise ValueError(f"tensor parallel degree {tp} does not divide the model's {part} ({value}); choose a tp dividing it")
        if attn.kv_cache is not None:
            raise ValueError("apply_tp must run before KV caches are set up (caches are sized by the local head count)")
        plan: dict[str, ParallelStyle] = {
            "attn.v_proj": ColwiseParallel(),
            "attn.output_proj": RowwiseParallel(),
            "mlp.w1": ColwiseParallel(),
            "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(),
        }
        if isinstance(attn.q_proj, QKNormProjection):
            # Qwen3: the linear is sharded by heads; the per-head norm sees this rank's heads [b, s, heads, hd] as a
            # head-sharded DTensor, so its replicated weight's gradient is summed over the TP ranks' heads
            for p in ("q", "k"):
                plan[f"attn.{p}_proj.linear"] = ColwiseParallel()
                plan[f"attn.{p}_proj.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        else:
            plan.update({"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel()})
        parallelize_module(layer, tp_mesh, plan)
        _place_adapters(layer, tp_mesh)
        # torchtune's attention reshapes q/k/v with these; after the plan each rank sees its shard only.
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
        attn.embed_dim //= tp
    _shard_vocabulary(model, tp_mesh, vocab_parallel)
    return model


def _place_adapters(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """LoRA adapters follow their projection's split: a column-wise weight (rows split) keeps ``A`` whole and splits
    ``B``'s rows; a row-wise one (columns split) splits ``A``'s columns and keeps ``B`` whole, so ``x A^T`` is a
    partial sum that the layer's output reduction adds up with the base product."""
    for m in layer.modules():
        if not isinstance(m, LoRALinear) or not isinstance(m.weight, DTensor):
            continue
        colwise = m.weight.placements[0] == Shard(0)
        for name, placement in (
            ("lora_a", Replicate() if colwise else Shard(1)),
            ("lora_b", Shard(0) if colwise else Replicate()),
        ):
            p = getattr(m, name)
            if p.is_meta:  # nothing to keep: a fresh tensor of the full shape
                whole = torch.empty(p.shape, dtype=p.dtype, device="meta")
            else:  # the column-wise plan split every parameter by rows
                whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            m.register_parameter(name, nn.Parameter(distribute_tensor(whole, tp_mesh, [placement]), p.requires_grad))


def _shard_vocabulary(model: nn.Module, tp_mesh: DeviceMesh, names: tuple[str, ...]) -> None:
    embedding = getattr(model, "tok_embeddings", None)
    head = getattr(model, "output", None)
    vocab = (
        embedding.num_embeddings
        if isinstance(embedding, nn.Embedding)
        else head.out_features
        if isinstance(head, nn.Linear)
        else None
    )
    if vocab is None or vocab % tp_mesh.size() or isinstance(head, TiedLinear):
        return
    if isinstance(head, nn.Linear) and isinstance(embedding, nn.Embedding) and head.weight is embedding.weight:
        return  # one tied Parameter: the lookup and the head would need two layouts of it
    plan: dict[str, ParallelStyle] = {}
    if isinstance(embedding, nn.Embedding) and "tok_embeddings" in names:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    # a value head (one output) stays replicated
    if isinstance(head, nn.Linear) and head.out_features == vocab and "output" in names:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)
