"""Activation memory of one training micro-batch on a pipeline stage: the bytes it holds from its forward to its
backward. One model for the planner (:meth:`fusedrl.pipelining.CostModel.from_flavors`, hence the search's memory
limit and memory pass) and the memory estimate (:mod:`fusedrl.memory`); ``docs/memory.md`` derives the terms and
``tests/test_memory.py`` checks the per-layer figure against autograd's saved tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusedrl.models import ModelFlavor

LOSS_BYTES_PER_TOKEN = 36
"""Small per-token tensors a PPO loss saves (masks, ratios, clipped values)."""


def layer_activation_bytes(f: ModelFlavor, tokens: int, itemsize: int, tp: int = 1) -> int:
    """Autograd's saved bytes of one transformer layer's forward over ``tokens`` tokens in a compute dtype of
    ``itemsize`` bytes, its attention and MLP split over ``tp`` ranks: per token two RMSNorms' float32 input copy
    and normalized value plus their output, q and k / v expanded to the query heads, the SDPA output and its float32
    log-sum-exp, the MLP's four intermediates and 8 bytes of ``rstd``."""
    d, h = f.embed_dim, f.num_heads
    q = h * f.head_dim
    per_token = 2 * (8 * d + itemsize * d) + itemsize * (4 * q // tp + 4 * f.intermediate_dim // tp) + 8 + 4 * (h // tp)
    return tokens * per_token


def stage_activation_bytes(
    f: ModelFlavor,
    layers: int,
    *,
    first: bool,
    last: bool,
    role: str,
    tokens: int,
    itemsize: int,
    tp: int = 1,
    head_in_loss: bool = True,
    recompute: bool = False,
) -> int:
    """Bytes one in-flight micro-batch of ``tokens`` tokens holds on a training stage of ``layers`` layers (a
    policy's full logits excluded: they are transients of its loss).

    ``role``: ``policy`` or ``value``. ``head_in_loss``: a policy's last stage returns its final hidden states
    (float32) and the policy loss applies the LM head in checkpointed chunks, as the trainer builds it
    (``split_decoder(..., apply_head=False)``, ``PolicyLoss(head=...)``). ``recompute``
    (``training.activation_checkpointing = "full"``): a layer keeps only its input."""
    d, c = f.embed_dim, itemsize
    total = layers * (c * tokens * d if recompute else layer_activation_bytes(f, tokens, c, tp))
    if first:
        total += 8 * tokens  # token ids saved by the embedding
    elif c == 4 and layers:
        total -= 4 * tokens * d  # the first norm's float32 input is the receive buffer itself
    if not last:
        return total + tokens * c * d  # the stage output, held by PipelineStage until its backward
    total += tokens * (8 * d + LOSS_BYTES_PER_TOKEN)  # the final norm's float32 tensors; the loss's own
    if role == "value":
        return total + tokens * (c * d + c + 4)  # normed input saved by the value head; its output, float32 copy
    if head_in_loss:  # float32 hidden output (held) and the loss's compute-dtype copy (the checkpoint's input)
        return total + tokens * (4 * d + (c * d if c != 4 else 0))
    return total + tokens * c * d  # normed input saved by the LM head
