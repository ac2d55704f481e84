"""The HF ``config.json`` of a Llama, Mistral, Qwen2 or Qwen3 decoder and fusedrl's :class:`ModelFlavor`, both ways.

:func:`read_flavor` / :func:`flavor_from_hf_config` read the architecture as transformers reads it (absent or null
fields take transformers' defaults) and refuse, in one line naming the field, its value and the fix, what fusedrl cannot
build exactly; :func:`hf_config` writes a flavor's fields so that transformers builds the same class and the load check
(:mod:`fusedrl.models.hf`) passes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fusedrl.config import InputError
from fusedrl.models.registry import FAMILIES, Llama3RoPE, ModelFlavor, check_role, resolve_flavor

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


class CheckpointError(InputError):
    """A checkpoint folder that cannot be loaded; ``problems`` lists every problem found."""

    def __init__(self, message: str, problems: Iterable[str] = ()):
        super().__init__(message)
        self.problems = list(problems)


_ARCHITECTURES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def hf_config(
    flavor: str | ModelFlavor,
    role: str = "policy",
    dtype: torch.dtype = torch.float32,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> dict:
    """HF ``config.json`` fields describing ``flavor`` with the head of ``role``; ``dtype`` is the tensors'.
    transformers builds the same architecture class from it (``LlamaForCausalLM``, ``Qwen3ForSequenceClassification``,
    ...), and :func:`read_flavor` reads ``flavor`` back from it.

    The special token ids go into the file as given: ``None`` is written as ``null`` rather than left out,
    which would make transformers assume its own defaults (Llama: bos 1, eos 2). ``eos_token_id`` may list
    every id generation stops on.
    """
    f = resolve_flavor(flavor)
    check_role(role)
    arch = _ARCHITECTURES[f.family]
    dtype_name = str(dtype).removeprefix("torch.")
    math = _flavor_math(f)  # the fields the load check compares, so an export always passes it
    rope = {"rope_type": math.pop("rope_type")} | {k: math.pop(k) for k in _LLAMA3_ROPE_KEYS if k in math}
    config = {
        "architectures": [f"{arch}ForCausalLM" if role == "policy" else f"{arch}ForSequenceClassification"],
        **math,
        "max_position_embeddings": f.max_seq_len,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "torch_dtype": dtype_name,  # the key of transformers 4; transformers 5 reads "dtype"
        "dtype": dtype_name,
        "bos_token_id": bos_token_id,
        "eos_token_id": json_ids(eos_token_id),
        "pad_token_id": pad_token_id,
    }
    if f.family == "mistral":
        config["sliding_window"] = None  # transformers' default is a 4096-token window
    if role == "value":
        config["num_labels"] = 1
    return config


def json_ids(ids: int | Sequence[int] | None) -> int | list[int] | None:
    return ids if ids is None or isinstance(ids, int) else [int(i) for i in ids]


def read_flavor(folder: str | os.PathLike, role: str = "policy") -> ModelFlavor:
    """The architecture of the HF checkpoint ``folder``, from its ``config.json`` (:func:`flavor_from_hf_config`).

    Raises :class:`CheckpointError` (one line naming the field, its value and the fix) when the folder has no
    readable ``config.json`` or it describes something fusedrl cannot build exactly. Reads no weights.
    """
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        problem = f"{folder} has no {CONFIG_FILE}"
        raise CheckpointError(
            f"cannot read the architecture: {problem}. Fix: point to an HF checkpoint folder with its {CONFIG_FILE}, "
            "or name the model's flavor",
            [problem],
        )
    try:
        return flavor_from_hf_config(read_config_file(path), role, name=folder.name)
    except ValueError as e:
        raise CheckpointError(f"cannot build {path}: {e}", [str(e)]) from None


def flavor_from_hf_config(config: Mapping[str, Any], role: str = "policy", *, name: str = "") -> ModelFlavor:
    """The :class:`ModelFlavor` of an HF ``config.json`` (a dict), read as transformers reads it (absent fields
    take its defaults); ``role`` is the head the model gets. ``name`` labels the flavor in messages.

    Supported: ``model_type`` llama (RoPE ``default`` or ``llama3``, biases, explicit ``head_dim``), mistral,
    qwen2 and qwen3, tied or untied embeddings, and for the value role a causal LM (fresh head) or a
    ``*ForSequenceClassification`` with one label. A sliding window caps ``max_seq_len`` at its width (within it
    attention is full). Raises ValueError ("field=value: why. Fix: ...", one line) for anything else: another
    model type, mixture of experts, a quantized checkpoint, another RoPE type or activation, partial rotary factors,
    attention dropout, several labels.
    """
    check_role(role)
    model_type = config.get("model_type")
    if model_type not in _HF_DEFAULTS:
        raise ValueError(
            f"model_type={model_type!r}: fusedrl builds {', '.join(FAMILIES)} decoders. Fix: use a checkpoint of one "
            "of these families (MoE, multimodal and other architectures are not supported)"
        )
    for key in _MOE_KEYS:
        if config.get(key):
            raise ValueError(f"{key}={config[key]!r}: a mixture-of-experts model. Fix: use a dense checkpoint")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method") if isinstance(config["quantization_config"], dict) else None
        raise ValueError(
            f"quantization_config (quant_method={method!r}): fusedrl loads float weights. Fix: dequantize the "
            "checkpoint to bf16 safetensors first"
        )
    read = _config_math(config, model_type)
    value = {k: v for k, (v, _, _) in read.items()}
    field = {k: where for k, (_, where, _) in read.items()}

    def refuse(key: str, why: str, fix: str) -> ValueError:
        return ValueError(f"{field[key]}={value[key]!r}: {why}. Fix: {fix}")

    if value["hidden_act"] != "silu":
        raise refuse("hidden_act", "fusedrl's MLP is SiLU-gated", "use a SiLU model or correct config.json")
    if value["partial_rotary_factor"] != 1.0:
        raise refuse("partial_rotary_factor", "fusedrl rotates every feature of a head", "use a model with full RoPE")
    if value["attention_dropout"] not in (0, 0.0):
        raise refuse("attention_dropout", "fusedrl trains without dropout", "set attention_dropout to 0.0 in config.json")
    rope_type = value["rope_type"]
    if rope_type not in ("default", "llama3") or (rope_type == "llama3" and model_type != "llama"):
        built = "default RoPE (and llama3 scaling for Llama)"
        raise refuse("rope_type", f"fusedrl builds {built}", "use a checkpoint with one of them")
    classifier = any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())
    if role == "value" and classifier:  # a reward model's head; a causal LM gets a fresh one (labels do not matter)
        labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)  # transformers' order
        if labels != 1:
            raise ValueError(
                f"num_labels={labels!r}: a value model (Critic, Reward) has one scalar head. Fix: use a reward model "
                "with num_labels = 1 or an LM checkpoint (it gets a fresh head)"
            )
    sizes = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):  # fmt: skip
        if not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 1:
            raise refuse(key, "must be a positive integer", "correct config.json")
        sizes[key] = value[key]
    for key in ("rms_norm_eps", "rope_theta"):
        if not isinstance(value[key], (int, float)) or isinstance(value[key], bool) or value[key] <= 0:
            raise refuse(key, "must be a positive number", "correct config.json")
    max_seq_len = sizes["max_position_embeddings"]
    window = _sliding_window(value, model_type)
    if window is not None and window < max_seq_len:
        log.info(
            "%s: sliding_window %d caps sequences at %d tokens (attention is full within it)",
            name or "config.json",
            window,
            window,
        )
        max_seq_len = window
    scaling = None
    if rope_type == "llama3":
        for key in _LLAMA3_ROPE_KEYS:
            if not isinstance(value[key], (int, float)) or isinstance(value[key], bool) or value[key] <= 0:
                raise refuse(key, "llama3 RoPE needs it as a positive number", "correct config.json")
        factor, low, high, original = (value[k] for k in _LLAMA3_ROPE_KEYS)
        scaling = Llama3RoPE(float(factor), float(low), float(high), int(original))
    try:
        return ModelFlavor(
            model_type,
            sizes["vocab_size"],
            sizes["num_hidden_layers"],
            sizes["num_attention_heads"],
            sizes["num_key_value_heads"],
            sizes["hidden_size"],
            sizes["intermediate_size"],
            max_seq_len,
            rope_base=float(value["rope_theta"]),
            norm_eps=float(value["rms_norm_eps"]),
            tie_word_embeddings=bool(value["tie_word_embeddings"]),
            head_dim=sizes["head_dim"],
            rope_scaling=scaling,
            attention_bias=bool(value.get("attention_bias", False)),
            mlp_bias=bool(value.get("mlp_bias", False)),
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"{e}. Fix: correct config.json") from None


# transformers' defaults (its LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config) for the fields below when
# config.json leaves them out or sets them to null; transformers builds the model from these, so fusedrl reads them
# too. Absent num_key_value_heads (llama, mistral) is num_attention_heads, absent head_dim is hidden_size //
# num_attention_heads (but Qwen3's default is 128). max_position_embeddings is not compared (it bounds lengths); it
# is the default of llama3 RoPE's original length. A family reads only the fields its HF model reads (Mistral and
# Qwen2 have no bias fields: their biases are fixed).
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "partial_rotary_factor": 1.0,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}

_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}

_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON_DEFAULTS,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_COMMON_DEFAULTS,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "qwen2": {
        **_COMMON_DEFAULTS,
        "vocab_size": 151_936,
        "intermediate_size": 22_016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32_768,
        **_QWEN_WINDOW,
    },
    "qwen3": {
        **_COMMON_DEFAULTS,
        "vocab_size": 151_936,
        "intermediate_size": 22_016,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32_768,
        "attention_bias": False,
        **_QWEN_WINDOW,
    },
}

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

# rope_scaling fields of rope_type "llama3", in Llama3RoPE's order.
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

_WINDOW_KEYS = ("sliding_window", "use_sliding_window")


class _Mismatch(NamedTuple):
    field: str  # as named in config.json
    got: Any
    want: Any
    absent: bool  # config.json leaves the field out: ``got`` is transformers' default


def _flavor_math(f: ModelFlavor) -> dict[str, Any]:
    """Every config.json field that changes the math, with flavor ``f``'s value (what fusedrl builds)."""
    math = {
        "model_type": f.family,
        "vocab_size": f.vocab_size,
        "hidden_size": f.embed_dim,
        "intermediate_size": f.intermediate_dim,
        "num_hidden_layers": f.num_layers,
        "num_attention_heads": f.num_heads,
        "num_key_value_heads": f.num_kv_heads,
        "head_dim": f.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f.norm_eps,
        "rope_theta": f.rope_base,
        "partial_rotary_factor": 1.0,
        "rope_type": "default",
        "tie_word_embeddings": f.tie_word_embeddings,
        "attention_dropout": 0.0,
    }
    if f.rope_scaling is not None:
        s = f.rope_scaling
        math.update(rope_type="llama3", **{k: getattr(s, k) for k in _LLAMA3_ROPE_KEYS})
    if f.family == "llama":
        math.update(attention_bias=f.attention_bias, mlp_bias=f.mlp_bias)
    if f.family == "qwen3":
        math["attention_bias"] = f.attention_bias
    if f.family in ("qwen2", "qwen3"):
        math["use_sliding_window"] = False
    return math


def _config_math(config: Mapping[str, Any], model_type: str) -> dict[str, tuple[Any, str, bool]]:
    """The fields of :func:`_flavor_math` (and the sliding window's) read from a config.json as transformers reads
    them: field -> (value, name in the file, whether it was absent and took transformers' default)."""
    given = {k: v for k, v in config.items() if v is not None}
    out = {k: (given.get(k, default), k, k not in given) for k, default in _HF_DEFAULTS[model_type].items()}
    out["model_type"] = (model_type, "model_type", False)
    if config.get("sliding_window", 0) is None:  # an explicit null is "no window", not the default one
        out["sliding_window"] = (None, "sliding_window", False)
    hidden, heads = out["hidden_size"][0], out["num_attention_heads"][0]
    head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    if "num_key_value_heads" in config and config["num_key_value_heads"] is None:  # null: one KV head per query head
        out["num_key_value_heads"] = (heads, "num_key_value_heads", False)
    for key, default in (("num_key_value_heads", heads), ("head_dim", head_dim)):
        out.setdefault(key, (given.get(key, default), key, key not in given))
    out["layer_types"] = (given.get("layer_types"), "layer_types", "layer_types" not in given)
    if out["hidden_act"][0] == "swish":  # transformers' ACT2FN maps "swish" to SiLU as well
        out["hidden_act"] = ("silu", "hidden_act", False)
    # RoPE: transformers 5 reads rope_scaling, else rope_parameters; their rope_theta / partial_rotary_factor win
    # over the top-level fields, and a llama3 rope without original_max_position_embeddings uses max_position_embeddings.
    where = "rope_parameters" if "rope_parameters" in given and not given.get("rope_scaling") else "rope_scaling"
    rope = given.get(where) or {}
    rope = rope if isinstance(rope, dict) else {"rope_type": rope}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            out[key] = (rope[key], f"{where}.{key}", False)
    out["rope_type"] = (rope.get("rope_type", rope.get("type", "default")), f"{where}.rope_type", not rope)
    for key in _LLAMA3_ROPE_KEYS:
        out[key] = (rope.get(key), f"{where}.{key}", key not in rope)
    if "original_max_position_embeddings" not in rope:
        name = out["original_max_position_embeddings"][1]
        out["original_max_position_embeddings"] = (out["max_position_embeddings"][0], name, True)
    return out


def _sliding_window(value: Mapping[str, Any], model_type: str) -> int | None:
    """The attention window of a config's sliding layers (None: every layer attends to the whole sequence), from
    :func:`_config_math`'s values. Mistral slides in every layer; Qwen only with ``use_sliding_window``, in the
    layers ``layer_types`` names ``sliding_attention``, else in layers ``max_window_layers`` and up."""
    window = value.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        types = value.get("layer_types")
        if not value.get("use_sliding_window") or window is None:
            return None
        if isinstance(types, list) and "sliding_attention" not in types:
            return None
        layers, first = value.get("num_hidden_layers"), value.get("max_window_layers")
        if not isinstance(types, list) and isinstance(layers, int) and isinstance(first, int) and first >= layers:
            return None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"sliding_window={window!r}: must be a positive integer or null. Fix: correct config.json")
    return window


def config_differences(config: Mapping[str, Any], f: ModelFlavor) -> list[_Mismatch]:
    """The math fields in which ``config`` (a config.json) differs from flavor ``f``, one entry per field. A sliding
    window differs only where it is shorter than ``f.max_seq_len`` (within it attention is full)."""
    want = _flavor_math(f)
    model_type = config.get("model_type") or want["model_type"]
    if model_type not in _HF_DEFAULTS or model_type != want["model_type"]:
        return [_Mismatch("model_type", model_type, want["model_type"], False)]
    got = _config_math(config, model_type)
    out = []
    for key, value in want.items():
        if key in _WINDOW_KEYS or (key in _LLAMA3_ROPE_KEYS and got["rope_type"][0] != want["rope_type"]):
            continue  # the window is compared below; scaling parameters of another RoPE type
        found, name, absent = got[key]
        if found != value:
            out.append(_Mismatch(name, found, value, absent))
    try:
        window = _sliding_window({k: v for k, (v, _, _) in got.items()}, model_type)
    except ValueError:
        window = 0
    if window is not None and window < f.max_seq_len:
        value, name, absent = got["sliding_window"]
        out.append(_Mismatch(name, value, None, absent))
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    """``path`` (a config.json) as a dict; ValueError saying what is wrong with it."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} is not a JSON object")
    return config
