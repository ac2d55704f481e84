"""The closed-form terms of the memory estimate (``docs/memory.md`` derives each): itemsizes, the training sequence
length, the rollout's transients (prefill, decode, scoring) and the Actor's logits. The training activations of a
micro-batch are :mod:`fusedrl.models.figures`, shared with the planner."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import nn

from fusedrl.buckets import evenly_spaced, round_up
from fusedrl.config import JobConfig
from fusedrl.layouts import DTYPES
from fusedrl.models import ModelFlavor, scoring_flavors
from fusedrl.rlhf.losses import DEFAULT_LOGITS_BUDGET_BYTES, logits_chunk_positions

GIB = 2**30
PHASES: tuple[str, ...] = ("weight_sync", "generation", "scoring", "training")
ROLLOUT_MODELS: tuple[str, ...] = ("actor", "critic", "reference", "reward")
OFFLOADED: tuple[str, ...] = ("rollout_reference", "rollout_reward")
"""Categories ``training.offload_frozen`` keeps in host memory outside the rollout (generation and scoring)."""
H2D_GB_PER_S = 25.0
"""Assumed host-to-device copy bandwidth per GPU from pinned memory (PCIe Gen5 x16 peaks at 64 GB/s; two GPUs
often share a switch): the time ``training.offload_frozen`` adds per iteration is host bytes / this."""
LOGITS_TRANSIENT_MULTIPLE = 3
"""Extra float32 ``[b, s-1, V]`` tensors alive during the Actor's policy loss (entropy) and its backward."""
SCORING_CHUNK_MULTIPLE = 2
"""Float32 logits chunks alive at once in the Reference's chunked head: the chunk and its log-softmax."""
CHUNKED_HEAD_MULTIPLE = 4
"""Float32 logits chunks alive at once in the policy loss's chunked LM head (forward: logits, log-softmax, exp,
product; its checkpointed backward stays below)."""
SAMPLING_BYTES = 28
"""Peak bytes per ``[slots, V]`` entry of one decode step: the float32 logits, scaled logits and probabilities, and
the counter-based exponential noise, whose 32-bit hash runs in int32 temporaries (measured 26.8-28.2 per entry for
SmolLM2's 49152-entry vocabulary, 30.1 for the debug models' 512, where small tensors count). Without top-k / top-p,
which training refuses; a filtered draw peaks at about 34 (its sort's values and int64 indices)."""
EXPERIENCE_BYTES_PER_TOKEN = 40
"""int64 tokens + eight float32 per-token tensors of the scored batch."""


def itemsize(name: str) -> int:
    """Bytes per element of a config dtype name."""
    return DTYPES[name].itemsize


def training_seq_len(cfg: JobConfig) -> int:
    """The longest training bucket: what the trainer pads a minibatch of full-length samples to."""
    longest = cfg.sequence_budget
    return round_up(longest, evenly_spaced(longest))


def actor_logits_bytes(f: ModelFlavor, rows: int, seq: int) -> int:
    """Float32 logits ``[b, s, V]`` and log-softmax ``[b, s-1, V]`` (+ gather index) of one in-flight micro-batch."""
    return rows * seq * f.vocab_size * 4 + rows * (seq - 1) * (f.vocab_size * 4 + 8)


def body_peak_bytes(f: ModelFlavor, tokens: int, r: int, g: int, engine: bool = False) -> int:
    """Peak bytes of a no-grad decoder forward over ``tokens`` tokens inside its largest layer: the MLP phase
    ``r T (4 D + 3 F / g)`` (the layer's input held by the caller, the residual, the normed input, SiLU, w3's
    output, their product) unless the attention phase ``r T (2 D + 6 q / g)`` is larger. ``engine``: the
    generation engine's prefill also still holds the layer's q, k and v during the MLP: ``+ r T (q + 2 kv) / g``."""
    d, h = f.embed_dim, f.num_heads
    q, kv = h * f.head_dim, f.num_kv_heads * f.head_dim
    mlp = r * (4 * d + 3 * f.intermediate_dim // g) + (r * (q + 2 * kv) // g if engine else 0)
    return tokens * max(mlp, r * (2 * d + 6 * q // g))


def decode_logits_bytes(f: ModelFlavor, slots: int) -> int:
    """Peak bytes of one decode step's logits and sampling over ``slots`` rows (``SAMPLING_BYTES`` per entry)."""
    return slots * f.vocab_size * SAMPLING_BYTES


def decode_step_bytes(f: ModelFlavor, rows: int, r: int, g: int) -> int:
    """Peak bytes of one decode step over ``rows`` slots: its forward over one token per row (q, k and v held through
    the MLP), or its logits and sampling, whichever is larger (the logits with a real vocabulary; the forward with the
    debug models' 512 entries)."""
    return max(body_peak_bytes(f, rows, r, g, engine=True), decode_logits_bytes(f, rows))


def prefill_bytes(f: ModelFlavor, rows: int, width: int, r: int, g: int) -> int:
    """The prefill's forward (body and last-position logits), or the first token's sampling from those logits, which
    holds as much as a decode step's over the same rows (the larger with a real vocabulary)."""
    return max(body_peak_bytes(f, rows * width, r, g, engine=True) + rows * f.vocab_size * (r + 4), decode_logits_bytes(f, rows))


def scoring_bytes(
    f: ModelFlavor, rows: int, width: int, r: int, g: int, max_new_tokens: int, budget: int = DEFAULT_LOGITS_BUDGET_BYTES
) -> tuple[int, int]:
    """(body peak, Reference hidden states + chunked-head logits) of one scoring micro-batch of ``rows x width``
    whose responses have at most ``max_new_tokens`` tokens: the head runs on response tokens only (their hidden states
    gathered first), a chunk of at most the budget's positions x ``rows`` of them at a time."""
    scored = max(1, min(width - 1, max_new_tokens))
    entries = rows * min(logits_chunk_positions(rows, f.vocab_size, budget), scored) * f.vocab_size
    # the head's own output before the float32 copy (none in float32), and with vocabulary-parallel heads
    # (g > 1) this rank's slice of it, which lives until the gathered logits are made
    head_out = (r * entries if r != 4 else 0) + (r * entries // g if g > 1 else 0)
    return (
        body_peak_bytes(f, rows * width, r, g),
        r * (rows * width + rows * scored) * f.embed_dim + SCORING_CHUNK_MULTIPLE * 4 * entries + head_out,
    )


def micro_batch_scoring_bytes(
    reference: ModelFlavor | None, others: Sequence[ModelFlavor], rows: int, width: int, r: int, g: int, max_new_tokens: int
) -> tuple[int, int]:
    """(largest body peak, the Reference's hidden states + chunked-head logits) of one scoring micro-batch of
    ``rows x width`` (:func:`scoring_flavors`; 0 for what the job does not run)."""
    body, head = scoring_bytes(reference, rows, width, r, g, max_new_tokens) if reference is not None else (0, 0)
    return max([body, *(body_peak_bytes(o, rows * width, r, g) for o in others)]), head


def worst_scoring_bytes(cfg: JobConfig, r: int, g: int) -> tuple[int, int, tuple[int, int]]:
    """The largest scoring transient over the micro-batch shapes the scorer can form with the job's scoring models
    (:func:`scoring_flavors`); (body, head, (rows, width))."""
    gen = cfg.generation
    reference, others = scoring_flavors(cfg)
    longest = cfg.sequence_budget
    best = (0, 0, (1, longest))
    for rows in range(1, gen.max_slots + 1):
        width = longest if rows == 1 else min(longest, gen.scoring_max_tokens // rows)
        if width < 2:
            break
        body, head = micro_batch_scoring_bytes(reference, others, rows, width, r, g, cfg.response_budget)
        if max(body, head) > max(best[0], best[1]):
            best = (body, head, (rows, width))
    return best


def rope_bytes(module: nn.Module) -> int:
    """Bytes of the RoPE tables of ``module`` (torchtune RoPE modules; built on meta, Llama 3.1's have none yet)."""
    total = 0
    for m in module.modules():
        if not callable(getattr(m, "rope_init", None)):
            continue
        buffers = list(m.buffers(recurse=False))
        if buffers:
            total += sum(b.numel() * b.element_size() for b in buffers)
        else:  # created float32 when materialized (fusedrl.models.init_rope_buffers)
            # ints of torchtune's RoPE modules (mypy sees nn.Module.__getattr__'s Tensor | Module)
            dim, max_seq_len = cast(int, m.dim), cast(int, m.max_seq_len)
            total += 4 * (max_seq_len * (dim // 2) * 2 + dim // 2)
    return total


def offload_seconds(host_bytes: int) -> float:
    """Seconds per iteration that copying ``host_bytes`` of offloaded weights in adds, at ``H2D_GB_PER_S``."""
    return host_bytes / (H2D_GB_PER_S * 1e9)
