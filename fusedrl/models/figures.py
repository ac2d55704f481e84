"""Derived figures of a :class:`ModelFlavor`, one definition each: forward FLOPs, KV-cache and activation bytes per
token, and the even split of its layers over pipeline stages (its parameter count is ``ModelFlavor.num_params``).

The planner's cost model, the rollout simulator's roofline costs, the layouts' stage splitting and the benchmarks
all call these, so a changed formula changes every estimate at once.
"""

from __future__ import annotations

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


def layer_activation_bytes(flavor: ModelFlavor, tokens: float, bytes_per_value: float) -> float:
    """Activations one decoder layer stores between a micro-batch's forward and backward without recomputation:
    about 16 x hidden + 2 x intermediate values per token."""
    return tokens * (16 * flavor.embed_dim + 2 * flavor.intermediate_dim) * bytes_per_value


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
