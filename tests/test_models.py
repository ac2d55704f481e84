import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchtune.models import llama3_1, llama3_2, qwen2_5
from torchtune.modules import TiedLinear

import fusedrl.models.hf as hf_module
from fusedrl.components.tokenizer import _TOKENIZER_COMPANIONS as TOKENIZER_COMPANIONS  # what Tokenizer.save copies
from fusedrl.models import (
    FLAVORS,
    CheckpointError,
    Llama3RoPE,
    ModelFlavor,
    build_model,
    hf_config,
    load_hf_checkpoint,
    save_hf_checkpoint,
)

# Our flavor -> torchtune 0.6.1's builder with the same sizes.
REAL_FLAVORS = {
    "llama3_2_1b": llama3_2.llama3_2_1b,
    "llama3_2_3b": llama3_2.llama3_2_3b,
    "llama3_1_8b": llama3_1.llama3_1_8b,
    "llama3_1_70b": llama3_1.llama3_1_70b,
    "llama3_1_405b": llama3_1.llama3_1_405b,
    "qwen2_5_0_5b": qwen2_5.qwen2_5_0_5b,
    "qwen2_5_1_5b": qwen2_5.qwen2_5_1_5b_instruct,
    "qwen2_5_3b": qwen2_5.qwen2_5_3b,
    "qwen2_5_7b": qwen2_5.qwen2_5_7b_instruct,
    "qwen2_5_14b": qwen2_5.qwen2_5_14b_instruct,
    "qwen2_5_32b": qwen2_5.qwen2_5_32b_instruct,
    "qwen2_5_72b": qwen2_5.qwen2_5_72b_instruct,
}

# A tiny Llama 3.2-style flavor (llama3_1 family, RoPE scaling, tied embeddings) for round trips.
TINY_LLAMA32 = ModelFlavor("llama", 384, 2, 4, 2, 64, 160, 256, 5e5, rope_scaling=Llama3RoPE(32.0), tie_word_embeddings=True)


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


def _rope_settings(model):
    rope = model.layers[0].attn.pos_embeddings
    return type(rope).__name__, {k: v for k, v in vars(rope).items() if isinstance(v, (int, float, bool))}


@pytest.mark.parametrize("flavor", sorted(REAL_FLAVORS))
def test_real_flavor_matches_torchtune_builder(flavor):
    ours = build_model(flavor, device="meta")
    with torch.device("meta"):
        theirs = REAL_FLAVORS[flavor]()
    assert _n_params(ours) == _n_params(theirs)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert isinstance(ours.output, TiedLinear) == isinstance(theirs.output, TiedLinear) == FLAVORS[flavor].tie_word_embeddings
    assert _rope_settings(ours) == _rope_settings(theirs)
    assert ours.max_seq_len == theirs.max_seq_len
    assert ours.norm.eps == theirs.norm.eps


@pytest.mark.parametrize("flavor", ["llama3_2_1b", "llama3_1_8b", "qwen2_5_7b"])
def test_real_flavor_value_role_has_scalar_head(flavor):
    policy = build_model(flavor, device="meta")
    value = build_model(flavor, "value", device="meta")
    f = FLAVORS[flavor]
    assert value.output.weight.shape == (1, f.embed_dim)
    lm_head = 0 if f.tie_word_embeddings else f.vocab_size * f.embed_dim
    assert _n_params(value) == _n_params(policy) - lm_head + f.embed_dim


@pytest.fixture
def tiny_llama32(monkeypatch):
    monkeypatch.setitem(FLAVORS, "tiny_llama32", TINY_LLAMA32)
    return "tiny_llama32"


def _random_model(flavor, role, seed):
    torch.manual_seed(seed)
    model = build_model(flavor, role)
    with torch.no_grad():
        for p in model.parameters():  # also randomise norms and biases so every tensor is checked
            p.normal_(0.0, 0.5)
    return model.eval()


def _tokens(vocab_size):
    return torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen", "tiny_llama32"])
@pytest.mark.parametrize("role", ["policy", "value"])
@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_save_load_round_trip_gives_identical_logits(tmp_path, flavor, role, max_shard_bytes, tiny_llama32):
    src = _random_model(flavor, role, seed=1)
    folder = save_hf_checkpoint(src, tmp_path / "ckpt", flavor, role, max_shard_bytes=max_shard_bytes)

    files = sorted(p.name for p in folder.iterdir())
    if max_shard_bytes is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [n for n in files if n.startswith("model-")]
        assert len(shards) > 1 and "model.safetensors.index.json" in files
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
    head = "lm_head.weight" if role == "policy" else "score.weight"
    names = _all_names(folder)
    tied_policy = role == "policy" and FLAVORS[flavor].tie_word_embeddings
    assert "model.embed_tokens.weight" in names and (head in names) == (not tied_policy)
    assert not any(n.startswith("layers.") for n in names)

    dst = _random_model(flavor, role, seed=2)
    tokens = _tokens(FLAVORS[flavor].vocab_size)
    with torch.no_grad():
        assert not torch.equal(src(tokens), dst(tokens))
        load_hf_checkpoint(dst, folder, flavor, role)
        assert torch.equal(src(tokens), dst(tokens))
    expected_last = FLAVORS[flavor].vocab_size if role == "policy" else 1
    assert dst(tokens).shape == (2, 24, expected_last)


def _all_names(folder):
    names = set()
    for path in Path(folder).glob("*.safetensors"):
        names |= set(load_file(path))
    return names


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen", "tiny_llama32"])
def test_checkpoint_matches_hf_transformers(tmp_path, flavor, tiny_llama32):
    """Our folders load into HF transformers with the same outputs (names, RoPE layout and config are HF's)."""
    transformers = pytest.importorskip("transformers")
    tokens = _tokens(FLAVORS[flavor].vocab_size)
    policy = _random_model(flavor, "policy", seed=3)
    folder = save_hf_checkpoint(policy, tmp_path / "lm", flavor)
    hf_lm = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    value = _random_model(flavor, "value", seed=4)
    folder = save_hf_checkpoint(value, tmp_path / "rm", flavor, "value")
    hf_rm = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_lm(tokens).logits, policy(tokens), rtol=1e-4, atol=1e-4)
        per_token = hf_rm.score(hf_rm.model(tokens).last_hidden_state)
        torch.testing.assert_close(per_token, value(tokens), rtol=1e-4, atol=1e-4)


def test_config_json_fields():
    c = hf_config("llama3_2_1b")
    assert c["architectures"] == ["LlamaForCausalLM"] and c["tie_word_embeddings"] is True
    assert c["rope_scaling"]["factor"] == 32.0 and c["hidden_size"] == 2048 and c["num_key_value_heads"] == 8
    assert hf_config("llama3_1_8b")["rope_scaling"]["factor"] == 8.0
    v = hf_config("qwen2_5_7b", "value", torch.bfloat16)
    assert v["architectures"] == ["Qwen2ForSequenceClassification"] and v["num_labels"] == 1
    assert v["model_type"] == "qwen2" and v["torch_dtype"] == "bfloat16" and v["vocab_size"] == 152_064


# ---------------------------------------------------------------------------- value from LM


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen"])
def test_value_model_starts_from_lm_checkpoint(tmp_path, flavor, caplog):
    policy = _random_model(flavor, "policy", seed=4)
    folder = save_hf_checkpoint(policy, tmp_path / "lm", flavor, "policy")
    value = _random_model(flavor, "value", seed=5)

    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(value, folder, flavor, "value")
    assert "missing tensors: score.weight" in str(err.value) and "init_value_head_from_lm=True" in str(err.value)

    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="fusedrl.models.hf"):
        load_hf_checkpoint(value, folder, flavor, "value", init_value_head_from_lm=True)
    backbone = {k: v for k, v in policy.state_dict().items() if k != "output.weight"}
    loaded = value.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in backbone.items())
    head = value.output.weight
    dim = FLAVORS[flavor].embed_dim
    assert head.shape == (1, dim) and 0 < head.std().item() < 3.0 / (dim + 1)
    assert "fresh score.weight" in caplog.text
    if not FLAVORS[flavor].tie_word_embeddings:
        assert "lm_head.weight" in caplog.text  # logged as ignored


def test_init_value_head_rejects_value_checkpoint(tmp_path):
    folder = save_hf_checkpoint(_random_model("debug", "value", 6), tmp_path / "v", "debug", "value")
    with pytest.raises(CheckpointError, match="already has a value head"):
        load_hf_checkpoint(build_model("debug", "value"), folder, "debug", "value", init_value_head_from_lm=True)


# ---------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def good_folder(tmp_path):
    return save_hf_checkpoint(_random_model("debug", "policy", 7), tmp_path / "ckpt", "debug")


def _edit(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def _load_error(folder, flavor="debug", role="policy", **kwargs) -> str:
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(build_model(flavor, role), folder, flavor, role, **kwargs)
    message = str(err.value)
    assert "Fix:" in message and "\n" not in message
    return message


def test_missing_tensor(good_folder):
    _edit(good_folder, lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("model.layers.0.mlp.up_proj.weight")))
    assert "missing tensors: model.layers.{0-1}.mlp.up_proj.weight" in _load_error(good_folder)


def test_unexpected_tensor(good_folder):
    _edit(good_folder, lambda t: t.update({"model.layers.5.self_attn.q_proj.bias": torch.zeros(64)}))
    assert "unexpected tensors: model.layers.5.self_attn.q_proj.bias" in _load_error(good_folder)


def test_misshaped_tensor(good_folder):
    _edit(good_folder, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)}))
    assert "wrong shape: model.layers.0.mlp.down_proj.weight expected [64, 192], found [64, 100]" in _load_error(good_folder)


def test_every_problem_is_listed_at_once(good_folder):
    def edit(t):
        t.pop("model.norm.weight")
        t["extra.weight"] = torch.zeros(3)
        t["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 32)

    _edit(good_folder, edit)
    message = _load_error(good_folder)
    assert "3 problem(s)" in message
    for part in (
        "missing tensors: model.norm.weight",
        "unexpected tensors: extra.weight",
        "model.layers.1.self_attn.o_proj.weight expected [64, 64], found [64, 32]",
    ):
        assert part in message


def test_bf16_checkpoint_loads_into_fp32_model(good_folder):
    _edit(good_folder, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    model = build_model("debug")
    load_hf_checkpoint(model, good_folder, "debug")  # any float dtype is cast; there is no strict flag
    expected = load_file(good_folder / "model.safetensors")["model.norm.weight"].float()
    assert model.norm.scale.dtype == torch.float32 and torch.equal(model.norm.scale, expected)


def test_float8_and_int_checkpoints_are_refused(good_folder):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)

    _edit(good_folder, edit)
    message = _load_error(good_folder)
    assert "unsupported dtype: model.layers.0.mlp.up_proj.weight is torch.float8_e4m3fn" in message
    assert "unsupported dtype: model.norm.weight is torch.int8" in message and "convert the checkpoint to bf16" in message


def test_truncated_file(good_folder):
    path = good_folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert "model.safetensors is truncated" in _load_error(good_folder)


def test_non_safetensors_file(good_folder):
    torch.save({"x": torch.zeros(3)}, good_folder / "model.safetensors")
    message = _load_error(good_folder)
    assert "model.safetensors is not a safetensors file" in message and "missing tensors" not in message


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    message = _load_error(tmp_path)
    assert "no model.safetensors or model.safetensors.index.json" in message and "pytorch_model.bin" in message


def test_index_naming_missing_shard(tmp_path):
    folder = save_hf_checkpoint(_random_model("debug", "policy", 8), tmp_path / "c", "debug", max_shard_bytes=40_000)
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[-1].unlink()
    message = _load_error(folder)
    assert f"names shard(s) that do not exist: {shards[-1].name}" in message and "missing tensors" in message


def test_vocab_mismatch(tmp_path, monkeypatch):
    monkeypatch.setitem(FLAVORS, "debug_vocab600", ModelFlavor("llama", 600, 2, 4, 2, 64, 192, 512))
    folder = save_hf_checkpoint(_random_model("debug_vocab600", "policy", 9), tmp_path / "c", "debug_vocab600")
    message = _load_error(folder)
    assert "vocab mismatch: model.embed_tokens.weight has 600 rows but flavor 'debug' has vocab_size 512" in message
    assert "vocab mismatch: lm_head.weight has 600 rows" in message
    assert "vocab mismatch: config.json has vocab_size=600" in message


def test_config_mismatch_is_reported(good_folder):
    config = json.loads((good_folder / "config.json").read_text())
    config["num_attention_heads"] = 8  # same tensor shapes, different RoPE head split
    (good_folder / "config.json").write_text(json.dumps(config))
    assert "config.json has num_attention_heads=8 but flavor 'debug' has 4" in _load_error(good_folder)


def test_policy_loading_value_checkpoint_says_which_role(tmp_path):
    folder = save_hf_checkpoint(_random_model("debug", "value", 10), tmp_path / "v", "debug", "value")
    message = _load_error(folder)
    assert "missing tensors: lm_head.weight" in message and "unexpected tensors: score.weight" in message
    assert "role='value'" in message


def test_wrong_flavor_lists_layers(good_folder):
    message = _load_error(good_folder, flavor="debug_qwen")
    assert "config.json has model_type='llama' but flavor 'debug_qwen' is a 'qwen2' model" in message
    assert "missing tensors: model.layers.{0-1}.self_attn.k_proj.bias" in message
    assert "unexpected tensors: lm_head.weight" not in message  # tied flavor ignores an LM head


def test_checkpoint_error_is_a_value_error_with_problem_list(good_folder):
    _edit(good_folder, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(build_model("debug"), good_folder, "debug")
    assert err.value.problems == ["missing tensors: model.norm.weight"]


# ---------------------------------------------------------------------------- atomic writes


def test_save_replaces_checkpoint_and_keeps_tokenizer_files(tmp_path):
    folder = save_hf_checkpoint(_random_model("debug", "policy", 11), tmp_path / "c", "debug", max_shard_bytes=40_000)
    # what an export's Tokenizer.save wrote there (a run that exports to the same folder again keeps them)
    tokenizer_files = ["tokenizer.json", *TOKENIZER_COMPANIONS]
    for name in tokenizer_files:
        (folder / name).write_text("{}")
    model = _random_model("debug", "policy", 12)
    save_hf_checkpoint(model, folder, "debug")
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", "model.safetensors", *tokenizer_files])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary folders left behind
    loaded = build_model("debug")
    load_hf_checkpoint(loaded, folder, "debug")
    assert torch.equal(loaded.norm.scale, model.norm.scale)


def test_failed_save_leaves_old_checkpoint_untouched(tmp_path, monkeypatch):
    folder = save_hf_checkpoint(_random_model("debug", "policy", 13), tmp_path / "c", "debug")
    before = (folder / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_module, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(_random_model("debug", "policy", 14), folder, "debug")
    assert (folder / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_save_refuses_to_replace_unrelated_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to replace .*notes.txt"):
        save_hf_checkpoint(build_model("debug"), tmp_path, "debug")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_unknown_flavor_and_role():
    with pytest.raises(ValueError, match="unknown model flavor 'nope'"):
        hf_config("nope")
    with pytest.raises(ValueError, match="unknown model role 'critic'"):
        save_hf_checkpoint(build_model("debug"), "/tmp/unused", "debug", "critic")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchtunes_and_takes_the_fused_kernel_with_a_bf16_scale(dtype):
    """fusedrl's RMSNorm gives torchtune's values (float32 arithmetic) and gradients; with a bf16 scale (FSDP2 mixed
    precision) it casts the scale, so torch does not fall back to its unfused decomposition (which warns)."""
    import warnings

    from torchtune.modules import RMSNorm as TuneRMSNorm

    from fusedrl.models.registry import RMSNorm

    ours, theirs = RMSNorm(16, eps=1e-5), TuneRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.scale.copy_(torch.randn(16))
    theirs.load_state_dict(ours.state_dict())
    ours.to(dtype), theirs.to(dtype)
    x = torch.randn(3, 5, 16, dtype=dtype, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback's "Cannot dispatch to fused implementation" would raise
        out = ours(x)
        out.float().square().sum().backward()
    want = theirs(x)
    want.float().square().sum().backward()
    assert out.dtype == dtype
    exact = dtype == torch.float32  # the float32 scale takes the same kernel as torchtune's
    torch.testing.assert_close(out, want, **({"atol": 0.0, "rtol": 0.0} if exact else {}))
    torch.testing.assert_close(ours.scale.grad, theirs.scale.grad, **({"atol": 0.0, "rtol": 0.0} if exact else {}))
