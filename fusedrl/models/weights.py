"""Fill a (possibly sharded) torchtune decoder slice by slice.

Three pieces, shared by the HF loader (:func:`fusedrl.models.hf.load_hf_weights`) and the in-memory
loader (:func:`load_state_slices`):

- HF <-> torchtune tensor names and the Llama q/k RoPE row permutation (torchtune keeps each head's
  rotary pairs interleaved, HF keeps them as two halves);
- the global indices of a tensor's local shard (plain tensor: everything; DTensor: per dimension,
  from its placements and this rank's mesh coordinate, ``_StridedShard`` of FSDP-over-TP included);
- :func:`fill_slices`, which asks a reader for the box of the global tensor covering the local
  shard and copies it in, cast to the tensor's dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fusedrl.models.registry import ModelFlavor, ValueHead, resolve_flavor

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
VALUE_HEAD_KEY = "score.weight"
TUNE_EMBED_KEY = "tok_embeddings.weight"
TUNE_HEAD_KEY = "output.weight"
ADAPTER_A, ADAPTER_B = "lora_a", "lora_b"  # a LoRA projection's adapters (fusedrl.models.lora), in no checkpoint

# torchtune name -> HF name, outside and inside a transformer layer. Qwen3's q/k projections are
# QKNormProjection modules (a linear, then the per-head norm): their own names are in _QK_NORM_NAMES.
_TOP_NAMES = {TUNE_EMBED_KEY: EMBED_KEY, "norm.scale": "model.norm.weight"}
_BIASED = ("weight", "bias")
_LAYER_NAMES = {
    **{f"attn.{p}_proj.{k}": f"self_attn.{p}_proj.{k}" for p in "qkv" for k in _BIASED},
    **{f"attn.output_proj.{k}": f"self_attn.o_proj.{k}" for k in _BIASED},
    **{f"mlp.{w}.{k}": f"mlp.{hf}_proj.{k}" for w, hf in (("w1", "gate"), ("w3", "up"), ("w2", "down")) for k in _BIASED},
    "sa_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
}
_QK_NORM_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith(("attn.q_proj.", "attn.k_proj."))},
    **{f"attn.{p}_proj.linear.{k}": f"self_attn.{p}_proj.{k}" for p in "qk" for k in _BIASED},
    **{f"attn.{p}_proj.norm.scale": f"self_attn.{p}_norm.weight" for p in "qk"},
}
_TOP_NAMES_HF = {v: k for k, v in _TOP_NAMES.items()}
_LAYER_NAMES_HF = {v: k for k, v in _LAYER_NAMES.items()}
_QK_NORM_NAMES_HF = {v: k for k, v in _QK_NORM_NAMES.items()}
_TUNE_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_ROPE_ROWS_RE = re.compile(r"layers\.\d+\.attn\.[qk]_proj\.(weight|bias)")

# Reads the box ``index`` (one slice per dim) of the global torchtune tensor ``name``, in torchtune layout.
Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]


# ---------------------------------------------------------------------------- names and layout


def hf_name(tune_name: str, role: str = "policy") -> str:
    """HF checkpoint name of torchtune tensor ``tune_name``; ``output.weight`` is ``lm_head`` / ``score`` by role."""
    if tune_name == TUNE_HEAD_KEY:
        return LM_HEAD_KEY if role == "policy" else VALUE_HEAD_KEY
    if tune_name in _TOP_NAMES:
        return _TOP_NAMES[tune_name]
    m = _TUNE_LAYER_RE.fullmatch(tune_name)
    if m:
        hf = _LAYER_NAMES.get(m.group(2)) or _QK_NORM_NAMES.get(m.group(2))
        if hf:
            return f"model.layers.{m.group(1)}.{hf}"
    raise ValueError(f"torchtune tensor {tune_name!r} has no HF name; only fusedrl's decoder tensors convert")


def tune_name(name: str, role: str = "policy", *, qk_norm: bool = False) -> str | None:
    """torchtune name of HF tensor ``name`` (``qk_norm``: of a model with Qwen3's q/k norms); None for what a
    model of ``role`` does not hold (RoPE ``inv_freq``, the other role's head)."""
    if "rotary_emb.inv_freq" in name or name == (VALUE_HEAD_KEY if role == "policy" else LM_HEAD_KEY):
        return None
    if name == (LM_HEAD_KEY if role == "policy" else VALUE_HEAD_KEY):
        return TUNE_HEAD_KEY
    if name in _TOP_NAMES_HF:
        return _TOP_NAMES_HF[name]
    m = _HF_LAYER_RE.fullmatch(name)
    names = _QK_NORM_NAMES_HF if qk_norm else _LAYER_NAMES_HF
    if m and m.group(2) in names:
        return f"layers.{m.group(1)}.{names[m.group(2)]}"
    raise ValueError(f"HF tensor {name!r} has no torchtune name; only Llama/Mistral/Qwen2/Qwen3 decoder checkpoints convert")


def rope_head_dim(tune_name: str, flavor: ModelFlavor) -> int | None:
    """Head size whose rows ``tune_name`` permutes between HF and torchtune (Llama / Mistral q/k), else None."""
    if flavor.interleaved_rope and _ROPE_ROWS_RE.fullmatch(tune_name):
        return flavor.head_dim
    return None


def hf_to_tune_rows(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF rotate-half rows -> torchtune interleaved rows, per head: ``out[h*hd + 2i + j] = t[h*hd + j*hd/2 + i]``.

    ``t`` holds whole heads along dim 0 (``t.shape[0] % head_dim == 0``).
    """
    heads = t.shape[0] // head_dim
    return t.reshape(heads, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def tune_to_hf_rows(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`hf_to_tune_rows`."""
    heads = t.shape[0] // head_dim
    return t.reshape(heads, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def tune_to_hf_state(
    state: Mapping[str, torch.Tensor], flavor: str | ModelFlavor, role: str = "policy"
) -> dict[str, torch.Tensor]:
    """A full torchtune state dict in HF names and layout, in ``state`` order with the head last."""
    f = resolve_flavor(flavor)
    out = {}
    for name, t in state.items():
        if name != TUNE_HEAD_KEY:
            hd = rope_head_dim(name, f)
            out[hf_name(name, role)] = t if hd is None else tune_to_hf_rows(t, hd)
    if TUNE_HEAD_KEY in state:
        out[hf_name(TUNE_HEAD_KEY, role)] = state[TUNE_HEAD_KEY]
    return out


def hf_to_tune_state(hf: Mapping[str, torch.Tensor], flavor: str | ModelFlavor, role: str = "policy") -> dict[str, torch.Tensor]:
    """A full HF state dict in torchtune names and layout (RoPE ``inv_freq``, the other role's head and a tied
    flavor's ``lm_head.weight`` are dropped)."""
    f = resolve_flavor(flavor)
    out = {}
    for name, t in hf.items():
        tune = tune_name(name, role, qk_norm=f.qk_norm)
        if tune is None or (tune == TUNE_HEAD_KEY and role == "policy" and f.tie_word_embeddings):
            continue
        hd = rope_head_dim(tune, f)
        out[tune] = t if hd is None else hf_to_tune_rows(t, hd)
    return out


# ---------------------------------------------------------------------------- local shards


def shard_indices(
    global_shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> list[torch.Tensor]:
    """Per tensor dim, the global indices held at mesh ``coordinate``, in local order.

    Placements apply left to right with ``torch.chunk`` semantics (trailing chunks may be short or
    empty). ``_StridedShard(dim, split_factor=s)`` (FSDP over TP) first cuts the dim into ``s``
    pieces, chunks each piece over the mesh dim and concatenates this rank's chunk of every piece.
    """
    idx = [torch.arange(n) for n in global_shape]
    for mesh_dim, p in enumerate(placements):
        if p.is_replicate():
            continue
        split = getattr(p, "split_factor", None)  # only _StridedShard has one (and its is_shard() is False)
        if p.is_partial() or not (p.is_shard() or split is not None):
            raise ValueError(f"cannot load into a DTensor with placement {p}; load before making it partial")
        d, k, r = p.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        idx[d] = torch.cat([_chunks(piece, k)[r] for piece in _chunks(idx[d], int(split or 1))])
    return idx


def local_indices(t: torch.Tensor) -> list[torch.Tensor]:
    """Per dim, the global indices of the tensor this rank holds of ``t`` (all of a plain tensor).

    For a DTensor the result is checked against ``__create_chunk_list__()`` (the offsets and sizes
    torch's DCP uses), whose first offsets must match; only a contiguous index set is a DCP box.
    """
    if not isinstance(t, DTensor):
        return [torch.arange(n) for n in t.shape]
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh and holds nothing
        return [torch.arange(0) for _ in t.shape]
    idx = shard_indices(t.shape, t.placements, mesh.shape, coordinate)
    local_shape = tuple(t.to_local().shape)
    (chunk,) = t.__create_chunk_list__()
    sizes = tuple(len(i) for i in idx)
    offsets = tuple(int(i[0]) if len(i) else o for i, o in zip(idx, chunk.offsets))
    if sizes != local_shape or sizes != tuple(chunk.sizes) or offsets != tuple(chunk.offsets):
        raise RuntimeError(
            f"cannot place the local shard of a DTensor with placements {t.placements}: computed sizes {sizes} "
            f"offsets {offsets}, torch reports local shape {local_shape} chunk {chunk}; this torch version shards "
            "differently than fusedrl assumes (update fusedrl.models.weights.shard_indices)"
        )
    return idx


def fill_slices(targets: Mapping[str, torch.Tensor], read: Reader) -> None:
    """Copy into each target's local shard ``read(name, box)`` cast to the target's dtype.

    ``box`` is one slice per dim: the bounding box of the local shard's global indices. Where a
    shard is not contiguous in the global tensor the box is gathered down to its rows. A target
    whose local shard is empty reads nothing.
    """
    with torch.no_grad():
        for name, t in targets.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.numel() == 0:
                continue
            idx = local_indices(t)
            box = tuple(slice(int(i.min()), int(i.max()) + 1) for i in idx)
            data = read(name, box)
            for d, (i, s) in enumerate(zip(idx, box)):
                if len(i) != s.stop - s.start or not torch.equal(i, torch.arange(s.start, s.stop)):
                    data = data.index_select(d, i - s.start)
            if tuple(data.shape) != tuple(local.shape):
                raise RuntimeError(f"internal error: read {tuple(data.shape)} for {name!r}, local shard is {tuple(local.shape)}")
            local.copy_(data)


def is_adapter(name: str) -> bool:
    """Whether state-dict entry ``name`` is a LoRA adapter (trained from its own initialisation, not loaded)."""
    return name.rpartition(".")[2] in (ADAPTER_A, ADAPTER_B)


def module_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``module`` by state-dict name (DTensors kept, not gathered); LoRA
    adapters are not among them.

    Raises when any is still on the meta device (call ``module.to_empty(device=...)`` first).
    """
    targets = {n: t for n, t in module.state_dict(keep_vars=True).items() if not is_adapter(n)}
    meta = [n for n, t in targets.items() if (t.to_local() if isinstance(t, DTensor) else t).is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        raise ValueError(
            f"module has tensors on the meta device ({shown}); call module.to_empty(device=...) before loading weights"
        )
    return targets


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with its floating-point parameters in ``dtype`` and its buffers as they are: a bf16 copy of a model
    keeps its float32 RoPE tables, as FSDP2's mixed precision (which casts parameters only) does in training. A
    :class:`ValueHead` keeps its dtype (values leave in float32). A parameter shared by two modules stays shared.
    Returns ``module``."""
    cast: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, ValueHead):
                continue
            for name, p in list(m.named_parameters(recurse=False)):
                if not p.is_floating_point() or p.dtype == dtype:
                    continue
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
                m.register_parameter(name, cast[id(p)])
    return module


def init_rope_buffers(module: nn.Module) -> None:
    """Recompute the RoPE buffers (``theta``, ``cache``) of every torchtune RoPE module in ``module``.

    They are not persistent (no checkpoint holds them) and ``to_empty`` leaves them uninitialised
    (Llama 3.1's scaled RoPE built on meta has none at all). They are computed on the CPU, exactly
    as a CPU-built model has them, then moved to the device of ``module``'s tensors; a buffer keeps
    its current dtype.
    """
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in module.state_dict(keep_vars=True).values()]
    device = next((t.device for t in tensors if not t.is_meta), None)
    if device is None:
        return
    for m in module.modules():
        rope_init = getattr(m, "rope_init", None)
        if not callable(rope_init):
            continue
        old = {n: b.dtype for n, b in m.named_buffers(recurse=False)}
        with torch.device("cpu"):
            rope_init()
        for n, b in list(m.named_buffers(recurse=False)):
            setattr(m, n, b.to(device=device, dtype=old.get(n, b.dtype)))


# ---------------------------------------------------------------------------- in-memory source


def load_state_slices(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Fill ``module``'s local shards from ``state``, a full torchtune-named state dict (plain tensors).

    ``module`` is a decoder, a ``split_decoder`` stage, possibly with DTensor (TP / FSDP2)
    parameters, already materialised (``to_empty``). ``state`` may hold more names than ``module``
    (the full model for one stage). A tied model's ``output.weight`` comes from
    ``tok_embeddings.weight`` when ``state`` has no ``output.weight``. Values are cast to each
    tensor's dtype; RoPE buffers are recomputed (:func:`init_rope_buffers`). Every name and shape
    is checked before anything is written.
    """
    targets = module_targets(module)
    source: dict[str, torch.Tensor] = {}
    problems = []
    for name, t in targets.items():
        src = state.get(name)
        if src is None and name == TUNE_HEAD_KEY:
            src = state.get(TUNE_EMBED_KEY)
        if src is None:
            problems.append(f"{name} is missing")
        elif isinstance(src, DTensor):
            problems.append(f"{name} is a DTensor")
        elif tuple(src.shape) != tuple(t.shape):
            problems.append(f"{name} has shape {list(src.shape)}, the module's is {list(t.shape)}")
        elif t.is_floating_point() and not src.is_floating_point():
            problems.append(f"{name} has dtype {src.dtype}, the module's is {t.dtype}")
        else:
            source[name] = src
    if problems:
        raise ValueError(
            f"cannot load the state dict: {'; '.join(problems)}. Fix: pass the full, plain state dict of a model "
            "built with the same flavor and role (e.g. build_model(flavor, role).state_dict())"
        )
    fill_slices(targets, lambda name, box: source[name][box])
    init_rope_buffers(module)


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    parts = list(t.chunk(n))
    return parts + [t[:0]] * (n - len(parts))
