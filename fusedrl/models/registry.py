"""Model flavors: named architectures built with torchtune's component builders.

A flavor fixes the architecture; a *role* fixes the head:

- ``policy``: LM head over the vocabulary (Actor, Reference).
- ``value``: scalar head per token (Critic, Reward).

Both roles are plain ``torchtune.modules.TransformerDecoder`` objects, so the rest of fusedrl
(pipeline splitting, FSDP2/TP, the generation engine) works on one module type.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torchtune.models.llama3._component_builders import llama3
from torchtune.models.llama3_1._component_builders import llama3_1
from torchtune.models.llama3_2._component_builders import llama3_2
from torchtune.models.qwen2._component_builders import qwen2
from torchtune.modules import TransformerDecoder

Role = Literal["policy", "value"]
ROLES: tuple[str, ...] = ("policy", "value")


@dataclass(frozen=True)
class ModelFlavor:
    """Architecture hyper-parameters of one flavor (names follow torchtune's builders)."""

    family: Literal["llama3", "llama3_1", "qwen2"]
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int
    rope_base: float = 500_000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False  # policy LM head shares the embedding (no separate output weight)
    scale_factor: int = 8  # llama3.1/3.2 RoPE scaling; ignored by other families


# Real sizes match the torchtune 0.6.1 model builders of the same name.
FLAVORS: dict[str, ModelFlavor] = {
    # Tiny, CPU-fast: unit tests and the embedded debug task.
    "debug": ModelFlavor("llama3", 512, 2, 4, 2, 64, 192, 512, rope_base=10_000.0),
    # One layer of "debug": a Critic smaller than the Actor (parallelism.pp_critic runs it on fewer stages).
    "debug_small": ModelFlavor("llama3", 512, 1, 4, 2, 64, 192, 512, rope_base=10_000.0),
    # ~27M parameters: CPU benchmarks.
    "debug_large": ModelFlavor("llama3", 512, 8, 8, 4, 512, 1536, 1024, rope_base=10_000.0),
    # Tiny qwen2-family model (q/k/v biases, tied embeddings): tests the Qwen code paths on CPU.
    "debug_qwen": ModelFlavor(
        "qwen2", 512, 2, 4, 2, 64, 192, 512, rope_base=1_000_000.0, norm_eps=1e-6, tie_word_embeddings=True
    ),
    # Llama 3.2 (torchtune's llama3_2 builders: llama3.1 architecture, RoPE scale 32, tied embeddings).
    "llama3_2_1b": ModelFlavor("llama3_1", 128_256, 16, 32, 8, 2048, 8192, 131_072, scale_factor=32, tie_word_embeddings=True),
    "llama3_2_3b": ModelFlavor("llama3_1", 128_256, 28, 24, 8, 3072, 8192, 131_072, scale_factor=32, tie_word_embeddings=True),
    # Llama 3.1 (RoPE scale 8, untied LM head).
    "llama3_1_8b": ModelFlavor("llama3_1", 128_256, 32, 32, 8, 4096, 14_336, 131_072),
    "llama3_1_70b": ModelFlavor("llama3_1", 128_256, 80, 64, 8, 8192, 28_672, 131_072),
    "llama3_1_405b": ModelFlavor("llama3_1", 128_256, 126, 128, 8, 16_384, 53_248, 131_072),
    # Qwen 2.5 (q/k/v biases; 0.5B-3B tie embeddings). Where torchtune has base and instruct
    # builders, the instruct one's max_seq_len / norm_eps are used (the weights have the same shapes).
    **{
        name: ModelFlavor(
            "qwen2",
            vocab,
            layers,
            heads,
            kv_heads,
            dim,
            hidden,
            seq,
            rope_base=1_000_000.0,
            norm_eps=1e-6,
            tie_word_embeddings=tied,
        )
        for name, vocab, layers, heads, kv_heads, dim, hidden, seq, tied in [
            ("qwen2_5_0_5b", 151_936, 24, 14, 2, 896, 4864, 32_768, True),
            ("qwen2_5_1_5b", 151_936, 28, 12, 2, 1536, 8960, 32_768, True),
            ("qwen2_5_3b", 151_936, 36, 16, 2, 2048, 11_008, 32_768, True),
            ("qwen2_5_7b", 152_064, 28, 28, 4, 3584, 18_944, 32_768, False),
            ("qwen2_5_14b", 152_064, 48, 40, 8, 5120, 13_824, 32_768, False),
            ("qwen2_5_32b", 152_064, 64, 40, 8, 5120, 27_648, 32_768, False),
            ("qwen2_5_72b", 152_064, 80, 64, 8, 8192, 29_568, 32_768, False),
        ]
    },
}


def build_model(flavor: str, role: Role = "policy", *, device: torch.device | str | None = None) -> TransformerDecoder:
    """Build a randomly initialised decoder of ``flavor`` with the head of ``role``.

    Use ``device="meta"`` to build large flavors without allocating memory.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; valid flavors: {', '.join(sorted(FLAVORS))}")
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}; valid roles: {', '.join(ROLES)}")
    f = FLAVORS[flavor]
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = _build_decoder(f)
        if role == "value":
            model.output = nn.Linear(f.embed_dim, 1, bias=False)
    return model


def _build_decoder(f: ModelFlavor) -> TransformerDecoder:
    common = dict(
        vocab_size=f.vocab_size,
        num_layers=f.num_layers,
        num_heads=f.num_heads,
        num_kv_heads=f.num_kv_heads,
        embed_dim=f.embed_dim,
        intermediate_dim=f.intermediate_dim,
        max_seq_len=f.max_seq_len,
        norm_eps=f.norm_eps,
    )
    if f.family == "llama3":
        if f.tie_word_embeddings:
            raise ValueError("family 'llama3' has no tied-embedding builder; use family 'llama3_1' for tied models")
        return llama3(rope_base=int(f.rope_base), **common)
    if f.family == "llama3_1":
        if f.tie_word_embeddings:  # torchtune's llama3_2 builder is llama3_1 with a tied LM head
            return llama3_2(rope_base=int(f.rope_base), scale_factor=f.scale_factor, tie_word_embeddings=True, **common)
        return llama3_1(rope_base=int(f.rope_base), scale_factor=f.scale_factor, **common)
    if f.family == "qwen2":
        return qwen2(rope_base=f.rope_base, tie_word_embeddings=f.tie_word_embeddings, **common)
    raise ValueError(f"unknown model family {f.family!r}")
