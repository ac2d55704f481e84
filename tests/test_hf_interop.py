"""HF interop: config.json fields that change the math are checked against a named flavor, a folder's own
architecture is read from its config.json, and an exported Actor works as is with plain transformers (logits,
tokenizer, generate, file modes)."""

import json
import os
import stat
from contextlib import contextmanager

import pytest
import torch

from fusedrl.components.checkpoint import export_hf
from fusedrl.components.tokenizer import ByteTokenizer
from fusedrl.models import (
    FLAVORS,
    CheckpointError,
    Llama3RoPE,
    ModelFlavor,
    build_model,
    flavor_from_hf_config,
    from_pretrained,
    hf_config,
    load_hf_weights,
    read_flavor,
    save_hf_checkpoint,
)

# A tiny llama3_1-family flavor (scaled RoPE, tied embeddings), registered by the fixture below.
TINY_LLAMA31 = ModelFlavor("llama", 384, 2, 4, 2, 64, 160, 256, 5e5, rope_scaling=Llama3RoPE(32.0), tie_word_embeddings=True)
TEXTS = ["hello world", "héllo 日本語 🎉", "repeat a 2 times:", ""]


@pytest.fixture
def tiny_llama31(monkeypatch):
    monkeypatch.setitem(FLAVORS, "tiny_llama31", TINY_LLAMA31)
    return "tiny_llama31"


def _random_model(flavor, role="policy", seed=0):
    torch.manual_seed(seed)
    model = build_model(flavor, role)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too, so every tensor matters
            p.normal_(0.0, 0.5)
    return model.eval()


def _edit_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _load_error(folder, flavor) -> str:
    with pytest.raises(CheckpointError) as err:
        load_hf_weights(build_model(flavor), folder, flavor)
    message = str(err.value)
    assert "\n" not in message and "Fix:" in message
    return message


# ---------------------------------------------------------------------------- config.json check


def _set(key, value):
    return lambda c: c.update({key: value})


def _drop(key):
    return lambda c: c.pop(key)


def _set_rope(key, value):
    return lambda c: c["rope_scaling"].update({key: value})


def _as_rope_parameters(theta):  # the form transformers 5 writes
    def edit(c):
        c.pop("rope_theta")
        c.pop("rope_scaling")
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}

    return edit


CONFIG_EDITS = [
    ("debug", _set("rope_theta", 5e5), "config.json has rope_theta=500000.0 but flavor 'debug' has 10000.0"),
    ("debug", _set("rms_norm_eps", 1e-6), "config.json has rms_norm_eps=1e-06 but flavor 'debug' has 1e-05"),
    (
        "debug",
        _drop("rms_norm_eps"),
        "config.json does not set rms_norm_eps (transformers' default 1e-06) but flavor 'debug' has 1e-05",
    ),
    ("debug", _set("head_dim", 32), "config.json has head_dim=32 but flavor 'debug' has 16"),
    ("debug", _set("tie_word_embeddings", True), "config.json has tie_word_embeddings=True but flavor 'debug' has False"),
    ("debug", _set("hidden_act", "gelu"), "config.json has hidden_act='gelu' but flavor 'debug' has 'silu'"),
    ("debug", _set("attention_bias", True), "config.json has attention_bias=True but flavor 'debug' has False"),
    ("debug", _set("mlp_bias", True), "config.json has mlp_bias=True but flavor 'debug' has False"),
    ("debug", _set("partial_rotary_factor", 0.5), "config.json has partial_rotary_factor=0.5 but flavor 'debug' has 1.0"),
    (
        "debug",
        _set("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        "config.json has rope_scaling.rope_type='linear' but flavor 'debug' has 'default'",
    ),
    ("debug", _as_rope_parameters(5e5), "config.json has rope_parameters.rope_theta=500000.0 but flavor 'debug' has 10000.0"),
    (
        "debug_qwen",
        lambda c: c.update(use_sliding_window=True, sliding_window=256, max_window_layers=0),
        "config.json has sliding_window=256 but flavor 'debug_qwen' has max_seq_len 512, which the window would cut",
    ),
    (
        "debug_qwen",
        _drop("tie_word_embeddings"),
        "config.json does not set tie_word_embeddings (transformers' default False) but flavor 'debug_qwen' has True",
    ),
    ("tiny_llama31", _set_rope("factor", 8.0), "config.json has rope_scaling.factor=8.0 but flavor 'tiny_llama31' has 32.0"),
    (
        "tiny_llama31",
        _set_rope("high_freq_factor", 2.0),
        "config.json has rope_scaling.high_freq_factor=2.0 but flavor 'tiny_llama31' has 4.0",
    ),
    (
        "tiny_llama31",
        _drop("rope_scaling"),
        "config.json does not set rope_scaling.rope_type (transformers' default 'default') but flavor 'tiny_llama31' has 'llama3'",
    ),
    (
        "tiny_llama31",
        _set_rope("original_max_position_embeddings", 4096),
        "config.json has rope_scaling.original_max_position_embeddings=4096 but flavor 'tiny_llama31' has 8192",
    ),
]


@pytest.mark.parametrize("flavor,edit,expected", CONFIG_EDITS, ids=[e for _, _, e in CONFIG_EDITS])
def test_each_math_field_of_config_json_is_checked(tmp_path, tiny_llama31, flavor, edit, expected):
    folder = save_hf_checkpoint(_random_model(flavor), tmp_path / "ckpt", flavor)
    load_hf_weights(build_model(flavor), folder, flavor)  # the file as written loads
    _edit_config(folder, edit)
    message = _load_error(folder, flavor)
    assert "1 problem(s)" in message and expected in message  # one line per field, file value and flavor value
    assert "leave the model's flavor empty to read its architecture from config.json" in message


def test_absent_fields_take_transformers_defaults(tmp_path):
    folder = save_hf_checkpoint(_random_model("debug"), tmp_path / "ckpt", "debug")
    # debug's values equal transformers' LlamaConfig defaults for all of these: absent is fine
    fields = [
        "head_dim",
        "hidden_act",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
    ]
    _edit_config(folder, lambda c: [c.pop(k) for k in fields])
    load_hf_weights(build_model("debug"), folder, "debug")
    _edit_config(folder, _drop("num_key_value_heads"))  # LlamaConfig: num_attention_heads
    assert "does not set num_key_value_heads (transformers' default 4) but flavor 'debug' has 2" in _load_error(folder, "debug")


def test_sizes_and_model_type_are_still_checked(tmp_path):
    folder = save_hf_checkpoint(_random_model("debug"), tmp_path / "ckpt", "debug")
    _edit_config(folder, _set("num_attention_heads", 8))
    message = _load_error(folder, "debug")
    assert "config.json has num_attention_heads=8 but flavor 'debug' has 4" in message
    assert "config.json has head_dim=16" not in message  # the file sets head_dim 16, the flavor has 16
    message = _load_error(folder, "debug_qwen")
    assert "config.json has model_type='llama' but flavor 'debug_qwen' is a 'qwen2' model" in message


# ---------------------------------------------------------------------------- a folder's own architecture


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen", "tiny_llama31"])
@pytest.mark.parametrize("role", ["policy", "value"])
def test_from_pretrained_reads_the_architecture_of_a_folder(tmp_path, tiny_llama31, flavor, role):
    src = _random_model(flavor, role, seed=1)
    folder = save_hf_checkpoint(src, tmp_path / "ckpt", flavor, role)
    model, found = from_pretrained(folder, role)
    assert found == FLAVORS[flavor] == read_flavor(folder, role) and found.name == "ckpt"
    tokens = torch.randint(0, FLAVORS[flavor].vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), src(tokens))
    bf16 = from_pretrained(folder, role, dtype=torch.bfloat16).model
    head = bf16.output.weight if role == "value" else None  # a value head stays float32
    assert {p.dtype for p in bf16.parameters() if p is not head} == {torch.bfloat16}
    assert head is None or head.dtype == torch.float32
    assert torch.equal(bf16.norm.scale, src.norm.scale.to(torch.bfloat16))


def test_from_pretrained_starts_a_value_model_from_an_lm_folder(tmp_path):
    folder = save_hf_checkpoint(_random_model("debug_qwen", seed=2), tmp_path / "lm", "debug_qwen")
    value, flavor = from_pretrained(folder, "value", init_value_head_from_lm=True)
    assert flavor == FLAVORS["debug_qwen"] and value.output.weight.shape == (1, 64)


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen", "tiny_llama31"])
def test_read_flavor_reads_configs_written_by_transformers(tmp_path, tiny_llama31, flavor):
    """transformers 5 rewrites RoPE as rope_parameters and the dtype as dtype: the architecture is the same."""
    transformers = pytest.importorskip("transformers")
    folder = save_hf_checkpoint(_random_model(flavor), tmp_path / "ckpt", flavor)
    transformers.AutoConfig.from_pretrained(folder).save_pretrained(tmp_path / "resaved")
    assert read_flavor(tmp_path / "resaved") == FLAVORS[flavor]


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
@pytest.mark.parametrize("role", ["policy", "value"])
def test_every_registered_flavor_reads_back_from_its_config(flavor, role):
    assert flavor_from_hf_config(hf_config(flavor, role), role) == FLAVORS[flavor]


# ---------------------------------------------------------------------------- export for transformers


@contextmanager
def _umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _greedy(model, ids, steps):
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


def _model_that_stops(tok, prompt_ids, steps):
    """A random debug model whose greedy continuation of ``prompt_ids`` ends with eos after a few tokens:
    the LM-head rows of eos and of the first new token after step 2 are swapped."""
    model = _random_model("debug", seed=5)
    free = _greedy(model, prompt_ids, steps)
    k = next(i for i in range(2, steps) if free[i] not in free[:i] and tok.eos_id not in free[: i + 1])
    with torch.no_grad():
        w = model.output.weight
        w[[free[k], tok.eos_id]] = w[[tok.eos_id, free[k]]]
    expected = _greedy(model, prompt_ids, steps)
    assert expected[: k + 1] == free[:k] + [tok.eos_id]
    return model, free[:k] + [tok.eos_id]


def test_exported_actor_works_with_plain_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = ByteTokenizer()
    prompt = "repeat a 2 times:"
    max_new = 12
    model, continuation = _model_that_stops(tok, tok.encode(prompt), max_new)
    folder = tmp_path / "actor_hf"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))  # stale: replaced by the export
    with _umask(0o022):
        assert export_hf(model, folder, "debug", "policy", tokenizer=tok) == folder

    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes == dict.fromkeys(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"], 0o644
    )
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids and config["torch_dtype"] == config["dtype"] == "float32"
    assert json.loads((folder / "generation_config.json").read_text()) == ids

    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert hf_tok(text).input_ids == tok.encode(text)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert hf_model.dtype == torch.float32
    tokens = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), rtol=1e-5, atol=1e-4)  # logits std ~2

    inputs = hf_tok(prompt, return_tensors="pt")
    out = hf_model.generate(**inputs, max_new_tokens=max_new, do_sample=False)[0].tolist()
    assert out == tok.encode(prompt) + continuation and len(continuation) < max_new  # stopped at eos, not at the limit


def test_export_files_follow_the_umask(tmp_path):
    with _umask(0o027):
        folder = save_hf_checkpoint(_random_model("debug"), tmp_path / "ckpt", "debug", max_shard_bytes=40_000)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o640}
