"""Model architectures (flavors) built from torchtune's modules.

A :class:`ModelFlavor` is one decoder architecture of the Llama, Mistral, Qwen2 or Qwen3 family, with the
fields of an HF ``config.json`` (``fusedrl.models.flavor_from_hf_config`` reads one); :data:`FLAVORS` names a
few (the debug ones for tests, and presets for the GPU configs). A *role* fixes the head:

- ``policy``: LM head over the vocabulary (Actor, Reference).
- ``value``: scalar head per token (Critic, Reward).

Both roles are plain ``torchtune.modules.TransformerDecoder`` objects, so the rest of fusedrl
(pipeline splitting, FSDP2/TP, the generation engine) works on one module type.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RotaryPositionalEmbeddings,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules import RMSNorm as TuneRMSNorm

from fusedrl.models.documents import accept_document_spans


class RMSNorm(TuneRMSNorm):
    """torchtune's RMSNorm (float32 arithmetic) with its scale cast to float32 too: a bf16 scale (mixed precision)
    beside the float32 input makes torch fall back from its fused kernel to a decomposition of several passes. Same
    values; a float32 scale is unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.scale.float(), self.eps).to(x.dtype)


Role = Literal["policy", "value"]
ROLES: tuple[str, ...] = ("policy", "value")
Family = Literal["llama", "mistral", "qwen2", "qwen3"]
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Llama3RoPE:
    """RoPE frequency scaling of Llama 3.1 / 3.2 (HF ``rope_type = "llama3"``)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelFlavor:
    """One decoder architecture; the fields are those of an HF ``config.json`` under torchtune's names.

    ``family`` is the HF ``model_type``. It fixes what has no config field: Qwen2 has q/k/v biases, Qwen3 an
    RMSNorm over each query and key head before RoPE; Llama and Mistral rotate interleaved pairs inside fusedrl
    (their q/k rows are permuted on load and export), Qwen rotates halves as HF does. ``attention_bias`` is HF's
    field: biases on the q/k/v and output projections (Llama, Qwen3). ``head_dim`` 0 means
    ``embed_dim // num_heads``. ``max_seq_len`` bounds sequence lengths (HF ``max_position_embeddings``, or a
    smaller sliding window: within it attention is full). ``name`` is for messages only.
    """

    family: Family
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int = 0
    rope_scaling: Llama3RoPE | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; fusedrl builds {', '.join(FAMILIES)}")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.embed_dim // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of features")
        if self.attention_bias and self.family in ("mistral", "qwen2"):
            raise ValueError(f"family {self.family!r} has no attention_bias field (its biases are fixed)")
        if self.mlp_bias and self.family != "llama":
            raise ValueError(f"family {self.family!r} has no mlp_bias field; only Llama's MLP may have biases")
        if self.rope_scaling is not None and self.family != "llama":
            raise ValueError(f"family {self.family!r}: llama3 RoPE scaling is built for Llama models only")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def interleaved_rope(self) -> bool:
        """Whether fusedrl's q/k rows are HF's permuted per head (torchtune's Llama RoPE rotates adjacent pairs)."""
        return self.family in ("llama", "mistral")

    def describe(self) -> str:
        return f"flavor {self.name!r}" if self.name else f"the {self.family} architecture"

    def num_params(self, role: str = "policy") -> int:
        """Parameters of the model with the head of ``role`` (a tied LM head counted once)."""
        d, hd = self.embed_dim, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = d * (q + 2 * kv) + q * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.attention_bias else 0)
        mlp = 3 * d * self.intermediate_dim + ((2 * self.intermediate_dim + d) if self.mlp_bias else 0)
        layer = attn + mlp + 2 * d + (2 * hd if self.qk_norm else 0)
        head = d if role == "value" else 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head


def _named(flavors: dict[str, ModelFlavor]) -> dict[str, ModelFlavor]:
    return {name: dataclasses.replace(f, name=name) for name, f in flavors.items()}


_LLAMA31 = Llama3RoPE(factor=8.0)
_LLAMA32 = Llama3RoPE(factor=32.0)

# Named architectures; a checkpoint folder's own config.json needs none of them (leave model.actor empty).
FLAVORS: dict[str, ModelFlavor] = _named(
    {
        # Tiny, CPU-fast: unit tests and the embedded debug task.
        "debug": ModelFlavor("llama", 512, 2, 4, 2, 64, 192, 512),
        # One layer of "debug": a Critic smaller than the Actor (parallelism.pp_critic runs it on fewer stages).
        "debug_small": ModelFlavor("llama", 512, 1, 4, 2, 64, 192, 512),
        # ~27M parameters: CPU benchmarks.
        "debug_large": ModelFlavor("llama", 512, 8, 8, 4, 512, 1536, 1024),
        # Tiny qwen2-family model (q/k/v biases, tied embeddings): tests the Qwen code paths on CPU.
        "debug_qwen": ModelFlavor("qwen2", 512, 2, 4, 2, 64, 192, 512, 1e6, 1e-6, tie_word_embeddings=True),
        # Llama 3.2 (llama3 RoPE scaled by 32, tied embeddings) and Llama 3.1 (scaled by 8, untied).
        "llama3_2_1b": ModelFlavor(
            "llama", 128_256, 16, 32, 8, 2048, 8192, 131_072, 5e5, rope_scaling=_LLAMA32, tie_word_embeddings=True
        ),
        "llama3_2_3b": ModelFlavor(
            "llama", 128_256, 28, 24, 8, 3072, 8192, 131_072, 5e5, rope_scaling=_LLAMA32, tie_word_embeddings=True
        ),
        "llama3_1_8b": ModelFlavor("llama", 128_256, 32, 32, 8, 4096, 14_336, 131_072, 5e5, rope_scaling=_LLAMA31),
        "llama3_1_70b": ModelFlavor("llama", 128_256, 80, 64, 8, 8192, 28_672, 131_072, 5e5, rope_scaling=_LLAMA31),
        "llama3_1_405b": ModelFlavor("llama", 128_256, 126, 128, 8, 16_384, 53_248, 131_072, 5e5, rope_scaling=_LLAMA31),
        # Qwen 2.5 (q/k/v biases; 0.5B-3B tie embeddings).
        **{
            name: ModelFlavor("qwen2", vocab, layers, heads, kv, dim, hidden, 32_768, 1e6, 1e-6, tie_word_embeddings=tied)
            for name, vocab, layers, heads, kv, dim, hidden, tied in [
                ("qwen2_5_0_5b", 151_936, 24, 14, 2, 896, 4864, True),
                ("qwen2_5_1_5b", 151_936, 28, 12, 2, 1536, 8960, True),
                ("qwen2_5_3b", 151_936, 36, 16, 2, 2048, 11_008, True),
                ("qwen2_5_7b", 152_064, 28, 28, 4, 3584, 18_944, False),
                ("qwen2_5_14b", 152_064, 48, 40, 8, 5120, 13_824, False),
                ("qwen2_5_32b", 152_064, 64, 40, 8, 5120, 27_648, False),
                ("qwen2_5_72b", 152_064, 80, 64, 8, 8192, 29_568, False),
            ]
        },
    }
)


def resolve_flavor(flavor: str | ModelFlavor) -> ModelFlavor:
    """``flavor`` itself, or the registered flavor of that name."""
    if isinstance(flavor, ModelFlavor):
        return flavor
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; valid flavors: {', '.join(sorted(FLAVORS))}")
    f = FLAVORS[flavor]
    return f if f.name == flavor else dataclasses.replace(f, name=flavor)  # a flavor registered without its name


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}; valid roles: {', '.join(ROLES)}")


class QKNormProjection(nn.Module):
    """A query or key projection followed by an RMSNorm over each head's features: Qwen3's ``q_norm`` /
    ``k_norm``, which HF applies before RoPE (torchtune's attention would apply its ``q_norm`` after RoPE)."""

    def __init__(self, linear: nn.Linear, norm: RMSNorm, head_dim: int) -> None:
        super().__init__()
        self.linear = linear
        self.norm = norm
        self.head_dim = head_dim

    def normalize(self, y: torch.Tensor) -> torch.Tensor:
        """The norm over each head of a projection output ``[..., heads * head_dim]`` (any number of heads)."""
        return self.norm(y.unflatten(-1, (-1, self.head_dim))).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(self.linear(x))


class ValueHead(nn.Linear):
    """The value role's scalar head (``[1, hidden]``, no bias), computed in its weight's dtype whatever the rest
    of the model computes in: rollout copies (:func:`cast_parameters`) and FSDP2's mixed precision
    (:func:`fusedrl.distributed.apply_fsdp`) keep it float32, so a bf16 model's values are the float32 projection
    of its last hidden state (one ``hidden``-long row: no cost)."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__(embed_dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def build_model(
    flavor: str | ModelFlavor, role: Role = "policy", *, device: torch.device | str | None = None
) -> TransformerDecoder:
    """Build a randomly initialised decoder of ``flavor`` (a name of :data:`FLAVORS` or a :class:`ModelFlavor`)
    with the head of ``role``. Use ``device="meta"`` to build large models without allocating memory.

    Modules are created in the order of torchtune's Llama builders, so a seed gives the same weights as theirs.
    """
    f = resolve_flavor(flavor)
    check_role(role)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = _build_decoder(f)
        if role == "value":
            model.output = ValueHead(f.embed_dim)
    accept_document_spans(model)  # packed rows (fusedrl.models.documents)
    return model


def _rope(f: ModelFlavor) -> nn.Module:
    if not f.interleaved_rope:
        return Qwen2RotaryPositionalEmbeddings(dim=f.head_dim, max_seq_len=f.max_seq_len, base=f.rope_base)
    # torchtune's Llama RoPE modules take an int base (the frequencies are the same for the float of an integer)
    base = int(f.rope_base) if float(f.rope_base).is_integer() else f.rope_base
    if f.rope_scaling is None:
        return RotaryPositionalEmbeddings(dim=f.head_dim, max_seq_len=f.max_seq_len, base=base)
    s = f.rope_scaling
    return Llama3ScaledRoPE(
        dim=f.head_dim,
        max_seq_len=f.max_seq_len,
        base=base,
        scale_factor=s.factor,  # torchtune annotates int; its math takes any float
        low_freq_factor=s.low_freq_factor,
        high_freq_factor=s.high_freq_factor,
        old_context_len=s.original_max_position_embeddings,
    )


def _build_decoder(f: ModelFlavor) -> TransformerDecoder:
    d, hd, h, kv = f.embed_dim, f.head_dim, f.num_heads, f.num_kv_heads
    rope = _rope(f)
    layers = nn.ModuleList()
    for _ in range(f.num_layers):
        q_linear, k_linear = nn.Linear(d, h * hd, bias=f.qkv_bias), nn.Linear(d, kv * hd, bias=f.qkv_bias)
        v_proj = nn.Linear(d, kv * hd, bias=f.qkv_bias)
        output_proj = nn.Linear(h * hd, d, bias=f.attention_bias)
        q_proj: nn.Module = q_linear
        k_proj: nn.Module = k_linear
        if f.qk_norm:
            q_proj = QKNormProjection(q_linear, RMSNorm(hd, eps=f.norm_eps), hd)
            k_proj = QKNormProjection(k_linear, RMSNorm(hd, eps=f.norm_eps), hd)
        attn = MultiHeadAttention(
            embed_dim=h * hd,  # torchtune only checks that it divides into the heads; the model width may differ
            num_heads=h,
            num_kv_heads=kv,
            head_dim=hd,
            q_proj=q_proj,
            k_proj=k_proj,
            v_proj=v_proj,
            output_proj=output_proj,
            pos_embeddings=rope,
            max_seq_len=f.max_seq_len,
        )
        mlp = FeedForward(
            gate_proj=nn.Linear(d, f.intermediate_dim, bias=f.mlp_bias),
            down_proj=nn.Linear(f.intermediate_dim, d, bias=f.mlp_bias),
            up_proj=nn.Linear(d, f.intermediate_dim, bias=f.mlp_bias),
        )
        norms = RMSNorm(d, eps=f.norm_eps), RMSNorm(d, eps=f.norm_eps)
        layers.append(TransformerSelfAttentionLayer(attn=attn, mlp=mlp, sa_norm=norms[0], mlp_norm=norms[1]))
    tok_embeddings = nn.Embedding(f.vocab_size, d)
    output = TiedLinear(tok_embeddings) if f.tie_word_embeddings else nn.Linear(d, f.vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=f.max_seq_len,
        num_heads=h,
        head_dim=hd,
        norm=RMSNorm(d, eps=f.norm_eps),
        output=output,
    )
