"""Tiny HF ``config.json`` contents of every decoder architecture fusedrl reads, with the sizes that break
shortcuts: 9 query heads over 3 KV heads (the others split over 2 tensor-parallel ranks), ``head_dim`` unequal to ``hidden_size / num_attention_heads``, tied and
untied embeddings, every kind of bias, Qwen3's q/k norms, llama3 RoPE scaling, vocabularies that a TP degree of 2
does and does not divide. Tests build transformers models and fusedrl flavors from them."""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {"num_hidden_layers": 3, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}

TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    # SmolLM2's shape at 1/8 scale: 9 heads / 3 KV heads, tied embeddings; here also explicit head_dim and biases
    "llama": {
        **_COMMON,
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 72,
        "intermediate_size": 112,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 16,
        "rope_theta": 100_000.0,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
    },
    "llama3_rope": {
        **_COMMON,
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {
        **_COMMON,
        "model_type": "mistral",
        "vocab_size": 512,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "sliding_window": None,
    },
    "qwen2": {
        **_COMMON,
        "model_type": "qwen2",
        "vocab_size": 509,  # odd: a TP degree of 2 cannot split it, the head stays replicated
        "hidden_size": 72,
        "intermediate_size": 120,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "rope_theta": 1_000_000.0,
    },
    "qwen3_biased": {
        **_COMMON,
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": True,
        "tie_word_embeddings": True,
    },
}
