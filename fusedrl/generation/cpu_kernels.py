"""The engine's CPU projections: cached weight layouts, oneDNN prepacking and one-row products.

Decode streams every weight from memory once per step. On the CPU aten's ``F.linear`` is not the fastest way to do
that (docs/generation.md): a one-row fp32 product runs ~1.1x faster on a contiguous [in, out] copy of the weight
(~1.35x faster than oneDNN's), and products of 4-32 rows (decode batches, prefills) 1.1-1.3x faster through oneDNN
with the weight prepacked into its blocked layout (an AMD machine measured 1.3-2.5x). Projections of one input (q/k/v,
the MLP's gate/up) run as one product of their weights stacked.

The interface: :func:`layouts_supported` says whether a model's weights can take this path, :func:`prepare` lays a
model's projection groups out for it, :func:`linears` applies projections through it (eagerly, or traced by a compiled
decode step), :func:`one_row_attention` is a compiled one-row step's attention, :func:`forget` drops a model's cached layouts.

Freshness: each layout is cached per group of weights and rebuilt when one of them changes (its
:func:`~fusedrl.generation.freshness.weights_stamp` moves: any in-place write through autograd or a ``torch.optim``
step, see that module). Writes that bypass both (through ``.data``, or kernels of one's own) must be followed by
:func:`forget` (``GenerationEngine.weights_updated`` calls it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import FeedForward, TiedLinear, TransformerDecoder, TransformerSelfAttentionLayer

from fusedrl.distributed import compat
from fusedrl.generation.freshness import Stamp, weights_stamp
from fusedrl.models import LoRALinear, QKNormProjection

# oneDNN's row-count hint for choosing the packed layout: 64 ran 1-32-row decode 5-10% faster than 8 or 32.
_PACK_ROWS_HINT = 64
# Weight streams of a one-row product: each weight is split into _ONE_ROW_STREAMS // len(weights) row blocks whose
# products inductor fuses into one loop, so each thread reads that many weight streams side by side (SmolLM2-135M,
# bf16, 2 threads of a Xeon with AMX: a decoder layer's kernel 409 us with 1 stream, 384 with 2, 329 with 4, 271 with
# 8, 291-304 with 16 or 32; docs/benchmarks.md).
_ONE_ROW_STREAMS = 8

# (ids of the tensors, kind) -> (weak refs to the tensors, their stamps, the layout)
_LAYOUTS: dict[tuple[tuple[int, ...], str], tuple[tuple[weakref.ref, ...], Stamp, torch.Tensor]] = {}


def _cached(tensors: list[torch.Tensor], kind: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()``, cached per ``(tensors, kind)`` until one of ``tensors`` is freed or changes (module docstring)."""
    key = (tuple(id(t) for t in tensors), kind)
    stamp = weights_stamp(tensors)
    entry = _LAYOUTS.get(key)
    if entry is None or any(r() is not t for r, t in zip(entry[0], tensors)) or entry[1] != stamp:
        value = build()
        refs = tuple(weakref.ref(t, lambda _: _LAYOUTS.pop(key, None)) for t in tensors)
        _LAYOUTS[key] = (refs, stamp, value)
        return value
    return entry[2]


def forget(model: nn.Module) -> None:
    """Drop every cached layout built from ``model``'s weights: the next product rebuilds it from the live weights."""
    ids = {id(p) for p in model.parameters()}
    for key in [k for k in _LAYOUTS if ids.intersection(k[0])]:
        del _LAYOUTS[key]


def layouts_supported(model: TransformerDecoder, tensor_parallel: bool) -> bool:
    """Plain fp32 CPU weights, or bf16 ones where oneDNN runs bf16 natively (not tensor-parallel DTensors, whose
    linears must run their own hooks)."""
    weight = model.tok_embeddings.weight
    if tensor_parallel or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and compat.onednn_bf16_supported())


def _layout(weights: list[torch.Tensor], kind: Literal["transposed", "packed"]) -> torch.Tensor:
    """The cached ``kind`` layout of ``weights`` stacked along their output dimension."""

    def build() -> torch.Tensor:
        w = _stacked(weights)
        return w.t().contiguous() if kind == "transposed" else compat.onednn_pack_linear_weight(w, _PACK_ROWS_HINT)

    return _cached(weights, kind, build)


def _adapter_blocks(linears: list[nn.Linear]) -> torch.Tensor:
    """``[sum out_i, sum rank_j]`` (cached): each adapted projection's ``scale B`` at its output rows and its adapter's
    columns, zeros elsewhere (a projection without adapters: zero rows). With ``xa`` the input through the adapted
    projections' ``A`` stacked, ``xa @ blocks^T`` is every projection's low-rank update at once."""
    adapted = [m for m in linears if type(m) is LoRALinear and m.adapted]

    def build() -> torch.Tensor:
        b = adapted[0].lora_b
        blocks = b.new_zeros(sum(m.weight.shape[0] for m in linears), sum(m.lora_b.shape[1] for m in adapted))
        row = col = 0
        for m in linears:
            if type(m) is LoRALinear and m.adapted:
                rank = m.lora_b.shape[1]
                blocks[row : row + m.lora_b.shape[0], col : col + rank] = m.lora_b.detach() * m.scale
                col += rank
            row += m.weight.shape[0]
        return blocks

    kind = "adapter_blocks" + "".join("1" if type(m) is LoRALinear and m.adapted else "0" for m in linears)
    return _cached([m.lora_b for m in adapted], kind, build)


def _adjacent(weights: list[torch.Tensor]) -> bool:
    """Whether ``weights`` lie one after another, contiguous, in one storage."""
    storage = weights[0].untyped_storage().data_ptr()
    return all(w.is_contiguous() and w.untyped_storage().data_ptr() == storage for w in weights) and all(
        b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(weights, weights[1:])
    )


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """``weights`` ([out_i, in] each) as one [sum out_i, in] tensor: a view when they are adjacent (as
    :func:`stack_projections` leaves them), else a concatenated copy."""
    first = weights[0].detach()
    if _adjacent(weights):
        return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))
    return torch.cat([w.detach() for w in weights])


@torch.no_grad()
def stack_projections(linears: list[nn.Linear]) -> None:
    """Move the weights of ``linears`` (projections of one input, same dtype and input size) into one storage, one
    after another, keeping their Parameter objects (``.data`` is swapped: optimizers, weight sync and state dicts keep
    working, and in-place updates keep moving each one's version counter): their stacked layout then reads them as
    one tensor, without a concatenated copy at each rebuild (a transient the memory estimate does not count)."""
    weights = [m.weight for m in linears]
    if not _adjacent(weights):
        stacked = torch.cat([w.detach() for w in weights])
        offset = 0
        for w in weights:
            rows = int(w.shape[0])
            w.data = stacked[offset : offset + rows]
            offset += rows


@torch.no_grad()
def separate_projections(linears: list[nn.Linear]) -> None:
    """Undo :func:`stack_projections` (an engine built earlier over the same model may have stacked them): each
    weight of ``linears`` in a storage of its own, the same Parameter objects and values. A nested compile region
    takes no inputs that alias each other."""
    weights = [m.weight for m in linears]
    if len({w.untyped_storage().data_ptr() for w in weights}) < len(weights):
        for w in weights:
            w.data = w.detach().clone()


def _stackable(layer: TransformerSelfAttentionLayer) -> list[list[nn.Linear]]:
    """The groups of a layer's plain linears that read one input: q/k/v, the MLP's gate/up."""
    attn, mlp = layer.attn, layer.mlp
    groups = [[m.linear if type(m) is QKNormProjection else m for m in (attn.q_proj, attn.k_proj, attn.v_proj)]]
    if type(mlp) is FeedForward and mlp.w3 is not None:
        groups.append([mlp.w1, mlp.w3])
    return [g for g in groups if all(type(m) in (nn.Linear, LoRALinear) for m in g)]


def prepare(model: TransformerDecoder, stack: bool) -> None:
    """Lay ``model``'s projection groups out for :func:`linears`: each group's weights in one storage with ``stack``;
    else each in its own, as a nested compile region needs."""
    for layer in model.layers:
        for group in _stackable(layer):
            (stack_projections if stack else separate_projections)(group)


def linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    """The projections ``F.linear(x, w, b)`` of ``weights``/``biases``, concatenated along the last dimension: one
    product with the weights stacked (q/k/v, and the MLP's gate/up: 2 and 1 fewer calls per layer, whose fixed cost
    dominates a one-row product of SmolLM2-135M's shapes: q/k/v 41 -> 22 us, gate/up 46 -> 39 us, bf16, 2 threads)."""
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([x.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)])
    # bf16 takes the packed layout at every row count (SmolLM2-135M's shapes, 2 threads of an AMD EPYC with
    # avx512_bf16: one row 25-28 us against F.linear's 46-48 and the transposed copy's 50-53; the LM head 1.1 ms
    # against 1.9 and 4.3)
    if x.numel() == x.shape[-1] and weights[0].dtype == torch.float32:  # one row
        out = x @ _layout(weights, "transposed")
        return out if bias is None else out + bias
    return compat.onednn_packed_linear(x, _layout(weights, "packed"), bias)


def one_row(rows: int | torch.SymInt) -> bool:
    """Whether a traced step holds one row (a static size: a step whose batch is symbolic holds several)."""
    return isinstance(rows, int) and rows == 1


def _one_row_products(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    """:func:`linear` of one row, traced (compiled only: eagerly the products would be materialized) as
    multiply-and-sum expressions that inductor compiles into loops streaming each weight once, accumulating in float32,
    fused with the layer's other element-wise work. oneDNN reads one row's weights at about half the bandwidth."""
    xf = x.float().unsqueeze(-2)
    blocks = max(1, _ONE_ROW_STREAMS // len(weights))
    outs = []
    for w, b in zip(weights, biases):
        out = torch.cat([(xf * rows.float()).sum(-1) for rows in w.chunk(blocks)], dim=-1)
        outs.append((out if b is None else out + b.float()).to(x.dtype))
    return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]


def one_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of one decode row, q [1, KV, G, hd] against k/v [1, KV, L, hd] under ``mask`` [1, 1, 1, L], as
    expressions (compiled only: eagerly they would materialize the products) that inductor fuses into the layer's
    kernel, in float32 as the CPU kernel accumulates: no separate SDPA call (~87 us a layer at L <= 128). At 16 rows
    the same loops ran 1.06-1.11x faster than SDPA at L <= 97 but 1.14x slower at L ~ 450 (1 thread), so many rows keep
    SDPA."""
    scores = (q.float().unsqueeze(-2) * k.float().unsqueeze(2)).sum(-1) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2)


# ``fusedrl::cpu_linear(x, weights, biases)`` is :func:`linear`: an operator (not a Python call) so that torch.compile
# keeps it as one opaque node with the live weights as its inputs; a plain torch.library op costs ~20 us less per call
# than a ``custom_op``.
_LIB = torch.library.Library("fusedrl", "FRAGMENT")
_LIB.define("cpu_linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIB.impl("cpu_linear", linear, "CPU")


@torch.library.register_fake("fusedrl::cpu_linear", lib=_LIB)
def _(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def handles(modules: Iterable[nn.Module]) -> bool:
    """Whether :func:`linears` takes these projections (plain, LoRA, tied-head or Qwen3-normed linears)."""
    inner = [m.linear if type(m) is QKNormProjection else m for m in modules]
    return all(type(m) in (nn.Linear, LoRALinear) or isinstance(m, TiedLinear) for m in inner)


def linears(modules: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``modules`` (projections that :func:`handles`) applied to ``x``, several at once as one product of their
    stacked weights (Qwen3's normed projections: their linear, then their norm). A LoRA projection
    (``lora.rollout_weights = "adapters"``) takes its frozen base the same way and adds its low-rank update unmerged
    (no dropout: the engine decodes in eval mode). Eagerly the products run on the cached layouts; traced by a compiled
    decode step, one row's are fused loops over the live weights and many rows' the ``fusedrl::cpu_linear`` node."""
    inner = [m.linear if type(m) is QKNormProjection else m for m in modules]
    # the LM head of tied embeddings uses the token embedding's weight
    weights: list[torch.Tensor] = [m.tied_module.weight if isinstance(m, TiedLinear) else m.weight for m in inner]  # type: ignore[misc]
    biases: list[torch.Tensor | None] = [None if isinstance(m, TiedLinear) else m.bias for m in inner]  # type: ignore[misc]
    adapted = [m for m in inner if type(m) is LoRALinear and m.adapted]
    compiling = torch.compiler.is_compiling()
    if not compiling:
        out = linear(x, weights, biases)
        if adapted:  # two products for the group's updates, added in place: no second output
            xa = linear(x, [m.lora_a for m in adapted], [None] * len(adapted))
            out.add_(linear(xa, [_adapter_blocks(inner)], [None]))  # type: ignore[arg-type]
    elif one_row(x.shape[:-1].numel()):
        out = _one_row_products(x, weights, biases)
    else:
        out = torch.ops.fusedrl.cpu_linear(x, weights, biases)
    parts = out.split([w.shape[0] for w in weights], dim=-1) if len(weights) > 1 else (out,)
    if adapted and compiling:  # traced per projection (inductor fuses them)
        for m, part in zip(inner, parts):
            if type(m) is LoRALinear and m.adapted:
                part.add_(F.linear(F.linear(x, m.lora_a) * m.scale, m.lora_b))
    return [m.normalize(p) if type(m) is QKNormProjection else p for m, p in zip(modules, parts)]
