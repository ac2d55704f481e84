"""Per transformer layer: FSDP2 (``fully_shard``, plus the root) and activation checkpointing."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtune.modules import TransformerSelfAttentionLayer

from fusedrl.distributed.compat import recompute_in_backward
from fusedrl.models import ValueHead


def transformer_layers(module: nn.Module) -> list[TransformerSelfAttentionLayer]:
    """The torchtune transformer layers inside ``module`` (a decoder or a pipeline stage), in order."""
    return [m for m in module.modules() if isinstance(m, TransformerSelfAttentionLayer)]


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> FSDPModule:
    """Shard ``module`` (a TransformerDecoder or a ``split_decoder`` stage) over the 1-D ``dp_mesh``, or hybrid-shard
    it over a 2-D ``(replicate, shard)`` mesh (replicated over the first dim, sharded over the second).

    Each transformer layer becomes its own FSDP unit (all-gathered just before use); the root unit
    holds the rest (embedding, final norm, head). ``mp_policy``, e.g.
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, computes in
    ``param_dtype`` and reduce-scatters gradients in ``reduce_dtype`` while the sharded parameters
    and the optimizer state stay float32. With pipeline parallelism, ``reshard_after_forward=False``
    avoids one all-gather per micro-batch at the cost of keeping the stage unsharded between
    forward and backward. Gradients are averaged over all of ``dp_mesh``. A value head (:class:`ValueHead`) is a
    unit of its own that computes in float32 under any ``mp_policy`` (its input cast up), so values leave in float32.
    """
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(
            f"apply_fsdp needs a 1-D data-parallel mesh or a 2-D (replicate, shard) one, got dims {dp_mesh.mesh_dim_names}; "
            "pass mesh['dp_shard']"
        )
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in transformer_layers(module):
        fully_shard(layer, **kwargs)
    if mp_policy is not None:
        head_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for head in (m for m in module.modules() if isinstance(m, ValueHead)):
            fully_shard(head, **(kwargs | {"mp_policy": head_policy}))
    return fully_shard(module, **kwargs)  # the same module, now an FSDPModule


def apply_activation_checkpointing(module: nn.Module) -> None:
    """Recompute each transformer layer of ``module`` in the backward: a micro-batch in flight then holds one
    hidden state per layer instead of the layer's activations (28x less for Llama-3.1-8B in bf16) for one
    more forward. Apply after tensor parallelism and before FSDP2, as torchtitan does."""
    for layer in transformer_layers(module):
        recompute_in_backward(layer)
