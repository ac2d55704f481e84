"""Tensor parallelism for torchtune decoders with DTensor parallelize plans."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fusedrl.distributed.fsdp import transformer_layers


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard every transformer layer of ``model`` (a decoder or a pipeline stage) over the 1-D ``tp_mesh``.

    Attention: q/k/v projections column-wise (each rank owns ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` kv heads), output projection row-wise. MLP: w1/w3 column-wise, w2
    row-wise. Each layer's attention and MLP outputs are all-reduced, so layers exchange plain
    replicated activations. The embedding, norms and output head stay replicated (same values and
    gradients on every TP rank); the head is small next to the layers for the models trained here.
    Call before ``apply_fsdp``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tp needs a 1-D tensor-parallel mesh, got dims {tp_mesh.mesh_dim_names}; pass mesh['tp']"
        )
    tp = tp_mesh.size()
    for layer in transformer_layers(model):
        attn, mlp = layer.attn, layer.mlp
        hidden = mlp.w1.out_features
        for name, value in (("num_heads", attn.num_heads), ("num_kv_heads", attn.num_kv_heads), ("hidden_dim", hidden)):
            if value % tp != 0:
                raise ValueError(
                    f"tensor parallel degree {tp} does not divide the model's {name} ({value}); choose a tp dividing it"
                )
        if attn.kv_cache is not None:
            raise ValueError("apply_tp must run before KV caches are set up (caches are sized by the local head count)")
        parallelize_module(
            layer,
            tp_mesh,
            {
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.output_proj": RowwiseParallel(),
                "mlp.w1": ColwiseParallel(),
                "mlp.w3": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(),
            },
        )
        # torchtune's attention reshapes q/k/v with these; after the plan each rank sees its shard only.
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
        attn.embed_dim //= tp
    return model
