"""Memory per rank of a PPO job: ``python -m fusedrl.bench.memory --config CONFIG [--world N] [--json] [--measure]
[--device-gib G] [--pipeline-shapes K] [--section.key=value ...]``.

For each distinct rank of an N-rank job both layouts (:func:`fusedrl.layouts.build_training_layout`,
:func:`fusedrl.layouts.build_rollout_layout`) are built on the meta device under torch's fake process group
(:func:`fusedrl.distributed.compat.init_fake_process_group`: one process plays rank r, builds, reads the modules,
destroys the group, next rank), so every size below comes from the real module trees and DTensor shardings.
Distinct ranks: every pipeline rank with its first and last dp_shard rank, TP rank 0. The other ranks of a stage
differ only by uneven FSDP2 chunks (the last dp rank holds the short ones), TP ranks hold equal shares (``apply_tp``
refuses uneven ones) and every rank holds the same rollout shares (gen_tp divides heads and MLP width). The
weight-sync plan needs every rank's shard boxes: :func:`fusedrl.models.weights.shard_indices` computes them from the
built ranks' placements (checked against the built DTensors) and the real :func:`fusedrl.distributed.plan_reshard`
plans the sync from them.

Notation: ``c`` compute itemsize (``training.mixed_precision_param``), ``r`` rollout itemsize (``rollout_dtype``;
the Reference and Reward use ``frozen_dtype``), ``kv`` KV-cache itemsize; ``D`` embed dim, ``H`` / ``KV`` heads / KV
heads, ``hd`` the head size (``head_dim``: ``D / H`` unless config.json sets it), ``q = H hd``, ``k = KV hd``, ``F`` MLP width, ``V`` vocabulary, ``L`` layers; ``tp``, ``g =
gen_tp``; ``P = data.max_prompt_len``, ``N = generation.max_new_tokens``; a training micro-batch has ``b =
ppo.microbatch_size`` rows of ``s`` tokens (the longest bucket ``round_up(P + N, evenly_spaced(P + N))``), ``T = b
s``; ``M = minibatch_size / dp_shard / microbatch_size`` micro-batches per model.

Persistent (every phase; steady state after the first iteration):

- ``train_params_{actor,critic}``: the local FSDP2 (x TP) shards in float32: ``4 x local numel``.
- ``optimizer_{actor,critic}``: AdamW ``exp_avg`` and ``exp_avg_sq`` on the shards, ``8 x local numel`` (the 0-dim
  ``step`` tensors stay on the host).
- ``rollout_{actor,critic,reference,reward}``: each rollout copy's local numel (attention / MLP weights, the
  embedding and the LM head sharded over g; norms, value heads and tied embeddings whole) x its dtype; no Reward
  bytes with ``model.reward = "none"`` (a rule-based reward alone).
- ``kv_cache``: ``L x 2 x max_slots x (P + N + 1) x (KV / g) x hd x kv`` (the engine's ``k_i`` / ``v_i`` buffers, one
  spare position each).
- ``rope_buffers``: each of the six model copies' RoPE tables, ``4 x (max_seq_len x hd + hd / 2)`` bytes (float32 in
  every copy: a bf16 rollout copy casts its parameters only; 67 MB for Llama 3.1's 131072 positions).
- ``pipeline_buffers``: the executor keeps a ``PipelineStage`` pair per trained micro-batch shape, at most
  ``STAGE_CACHE_SIZE`` (2) of them, the least recently used evicted, and a stage preallocates ``M`` activation receive
  buffers (non-first stage) and ``M`` gradient receive buffers (non-last stage), each ``c T D``; counted for the
  longest two of the sequence buckets a run visits (``--pipeline-shapes K``: the K longest; default every bucket).

Training phase:

- ``gradients_{actor,critic}``: float32 sharded gradients (as large as the shards) from the end-of-minibatch
  reduce-scatter until ``zero_grad`` after the optimizer step.
- ``unsharded_params``: with ``reshard_after_forward=False`` a stage stays all-gathered in the compute dtype from its
  first forward to the minibatch's gradient reduction: ``c x`` its TP-local numel.
- ``unsharded_grads``: the executor runs every backward without gradient sync, so FSDP2 accumulates the *unsharded*
  gradient of the whole stage over the micro-batches, in the reduce dtype when it differs from the compute dtype
  (``training.mixed_precision_reduce``), else in the compute dtype: ``4 x`` TP-local numel for bf16 / fp32; a
  vocabulary-parallel embedding's gradient comes out of DTensor's embedding backward at full size (measured).
- ``activations``, per in-flight micro-batch of a stage of ``l`` layers (autograd's saved tensors; SDPA saves no
  ``[H, s, s]`` scores): per layer ``T x [2 (8 D + c D) + c (4 q + 4 F) / tp + 8 + 4 H / tp]``. Each RMSNorm saves its
  float32 input copy, the normalized float32 value and its compute-dtype output; attention saves q, k and v (k, v
  expanded to ``H / tp`` heads by torchtune's GQA), the SDPA output and its float32 log-sum-exp; the MLP saves w1's
  output, its SiLU, w3's output and their product; 8 bytes of ``rstd``. Per stage: ``l`` layers; ``+ 8 T`` token ids
  on the first stage; a non-last stage's output ``c T D`` (held by ``PipelineStage`` until its backward); a last
  stage's final norm ``8 T D``, ``36 T`` of loss tensors and: Critic ``T (c D + c + 4)`` (head input and value
  output); Actor with the LM head in the loss (``split_decoder(apply_head=False)``, ``PolicyLoss(head=...)``) ``T (4 D
  + c D)`` (the float32 hidden output and the loss's compute-dtype copy, the checkpointed chunks' input), else ``c T
  D`` plus ``actor_logits``, ``4 T V + 4 b (s-1) (V + 2)`` (float32 logits and log-softmax). With a float32
  compute dtype a non-first stage's first norm input is its receive buffer: ``- 4 T D``. Measured exactly by
  ``--measure`` (``saved_tensors_hooks`` plus the held stage outputs).
- ``recompute`` (``training.activation_checkpointing = "full"``): a layer then keeps only its input, ``c T D``,
  per in-flight micro-batch instead of the activations above, and its backward rebuilds one layer's activations
  (the per-layer figure above) at a time.
- ``logits_transient`` (Actor's last stage, during its forward and backward): ``4 x`` one float32 logits chunk
  (``b x positions x V x 4 <= DEFAULT_LOGITS_BUDGET_BYTES``) for the chunked LM head (logits, log-softmax, exp,
  product; measured 4.0 in forward, 3.5 in backward), or ``3 x 4 b (s-1) V`` with full logits (the entropy's
  log-softmax, exp and product; measured 3.0).
- The program: :func:`training_walk` follows the rank's lowered program (:func:`fusedrl.rlhf.plan_program`): a
  micro-batch is held from its F to its B (W when split), a model's unsharded parameters exist from its first F and
  its unsharded gradients from its first backward (charged at the backward's start or end, whichever is larger). The
  in-flight counts are exact for the schedule in use; the largest moment is kept.
- ``reduce_scatter``: the gradient reduction copies one FSDP2 unit's unsharded gradients into a reduce-scatter
  buffer (the largest unit: a layer, or the root with the embedding / head).
- ``experience``: the scored batch and its padded copy, ``2 x batch_size x s x 40`` bytes.
- ``optimizer_step``: one float32 copy of the shards (foreach AdamW's ``sqrt(exp_avg_sq)``).

The training peak is the largest of three moments: compute (the walk's largest moment), reduction (unsharded params
and grads + ``reduce_scatter``) and optimizer step (sharded grads + ``optimizer_step``), each + ``experience``.

With ``training.offload_frozen`` ``rollout_reference`` and ``rollout_reward`` count in the generation and scoring
phases only; the rank keeps them in host memory (``host_gib``) and copying them in before each rollout adds host
bytes / ``H2D_GB_PER_S`` seconds per iteration (an assumed bandwidth, printed with the figure).

Other phases (a rank runs one of weight sync, decoding or scoring at a time, so their transients never add up):

- ``weight_sync_buffers``: :func:`sync_transients` replays :func:`fusedrl.distributed.reshard` over the real plan,
  one unit (a decoder layer, or one tensor outside the layers) at a time: receive buffers and send blocks (a cast to
  the rollout dtype, or the ``contiguous()`` copy of a strided slice; one per destination) live until the next unit,
  a block the rank keeps until the next block, and the loop variables ``buf`` / ``block`` carry the last ones into
  the next unit. The Actor's and the Critic's syncs run in turn: the larger counts.
- ``prefill_activations`` (generation): up to ``max_slots`` prompts are admitted and prefilled at once without grad,
  ``T_p = max_slots x P`` tokens (``max_slots x (P + N - 1)`` when migrated requests are re-prefilled,
  ``fusion.migration_mode = "reprefill"``); inside a layer the MLP phase holds
  ``r T_p (4 D + 3 F / g + (q + 2 k) / g)`` (layer input, residual, attention output, normed input, SiLU, w3's
  output, product, and the layer's q, k, v), unless the attention phase ``r T_p (2 D + 6 q / g)`` is larger; plus
  ``max_slots x V x (r + 4)`` last-position logits; or, when larger (SmolLM2's 49152-entry vocabulary), the first
  token's sampling from them, as ``decode_logits`` below over the prefilled rows.
- ``decode_logits`` (generation): ``max_slots x V x 28``: float32 logits, scaled logits and probabilities, and the
  counter-based exponential noise, whose hash runs in int32 ``[slots, V]`` temporaries (measured 26.8-30.1 bytes
  per entry without top-k / top-p, which training refuses; about 34 with them).
- ``scoring_activations`` / ``scoring_logits`` (scoring): a micro-batch has at most ``max_slots`` samples and at most
  ``scoring_max_tokens`` padded tokens ``T_s`` (a longer sample alone; the worst shape is searched); its no-grad
  forward peaks at ``r T_s (4 D + 3 F / g)`` (or the attention phase), the Reference's chunked head at ``r T_s D``
  hidden states + 2 float32 chunks (the chunk and its log-softmax; measured 2.0), + the head's compute-dtype
  output when it is not float32, + with ``g > 1`` the rank's vocabulary slice of the chunk (``r / g`` per entry)
  before it is gathered. The phase holds the larger.

Not estimated: the CUDA context, NCCL buffers, allocator caching and fragmentation, CUDA-graph pools of the compiled
decode; the int8 engine copy (``generation.quantize``); the KV states of migrated requests queued on a kept instance;
the example tensors the executor allocates when it builds a stage for a new shape; the tensors Qwen3's per-head q/k
norms save for their backward (about ``8 T (q + k) / tp`` bytes per layer, not in the per-layer figure); the
forward-only pass of ``ppo.recompute_logprobs`` (no saved tensors: below the training step's peak); host memory (the CPU engine's
weight layout copies for its linears, the optimizer's ``step`` tensors). ``docs/memory.md`` tells how to read the figures.

``--measure`` runs a config (default: ``debug_ppo.toml`` with ``debug_large`` models, random initialisation, a small
batch, 4 CPU ranks) through the real :class:`fusedrl.trainer.Trainer` for two iterations; each rank sums the bytes of
the live tensors of every category (distinct storages), records the training step's saved tensors per micro-batch,
the unsharded parameters and gradients before the gradient reduction and the weight sync's P2P buffers, and
profiles (``torch.profiler`` CPU memory events: the net bytes allocated) a training step, a weight sync, the
largest prefill and scoring micro-batch and a decode step. The estimate for the same layout, program and sequence
length is compared per rank and category; a compared category off by more than 10% fails the run (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fusedrl.bench import NO_OUTPUT_OVERRIDES
from fusedrl.buckets import evenly_spaced, round_up
from fusedrl.config import ConfigError, JobConfig, load_config
from fusedrl.distributed import check_dims, plan_reshard
from fusedrl.distributed.compat import init_fake_process_group
from fusedrl.distributed.reshard import Box, ReshardPlan
from fusedrl.layouts import DTYPES, build_rollout_layout, build_training_layout, model_flavor
from fusedrl.models import ModelFlavor
from fusedrl.models.weights import shard_indices
from fusedrl.pipelining import ACTOR, CRITIC, STAGE_CACHE_SIZE, FusedPipelineSchedule, LoweredProgram
from fusedrl.rlhf import Scorer
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
LOSS_BYTES_PER_TOKEN = 36
"""Small per-token tensors a PPO loss saves (masks, ratios, clipped values)."""
SAMPLING_BYTES = 28
"""Peak bytes per ``[slots, V]`` entry of one decode step: the float32 logits, scaled logits and probabilities, and
the counter-based exponential noise, whose 32-bit hash runs in int32 temporaries (measured 26.8-28.2 per entry for
SmolLM2's 49152-entry vocabulary, 30.1 for the debug models' 512, where small tensors count). Without top-k / top-p,
which training refuses; a filtered draw peaks at about 34 (its sort's values and int64 indices)."""
EXPERIENCE_BYTES_PER_TOKEN = 40
"""int64 tokens + eight float32 per-token tensors of the scored batch."""
TOLERANCE = 0.10
MEASURE_CONFIG = "train_configs/debug_ppo.toml"
MEASURE_OVERRIDES: tuple[str, ...] = (
    "--model.actor=debug_large",
    "--model.critic=debug_large",
    "--model.reward=debug_large",
    "--model.actor_path=",
    "--model.critic_path=",
    "--model.reward_path=",
    "--model.reference_path=",
    "--ppo.batch_size=8",
    "--ppo.minibatch_size=8",
    "--ppo.microbatch_size=2",
    "--ppo.epochs=1",
    "--data.max_prompt_len=32",
    "--generation.max_new_tokens=24",
    "--generation.max_slots=4",
    "--generation.stop_token_ids=[]",
    "--fusion.schedule_search_budget_s=0.2",
)
_RUN_OVERRIDES: tuple[str, ...] = (
    "--training.steps=2",
    *NO_OUTPUT_OVERRIDES,
    "--metrics.timeline_interval=0",
    "--training.device=cpu",
)


# ---------------------------------------------------------------------------------------------- formulas


def _itemsize(name: str) -> int:
    return DTYPES[name].itemsize


def training_seq_len(cfg: JobConfig) -> int:
    """The longest training bucket: what the trainer pads a minibatch of full-length samples to."""
    longest = cfg.sequence_budget
    return round_up(longest, evenly_spaced(longest))


def layer_activation_bytes(f: ModelFlavor, tokens: int, c: int, tp: int) -> int:
    """Autograd's saved bytes of one transformer layer's forward over ``tokens`` tokens (module docstring)."""
    d, h = f.embed_dim, f.num_heads
    q = h * f.head_dim
    per_token = 2 * (8 * d + c * d) + c * (4 * q // tp + 4 * f.intermediate_dim // tp) + 8 + 4 * (h // tp)
    return tokens * per_token


def stage_activation_bytes(
    f: ModelFlavor,
    layers: int,
    first: bool,
    last: bool,
    role: str,
    rows: int,
    seq: int,
    c: int,
    tp: int,
    head_in_loss: bool = False,
    recompute: bool = False,
) -> int:
    """Bytes one in-flight micro-batch holds on a training stage, the Actor's full logits excluded.

    ``head_in_loss``: the stage returns its final hidden states (float32) and the policy loss applies the LM head
    in checkpointed chunks (``split_decoder(..., apply_head=False)``, ``PolicyLoss(head=...)``). ``recompute``
    (``training.activation_checkpointing = "full"``): a layer keeps only its input, ``c T D``."""
    tokens, d = rows * seq, f.embed_dim
    total = layers * (c * tokens * d if recompute else layer_activation_bytes(f, tokens, c, tp))
    if first:
        total += 8 * tokens  # token ids saved by the embedding
    elif c == 4 and layers:
        total -= 4 * tokens * d  # the first norm's float32 input is the receive buffer itself
    if not last:
        return total + tokens * c * d  # the stage output, held until its backward
    total += tokens * (8 * d + LOSS_BYTES_PER_TOKEN)  # final norm's saved float32 tensors; the loss's own
    if role == "value":
        return total + tokens * (c * d + c + 4)  # normed input saved by the value head; its output, float32 copy
    if head_in_loss:  # float32 hidden output (held) and the loss's compute-dtype copy (checkpoint input)
        return total + tokens * (4 * d + (c * d if c != 4 else 0))
    return total + tokens * c * d  # normed input saved by the LM head


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


def prefill_bytes(f: ModelFlavor, rows: int, width: int, r: int, g: int) -> int:
    """The prefill's forward (body and last-position logits), or the first token's sampling from those logits, which
    holds as much as a decode step's over the same rows (the larger with a real vocabulary)."""
    return max(body_peak_bytes(f, rows * width, r, g, engine=True) + rows * f.vocab_size * (r + 4), decode_logits_bytes(f, rows))


def scoring_bytes(
    f: ModelFlavor, rows: int, width: int, r: int, g: int, budget: int = DEFAULT_LOGITS_BUDGET_BYTES
) -> tuple[int, int]:
    """(body peak, Reference hidden states + chunked-head logits) of one scoring micro-batch of ``rows x width``."""
    entries = rows * min(logits_chunk_positions(rows, f.vocab_size, budget), max(1, width - 1)) * f.vocab_size
    # the head's own output before the float32 copy (none in float32), and with vocabulary-parallel heads
    # (g > 1) this rank's slice of it, which lives until the gathered logits are made
    head_out = (r * entries if r != 4 else 0) + (r * entries // g if g > 1 else 0)
    return (
        body_peak_bytes(f, rows * width, r, g),
        r * rows * width * f.embed_dim + SCORING_CHUNK_MULTIPLE * 4 * entries + head_out,
    )


def worst_scoring_bytes(
    cfg: JobConfig, f: ModelFlavor, r: int, g: int, others: Sequence[ModelFlavor] = ()
) -> tuple[int, int, tuple[int, int]]:
    """The largest scoring transient over the micro-batch shapes the scorer can form; (body, head, (rows, width)).
    ``f``: the Reference (policy head); ``others``: the Critic's and Reward's flavors (their bodies run too)."""
    gen = cfg.generation
    longest = cfg.sequence_budget
    best = (0, 0, (1, longest))
    for rows in range(1, gen.max_slots + 1):
        width = longest if rows == 1 else min(longest, gen.scoring_max_tokens // rows)
        if width < 2:
            break
        body, head = scoring_bytes(f, rows, width, r, g)
        body = max([body, *(body_peak_bytes(o, rows * width, r, g) for o in others)])
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


# ---------------------------------------------------------------------------------------------- layouts on meta


@dataclass(frozen=True)
class TensorInfo:
    """One parameter of a built module: its full shape, this rank's share, and how it is sharded."""

    name: str
    shape: tuple[int, ...]
    local_numel: int
    itemsize: int
    placements: tuple = ()
    mesh_dims: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    box: Box | None = None  # this rank's box (fusedrl.distributed.reshard.local_box)

    @property
    def local_bytes(self) -> int:
        return self.local_numel * self.itemsize

    def unsharded_numel(self) -> int:
        """Numel once FSDP2 all-gathers it (its TP share)."""
        n = 1
        for s in self.shape:
            n *= s
        for dim, size, p in zip(self.mesh_dims, self.mesh_shape, self.placements):
            if dim != "dp_shard" and not p.is_replicate():
                n //= size
        return n


def offload_seconds(host_bytes: int) -> float:
    """Seconds per iteration that copying ``host_bytes`` of offloaded weights in adds, at ``H2D_GB_PER_S``."""
    return host_bytes / (H2D_GB_PER_S * 1e9)


def _grad_numel(x: TensorInfo) -> int:
    """Numel of the unsharded gradient FSDP2 accumulates for ``x``: its TP share, except for a vocabulary-parallel
    embedding, whose gradient DTensor's backward produces at full size (measured by ``--measure`` at tp = 2)."""
    if x.name.endswith("tok_embeddings.weight"):
        return x.shape[0] * x.shape[1]
    return x.unsharded_numel()


def describe(module: nn.Module) -> list[TensorInfo]:
    """The parameters of ``module`` (meta DTensors or plain tensors) as :class:`TensorInfo`."""
    from fusedrl.distributed.reshard import local_box

    out = []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            assert mesh.mesh_dim_names is not None  # fusedrl's meshes name their dimensions
            out.append(
                TensorInfo(
                    name,
                    tuple(p.shape),
                    p.to_local().numel(),
                    p.element_size(),
                    tuple(p.placements),
                    tuple(mesh.mesh_dim_names),
                    tuple(mesh.shape),
                    local_box(p),
                )
            )
        else:
            out.append(TensorInfo(name, tuple(p.shape), p.numel(), p.element_size(), box=local_box(p)))
    return out


@dataclass
class StageInfo:
    model: str  # actor | critic
    index: int
    layers: int
    first: bool
    last: bool
    tensors: list[TensorInfo]
    rope: int
    head_in_loss: bool  # a last stage that returns hidden states (the loss applies the LM head in chunks)


@dataclass
class RankBuild:
    """What one rank's layouts hold, read from the modules built on meta."""

    rank: int
    coords: dict[str, int]
    stages: dict[str, StageInfo]
    rollout: dict[str, list[TensorInfo]]
    rollout_rope: dict[str, int]
    kv_heads: int  # the engine's KV heads on this rank


def rank_coords(cfg: JobConfig, rank: int) -> dict[str, int]:
    """Coordinates of ``rank`` in the training mesh ``(pp, dp_shard, tp)``, the Critic's replica mesh
    ``(critic_replica, critic_pp, dp_shard, tp)`` and the generation mesh ``(gen_dp, gen_tp)`` (all row-major over
    the ranks, as ``init_device_mesh`` lays them out)."""
    p = cfg.parallelism
    pp = rank // (p.dp_shard * p.tp)
    return {
        "pp": pp,
        "critic_replica": pp // p.critic_stages,
        "critic_pp": pp % p.critic_stages,
        "dp_shard": rank // p.tp % p.dp_shard,
        "tp": rank % p.tp,
        "gen_dp": rank // p.gen_tp,
        "gen_tp": rank % p.gen_tp,
    }


def distinct_ranks(cfg: JobConfig) -> list[int]:
    """Every pipeline rank with its first and last dp_shard rank, TP rank 0 (see the module docstring)."""
    p = cfg.parallelism
    return sorted({(pp * p.dp_shard + d) * p.tp for pp in range(p.pp) for d in (0, p.dp_shard - 1)})


def fake_group(rank: int, world: int) -> None:
    """Play rank ``rank`` of ``world`` under a fake process group, with DTensor's sharding-propagation caches
    emptied first: their keys ignore the rank, so a cached output spec would carry the previous rank's mesh (and
    mesh coordinate) into this rank's FSDP2 parameters (torch internals, read by nothing else in fusedrl)."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    init_fake_process_group(rank, world)


def build_rank(cfg: JobConfig, rank: int, world: int) -> RankBuild:
    """Build rank ``rank``'s training and rollout layouts on meta under a fake process group and describe them."""
    fake_group(rank, world)
    try:
        device = torch.device("cpu")  # the mesh's device type; with materialize=False nothing is allocated
        training = build_training_layout(cfg, device, materialize=False)
        rollout = build_rollout_layout(cfg, device, materialize=False)
        stages = {}
        for model, module, index in (
            (ACTOR, training.actor_stage, training.pp_rank),
            (CRITIC, training.critic_stage, training.critic_index),
        ):
            last = module.output is not None
            stages[model] = StageInfo(
                model,
                index,
                len(module.layers),
                module.tok_embeddings is not None,
                last,
                describe(module),
                rope_bytes(module),
                last and not getattr(module, "apply_head", True),
            )
        models = {name: m for name in ROLLOUT_MODELS if (m := getattr(rollout, name)) is not None}
        kv_heads = models["actor"].layers[0].attn.num_kv_heads  # apply_tp divided it by gen_tp
        return RankBuild(
            rank,
            rank_coords(cfg, rank),
            stages,
            {n: describe(m) for n, m in models.items()},
            {n: rope_bytes(m) for n, m in models.items()},
            kv_heads,
        )
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- weight sync


_BOX_CACHE: dict[tuple, Box | None] = {}


def _box_at(t: TensorInfo, coords: dict[str, int]) -> Box | None:
    """The box of ``t`` held at the mesh coordinates ``coords`` (None when empty)."""
    if not t.placements:
        return Box(tuple(0 for _ in t.shape), t.shape)
    coordinate = tuple(coords[d] for d in t.mesh_dims)
    key = (t.shape, repr(t.placements), t.mesh_shape, coordinate)
    if key not in _BOX_CACHE:
        idx = shard_indices(t.shape, t.placements, t.mesh_shape, coordinate)
        if any(len(i) == 0 for i in idx):
            _BOX_CACHE[key] = None
        else:
            for d, i in enumerate(idx):
                if int(i[-1]) - int(i[0]) + 1 != len(i):
                    raise ValueError(f"{t.name}: the shard at {coordinate} is not one block along dim {d}")
            _BOX_CACHE[key] = Box(tuple(int(i[0]) for i in idx), tuple(len(i) for i in idx))
    return _BOX_CACHE[key]


def all_rank_boxes(
    cfg: JobConfig,
    world: int,
    builds: dict[int, RankBuild],
    model: str,
) -> list[tuple[dict, dict]]:
    """Per rank, ``({name: (shape, box)} of its training stage of ``model``, {name: (shape, box, dtype)} of its
    rollout copy)``: what :func:`fusedrl.distributed.plan_reshard` gathers from every rank."""
    by_pp: dict[int, RankBuild] = {}
    for b in builds.values():
        by_pp.setdefault(b.coords["pp"], b)
    reference = next(iter(builds.values()))
    dtype = DTYPES[cfg.training.rollout_dtype]
    everyone = []
    for rank in range(world):
        coords = rank_coords(cfg, rank)
        stage = by_pp[coords["pp"]].stages[model]
        src = {t.name: (t.shape, box) for t in stage.tensors if (box := _box_at(t, coords)) is not None}
        dst = {t.name: (t.shape, box, dtype) for t in reference.rollout[model] if (box := _box_at(t, coords)) is not None}
        everyone.append((src, dst))
    for b in builds.values():  # the arithmetic must agree with the DTensors the built ranks hold
        mine_src, mine_dst = everyone[b.rank]
        for t in b.stages[model].tensors:
            if t.local_numel and mine_src[t.name][1] != t.box:
                raise RuntimeError(f"rank {b.rank} {t.name}: computed box {mine_src[t.name][1]} != built {t.box}")
        for t in b.rollout[model]:
            if t.local_numel and mine_dst[t.name][1] != t.box:
                raise RuntimeError(f"rank {b.rank} rollout {t.name}: computed box {mine_dst[t.name][1]} != built {t.box}")
    return everyone


def plan_for(everyone: list[tuple[dict, dict]]) -> ReshardPlan:
    """The real weight-sync plan from every rank's boxes (under an initialised fake process group)."""

    def gather(out: list, obj: Any, group: Any = None) -> None:
        out[:] = everyone

    with mock.patch.object(dist, "all_gather_object", gather):
        return plan_reshard({}, {})


def _contiguous_within(box: Box, outer: Box) -> bool:
    """Whether ``box`` is one contiguous run of the row-major local tensor of ``outer``."""
    partial = [d for d, (a, b) in enumerate(zip(box.sizes, outer.sizes)) if a < b]
    return not partial or all(box.sizes[d] == 1 for d in range(partial[-1]))


def sync_transients(
    plan: ReshardPlan, everyone: list[tuple[dict, dict]], src_itemsize: int, ranks: Iterable[int]
) -> dict[int, dict[str, int]]:
    """Per rank in ``ranks``: the largest bytes :func:`fusedrl.distributed.reshard` holds at once beyond the two
    layouts' own tensors, replaying its loop over ``plan``: receive buffers and send blocks (a cast, or the
    ``contiguous()`` copy of a strided slice) live until the next unit starts, a block the rank keeps itself until
    the next block replaces it, and the loop variables ``buf`` / ``block`` keep the last receive buffer and block of
    a unit alive into the next one. Returns ``{"total": peak, "recv": ..., "send": ...}`` (the unit's receive and
    send bytes at the peak) and ``"unit"``: the largest receive + send bytes of one unit."""
    best = {}
    for r in ranks:
        peak = {"total": 0, "recv": 0, "send": 0}
        largest = 0
        buf = block = 0  # bytes the loop variables hold (0: nothing, or a view of a source shard)
        block_in_ops = buf_in_incoming = False
        for unit in plan.units:
            # ``ops = []`` / ``incoming = []``: the previous unit's tensors go, but for what buf / block still hold
            live = buf + block
            recv = send = 0
            buf_in_incoming = block_in_ops = False
            for t in unit:
                if r not in (t.src, t.dst):
                    continue
                wire = plan.wire_dtype[t.name].itemsize
                nbytes = t.box.numel * wire
                if t.src == r:
                    cast = wire != src_itemsize
                    strided = not _contiguous_within(t.box, everyone[t.src][0][t.name][1])
                    new = nbytes if cast else 0
                    live += new + (nbytes if t.dst != r and strided and not cast else 0)
                    if not block_in_ops:
                        live -= block  # the previous block is dropped unless a send still holds it
                    block, block_in_ops = new, t.dst != r
                    if t.dst != r:
                        send += nbytes if cast or strided else 0
                else:
                    live += nbytes
                    recv += nbytes
                    if not buf_in_incoming:
                        live -= buf
                    buf, buf_in_incoming = nbytes, True
                if live > peak["total"]:
                    peak = {"total": live, "recv": recv, "send": send}
            largest = max(largest, recv + send)
        best[r] = {**peak, "unit": largest}
    return best


# ---------------------------------------------------------------------------------------------- the estimate


def training_walk(
    program: LoweredProgram,
    pp_rank: int,
    per_mb: dict[str, int],
    logits_mb: int,
    params: dict[str, int],
    grads: dict[str, int],
    loss_transient: int,
    recompute: dict[str, int],
    first_unit_grads: dict[str, int],
) -> tuple[dict[str, int], dict[str, int], int]:
    """Walk ``pp_rank``'s lowered program and find its largest training-step moment.

    A model's micro-batch holds ``per_mb`` bytes (+ ``logits_mb`` for the Actor) from its F to its B (W when the
    backward is split); the model's unsharded parameters (``params``) exist from its first F, its unsharded
    gradients (``grads``) from its first backward; ``loss_transient`` joins during the Actor's F and B on the rank
    holding its last stage; ``recompute`` (per model: one layer's activations rebuilt by activation checkpointing,
    0 without it) joins during the model's B and I (the larger of the two when both apply: the loss's backward
    ends first). A backward is charged at its start (the micro-batch still held, the model's gradients as they
    were) or at its end (released, gradients present), whichever is larger; the model's first backward that computes
    weight gradients (B, or W when split) is charged at its start with ``first_unit_grads`` more (autograd writes the
    gradients of the stage's last FSDP2 unit before it frees that unit's saved activations). Returns (per model the most
    micro-batches held at once, the categories live at the largest moment, the largest activations + logits
    alone)."""
    count = {ACTOR: 0, CRITIC: 0}
    most = dict(count)
    gathered: set[str] = set()
    graded: set[str] = set()
    split = {m: any(a.kind == "W" for a in program.programs[pp_rank] if a.model == m) for m in count}
    best: dict[str, int] = {}
    held = 0

    def moment(transient: int, rebuilt: int, first: int = 0) -> dict[str, int]:
        return {
            "unsharded_params": sum(params[x] for x in gathered),
            "unsharded_grads": sum(grads[x] for x in graded) + first,
            "activations": sum(count[x] * per_mb[x] for x in count),
            "actor_logits": count[ACTOR] * logits_mb,
            "logits_transient": transient,
            "recompute": rebuilt,
        }

    for a in program.programs[pp_rank]:
        if a.kind not in ("F", "B", "I", "W"):
            continue
        m = a.model
        transient = loss_transient if m == ACTOR and a.kind in ("F", "B", "I") else 0
        rebuilt = recompute[m] if a.kind in ("B", "I") else 0
        if transient and rebuilt:  # the loss's backward ends before the layers' recomputation starts
            transient, rebuilt = (transient, 0) if transient >= rebuilt else (0, rebuilt)
        if a.kind == "F":
            gathered.add(m)
            count[m] += 1
            most[m] = max(most[m], count[m])
        writes_grads = a.kind == ("W" if split[m] else "B")
        candidates = [moment(transient, rebuilt, first_unit_grads[m] if writes_grads and m not in graded else 0)]
        held = max(held, candidates[0]["activations"] + candidates[0]["actor_logits"])
        if a.kind in ("B", "W"):
            graded.add(m)
            if a.kind == ("W" if split[m] else "B"):
                count[m] -= 1
            candidates.append(moment(0, 0))
        best = max([best, *candidates], key=lambda d: sum(d.values()))
    return most, best, held


@dataclass
class RankEstimate:
    """One rank's figures in bytes: persistent state, transients, and what is live at each phase's peak."""

    rank: int
    coords: dict[str, int]
    persistent: dict[str, int]
    transients: dict[str, int]
    phases: dict[str, dict[str, int]]
    details: dict[str, Any] = field(default_factory=dict)

    def phase_peak(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def host_total(self) -> int:
        """Bytes this rank keeps in host memory between rollouts (``training.offload_frozen``)."""
        return sum(self.details["host"].values())

    @property
    def persistent_total(self) -> int:
        return sum(self.persistent.values())

    @property
    def peak(self) -> tuple[int, str]:
        return max((self.phase_peak(p), p) for p in PHASES)


@dataclass
class Estimate:
    config: str
    world: int
    ranks: list[RankEstimate]
    notes: list[str]

    def max_over_ranks(self, phase: str, category: str) -> tuple[int, int]:
        """(bytes, rank) of the rank with the most of ``category`` at ``phase``'s peak."""
        return max(((r.phases[phase].get(category, 0), r.rank) for r in self.ranks), key=lambda x: (x[0], -x[1]))


def estimate_rank(
    cfg: JobConfig,
    build: RankBuild,
    program: LoweredProgram,
    sync: dict[str, int],
    pipeline_seqs: Sequence[int],
    seq_len: int | None = None,
) -> RankEstimate:
    """The figures of one built rank (module docstring); ``seq_len``: the training micro-batch length (default
    :func:`training_seq_len`)."""
    t, par, gen = cfg.training, cfg.parallelism, cfg.generation
    c, r, frozen, kv = (
        _itemsize(t.mixed_precision_param),
        _itemsize(t.rollout_dtype),
        _itemsize(t.frozen_dtype),
        _itemsize(t.kv_cache_dtype),
    )
    accum = 4 if t.mixed_precision_reduce != t.mixed_precision_param else c
    rows, seq = cfg.ppo.microbatch_size, seq_len or training_seq_len(cfg)
    flavors = {ACTOR: model_flavor(cfg, "actor"), CRITIC: model_flavor(cfg, "critic")}
    actor = flavors[ACTOR]
    n_mb = program.microbatches[ACTOR]

    persistent: dict[str, int] = {}
    for m, st in build.stages.items():
        persistent[f"train_params_{m}"] = sum(x.local_bytes for x in st.tensors)
    for m, st in build.stages.items():
        persistent[f"optimizer_{m}"] = 2 * sum(4 * x.local_numel for x in st.tensors)
    for name in ROLLOUT_MODELS:
        persistent[f"rollout_{name}"] = sum(x.local_bytes for x in build.rollout.get(name, ()))  # 0: no Reward model
    longest = cfg.sequence_budget
    positions = longest + 1  # the engine's cache keeps one spare position
    persistent["kv_cache"] = actor.num_layers * 2 * gen.max_slots * positions * build.kv_heads * actor.head_dim * kv
    persistent["rope_buffers"] = sum(st.rope for st in build.stages.values()) + sum(build.rollout_rope.values())
    pipe = 0
    for m, st in build.stages.items():
        kinds = (not st.first) + (not st.last)
        pipe += sum(kinds * program.microbatches[m] * rows * s * flavors[m].embed_dim * c for s in pipeline_seqs)
    persistent["pipeline_buffers"] = pipe

    ac = t.activation_checkpointing == "full"
    per_mb = {
        m: stage_activation_bytes(
            flavors[m],
            st.layers,
            st.first,
            st.last,
            "policy" if m == ACTOR else "value",
            rows,
            seq,
            c,
            par.tp,
            st.head_in_loss,
            ac,
        )
        for m, st in build.stages.items()
    }
    recompute = {
        m: layer_activation_bytes(flavors[m], rows * seq, c, par.tp) if ac and st.layers else 0 for m, st in build.stages.items()
    }
    actor_stage = build.stages[ACTOR]
    chunked = actor_stage.last and actor_stage.head_in_loss
    logits_mb = actor_logits_bytes(actor, rows, seq) if actor_stage.last and not chunked else 0
    chunk = rows * min(logits_chunk_positions(rows, actor.vocab_size), seq - 1) * actor.vocab_size * 4
    stage_params = {m: c * sum(x.unsharded_numel() for x in st.tensors) for m, st in build.stages.items()}
    stage_grads = {m: accum * sum(_grad_numel(x) for x in st.tensors) for m, st in build.stages.items()}
    loss_transient = (
        CHUNKED_HEAD_MULTIPLE * chunk
        if chunked
        else LOGITS_TRANSIENT_MULTIPLE * 4 * rows * (seq - 1) * actor.vocab_size
        if actor_stage.last
        else 0
    )
    groups: dict[str, int] = {}  # FSDP2 units: one per transformer layer, the root holds the rest
    for st in build.stages.values():
        for x in st.tensors:
            key = f"{st.model}.{'.'.join(x.name.split('.')[:2]) if x.name.startswith('layers.') else 'root'}"
            groups[key] = groups.get(key, 0) + accum * x.unsharded_numel()
    # the unit whose gradients a first backward writes before freeing anything: the stage's last layer (its root
    # alone when it has no layer)
    first_unit_grads = {
        m: groups[max((k for k in groups if k.startswith(f"{m}.layers.")), key=lambda k: int(k.split(".")[2]))]
        if st.layers
        else stage_grads[m]
        for m, st in build.stages.items()
    }
    most, compute, held = training_walk(
        program, build.coords["pp"], per_mb, logits_mb, stage_params, stage_grads, loss_transient, recompute, first_unit_grads
    )
    transients = {
        "weight_sync_buffers": sync["total"],
        "unsharded_params": sum(stage_params.values()),
        "unsharded_grads": sum(stage_grads.values()),
        "activations": compute["activations"],
        "actor_logits": compute["actor_logits"],
        "logits_transient": loss_transient,
        "recompute": compute["recompute"],
        "reduce_scatter": max(groups.values()),
        "experience": 2 * cfg.ppo.batch_size * seq * EXPERIENCE_BYTES_PER_TOKEN,
        "optimizer_step": sum(4 * x.local_numel for st in build.stages.values() for x in st.tensors),
    }
    g = par.gen_tp
    # migrated requests re-prefill their prompt and generated tokens in "reprefill" mode
    reprefill = cfg.fusion.inter_stage and cfg.fusion.migration_mode == "reprefill"
    width = longest - 1 if reprefill else cfg.data.max_prompt_len
    transients["prefill_activations"] = prefill_bytes(actor, gen.max_slots, width, r, g)
    transients["decode_logits"] = decode_logits_bytes(actor, gen.max_slots)
    scored_bodies = (flavors[CRITIC], model_flavor(cfg, "reward")) if cfg.model.uses_reward_model else (flavors[CRITIC],)
    body, head, shape = worst_scoring_bytes(cfg, actor, max(r, frozen), g, scored_bodies)
    transients["scoring_activations"], transients["scoring_logits"] = body, head
    gradients = {f"gradients_{m}": persistent[f"train_params_{m}"] for m in build.stages}

    def pick(*names: str) -> dict[str, int]:
        return {n: transients[n] for n in names}

    def larger(a: str, b: str) -> dict[str, int]:
        return pick(a if transients[a] >= transients[b] else b)

    moments = [  # see the module docstring: compute, gradient reduction, optimizer step
        {**compute, **pick("experience")},
        pick("unsharded_params", "unsharded_grads", "reduce_scatter", "experience"),
        {**gradients, **pick("optimizer_step", "experience")},
    ]
    # training.offload_frozen: the Reference and the Reward are on the device during the rollout only
    offloaded = {k: persistent.pop(k) for k in OFFLOADED if t.offload_frozen}
    training_moment = max(moments, key=lambda d: sum(d.values()))
    phases = {
        "weight_sync": {**persistent, **pick("weight_sync_buffers")},
        "generation": {**persistent, **offloaded, **larger("prefill_activations", "decode_logits")},
        "scoring": {**persistent, **offloaded, **larger("scoring_activations", "scoring_logits")},
        "training": {**persistent, **training_moment},
    }
    details = {
        "in_flight_max": most,
        "training_compute_peak": compute,
        "activation_peak": held,
        "activation_bytes_per_microbatch": per_mb,
        "actor_logits_bytes_per_microbatch": logits_mb,
        "microbatches": n_mb,
        "seq_len": seq,
        "gradients": gradients,
        "weight_sync_unit": sync,
        "scoring_microbatch": list(shape),
        "stage_layers": {m: st.layers for m, st in build.stages.items()},
        "host": offloaded,
    }
    return RankEstimate(build.rank, build.coords, persistent, transients, phases, details)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def estimate(
    cfg: JobConfig,
    world: int | None = None,
    *,
    config_name: str = "",
    ranks: Sequence[int] | None = None,
    program: LoweredProgram | None = None,
    pipeline_seqs: Sequence[int] | None = None,
    pipeline_shapes: int | None = None,
    seq_len: int | None = None,
    progress: Callable[[str], None] | None = _progress,
) -> Estimate:
    """Build the distinct ranks (or ``ranks``) of a ``world``-rank job on meta and estimate their memory.

    ``program``: the lowered training program (default: :func:`fusedrl.rlhf.plan_program`, the schedule search with
    the config's budget); ``pipeline_seqs``: the sequence buckets whose pipeline stages are cached (default: the
    longest ``STAGE_CACHE_SIZE`` of the ``pipeline_shapes`` longest buckets a run visits, every bucket by default);
    ``seq_len``: the training micro-batch length (default: the longest
    bucket)."""
    from fusedrl.rlhf import plan_program

    par = cfg.parallelism
    world = par.pp * par.dp_shard * par.tp if world is None else world
    check_dims(cfg, world)
    if dist.is_initialized():
        raise RuntimeError(
            "the memory estimate plays every rank under its own fake process group; call it in a "
            "process without an initialised default process group"
        )
    say = progress or (lambda _: None)
    wanted = list(ranks) if ranks is not None else distinct_ranks(cfg)
    to_build = sorted(set(wanted) | {(pp * par.dp_shard) * par.tp for pp in range(par.pp)})
    start = time.perf_counter()
    builds: dict[int, RankBuild] = {}
    for i, rank in enumerate(to_build, 1):
        c = rank_coords(cfg, rank)
        say(
            f"[memory] building rank {rank} ({i}/{len(to_build)}: pp={c['pp']} dp_shard={c['dp_shard']} tp={c['tp']}) "
            f"of {world}, {time.perf_counter() - start:.1f}s"
        )
        builds[rank] = build_rank(cfg, rank, world)
    syncs: dict[int, dict[str, Any]] = {r: {"total": 0, "unit": 0} for r in wanted}
    fake_group(0, world)
    try:
        for model in (ACTOR, CRITIC):
            say(f"[memory] planning the {model} weight sync over {world} ranks, {time.perf_counter() - start:.1f}s")
            everyone = all_rank_boxes(cfg, world, builds, model)
            per_rank = sync_transients(plan_for(everyone), everyone, 4, wanted)
            for rank, figures in per_rank.items():
                unit = max(figures["unit"], syncs[rank]["unit"])  # the Actor's and the Critic's syncs run in turn
                if figures["total"] > syncs[rank]["total"]:
                    syncs[rank] = {**figures, "model": model}
                syncs[rank]["unit"] = unit
    finally:
        dist.destroy_process_group()
    if program is None:
        say(f"[memory] planning the training program (schedule search budget {cfg.fusion.schedule_search_budget_s} s)")
        program, _ = plan_program(cfg, cfg.sequence_budget)
    if pipeline_seqs is None:
        longest = cfg.sequence_budget
        visited = list(evenly_spaced(longest))[-max(1, pipeline_shapes or len(evenly_spaced(longest))) :]
        pipeline_seqs = visited[-STAGE_CACHE_SIZE:]  # what the executor keeps; the last one is training_seq_len
    results = [estimate_rank(cfg, builds[r], program, syncs[r], pipeline_seqs, seq_len) for r in wanted]
    say(f"[memory] done in {time.perf_counter() - start:.1f}s")
    notes = (
        []
        if ranks is not None
        else [
            (
                f"ranks built: {', '.join(map(str, wanted))} (every pipeline rank with its first and last dp_shard rank, TP "
                "rank 0; the other ranks of a stage differ only by uneven FSDP2 chunks, and every rank holds the same rollout "
                "shares)"
            )
        ]
    )
    notes.append(
        f"pipeline buffers counted for sequence buckets {list(pipeline_seqs)} (the executor keeps a stage pair per "
        f"trained bucket, at most {STAGE_CACHE_SIZE}, the least recently used evicted)"
    )
    return Estimate(config_name, world, results, notes)


# ---------------------------------------------------------------------------------------------- output


def _gib(n: float) -> float:
    return n / GIB


def categories(est: Estimate) -> list[str]:
    """Every category that appears at some phase peak, persistent ones first."""
    seen: dict[str, None] = {}
    for r in est.ranks:
        for name in r.persistent:
            seen.setdefault(name)
    for phase in PHASES:
        for r in est.ranks:
            for name in r.phases[phase]:
                seen.setdefault(name)
    return [n for n in seen if any(est.max_over_ranks(p, n)[0] for p in PHASES)]


def format_table(est: Estimate, device_gib: float) -> str:
    """Per category and phase: the largest bytes over ranks (GiB) and the rank holding them; then per rank."""
    width = 14
    lines = [f"memory per rank: {est.config}, {est.world} ranks (GiB at each phase's peak, max over ranks, rank)"]
    lines.append(f"{'category':<22}" + "".join(f"{p:>{width}}" for p in PHASES))
    for name in categories(est):
        cells = []
        for phase in PHASES:
            value, rank = est.max_over_ranks(phase, name)
            cells.append(f"{_gib(value):>8.3f} r{rank:<4}" if value else f"{'-':>8}      ")
        lines.append(f"{name:<22}" + "".join(f"{c:>{width}}" for c in cells))
    peaks = []
    for phase in PHASES:
        value, rank = max((r.phase_peak(phase), r.rank) for r in est.ranks)
        peaks.append(f"{_gib(value):>8.3f} r{rank:<4}")
    lines.append(f"{'phase peak':<22}" + "".join(f"{c:>{width}}" for c in peaks))
    lines.append("")
    lines.append(
        f"{'rank':>5} {'pp':>3} {'dp':>3} {'tp':>3} {'persistent':>11} {'peak':>8}  {'phase':<12} in flight (actor, critic)"
    )
    for r in est.ranks:
        value, phase = r.peak
        flight = r.details["in_flight_max"]
        lines.append(
            f"{r.rank:>5} {r.coords['pp']:>3} {r.coords['dp_shard']:>3} {r.coords['tp']:>3} "
            f"{_gib(r.persistent_total):>11.2f} {_gib(value):>8.2f}  {phase:<12} "
            f"{flight[ACTOR]}, {flight[CRITIC]}"
        )
    persistent = max(r.persistent_total for r in est.ranks)
    peak, worst = max((r.peak[0], r.rank) for r in est.ranks)
    lines.append("")
    lines.extend(f"note: {n}" for n in est.notes)
    verdict = "fits" if _gib(peak) <= device_gib else "does NOT fit"
    host = max(r.host_total for r in est.ranks)
    if host:
        lines.append(
            f"host memory per rank {_gib(host):.2f} GiB (Reference and Reward, training.offload_frozen): "
            f"copying them in adds {offload_seconds(host):.2f} s per iteration at an assumed "
            f"{H2D_GB_PER_S:g} GB/s"
        )
    lines.append(
        f"per-rank persistent {_gib(persistent):.2f} GiB, per-rank peak {_gib(peak):.2f} GiB (rank {worst}, "
        f"{est.ranks[[r.rank for r in est.ranks].index(worst)].peak[1]}): {verdict} in {device_gib:g} GiB"
    )
    return "\n".join(lines)


def to_json(est: Estimate, device_gib: float) -> dict:
    """The ``--json`` object: maxima over ranks in GiB, and every rank's figures."""
    phases = {}
    for phase in PHASES:
        value, rank = max((r.phase_peak(phase), r.rank) for r in est.ranks)
        phases[phase] = {
            "peak_gib": round(_gib(value), 3),
            "rank": rank,
            "categories_gib": {
                n: round(_gib(est.max_over_ranks(phase, n)[0]), 3) for n in categories(est) if est.max_over_ranks(phase, n)[0]
            },
        }
    peak = max(r.peak[0] for r in est.ranks)
    ranks = {
        str(r.rank): {
            "coords": r.coords,
            "persistent_gib": round(_gib(r.persistent_total), 3),
            "peak_gib": round(_gib(r.peak[0]), 3),
            "peak_phase": r.peak[1],
            "persistent": r.persistent,
            "transients": r.transients,
            "phase_peaks_gib": {p: round(_gib(r.phase_peak(p)), 3) for p in PHASES},
            "in_flight_max": r.details["in_flight_max"],
            "host_gib": round(_gib(r.host_total), 3),
        }
        for r in est.ranks
    }
    host = max(r.host_total for r in est.ranks)
    return {
        "config": est.config,
        "world": est.world,
        "device_gib": device_gib,
        "per_rank_persistent_gib": round(_gib(max(r.persistent_total for r in est.ranks)), 3),
        "per_rank_peak_gib": round(_gib(peak), 3),
        "fits": _gib(peak) <= device_gib,
        "phases": phases,
        "per_rank_host_gib": round(_gib(host), 3),
        "offload_s_per_iteration": round(offload_seconds(host), 3),
        "ranks": ranks,
    }


# ---------------------------------------------------------------------------------------------- --measure


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding ``t``'s data: a DTensor's local shard; the inner tensor of an async collective's result
    (a wrapper subclass without storage of its own, which TP's functional collectives return until waited on)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if type(local) is not torch.Tensor and not isinstance(local, nn.Parameter) and hasattr(local, "wait"):
        local = local.wait()
    return local.untyped_storage()


def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _storage(t)
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _ptrs(tensors: Iterable[torch.Tensor | None]) -> set[int]:
    out = set()
    for t in tensors:
        if t is not None:
            out.add(_storage(t).data_ptr())
    return out


def _stage_buffers(stage: Any) -> list[torch.Tensor]:
    """The receive and gradient-receive buffers a ``PipelineStage`` preallocated."""
    out: list[torch.Tensor] = []
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        out.extend(i.buffer for i in infos if getattr(i, "buffer", None) is not None)
    return out


def _fsdp_unsharded_grads(module: nn.Module) -> list[torch.Tensor]:
    """FSDP2's accumulated unsharded gradients of ``module`` (torch internals: read-only, for measurement)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        for p in getattr(group, "fsdp_params", ()):
            grad = p.unsharded_accumulated_grad
            if grad is None and hasattr(p, "_unsharded_param"):
                grad = p._unsharded_param.grad
            if grad is not None:
                out.append(grad)
    return out


def _profile_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` under the profiler with CPU memory events; (its result, peak net bytes allocated during it).

    Counts the calling thread's allocations, and another thread's only when that thread keeps memory past the end:
    gloo's worker threads allocate and free their own scratch for each collective (one unit's worth per all-gather),
    and when those frees land depends on how the OS schedules that thread, not on the step (NCCL has no such host
    scratch)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_PROFILED_RANGE):
            result = fn()
    everything = prof.profiler.kineto_results.events()
    caller = next(e.start_thread_id() for e in everything if e.name() == _PROFILED_RANGE)
    memory = [e for e in everything if e.name() == "[memory]"]
    kept: dict[int, int] = {}
    for e in memory:
        kept[e.start_thread_id()] = kept.get(e.start_thread_id(), 0) + e.nbytes()
    counted = {caller} | {thread for thread, net in kept.items() if net}
    events = sorted((e for e in memory if e.start_thread_id() in counted), key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return result, peak


_PROFILED_RANGE = "fusedrl.bench.memory.measured"


class _SavedTensors:
    """Live bytes of autograd's saved tensors (and held stage outputs) per in-flight micro-batch of a training step.

    ``PipelineStage.forward_one_chunk`` sets the current micro-batch (the loss that follows is charged to it too);
    a full backward releases it. Storages of parameters, buffers and receive buffers are left out at the end.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple, dict[int, int]]] = []
        self.current: tuple | None = None
        self.excluded: set[int] = set()
        self.per_key: dict[tuple, dict[int, int]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.current is not None and not t.is_meta:
            s = _storage(t)
            self.per_key.setdefault(self.current, {})[s.data_ptr()] = s.nbytes()
        return t

    def forward(self, key: tuple, output: Any, stage: Any) -> None:
        self.current = key
        outputs = output if isinstance(output, tuple) else (output,)
        held = self.per_key.setdefault(key, {})
        for o in outputs:
            if isinstance(o, torch.Tensor):
                storage = _storage(o)
                held[storage.data_ptr()] = storage.nbytes()
        self.events.append(("F", key, held))
        self.excluded |= _ptrs(stage.submod.parameters()) | _ptrs(stage.submod.buffers()) | _ptrs(_stage_buffers(stage))

    def release(self, key: tuple) -> None:
        self.events.append(("B", key, {}))

    def peak(self) -> tuple[int, dict[tuple, int]]:
        """(largest live bytes over the step, bytes per micro-batch key)."""
        sizes = {k: sum(n for p, n in v.items() if p not in self.excluded) for k, v in self.per_key.items()}
        live: set[tuple] = set()
        peak = 0
        for kind, key, _ in self.events:
            (live.add if kind == "F" else live.discard)(key)
            peak = max(peak, sum(sizes[k] for k in live))
        return peak, sizes


def _measure_worker(argv: list[str], out: str) -> dict[str, Any]:
    """On every rank: run the trainer for two iterations and sum the live bytes of each category."""
    from torch.distributed.pipelining import PipelineStage

    from fusedrl.trainer import Trainer

    cfg = load_config([*argv, f"--job.output_dir={out}"])
    trainer = Trainer(cfg)
    layout, rollout, engine = trainer.layout, trainer.rollout, trainer.engine
    engine._forward.cpu_layouts = False  # the CPU-only weight layout copies would count as prefill transients
    stage_modules = {ACTOR: layout.actor_stage, CRITIC: layout.critic_stage}
    got: dict[str, Any] = {"unsharded": {}, "sync": {}, "profiled": {}, "activations": {}}
    names = {id(layout.actor_stage): ACTOR, id(layout.critic_stage): CRITIC}

    # weight sync: bytes of each unit's P2P batch (sends and receive buffers)
    def wrap_sync(sync: Any, model: str) -> None:
        original = sync.sync
        real_batch = dist.batch_isend_irecv
        sources = _ptrs(sync._src.values())  # a send of a slice that needs no copy is a view of its source shard

        def batch(ops: list) -> Any:
            fresh = _storage_bytes(o.tensor for o in ops if _storage(o.tensor).data_ptr() not in sources)
            got["sync"][model] = max(got["sync"].get(model, 0), fresh)
            return real_batch(ops)

        calls = [0]

        def wrapped() -> Any:
            calls[0] += 1
            with mock.patch.object(dist, "batch_isend_irecv", batch):
                if calls[0] == 1:  # the first sync also allocates one-time state (communication, dispatch caches)
                    return original()
                result, peak = _profile_peak(original)
            got["profiled"][f"weight_sync_{model}"] = max(got["profiled"].get(f"weight_sync_{model}", 0), peak)
            return result

        sync.sync = wrapped

    for sync, model in zip(trainer.syncs, (ACTOR, CRITIC)):
        wrap_sync(sync, model)

    # training: unsharded params / grads before the reduction; saved tensors per micro-batch
    saved = _SavedTensors()
    real_reduce, real_forward, real_backward = (
        PipelineStage.perform_reduce_grad,
        PipelineStage.forward_one_chunk,
        PipelineStage.backward_one_chunk,
    )

    def reduce(self: PipelineStage, *args: Any, **kwargs: Any) -> Any:
        model = names[id(self.submod)]
        # all-gathered: plain tensors, or DTensors left on the TP mesh only
        params = [
            p
            for p in self.submod.parameters()
            if not isinstance(p, DTensor) or "dp_shard" not in (p.device_mesh.mesh_dim_names or ())
        ]
        figures = {"params": _storage_bytes(params), "grads": _storage_bytes(_fsdp_unsharded_grads(self.submod))}
        old = got["unsharded"].get(model, {"params": 0, "grads": 0})
        got["unsharded"][model] = {k: max(old[k], v) for k, v in figures.items()}
        return real_reduce(self, *args, **kwargs)

    def forward(self: PipelineStage, mb: int, *args: Any, **kwargs: Any) -> Any:
        saved.current = (names[id(self.submod)], mb)
        output = real_forward(self, mb, *args, **kwargs)
        saved.forward((names[id(self.submod)], mb), output, self)
        return output

    def backward(self: PipelineStage, mb: int, *args: Any, **kwargs: Any) -> Any:
        saved.current = None
        result = real_backward(self, mb, *args, **kwargs)
        if kwargs.get("full_backward", True):
            saved.release((names[id(self.submod)], mb))
        return result

    # LocalSchedule (pp = 1) has no lowered program or pipeline stages to measure
    schedule = trainer.executor.schedule
    assert isinstance(schedule, FusedPipelineSchedule), "memory --measure needs a pipelined config (pp >= 2)"
    schedule_step = schedule.step
    steps_seen = [0]

    def step(*args: Any, **kwargs: Any) -> Any:
        steps_seen[0] += 1
        _SavedTensors.__init__(saved)
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
        with (
            hooks,
            mock.patch.multiple(
                PipelineStage, perform_reduce_grad=reduce, forward_one_chunk=forward, backward_one_chunk=backward
            ),
        ):
            if steps_seen[0] == 2:  # the second minibatch: stages already built
                result, peak = _profile_peak(lambda: schedule_step(*args, **kwargs))
                got["profiled"]["training_step"] = peak
            else:
                result = schedule_step(*args, **kwargs)
        peak, sizes = saved.peak()
        if peak > got["activations"].get("peak", 0):
            largest = {m: max((v for (model, _), v in sizes.items() if model == m), default=0) for m in (ACTOR, CRITIC)}
            got["activations"] = {"peak": peak, "per_microbatch": largest}
        return result

    schedule.step = step  # type: ignore[method-assign]  # measurement: wraps this instance's step

    # gradients at the optimizer step
    for model, opt in ((ACTOR, trainer.opt.actor), (CRITIC, trainer.opt.critic)):

        def opt_step(*args: Any, _opt: Any = opt, _model: str = model, _original: Any = opt.step, **kwargs: Any) -> Any:
            key = f"gradients_{_model}"
            got[key] = max(got.get(key, 0), _storage_bytes(p.grad for p in stage_modules[_model].parameters()))
            return _original(*args, **kwargs)

        opt.step = opt_step  # type: ignore[method-assign]  # measurement: wraps this optimizer's step

    # generation and scoring transients (profiled)
    scorer: Scorer = cast(Any, trainer.controller.score).__self__  # score is the bound method Scorer.score
    real_score_mb, real_prefill, real_decode = scorer._score_micro_batch, engine._prefill, engine._decode_step

    def score_mb(samples: list) -> Any:
        width = max(s.num_tokens for s in samples)
        result, peak = _profile_peak(lambda: real_score_mb(samples))
        shape = (len(samples), width)
        best = got["profiled"].get("scoring")
        if best is None or peak > best["peak"]:
            got["profiled"]["scoring"] = {"peak": peak, "shape": shape}
        return result

    def prefill(slots: list) -> Any:
        width = max(len(s.request.prompt) + len(s.generated[:-1]) for s in slots)
        result, peak = _profile_peak(lambda: real_prefill(slots))
        best = got["profiled"].get("prefill")
        if best is None or peak > best["peak"]:
            got["profiled"]["prefill"] = {"peak": peak, "shape": (len(slots), width)}
        return result

    decodes = [0]

    def decode_step() -> Any:
        decodes[0] += 1
        if decodes[0] % 8 != 3:
            return real_decode()
        b = round_up(len(engine._active), engine.batch_buckets)  # the step pads its rows to a bucket
        result, peak = _profile_peak(real_decode)
        best = got["profiled"].get("decode")
        if best is None or peak > best["peak"]:
            got["profiled"]["decode"] = {"peak": peak, "rows": b}
        return result

    # measurement: wraps these instances' methods
    scorer._score_micro_batch, engine._prefill, engine._decode_step = score_mb, prefill, decode_step  # type: ignore[method-assign]

    for step_number in (1, 2):
        trainer.train_step(step_number)

    persistent = {}
    for model, module in stage_modules.items():
        persistent[f"train_params_{model}"] = _storage_bytes(module.parameters())
    for model, opt in ((ACTOR, trainer.opt.actor), (CRITIC, trainer.opt.critic)):
        persistent[f"optimizer_{model}"] = _storage_bytes(
            v for s in opt.state.values() for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor)
        )
    rollout_models = {name: m for name in ROLLOUT_MODELS if (m := getattr(rollout, name)) is not None}
    for name in ROLLOUT_MODELS:
        persistent[f"rollout_{name}"] = _storage_bytes(rollout_models[name].parameters() if name in rollout_models else ())
    persistent["kv_cache"] = _storage_bytes(b for n, b in engine._forward.named_buffers() if n[:2] in ("k_", "v_"))
    models = (*stage_modules.values(), *rollout_models.values())
    persistent["rope_buffers"] = _storage_bytes(b for m in models for b in m.buffers())
    stages = list(schedule._stages.items())
    persistent["pipeline_buffers"] = _storage_bytes(b for _, st in stages for b in _stage_buffers(st))
    got["pipeline_seqs"] = sorted({key[2][1] for key, _ in stages})
    got["persistent"] = persistent  # after the second iteration: offloaded frozen models are in host memory
    got["host"] = trainer.frozen.host_bytes if trainer.frozen is not None else 0
    got["program"] = schedule.program
    got["rank"] = dist.get_rank()
    return got


def measure(argv: list[str], world: int) -> list[dict[str, Any]]:
    """Run the config through the real trainer on ``world`` CPU ranks; per-rank measured bytes."""
    import tempfile

    from fusedrl.testing import run_multirank

    with tempfile.TemporaryDirectory() as out:
        return run_multirank(_measure_worker, world, argv, out, timeout_s=1800.0)


@dataclass
class Comparison:
    rank: int
    category: str
    measured: int
    estimated: int
    gated: bool

    @property
    def ratio(self) -> float:
        return self.measured / self.estimated if self.estimated else (1.0 if not self.measured else float("inf"))

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE


def compare(cfg: JobConfig, measured: list[dict[str, Any]], est: Estimate) -> list[Comparison]:
    """Measured vs estimated per rank and category (gated: must agree within 10%; else informational)."""
    out: list[Comparison] = []
    t = cfg.training
    r, g = _itemsize(t.rollout_dtype), cfg.parallelism.gen_tp
    actor = model_flavor(cfg, "actor")
    for m, e in zip(measured, est.ranks):
        for name, value in m["persistent"].items():
            offloaded = name in e.details["host"]  # freed on the device outside the rollout: 0 expected
            out.append(
                Comparison(
                    e.rank, f"{name} (device, after training)" if offloaded else name, value, e.persistent.get(name, 0), True
                )
            )
        if e.details["host"]:
            out.append(Comparison(e.rank, "host copies (training.offload_frozen)", m["host"], e.host_total, True))
        for model in (ACTOR, CRITIC):
            out.append(
                Comparison(
                    e.rank,
                    f"gradients_{model}",
                    m.get(f"gradients_{model}", 0),
                    e.details["gradients"][f"gradients_{model}"],
                    True,
                )
            )
        unsharded = {k: sum(v[k] for v in m["unsharded"].values()) for k in ("params", "grads")}
        out.append(Comparison(e.rank, "unsharded_params", unsharded["params"], e.transients["unsharded_params"], True))
        out.append(Comparison(e.rank, "unsharded_grads", unsharded["grads"], e.transients["unsharded_grads"], True))
        out.append(
            Comparison(
                e.rank, "activations (+ logits), in-flight peak", m["activations"]["peak"], e.details["activation_peak"], True
            )
        )
        out.append(
            Comparison(
                e.rank,
                "weight sync: largest unit's send+recv",
                max(m["sync"].values(), default=0),
                e.details["weight_sync_unit"]["unit"],
                True,
            )
        )
        prof = m["profiled"]
        if "scoring" in prof:
            rows, width = prof["scoring"]["shape"]
            body, head = scoring_bytes(actor, rows, width, r, g)
            out.append(
                Comparison(
                    e.rank, f"scoring micro-batch {rows}x{width} (profiled)", prof["scoring"]["peak"], max(body, head), True
                )
            )
        if "prefill" in prof:
            rows, width = prof["prefill"]["shape"]
            out.append(
                Comparison(
                    e.rank,
                    f"prefill {rows}x{width} (profiled)",
                    prof["prefill"]["peak"],
                    prefill_bytes(actor, rows, width, r, g),
                    True,
                )
            )
        if "decode" in prof:
            rows = prof["decode"]["rows"]
            out.append(
                Comparison(
                    e.rank, f"decode step, {rows} rows (profiled)", prof["decode"]["peak"], decode_logits_bytes(actor, rows), True
                )
            )
        if "training_step" in prof:
            tr = e.transients
            step = max(
                sum(e.details["training_compute_peak"].values()),
                tr["unsharded_params"] + tr["unsharded_grads"] + tr["reduce_scatter"],
            )
            out.append(Comparison(e.rank, "training step (profiled)", prof["training_step"], step, True))
        sync_peak = max((v for k, v in prof.items() if k.startswith("weight_sync")), default=None)
        if sync_peak is not None:
            out.append(Comparison(e.rank, "weight sync (profiled)", sync_peak, e.transients["weight_sync_buffers"], False))
    return out


def format_comparison(rows: list[Comparison]) -> str:
    lines = [f"{'rank':>4}  {'category':<44}{'measured MiB':>14}{'estimated MiB':>15}{'ratio':>8}  check"]
    for c in rows:
        check = ("ok" if c.ok else "OFF BY >10%") if c.gated else "informational"
        lines.append(
            f"{c.rank:>4}  {c.category:<44}{c.measured / 2**20:>14.3f}{c.estimated / 2**20:>15.3f}{c.ratio:>8.3f}  {check}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=None, help=f"TOML job config (default with --measure: a debug_large run of {MEASURE_CONFIG})"
    )
    parser.add_argument("--world", type=int, default=None, help="ranks (default pp * dp_shard * tp; 4 with --measure)")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="run the config through the real trainer on CPU ranks and compare with the estimate",
    )
    parser.add_argument("--device-gib", type=float, default=80.0, help="device memory to check the peak against")
    parser.add_argument(
        "--pipeline-shapes",
        type=int,
        default=None,
        help="sequence buckets a run visits, the longest first (default: every bucket); the executor keeps the stages "
        f"(and buffers) of {STAGE_CACHE_SIZE} of them",
    )
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--") or "." not in o.split("=")[0]]
    if bad:
        parser.error(f"unexpected arguments {bad}; config overrides look like --section.key=value")
    if args.measure:
        return _main_measure(args, overrides)
    if args.config is None:
        parser.error("--config is required (or --measure)")
    try:
        cfg = load_config(["--job.config_file", args.config, *overrides])
        est = estimate(cfg, args.world, config_name=args.config, pipeline_shapes=args.pipeline_shapes)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(est, args.device_gib))
    if args.json:
        print(json.dumps(to_json(est, args.device_gib)))
    return 0


def _main_measure(args: argparse.Namespace, overrides: list[str]) -> int:
    config = args.config or MEASURE_CONFIG
    defaults = MEASURE_OVERRIDES if args.config is None else ()
    argv = ["--job.config_file", config, *defaults, *overrides, *_RUN_OVERRIDES]
    try:
        cfg = load_config(argv)
        world = args.world or cfg.parallelism.pp * cfg.parallelism.dp_shard * cfg.parallelism.tp
        check_dims(cfg, world)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _progress(f"[memory] running {config} through the trainer on {world} CPU ranks (2 iterations)")
    measured = sorted(measure(argv, world), key=lambda m: m["rank"])
    est = estimate(
        cfg,
        world,
        config_name=config,
        ranks=list(range(world)),
        program=measured[0]["program"],
        pipeline_seqs=measured[0]["pipeline_seqs"],
        seq_len=max(measured[0]["pipeline_seqs"]),
    )
    rows = compare(cfg, measured, est)
    print(format_table(est, args.device_gib))
    print()
    print(f"measured (real trainer, {world} CPU ranks, 2 iterations) vs estimated, per rank and category:")
    print(format_comparison(rows))
    gated = [c for c in rows if c.gated]
    failed = [c for c in gated if not c.ok]
    print(
        f"{len(gated) - len(failed)}/{len(gated)} compared categories within {TOLERANCE:.0%}"
        + ("" if not failed else f"; off: {', '.join(sorted({c.category for c in failed}))}")
    )
    if args.json:
        result = to_json(est, args.device_gib)
        result["comparison"] = [
            {
                "rank": c.rank,
                "category": c.category,
                "measured": c.measured,
                "estimated": c.estimated,
                "ratio": round(c.ratio, 4),
                "gated": c.gated,
            }
            for c in rows
        ]
        result["comparison_ok"] = not failed
        print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
