"""The model's forward over the engine's slot KV cache: prefill and the decode step (with its sampling), and each slot's
decode inputs kept on the device. The engine (``engine.py``) decides which requests hold which slots; this module runs
the decoder's own submodules over them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import FeedForward, MultiHeadAttention, TransformerDecoder, TransformerSelfAttentionLayer

from fusedrl.distributed import compat
from fusedrl.generation import cpu_kernels
from fusedrl.generation.request import SamplingParams
from fusedrl.generation.sampling import sample_tokens


class SlotForward(nn.Module):
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
        self.cpu_layouts = cpu_layouts  # CPU linears through cached weight layouts (fusedrl.generation.cpu_kernels)
        # q/k/v and gate/up each in one storage: their stacked layouts read them without a copy (unless a compile
        # region will take them; the layouts are then built from a concatenated copy)
        if cpu_layouts:
            cpu_kernels.prepare(model, stack=stack_projections)
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

    def _linears(self, modules: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
        """Each of ``modules`` (projections) applied to ``x``: through the CPU kernels where they take them."""
        if self.cpu_layouts and cpu_kernels.handles(modules):
            return cpu_kernels.linears(modules, x)
        return [m(x) for m in modules]

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
            if self.cpu_layouts and torch.compiler.is_compiling() and cpu_kernels.one_row(b * s):
                out = cpu_kernels.one_row_attention(grouped, k, v, mask).to(self.dtype)
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

    def extend(self, tokens: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded tokens [n, L] at positions ``starts[i] .. starts[i] + lengths[i] - 1`` of cache rows ``rows``,
        each attending to its row's cached positions before ``starts[i]`` and causally to its own new ones; their keys
        and values are written into the cache. Returns the final hidden states [n, L, dim] (normed): the logits of
        any position are ``self._linear(self.model.output, h)``. Padding positions land past a row's length (or in
        the spare column past ``max_len``), where decode overwrites them before they are ever attended to."""
        n, width = tokens.shape
        offsets = torch.arange(width, device=tokens.device)
        pos = starts[:, None] + offsets[None, :]  # [n, L]
        write = pos.clamp(max=self.columns.shape[0])  # padding past max_len goes to the spare column
        span = int((starts + lengths).max())
        mask = (self.columns[None, None, :span] <= pos[:, :, None])[:, None]  # [n, 1, L, span]
        h = self.model.tok_embeddings(tokens)
        for i, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(layer.attn, layer.sa_norm(h), pos)
            kc, vc = self.cache(i)
            kc[rows[:, None], write] = k.to(kc.dtype)
            vc[rows[:, None], write] = v.to(vc.dtype)
            keys, values = kc[rows, :span].transpose(1, 2), vc[rows, :span].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2).to(self.dtype), keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
            ).transpose(1, 2)
            out = self._linear(layer.attn.output_proj, out.reshape(n, width, self.num_heads * self.head_dim).to(q.dtype))
            h = self._block(layer, h, out)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits of final hidden states (:meth:`extend`'s)."""
        return self._linear(self.model.output, hidden).float()

    def sample_step(
        self, ints: torch.Tensor, floats: torch.Tensor, columns: torch.Tensor, any_sampled: bool, any_filtered: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode and sample one token for cache rows 0..b-1 from their device state (``ints`` [b, 6] / ``floats``
        [b, 2], the :class:`SlotState` columns), attending to the cache columns ``columns`` (0..L-1: a slice of
        ``self.columns``, whose length the compiled step takes as symbolic). Returns the sampled tokens [b], their
        log-probs [b] and the rows' next ``ints`` (inactive rows unchanged): one graph when compiled, sampling
        included."""
        tokens, pos = ints[:, SlotState.TOKEN].contiguous(), ints[:, SlotState.POSITION].contiguous()
        mask = (columns[None, :] <= pos[:, None])[:, None, None, :]
        sampled, logprobs = sample_rows(self(tokens, pos, mask), ints, floats, any_sampled, any_filtered)
        return sampled, logprobs, SlotState.advanced(ints, sampled)


def layer_region(forward: SlotForward) -> Callable[..., torch.Tensor]:
    """``forward._decode_layer`` as a nested compile region (a function of its own: the region marks it)."""

    def decode_layer(layer, h, kc, vc, rows, positions, mask) -> torch.Tensor:
        return forward._decode_layer(layer, h, kc, vc, rows, positions, mask)

    return torch.compiler.nested_compile_region(decode_layer)


def sample_rows(
    logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, any_sampled: bool, any_filtered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens`` of rows whose sampling parameters and random-stream position are the state ``ints``/``floats``."""
    return sample_tokens(
        logits,
        floats[:, SlotState.TEMPERATURE],
        ints[:, SlotState.TOP_K],
        floats[:, SlotState.TOP_P],
        ints[:, SlotState.SEED],
        ints[:, SlotState.COUNT],
        any_sampled=any_sampled,
        any_filtered=any_filtered,
    )


class SlotState:
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

    def write(self, i: int, pending: int, cache_len: int, seed: int, sampled: int, sampling: SamplingParams) -> None:
        """Row ``i`` takes a request whose ``pending`` token (0 for a fresh request, whose first token comes from its
        prefill) follows a cache of ``cache_len`` positions, after it sampled ``sampled`` tokens."""
        self.ints[i] = torch.tensor([pending, cache_len, seed, sampled, sampling.top_k, 1])
        self.floats[i] = torch.tensor([sampling.temperature, sampling.top_p])

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
