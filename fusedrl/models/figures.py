"""Derived figures of a :class:`ModelFlavor`, one definition each: forward FLOPs, KV-cache bytes per token, the even
split of its layers over pipeline stages, and the activation memory a training micro-batch holds on a stage from its
forward to its backward (its parameter count is ``ModelFlavor.num_params``).

The planner's cost model (hence the search's memory limit and memory pass), the memory estimate
(:mod:`fusedrl.memory`), the rollout simulator's roofline costs, the layouts' stage splitting and the benchmarks all
call these, so a changed formula changes every estimate at once; ``docs/memory.md`` derives the activation terms and
``tests/test_memory.py`` checks the per-layer figure against autograd's saved tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusedrl.models.registry import ModelFlavor, check_role


def layer_matmul_params(flavor: ModelFlavor) -> int:
    """Weights of one decoder layer that multiply every token once: q, k, v, o and the gated MLP (norms and biases,
    which cost no matmul FLOPs, left out)."""
    q, kv = flavor.num_heads * flavor.head_dim, flavor.num_kv_heads * flavor.head_dim
    return flavor.embed_dim * (2 * q + 2 * kv) + 3 * flavor.embed_dim * flavor.intermediate_dim


def head_outputs(flavor: ModelFlavor, role: str) -> int:
    """Output features of the head of ``role``: the vocabulary (policy) or one value."""
    check_role(role)
    return flavor.vocab_size if role == "policy" else 1


def stage_forward_flops(
    flavor: ModelFlavor, role: str, num_stages: int, tokens: float, attended: float
) -> list[tuple[float, float]]:
    """Per pipeline stage, (forward FLOPs, the part of them in weight matmuls) of a micro-batch of ``tokens`` tokens.

    2 FLOPs per matmul weight per token (:func:`layer_matmul_params`), plus causal attention: the scores QK^T and the
    values PV, halved by the mask, 2 x ``attended`` x query width, where ``attended`` is the micro-batch's sum of
    squared sequence lengths (``tokens x seq_len`` for equal lengths). The head of ``role`` is charged to the last
    stage; layers are split as :func:`stage_layer_counts` splits them. The weight-matmul part is what a weight
    gradient costs again in the backward (attention's products have no weights)."""
    q = flavor.num_heads * flavor.head_dim
    layer_matmul = 2 * tokens * layer_matmul_params(flavor)
    layer = layer_matmul + 2 * attended * q
    head = 2 * tokens * flavor.embed_dim * head_outputs(flavor, role)
    out = []
    for s, k in enumerate(stage_layer_counts(flavor.num_layers, num_stages)):
        h = head if s == num_stages - 1 else 0
        out.append((k * layer + h, k * layer_matmul + h))
    return out


def forward_flops(flavor: ModelFlavor, role: str, lengths: Sequence[int], head_tokens: int) -> float:
    """Forward FLOPs of the whole model over sequences of ``lengths`` tokens each (no padding: each sequence attends
    causally to its own tokens), its head applied to ``head_tokens`` of them (a policy's LM head runs on response
    tokens only). A training step costs three times this (the backward twice the forward)."""
    tokens = sum(lengths)
    ((flops, _),) = stage_forward_flops(flavor, role, 1, tokens, sum(n * n for n in lengths))
    return flops - 2 * (tokens - head_tokens) * flavor.embed_dim * head_outputs(flavor, role)


def kv_bytes_per_token(flavor: ModelFlavor, bytes_per_value: int) -> int:
    """KV-cache bytes one token holds: a key and a value of every KV head in every layer."""
    return flavor.num_layers * 2 * flavor.num_kv_heads * flavor.head_dim * bytes_per_value


def stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Layers per pipeline stage, split as evenly as possible (earlier stages take the remainder)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot balance {num_layers} layers over {num_stages} pipeline stages; use fewer stages or pass boundaries explicitly"
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


LOSS_BYTES_PER_TOKEN = 36
"""Small per-token tensors a PPO loss saves (masks, ratios, clipped values)."""


def layer_activation_bytes(f: ModelFlavor, tokens: int, itemsize: int, tp: int = 1) -> int:
    """Autograd's saved bytes of one transformer layer's forward over ``tokens`` tokens in a compute dtype of
    ``itemsize`` bytes, its attention and MLP split over ``tp`` ranks: per token two RMSNorms' float32 input copy
    and normalized value plus their output, q and k / v expanded to the query heads, the SDPA output and its float32
    log-sum-exp, the MLP's four intermediates and 8 bytes of ``rstd``; below float32 also the two norms' float32
    scale copies (their kernel's weight: :class:`fusedrl.models.registry.RMSNorm`)."""
    d, h = f.embed_dim, f.num_heads
    q = h * f.head_dim
    per_token = 2 * (8 * d + itemsize * d) + itemsize * (4 * q // tp + 4 * f.intermediate_dim // tp) + 8 + 4 * (h // tp)
    return tokens * per_token + (2 * 4 * d if itemsize != 4 else 0)


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
