"""GenerationEngine: slot KV cache, continuous batching, compiled decode over a torchtune decoder."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, TypeVar, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.modules import FeedForward, MultiHeadAttention, TiedLinear, TransformerDecoder, TransformerSelfAttentionLayer
from tqdm.auto import tqdm

from fusedrl.buckets import doubling, round_up
from fusedrl.config import ConfigError, GenerationSection, Startup
from fusedrl.config.loader import source_of
from fusedrl.distributed import compat
from fusedrl.generation.request import FinishReason, Request, RequestId, RequestResult, SamplingParams, request_seed
from fusedrl.generation.sampling import sample_tokens
from fusedrl.generation.state import RequestState
from fusedrl.models import LoRALinear, QKNormProjection

_T = TypeVar("_T")
Quantize = Literal["int8_weight_only"]
CompileScope = Literal["step", "layer"]
COMPILE_SCOPES: tuple[str, ...] = get_args(CompileScope)
QUANTIZE_MODES: tuple[str, ...] = ("int8_weight_only",)
BACKENDS: tuple[str, ...] = ("inductor", "tensorrt", "eager", "aot_eager")


# ---------------------------------------------------------------- CPU linears on cached weight layouts
# Decode streams every weight from memory once per step. On the benchmark CPU (Intel Xeon, one thread,
# debug_large's 100 MB of fp32 weights; docs/generation.md) aten's ``F.linear`` is not the fastest way to do
# that: a one-row product runs ~1.1x faster than it on a contiguous [in, out] copy of the weight (~1.35x faster
# than oneDNN's), and products of 4-32 rows (decode batches, prefills) 1.1-1.3x faster through oneDNN with the
# weight prepacked into its blocked layout (an earlier AMD machine measured 1.3-2.5x for the latter). Each layout is
# cached per group of weights (projections of one input, stacked) and rebuilt when one of them changes in place
# (its version counter moves: an optimizer step, load_state_dict, weight sync), so the engine keeps using the live
# weights; a model used at both row counts holds both copies.
# oneDNN's row-count hint for choosing the packed layout: 64 ran 1-32-row decode 5-10% faster than 8 or 32.
_PACK_ROWS_HINT = 64
_LAYOUTS: dict[tuple[tuple[int, ...], str], tuple[tuple[weakref.ref, ...], tuple[int, ...], torch.Tensor]] = {}


def _cached(tensors: list[torch.Tensor], kind: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()``, cached per ``(tensors, kind)`` until one of ``tensors`` is freed or changes in place."""
    key = (tuple(id(t) for t in tensors), kind)
    versions = tuple(t._version for t in tensors)
    entry = _LAYOUTS.get(key)
    if entry is None or any(r() is not t for r, t in zip(entry[0], tensors)) or entry[1] != versions:
        value = build()
        refs = tuple(weakref.ref(t, lambda _: _LAYOUTS.pop(key, None)) for t in tensors)
        _LAYOUTS[key] = (refs, versions, value)
        return value
    return entry[2]


def _weight_layout(weights: list[torch.Tensor], kind: Literal["transposed", "packed"]) -> torch.Tensor:
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
    :func:`_stack_projections` leaves them), else a concatenated copy."""
    first = weights[0].detach()
    if _adjacent(weights):
        return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))
    return torch.cat([w.detach() for w in weights])


@torch.no_grad()
def _stack_projections(linears: list[nn.Linear]) -> None:
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
def _separate_projections(linears: list[nn.Linear]) -> None:
    """Undo :func:`_stack_projections` (an engine built earlier over the same model may have stacked them): each
    weight of ``linears`` in a storage of its own, the same Parameter objects and values. A nested compile region
    takes no inputs that alias each other."""
    weights = [m.weight for m in linears]
    if len({w.untyped_storage().data_ptr() for w in weights}) < len(weights):
        for w in weights:
            w.data = w.detach().clone()


def _linear_cpu(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
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
        out = x @ _weight_layout(weights, "transposed")
        return out if bias is None else out + bias
    return compat.onednn_packed_linear(x, _weight_layout(weights, "packed"), bias)


# Weight streams of a one-row product: each weight is split into _ONE_ROW_STREAMS // len(weights) row blocks whose
# products inductor fuses into one loop, so each thread reads that many weight streams side by side (SmolLM2-135M,
# bf16, 2 threads of a Xeon with AMX: a decoder layer's kernel 409 us with 1 stream, 384 with 2, 329 with 4, 271 with
# 8, 291-304 with 16 or 32; docs/benchmarks.md).
_ONE_ROW_STREAMS = 8


def _one_row(rows: int | torch.SymInt) -> bool:
    """Whether a traced step holds one row (a static size: a step whose batch is symbolic holds several)."""
    return isinstance(rows, int) and rows == 1


def _one_row_products(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    """``_linear_cpu`` of one row, traced (compiled only: eagerly the products would be materialized) as
    multiply-and-sum expressions that inductor compiles into loops streaming each weight once, accumulating in float32,
    fused with the layer's other element-wise work. oneDNN reads one row's weights at about half the bandwidth."""
    xf = x.float().unsqueeze(-2)
    blocks = max(1, _ONE_ROW_STREAMS // len(weights))
    outs = []
    for w, b in zip(weights, biases):
        out = torch.cat([(xf * rows.float()).sum(-1) for rows in w.chunk(blocks)], dim=-1)
        outs.append((out if b is None else out + b.float()).to(x.dtype))
    return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]


def _one_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of one decode row, q [1, KV, G, hd] against k/v [1, KV, L, hd] under ``mask`` [1, 1, 1, L], as
    expressions (compiled only: eagerly they would materialize the products) that inductor fuses into the layer's
    kernel, in float32 as the CPU kernel accumulates: no separate SDPA call (~87 us a layer at L <= 128). At 16 rows
    the same loops ran 1.06-1.11x faster than SDPA at L <= 97 but 1.14x slower at L ~ 450 (1 thread), so many rows keep
    SDPA."""
    scores = (q.float().unsqueeze(-2) * k.float().unsqueeze(2)).sum(-1) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2)


# ``fusedrl::cpu_linear(x, weights, biases)`` is ``_linear_cpu``: an operator (not a Python call) so that
# torch.compile keeps it as one opaque node with the live weights as its inputs; a plain torch.library op costs
# ~20 us less per call than a ``custom_op``.
_LIB = torch.library.Library("fusedrl", "FRAGMENT")
_LIB.define("cpu_linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIB.impl("cpu_linear", _linear_cpu, "CPU")


@torch.library.register_fake("fusedrl::cpu_linear", lib=_LIB)
def _(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _copy_tensor_data(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s data into ``dst`` in place, through the inner tensors of tensor subclasses of the same layout
    (torchao's quantized weights: their ``__tensor_flatten__`` names)."""
    flatten = getattr(dst, "__tensor_flatten__", None)
    if flatten is None:
        dst.copy_(src)
        return
    for name in flatten()[0]:
        _copy_tensor_data(getattr(dst, name), getattr(src, name))


def _tensor_parallel(model: TransformerDecoder) -> bool:
    """Whether ``model``'s weights are DTensors (``fusedrl.distributed.apply_tp`` over a generation instance)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _can_use_cpu_layouts(model: TransformerDecoder) -> bool:
    """Plain fp32 CPU weights, or bf16 ones where oneDNN runs bf16 natively (not tensor-parallel DTensors, whose
    linears must run their own hooks)."""
    weight = model.tok_embeddings.weight
    plain = not _tensor_parallel(model)
    if not (plain and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and compat.onednn_bf16_supported())


def check_compile(startup: Startup) -> None:
    """Startup check (raises ConfigError): CUDA graphs (``compile_mode = "reduce-overhead"``) record the whole decode
    step, so they need ``compile_scope = "step"``; the compiled decode takes no tensor-parallel weights."""
    g = startup.cfg.generation
    gen_tp = startup.cfg.parallelism.gen_tp
    if g.compile and gen_tp > 1:
        raise ConfigError(
            f"generation.compile = true ({source_of(startup.cfg, 'generation.compile')}) with parallelism.gen_tp = "
            f"{gen_tp}: the compiled decode does not take tensor-parallel (DTensor) weights in this torch; set "
            "--generation.compile=false or parallelism.gen_tp = 1"
        )
    if g.compile and g.compile_scope == "layer" and g.compile_mode == "reduce-overhead":
        raise ConfigError(
            f"generation.compile_mode = reduce-overhead ({source_of(startup.cfg, 'generation.compile_mode')}) records CUDA "
            "graphs of the whole decode step, but generation.compile_scope = layer compiles one layer: set "
            "--generation.compile_scope=step, or compile_mode = default"
        )


class _SlotForward(nn.Module):
    """Prefill and decode over the slot KV cache, calling the decoder's own submodules.

    Layer i's slot cache is the buffer pair ``k_i``/``v_i``, each [slots, max_len + 1, kv_heads, head_dim] in
    ``kv_dtype``; buffers, so that torch.compile / CUDA graphs treat them as static addresses. Attention runs in
    the cache's dtype; its output is cast back to the weights' dtype. With tensor-parallel linears (DTensor
    weights over a generation instance) ``kv_heads`` is this rank's share of the heads: the cache holds this
    rank's KV heads only.
    """

    columns: torch.Tensor  # 0..max_len-1 (a buffer): a decode step's attended columns are a slice of it

    def __init__(
        self,
        model: TransformerDecoder,
        slots: int,
        max_len: int,
        cpu_layouts: bool,
        kv_dtype: torch.dtype | None = None,
        stack_projections: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.cpu_layouts = cpu_layouts  # CPU fp32 linears through cached weight layouts (see _linear_cpu)
        # q/k/v and gate/up each in one storage: their stacked layouts read them without a copy (unless a compile
        # region will take them; the layouts are then built from a concatenated copy)
        if cpu_layouts:
            for layer in model.layers:
                for group in self._stackable(layer):
                    (_stack_projections if stack_projections else _separate_projections)(group)
        attn = model.layers[0].attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        weight = model.tok_embeddings.weight
        self.dtype: torch.dtype = kv_dtype or weight.dtype  # the cache's (a plain attribute: no guard on a buffer)
        # One spare position past max_len, never written or attended: with it, the attended slice kc[:b, :L] is
        # never contiguous, so a compiled decode step's symbolic L needs no separate graph for L == max_len.
        shape = (slots, max_len + 1, self.num_kv_heads, self.head_dim)
        # One buffer per layer and tensor: in-place index_put_ on a view of a shared buffer makes inductor
        # write the whole buffer back every step, on a buffer of its own it stays an in-place scatter.
        for i in range(len(model.layers)):
            for kind in "kv":
                buf = torch.zeros(shape, dtype=self.dtype, device=weight.device)
                compat.mark_static(buf)  # compiled per layer, only the batch and attended length are symbolic
                self.register_buffer(f"{kind}_{i}", buf, persistent=False)
        self.register_buffer("columns", torch.arange(max_len, device=weight.device), persistent=False)
        # the engine swaps in a nested compile region of the layer when it compiles per layer
        self.decode_layer: Callable[..., torch.Tensor] = self._decode_layer

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s slot cache (k, v), each [slots, max_len, kv_heads, head_dim]."""
        return getattr(self, f"k_{layer}"), getattr(self, f"v_{layer}")

    def read_slot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's first ``length`` positions: (k, v), each [layers, length, kv_heads, head_dim]."""
        caches = [self.cache(i) for i in range(len(self.model.layers))]
        return torch.stack([k[slot, :length] for k, _ in caches]), torch.stack([v[slot, :length] for _, v in caches])

    def write_slot(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for i in range(len(self.model.layers)):
            kc, vc = self.cache(i)
            kc[slot, : k.shape[1]] = k[i]
            vc[slot, : v.shape[1]] = v[i]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for i in range(len(self.model.layers)):
            for c in self.cache(i):
                c[dst, :length] = c[src, :length]

    @staticmethod
    def _stackable(layer: TransformerSelfAttentionLayer) -> list[list[nn.Linear]]:
        """The groups of a layer's plain linears that read one input: q/k/v, the MLP's gate/up."""
        attn, mlp = layer.attn, layer.mlp
        groups = [[m.linear if type(m) is QKNormProjection else m for m in (attn.q_proj, attn.k_proj, attn.v_proj)]]
        if type(mlp) is FeedForward and mlp.w3 is not None:
            groups.append([mlp.w1, mlp.w3])
        return [g for g in groups if all(type(m) in (nn.Linear, LoRALinear) for m in g)]

    def _linears(self, modules: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
        """Each of ``modules`` (projections) applied to ``x``; plain linears on the cached CPU layouts, several at once
        as one product of their stacked weights (Qwen3's normed projections: their linear, then their norm). A LoRA
        projection (``lora.rollout_weights = "adapters"``) takes its frozen base the same way and adds its low-rank
        update unmerged."""
        inner = [m.linear if type(m) is QKNormProjection else m for m in modules]
        if not self.cpu_layouts or any(type(m) not in (nn.Linear, LoRALinear) and not isinstance(m, TiedLinear) for m in inner):
            return [m(x) for m in modules]
        # the LM head of tied embeddings uses the token embedding's weight
        weights: list[torch.Tensor] = [m.tied_module.weight if isinstance(m, TiedLinear) else m.weight for m in inner]  # type: ignore[misc]
        biases: list[torch.Tensor | None] = [None if isinstance(m, TiedLinear) else m.bias for m in inner]  # type: ignore[misc]
        adapted = [m for m in inner if type(m) is LoRALinear and m.adapted]  # eval mode: no dropout
        compiling = torch.compiler.is_compiling()
        if not compiling:
            out = _linear_cpu(x, weights, biases)
            if adapted:  # two products for the group's updates, added in place: no second output
                xa = _linear_cpu(x, [m.lora_a for m in adapted], [None] * len(adapted))
                out.add_(_linear_cpu(xa, [_adapter_blocks(inner)], [None]))  # type: ignore[arg-type]
        elif _one_row(x.shape[:-1].numel()):
            out = _one_row_products(x, weights, biases)
        else:
            out = torch.ops.fusedrl.cpu_linear(x, weights, biases)
        parts = out.split([w.shape[0] for w in weights], dim=-1) if len(weights) > 1 else (out,)
        if adapted and compiling:  # traced per projection (inductor fuses them)
            for m, part in zip(inner, parts):
                if type(m) is LoRALinear and m.adapted:
                    part.add_(F.linear(F.linear(x, m.lora_a) * m.scale, m.lora_b))
        return [m.normalize(p) if type(m) is QKNormProjection else p for m, p in zip(modules, parts)]

    def _linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self._linears([module], x)[0]

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (self.cpu_layouts and type(mlp) is FeedForward):
            return mlp(x)
        ff: FeedForward = mlp  # checked above
        # torchtune's FeedForward.forward, with its projections through _linears.
        if ff.w3 is None:
            return self._linear(ff.w2, ff.activation(self._linear(ff.w1, x)))
        gate, up = self._linears([ff.w1, ff.w3], x)
        # gate and up are views of one buffer: the product in place, and the buffer freed before the down projection,
        # hold no more than separate projections would
        h = ff.activation(gate).mul_(up)
        del gate, up
        return self._linear(ff.w2, h)

    def _qkv(self, attn: MultiHeadAttention, x: torch.Tensor, pos: torch.Tensor):
        b, s, _ = x.shape
        q, k, v = self._linears([attn.q_proj, attn.k_proj, attn.v_proj], x)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        if attn.pos_embeddings is not None:
            q = attn.pos_embeddings(q, input_pos=pos)
            k = attn.pos_embeddings(k, input_pos=pos)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def _attend(self, attn: MultiHeadAttention, q, k, v, *, mask=None) -> torch.Tensor:
        """q [b, s, H, hd], k/v [b, L, KV, hd] -> [b, s, H*hd], in the cache's dtype; GQA without repeating K/V.

        A prefill (no ``mask``) is causal over the prompt: SDPA's ``enable_gqa``, which CUDA's flash kernel serves.
        A decode step (``mask`` [b, 1, 1, L], one query per row) regroups the query heads that share a KV head as
        that head's queries ([b, KV, H / KV, hd]): an attention without GQA, whose boolean mask CUDA's
        memory-efficient kernel takes (with ``enable_gqa`` and a mask SDPA falls back to the math backend, which
        upcasts to float32 and repeats K/V per query head), and which the CPU kernel runs in bf16 as fast as in
        float32 (with one query per head it ran bf16 ~6x slower).
        """
        b, s = q.shape[:2]
        k, v = k.transpose(1, 2).to(self.dtype), v.transpose(1, 2).to(self.dtype)
        if mask is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2).to(self.dtype), k, v, is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads
            ).transpose(1, 2)
        else:
            grouped = q.reshape(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
            if self.cpu_layouts and torch.compiler.is_compiling() and _one_row(b * s):
                out = _one_row_attention(grouped, k, v, mask).to(self.dtype)
            else:
                out = F.scaled_dot_product_attention(grouped.to(self.dtype), k, v, attn_mask=mask)
        out = out.reshape(b, s, self.num_heads * self.head_dim).to(q.dtype)
        return self._linear(attn.output_proj, out)

    def _block(self, layer: TransformerSelfAttentionLayer, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = h + layer.sa_scale(attn_out)
        return h + layer.mlp_scale(self._mlp(layer.mlp, layer.mlp_norm(h)))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One decode step for cache rows 0..b-1.

        tokens/positions [b]: the pending token of each row and its position; mask [b, 1, 1, L] marks
        the cache columns each row attends to (L is the length bucket). Returns float logits [b, V].
        """
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        h = self.model.tok_embeddings(tokens[:, None])
        for i, layer in enumerate(self.model.layers):
            h = self.decode_layer(layer, h, *self.cache(i), rows, positions, mask)
        return self._linear(self.model.output, self.model.norm(h[:, 0])).float()

    def _decode_layer(
        self,
        layer: TransformerSelfAttentionLayer,
        h: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One layer of a decode step: ``h`` [b, 1, dim] of rows 0..b-1 through ``layer``, their keys and values
        written into the layer's cache ``kc``/``vc`` at ``positions``. Every layer has the same structure, so that
        compiled (``compile_scope = "layer"``) one region's code serves them all."""
        b, length = h.shape[0], mask.shape[-1]
        q, k, v = self._qkv(layer.attn, layer.sa_norm(h), positions[:, None])
        kc.index_put_((rows, positions), k[:, 0].to(kc.dtype))
        vc.index_put_((rows, positions), v[:, 0].to(vc.dtype))
        del k, v  # v is a view of the stacked q/k/v projection's output: freed before the attention and the MLP
        out = self._attend(layer.attn, q, kc[:b, :length], vc[:b, :length], mask=mask)
        return self._block(layer, h, out)

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded tokens [n, P] at positions 0..P-1 into cache rows ``slots``; logits [n, V] at lengths-1.

        Causal attention keeps padding from reaching real tokens; the padding's cache entries lie beyond
        each row's length and are overwritten by decode before they are ever attended to.
        """
        n, p = tokens.shape
        pos = torch.arange(p, device=tokens.device)
        h = self.model.tok_embeddings(tokens)
        for i, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(layer.attn, layer.sa_norm(h), pos[None, :].expand(n, p))
            # v apart from the stacked q/k/v projection's output (RoPE made q and k new tensors): that buffer is then
            # freed instead of living through the attention and the MLP
            v = v.contiguous()
            kc, vc = self.cache(i)
            kc[slots[:, None], pos[None, :]] = k.to(kc.dtype)  # the cache's dtype may differ from the weights'
            vc[slots[:, None], pos[None, :]] = v.to(vc.dtype)
            h = self._block(layer, h, self._attend(layer.attn, q, k, v))
        last = h[torch.arange(n, device=tokens.device), lengths - 1]
        return self._linear(self.model.output, self.model.norm(last)).float()

    def sample_step(
        self, ints: torch.Tensor, floats: torch.Tensor, columns: torch.Tensor, any_sampled: bool, any_filtered: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode and sample one token for cache rows 0..b-1 from their device state (``ints`` [b, 6] / ``floats``
        [b, 2], the :class:`_SlotState` columns), attending to the cache columns ``columns`` (0..L-1: a slice of
        ``self.columns``, whose length the compiled step takes as symbolic). Returns the sampled tokens [b], their
        log-probs [b] and the rows' next ``ints`` (inactive rows unchanged): one graph when compiled, sampling
        included."""
        tokens, pos = ints[:, _SlotState.TOKEN].contiguous(), ints[:, _SlotState.POSITION].contiguous()
        mask = (columns[None, :] <= pos[:, None])[:, None, None, :]
        sampled, logprobs = _sample_rows(self(tokens, pos, mask), ints, floats, any_sampled, any_filtered)
        return sampled, logprobs, _SlotState.advanced(ints, sampled)


def _layer_region(forward: _SlotForward) -> Callable[..., torch.Tensor]:
    """``forward._decode_layer`` as a nested compile region (a function of its own: the region marks it)."""

    def decode_layer(layer, h, kc, vc, rows, positions, mask) -> torch.Tensor:
        return forward._decode_layer(layer, h, kc, vc, rows, positions, mask)

    return torch.compiler.nested_compile_region(decode_layer)


def _sample_rows(
    logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, any_sampled: bool, any_filtered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens`` of rows whose sampling parameters and random-stream position are the state ``ints``/``floats``."""
    return sample_tokens(
        logits,
        floats[:, _SlotState.TEMPERATURE],
        ints[:, _SlotState.TOP_K],
        floats[:, _SlotState.TOP_P],
        ints[:, _SlotState.SEED],
        ints[:, _SlotState.COUNT],
        any_sampled=any_sampled,
        any_filtered=any_filtered,
    )


class _SlotState:
    """Each slot's decode inputs on the device, written when a request takes or leaves a slot and advanced there by
    every step: a decode step sends nothing host-to-device (its one host read is the sampled tokens and log-probs).

    ``ints`` columns: the pending token, its position (the slot's cache length), the request's seed, the tokens it
    has sampled (its random stream's counter), top-k and 1 for a slot holding a request (0: free; a free row of a
    batch bucket decodes token 0 at position 0 and does not advance); ``floats``: temperature and top-p."""

    TOKEN, POSITION, SEED, COUNT, TOP_K, ACTIVE = range(6)
    TEMPERATURE, TOP_P = range(2)

    def __init__(self, slots: int, device: torch.device) -> None:
        self.ints = torch.zeros(slots, 6, dtype=torch.int64, device=device)
        self.floats = torch.zeros(slots, 2, dtype=torch.float32, device=device)

    def write(self, i: int, slot: _Slot) -> None:
        p = slot.request.sampling
        pending = slot.generated[-1] if slot.generated else 0  # a fresh slot's first token comes from its prefill
        self.ints[i] = torch.tensor([pending, slot.cache_len, slot.seed, len(slot.generated), p.top_k, 1])
        self.floats[i] = torch.tensor([p.temperature, p.top_p])

    def move(self, src: int, dst: int) -> None:
        self.ints[dst] = self.ints[src]
        self.floats[dst] = self.floats[src]

    @classmethod
    def advanced(cls, ints: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``ints`` after its rows sampled ``tokens``: each active row's pending token, one position on."""
        column = torch.arange(ints.shape[1], device=ints.device)
        moved = ints + ((column == cls.POSITION) | (column == cls.COUNT)).to(ints.dtype)
        nxt = torch.where(column == cls.TOKEN, tokens[:, None], moved)
        return torch.where(ints[:, cls.ACTIVE, None] == 1, nxt, ints)


@dataclass(eq=False)
class _Slot:
    request: Request
    seed: int  # request_seed(seed, id): the key of the request's random stream
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def cache_len(self) -> int:
        return len(self.request.prompt) + len(self.generated) - 1


@dataclass
class CompileStats:
    """What torch.compile cost an engine so far: graphs compiled and the wall time of the calls that compiled one
    (compilation plus that call's own run)."""

    graphs: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    """What a migration controller needs to know about an engine."""

    active: int
    waiting: int
    free_slots: int
    remaining_tokens: int  # upper bound: sum of each unfinished request's unused token budget
    cached_tokens: int


@dataclass(frozen=True)
class RequestProgress:
    """Where one unfinished request stands (for remaining-work estimates)."""

    id: RequestId
    prompt_len: int
    generated: int
    budget: int  # SamplingParams.new_token_budget: target_len if forced, else max_new_tokens
    forced: bool  # True when target_len fixes the length exactly
    active: bool  # holds a slot (False: waiting)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generated


class GenerationEngine:
    """Continuous-batching generation over a torchtune ``TransformerDecoder``'s own modules.

    Args:
        model: the decoder (its weights are used in place unless ``quantize`` is set).
        max_slots: requests decoded at once; each slot owns ``max_len`` KV positions per layer.
        max_len: longest sequence (prompt + generated) the job needs, at most the model's ``max_seq_len``; it
            sizes the KV cache (required: a 128k-context model's whole context would be ~137 GB of bf16 cache
            for an 8B model with 64 slots).
        seed: default seed; each request's random stream is keyed by (request.seed or seed, request.id) and the
            number of tokens it has sampled (see :mod:`.sampling`).
        compile: compile as ``compile_scope`` says.
        compile_scope: ``"layer"`` (default): the decode step with its sampling as one graph in which each decoder
            layer is one nested compile region (compiled once, its code reused by every layer), with symbolic batch
            and length (one graph for 2 or more rows, another for a single row, whose CPU products are fused loops
            streaming the weights), so that compiling costs about the same whatever the model's depth and the buckets
            visited; the prefill stays eager.
            ``"step"``: the whole decode step with its sampling (batch padded to ``batch_buckets``,
            attended length to ``len_buckets`` but symbolic: one graph per batch bucket; with
            ``mode="reduce-overhead"`` a CUDA graph per (batch, length) bucket pair that occurs) and the prefill (one
            graph with symbolic rows and prompt length, another for a single row).
        backend / mode: passed to ``torch.compile`` (``mode="reduce-overhead"`` uses CUDA graphs on GPU);
            ``backend="tensorrt"`` needs ``pip install fusedrl[tensorrt]``.
        quantize: ``"int8_weight_only"`` decodes with a torchao int8 weight-only copy of the model.
        kv_dtype: dtype of the KV cache (default: the model's weight dtype).

    The model may be tensor-parallel over a generation instance (``fusedrl.distributed.apply_tp``): every rank
    of the instance runs the same requests in lockstep, holds its share of the KV heads, and samples the same
    tokens (the logits are replicated).
    """

    def __init__(
        self,
        model: TransformerDecoder,
        *,
        max_slots: int = 8,
        max_len: int,
        seed: int = 0,
        compile: bool = False,
        compile_scope: CompileScope = "layer",
        backend: str = "inductor",
        mode: str | None = None,
        quantize: Quantize | None = None,
        batch_buckets: Iterable[int] | None = None,
        len_buckets: Iterable[int] | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if quantize is not None and quantize not in QUANTIZE_MODES:
            raise ValueError(f"unknown quantize mode {quantize!r}; valid: {', '.join(QUANTIZE_MODES)} or None")
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"unknown compile scope {compile_scope!r}; valid: {', '.join(COMPILE_SCOPES)}")
        if compile and compile_scope == "layer" and mode == "reduce-overhead":
            raise ValueError(
                "mode='reduce-overhead' records CUDA graphs of the whole decode step: use compile_scope='step' with it"
            )
        if backend not in BACKENDS:
            raise ValueError(f"unknown compile backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if compile and backend == "tensorrt":
            try:
                import torch_tensorrt  # noqa: F401
            except ImportError as e:
                raise ImportError("backend='tensorrt' needs torch-tensorrt: pip install fusedrl[tensorrt]") from e
        if compile and _tensor_parallel(model):
            raise ValueError("compile=True with tensor-parallel (DTensor) weights: the compiled decode does not take them")
        model_max = model.max_seq_len
        if not 2 <= max_len <= model_max:
            raise ValueError(f"max_len must be in [2, {model_max}] (the model's max_seq_len), got {max_len}")
        self.source_model = model
        self.max_slots, self.max_len, self.seed = max_slots, max_len, seed
        self.quantize, self.compile, self.backend, self.mode = quantize, compile, backend, mode
        self.compile_scope = compile_scope
        self.kv_dtype = kv_dtype
        self.batch_buckets = tuple(sorted(set(batch_buckets or doubling(1, max_slots))))
        self.len_buckets = tuple(sorted(set(len_buckets or doubling(64, max_len))))
        if self.batch_buckets[0] < 1 or self.batch_buckets[-1] != max_slots:
            raise ValueError(f"batch_buckets {self.batch_buckets} must lie in [1, max_slots] and include max_slots={max_slots}")
        if self.len_buckets[0] < 1 or self.len_buckets[-1] != max_len:
            raise ValueError(f"len_buckets {self.len_buckets} must lie in [1, max_len] and include max_len={max_len}")
        self.vocab_size = model.tok_embeddings.num_embeddings
        self.device = model.tok_embeddings.weight.device
        self._build()
        self._state = _SlotState(max_slots, self.device)
        self._active: list[_Slot] = []
        self._waiting: deque[RequestState] = deque()
        self._ready: list[RequestResult] = []
        self._ids: set[RequestId] = set()

    @classmethod
    def from_config(
        cls,
        model: TransformerDecoder,
        section: GenerationSection,
        *,
        max_len: int,
        seed: int,
        kv_dtype: torch.dtype | None = None,
    ) -> GenerationEngine:
        """An engine as the ``[generation]`` section says (``compile_mode = "default"`` and ``quantize = "none"``
        are torch.compile's default mode and no quantization)."""
        if section.compile and section.compile_cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = section.compile_cache_dir  # read by inductor at each cache access
        return cls(
            model,
            max_slots=section.max_slots,
            max_len=max_len,
            seed=seed,
            compile=section.compile,
            compile_scope=section.compile_scope,
            backend=section.backend,
            mode=None if section.compile_mode == "default" else section.compile_mode,
            quantize=None if section.quantize == "none" else section.quantize,
            kv_dtype=kv_dtype,
        )

    @property
    def kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's slot cache buffers (k, v), each ``[max_slots, max_len + 1, kv_heads, head_dim]``."""
        return [self._forward.cache(i) for i in range(len(self.model.layers))]

    # ---------------------------------------------------------------- model / weights
    def _build(self) -> None:
        model = self.source_model
        if self.quantize == "int8_weight_only":
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            model = copy.deepcopy(model)
            quantize_(model, Int8WeightOnlyConfig())
        self.model = model.eval()
        cpu_layouts = self.quantize is None and _can_use_cpu_layouts(self.model)
        # torchao's quantized weights (tensor subclasses) do not enter a nested compile region (torch 2.13): a quantized
        # engine's step graph traces every layer inline
        regions = self.compile and self.compile_scope == "layer" and self.quantize is None
        self._forward = _SlotForward(
            self.model, self.max_slots, self.max_len, cpu_layouts, self.kv_dtype, stack_projections=not regions
        )
        self._decode: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._forward.sample_step
        self._prefill_fn: Callable[..., torch.Tensor] = self._forward.prefill
        self.compile_stats = CompileStats()
        if regions:
            # The decode step with its sampling is one graph (one dispatch and one set of guards per step) in which
            # every layer is the same nested compile region: compiled once, its code reused by every layer. The batch
            # and the attended length are symbolic (marked per call): one graph per pair of sampling flags, and one
            # for a single row. The prefill stays eager.
            self._forward.decode_layer = _layer_region(self._forward)
            compat.allow_recompiles(2 * 4)  # many rows and one row, for each of the 4 pairs of sampling flags
        elif self.compile and self.compile_scope == "step":
            compat.allow_recompiles(4 * len(self.batch_buckets))  # a graph per batch bucket and sampling flags
            # prefill: one graph over symbolic rows and prompt length (padding a prompt to a length bucket would
            # cost up to twice its compute); no CUDA graphs: one prefill runs long enough that launch overhead
            # does not matter, and graph pools would hold its large activations
            self._prefill_fn = torch.compile(self._forward.prefill, backend=self.backend, dynamic=True)
        if self.compile:
            self._decode = torch.compile(self._forward.sample_step, backend=self.backend, mode=self.mode, dynamic=False)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy full (unsharded) weights into the model; a quantized engine re-quantizes them in place."""
        if self._active:
            raise RuntimeError("load_weights with requests in flight; finish or export them first")
        self.source_model.load_state_dict(state_dict, strict=True)
        self.weights_updated()

    def weights_updated(self) -> None:
        """Call after the source model's weights were written in place (a weight sync): a quantized engine
        quantizes them into its copy's existing tensors (a compiled decode keeps its graphs); otherwise the live
        weights are used as they are."""
        if self._active:
            raise RuntimeError("weights changed with requests in flight; finish or export them first")
        if self.quantize is not None:
            self._requantize()

    @torch.no_grad()
    def _requantize(self) -> None:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        copies = dict(self.model.named_parameters())
        linears = {f"{name}.weight": m for name, m in self.source_model.named_modules() if type(m) is nn.Linear}
        for name, p in self.source_model.named_parameters():
            target = copies[name]
            if name not in linears:
                target.copy_(p)
                continue
            fresh = nn.Linear(p.shape[1], p.shape[0], bias=False, device=p.device, dtype=p.dtype)
            fresh.weight.copy_(p)
            quantize_(fresh, Int8WeightOnlyConfig())
            _copy_tensor_data(target, fresh.weight)

    # ---------------------------------------------------------------- requests in
    def add_request(self, request: Request) -> None:
        """Queue a request. A malformed request becomes an error result (returned by the next step()).

        A request without a seed takes the engine's, so that its random stream stays the same when it is exported
        to another engine."""
        if request.seed is None:
            request = dataclasses.replace(request, seed=self.seed)
        if request.id in self._ids:
            raise ValueError(f"request id {request.id!r} is already in this engine; ids must be unique")
        error = self._validate(request)
        if error is not None:
            self._ready.append(RequestResult(request, [], [], "error", error))
            return
        self._ids.add(request.id)
        self._waiting.append(RequestState(request, [], []))

    def _validate(self, request: Request) -> str | None:
        prompt = request.prompt
        if not prompt:
            return "empty prompt: give at least one token"
        if len(prompt) >= self.max_len:
            return (
                f"prompt has {len(prompt)} tokens but the engine's max_len is {self.max_len}: "
                f"shorten it to at most {self.max_len - 1} tokens or raise max_len"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}): fix the tokenizer/prompt"
        target = request.sampling.target_len
        if target is not None and len(prompt) + target > self.max_len:
            return f"prompt ({len(prompt)}) + target_len ({target}) exceeds max_len {self.max_len}"
        return None

    def import_request(self, state: RequestState) -> None:
        """Continue a request exported by another engine (with its KV, or re-prefilled from its tokens)."""
        if state.id in self._ids:
            raise ValueError(f"request id {state.id!r} is already in this engine; ids must be unique")
        error = self._validate(state.request)
        if error is not None:
            raise ValueError(f"cannot import request {state.id!r}: {error}")
        if state.k is not None:
            expected = (len(self.model.layers), state.cache_len, self._forward.num_kv_heads, self._forward.head_dim)
            if tuple(state.k.shape) != expected or state.k.dtype != self._forward.dtype:
                raise ValueError(
                    f"request {state.id!r} KV has shape {tuple(state.k.shape)} {state.k.dtype}, this engine needs "
                    f"{expected} {self._forward.dtype}: export it with mode='reprefill' instead"
                )
        self._ids.add(state.id)
        self._waiting.append(state)

    # ---------------------------------------------------------------- requests out
    def export_request(self, request_id: RequestId, mode: Literal["kv", "reprefill"] = "kv") -> RequestState:
        """Remove an unfinished request and return its state (KV included when ``mode="kv"``)."""
        if mode not in ("kv", "reprefill"):
            raise ValueError(f"export mode must be 'kv' or 'reprefill', got {mode!r}")
        for i, slot in enumerate(self._active):
            if slot.request.id == request_id:
                n = slot.cache_len
                state = RequestState(slot.request, list(slot.generated), list(slot.logprobs))
                if mode == "kv":
                    state.k, state.v = self._forward.read_slot(i, n)
                self._remove_slot(i)
                self._ids.discard(request_id)
                return state
        for state in self._waiting:
            if state.id == request_id:
                self._waiting.remove(state)
                self._ids.discard(request_id)
                return state if mode == "kv" else state.without_kv()
        raise KeyError(f"request {request_id!r} is not unfinished in this engine (finished, exported or never added)")

    def unfinished_ids(self) -> list[RequestId]:
        return [s.request.id for s in self._active] + [s.id for s in self._waiting]

    def progress(self) -> list[RequestProgress]:
        """Every unfinished request's progress: active slots first, then the waiting queue in order."""
        entries = [(s.request, len(s.generated), True) for s in self._active]
        entries += [(s.request, len(s.generated), False) for s in self._waiting]
        return [
            RequestProgress(r.id, len(r.prompt), n, r.sampling.new_token_budget, r.sampling.target_len is not None, active)
            for r, n, active in entries
        ]

    @property
    def num_unfinished(self) -> int:
        return len(self._active) + len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._active or self._waiting or self._ready)

    def stats(self) -> EngineStats:
        remaining = sum(s.request.sampling.new_token_budget - len(s.generated) for s in self._active)
        remaining += sum(s.request.sampling.new_token_budget - len(s.generated) for s in self._waiting)
        return EngineStats(
            active=len(self._active),
            waiting=len(self._waiting),
            free_slots=self.max_slots - len(self._active),
            remaining_tokens=remaining,
            cached_tokens=sum(s.cache_len for s in self._active),
        )

    # ---------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self) -> list[RequestResult]:
        """Admit waiting requests into free slots (prefill), then decode one token for every active slot.

        Returns the requests that finished (or were rejected) since the last call.
        """
        self._admit()
        if self._active:
            self._decode_step()
        done, self._ready = self._ready, []
        return done

    def generate(self, requests: Iterable[Request], *, progress: bool | None = None) -> list[RequestResult]:
        """Run ``requests`` to completion; results in input order.

        ``progress``: a tqdm bar on rank 0 (None: only when stderr is a terminal; False: never).
        """
        requests = list(requests)
        for r in requests:
            self.add_request(r)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        bar = tqdm(
            total=len(requests),
            unit="req",
            desc="generate",
            disable=(None if progress is None else not progress) if rank0 else True,
        )
        results: dict[RequestId, RequestResult] = {}
        with bar:
            while self.has_work():
                for res in self.step():
                    results[res.id] = res
                    bar.update(1)
        return [results[r.id] for r in requests]

    def _admit(self) -> None:
        free = self.max_slots - len(self._active)
        if not free or not self._waiting:
            return
        taken = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        to_prefill: list[_Slot] = []
        for state in taken:
            seed = self.seed if state.request.seed is None else state.request.seed  # imported without one
            slot = _Slot(state.request, request_seed(seed, state.id), list(state.generated), list(state.logprobs))
            i = len(self._active)
            self._active.append(slot)
            self._state.write(i, slot)
            if state.k is not None:
                assert state.v is not None  # a state's K and V are set together
                self._forward.write_slot(i, state.k.to(self.device), state.v.to(self.device))
            else:
                to_prefill.append(slot)
        if to_prefill:
            self._prefill(to_prefill)

    def _prefill(self, slots: list[_Slot]) -> None:
        """Prefill ``slots`` (fresh or resumed from tokens). Slots whose tokens are identical (a GRPO group's samples
        of one prompt) share one prefill: it runs once, into the first one's cache row, whose filled positions are
        then copied to the others', and they sample from the same logits, each with its own random stream."""
        seqs = [s.request.prompt + s.generated[:-1] for s in slots]
        index = [self._active.index(s) for s in slots]
        first: dict[tuple[int, ...], int] = {}  # each distinct token sequence -> its row among the prefilled ones
        shared = [first.setdefault(tuple(seq), len(first)) for seq in seqs]
        unique = [seqs[shared.index(u)] for u in range(len(first))]
        owners = [index[shared.index(u)] for u in range(len(first))]
        width = max(len(x) for x in unique)
        lengths = [len(x) for x in unique]
        tokens = torch.zeros(len(unique), width, dtype=torch.int64)
        for row, seq in enumerate(unique):
            tokens[row, : len(seq)] = torch.tensor(seq)
        logits = self._call(
            self._prefill_fn,
            tokens.to(self.device),
            torch.tensor(owners, device=self.device),
            torch.tensor(lengths, device=self.device),
        )[: len(unique)]
        for i, u in zip(index, shared):
            if i != owners[u]:
                self._forward.move_slot(owners[u], i, lengths[u])
        logits = logits[torch.tensor(shared, device=self.device)]
        # Requests resumed from tokens already have their pending token; only fresh ones sample here.
        fresh = [row for row, s in enumerate(slots) if not s.generated]
        if fresh:
            rows = torch.tensor([index[r] for r in fresh], device=self.device)
            sampled_slots = [slots[r] for r in fresh]
            ints, floats = self._state.ints[rows], self._state.floats[rows]
            flags = self._sampling_flags(sampled_slots)
            tokens, logprobs = _sample_rows(logits[fresh], ints, floats, *flags)
            self._state.ints[rows] = _SlotState.advanced(ints, tokens)
            self._record(sampled_slots, tokens, logprobs)

    def _decode_step(self) -> None:
        n = len(self._active)
        b = round_up(n, self.batch_buckets)
        # the host knows every cache length: the length bucket needs no device read
        length = round_up(max(s.cache_len for s in self._active), self.len_buckets, strictly_above=True)
        columns, ints, floats = self._forward.columns[:length], self._state.ints[:b], self._state.floats[:b]
        if self.compile:
            # the attended length is symbolic: one graph for every length bucket (compiled per step, the buckets bound
            # the CUDA graphs recorded, one per length); per layer, the batch too where it varies (2 <= b <= max_slots;
            # a single row has a graph of its own, a size of 1 is never symbolic, and its CPU products stream weights)
            compat.mark_dim_dynamic(columns, 0)
            if self.compile_scope == "layer" and self.max_slots > 2 and b > 1:
                compat.mark_dim_dynamic(ints, 0)
                compat.mark_dim_dynamic(floats, 0)
        # rows past n: free slots (token 0 at position 0, cleared when their request left)
        tokens, logprobs, ints = self._call(self._decode, ints, floats, columns, *self._sampling_flags(self._active))
        self._state.ints[:b] = ints  # copied at once: a CUDA graph's outputs are overwritten by its next replay
        self._record(list(self._active), tokens[:n], logprobs[:n])

    def _call(self, fn: Callable[..., _T], *args) -> _T:
        """``fn(*args)``, counting the graphs it compiled into ``compile_stats``."""
        if not self.compile:
            return fn(*args)
        graphs, start = compat.compiled_graph_count(), time.perf_counter()
        out = fn(*args)
        new = compat.compiled_graph_count() - graphs
        if new:
            self.compile_stats.graphs += new
            self.compile_stats.seconds += time.perf_counter() - start
        return out

    @staticmethod
    def _sampling_flags(slots: list[_Slot]) -> tuple[bool, bool]:
        """(some slot samples at temperature > 0, some slot sets top-k or top-p): False skips that work."""
        params = [s.request.sampling for s in slots]
        return any(p.temperature > 0 for p in params), any(p.top_k > 0 or p.top_p < 1.0 for p in params)

    def _record(self, slots: list[_Slot], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append each slot's sampled token and log-prob (one device-to-host copy) and retire finished slots."""
        host = torch.stack([tokens.double(), logprobs.double()]).tolist()  # token ids are exact in float64
        finished = []
        for slot, tok, lp in zip(slots, map(int, host[0]), host[1]):
            slot.generated.append(tok)
            slot.logprobs.append(lp)
            reason = self._finish_reason(slot, tok)
            if reason is not None:
                finished.append((self._active.index(slot), reason))
        for i, reason in sorted(finished, reverse=True):
            slot = self._active[i]
            self._ready.append(RequestResult(slot.request, slot.generated, slot.logprobs, reason))
            self._ids.discard(slot.request.id)
            self._remove_slot(i)

    def _finish_reason(self, slot: _Slot, token: int) -> FinishReason | None:
        p: SamplingParams = slot.request.sampling
        n = len(slot.generated)
        if p.target_len is not None:
            return "length" if n >= p.target_len else None
        if token in p.stop_token_ids:
            return "stop"
        if n >= p.max_new_tokens:
            return "length"
        if len(slot.request.prompt) + n >= self.max_len:
            return "max_len"
        return None

    def _remove_slot(self, i: int) -> None:
        """Free slot i, keeping active slots contiguous: the last active slot moves into i."""
        last = len(self._active) - 1
        if i != last:
            self._forward.move_slot(last, i, self._active[last].cache_len)
            self._state.move(last, i)
            self._active[i] = self._active[last]
        self._state.ints[last] = 0  # a free row decodes at position 0 (padding rows of a batch bucket)
        self._active.pop()
