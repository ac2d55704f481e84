"""Any Llama / Mistral / Qwen2 / Qwen3 checkpoint loads from its config.json alone: tiny random transformers models
of every architecture (fusedrl.testing.architectures: odd head counts, head_dim unequal to hidden / heads, tied and
untied, biases, q/k norms, llama3 RoPE) give fusedrl the same logits and greedy tokens, value heads read from
``*ForSequenceClassification``, exports load back in transformers as the same class, bit for bit, and tensor-parallel
generation instances (gen_tp = 2) sample what one process samples. What cannot be built exactly is a one-line error
before any weight is read."""

import json

import pytest
import torch
import transformers  # a dev dependency (pyproject.toml): these tests run wherever the suite runs

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.models import CheckpointError, ModelFlavor, flavor_from_hf_config, from_pretrained, read_flavor, save_hf_checkpoint
from fusedrl.testing.architectures import TINY_ARCHITECTURES

ARCHS = sorted(TINY_ARCHITECTURES)
PROMPTS = ([5, 17, 33], [9, 2, 41, 7, 100, 3, 8], [250])
NEW_TOKENS = 12


def _hf_config(arch: str, role: str = "policy", **changes):
    fields = {**TINY_ARCHITECTURES[arch], **changes}
    model_type = fields.pop("model_type")
    if role == "value":
        fields.update(num_labels=1, pad_token_id=0)
    return transformers.AutoConfig.for_model(model_type, attn_implementation="eager", **fields)


def _hf_model(arch: str, role: str = "policy", seed: int = 0):
    """A transformers model of ``arch`` with every tensor random (norm weights around 1), so each one matters."""
    auto = transformers.AutoModelForCausalLM if role == "policy" else transformers.AutoModelForSequenceClassification
    torch.manual_seed(seed)
    model = auto.from_config(_hf_config(arch, role)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """arch -> (transformers policy model, its saved folder)."""
    out = {}
    for arch in ARCHS:
        model = _hf_model(arch)
        folder = tmp_path_factory.mktemp(arch)
        model.save_pretrained(folder)
        out[arch] = (model, folder)
    return out


def _tokens(arch: str, seed: int = 0) -> torch.Tensor:
    # from 1: id 0 is the value models' padding, after which transformers' sequence classifiers stop reading
    return torch.randint(1, TINY_ARCHITECTURES[arch]["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers(folders, arch):
    hf, folder = folders[arch]
    model, flavor = from_pretrained(folder)
    assert flavor.family == hf.config.model_type and flavor.name == folder.name
    tokens = _tokens(arch)
    with torch.no_grad():
        theirs, ours = hf(tokens).logits, model(tokens)
    assert theirs.std() > 0.5  # logits that differ between tokens
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_generate(folders, arch):
    hf, folder = folders[arch]
    model = from_pretrained(folder).model.eval()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    results = GenerationEngine(model, max_slots=2, max_len=32).generate(
        [Request(i, list(p), greedy) for i, p in enumerate(PROMPTS)]
    )
    for prompt, result in zip(PROMPTS, sorted(results, key=lambda r: r.id)):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.tokens == out[0, len(prompt) :].tolist(), (arch, prompt)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_biased"])
def test_value_model_from_a_sequence_classification_folder(tmp_path, folders, arch):
    hf = _hf_model(arch, "value", seed=1)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"][0].endswith("ForSequenceClassification")
    model, _ = from_pretrained(tmp_path, "value")
    tokens = _tokens(arch, seed=1)
    with torch.no_grad():  # transformers scores the last token
        torch.testing.assert_close(model(tokens)[:, -1], hf(tokens).logits, rtol=1e-5, atol=5e-5)
    lm_folder = folders[arch][1]  # a causal LM: a value model from it needs a fresh head
    with pytest.raises(CheckpointError, match="missing tensors: score.weight.*init_value_head_from_lm=True"):
        from_pretrained(lm_folder, "value")
    value = from_pretrained(lm_folder, "value", init_value_head_from_lm=True).model
    assert value.output.weight.shape == (1, TINY_ARCHITECTURES[arch]["hidden_size"])


@pytest.mark.parametrize("arch", ARCHS)
def test_export_loads_in_transformers_as_the_same_class_bit_for_bit(tmp_path, folders, arch):
    hf, folder = folders[arch]
    model, flavor = from_pretrained(folder)
    exported = save_hf_checkpoint(model, tmp_path / "export", flavor)
    back = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(back) is type(hf)
    theirs, ours = hf.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), arch
    back.save_pretrained(tmp_path / "resaved")
    again, again_flavor = from_pretrained(tmp_path / "resaved")
    assert again_flavor == flavor
    state, state_again = model.state_dict(), again.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)


# ---------------------------------------------------------------------------- what cannot be built exactly

REFUSED = [
    ("llama", {"model_type": "mixtral"}, "model_type='mixtral': fusedrl builds llama, mistral, qwen2, qwen3 decoders"),
    ("qwen3", {"num_experts": 8}, "num_experts=8: a mixture-of-experts model"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ("qwen2", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type='llama3'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config (quant_method='gptq')"),
    ("qwen3", {"num_attention_heads": 3}, "num_heads (3) must be a multiple of num_kv_heads (2)"),
    ("qwen2", {"hidden_size": "72"}, "hidden_size='72': must be a positive integer"),
]


@pytest.mark.parametrize("arch,changes,expected", REFUSED, ids=[e for _, _, e in REFUSED])
def test_what_cannot_be_built_exactly_is_one_line_naming_the_field(tmp_path, arch, changes, expected):
    config = {**TINY_ARCHITECTURES[arch], **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        read_flavor(tmp_path)
    message = str(err.value)
    assert expected in message and "Fix:" in message and "\n" not in message and len(message) < 300, message


def test_several_labels_refuse_a_reward_head_only():
    classifier = {**TINY_ARCHITECTURES["llama"], "architectures": ["LlamaForSequenceClassification"]}
    with pytest.raises(ValueError, match="num_labels=3: a value model .* has one scalar head"):
        flavor_from_hf_config({**classifier, "num_labels": 3}, "value")
    with pytest.raises(ValueError, match="num_labels=2"):  # transformers reads id2label first, and defaults to 2
        flavor_from_hf_config({**classifier, "id2label": {"0": "bad", "1": "good"}, "num_labels": 1}, "value")
    with pytest.raises(ValueError, match="num_labels=2"):
        flavor_from_hf_config(classifier, "value")
    assert flavor_from_hf_config({**classifier, "num_labels": 1}, "value").num_layers == 3
    lm = {**TINY_ARCHITECTURES["llama"], "architectures": ["LlamaForCausalLM"], "id2label": {"0": "a", "1": "b"}}
    assert flavor_from_hf_config(lm, "value") == flavor_from_hf_config(lm, "policy")  # an LM gets a fresh head


def test_a_sliding_window_caps_the_sequence_length_where_layers_slide():
    mistral = {k: v for k, v in TINY_ARCHITECTURES["mistral"].items() if k != "sliding_window"}
    assert flavor_from_hf_config(mistral).max_seq_len == 128  # transformers' default window (4096) never slides here
    assert flavor_from_hf_config({**mistral, "sliding_window": 64}).max_seq_len == 64
    assert flavor_from_hf_config({**mistral, "sliding_window": None, "max_position_embeddings": 8192}).max_seq_len == 8192
    qwen = {**TINY_ARCHITECTURES["qwen3"], "sliding_window": 16}
    assert flavor_from_hf_config(qwen).max_seq_len == 128  # use_sliding_window is off
    sliding = {**qwen, "use_sliding_window": True}
    assert flavor_from_hf_config(sliding).max_seq_len == 128  # layers 0-2 are below max_window_layers (28)
    assert flavor_from_hf_config({**sliding, "max_window_layers": 2}).max_seq_len == 16  # layer 2 slides
    assert flavor_from_hf_config({**sliding, "layer_types": ["full_attention"] * 3}).max_seq_len == 128
    mixed = ["full_attention", "sliding_attention", "full_attention"]
    assert flavor_from_hf_config({**sliding, "layer_types": mixed}).max_seq_len == 16
    assert flavor_from_hf_config({**sliding, "max_window_layers": 0, "sliding_window": None}).max_seq_len == 128


def test_explicit_nulls_read_as_transformers_reads_them():
    qwen = {**TINY_ARCHITECTURES["qwen2"], "num_key_value_heads": None}
    assert flavor_from_hf_config(qwen).num_kv_heads == 6  # one KV head per query head, not Qwen2Config's default 32
    absent = {k: v for k, v in TINY_ARCHITECTURES["qwen2"].items() if k != "num_key_value_heads"}
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(32\)"):
        flavor_from_hf_config(absent)


def test_head_dim_defaults_follow_each_family():
    no_head_dim = {k: v for k, v in TINY_ARCHITECTURES["qwen3"].items() if k != "head_dim"}
    assert flavor_from_hf_config(no_head_dim).head_dim == 128  # Qwen3Config's default, not hidden / heads
    assert flavor_from_hf_config({**no_head_dim, "model_type": "qwen2"}).head_dim == 16
    flavor = flavor_from_hf_config(TINY_ARCHITECTURES["llama"])
    assert (flavor.head_dim, flavor.embed_dim // flavor.num_heads) == (16, 8)


# ---------------------------------------------------------------------------- tensor-parallel instances


def _tp_generation(folders: dict) -> dict:
    import torch.distributed as dist

    from fusedrl.distributed import ParallelDims, apply_tp

    mesh = ParallelDims(dp_shard=dist.get_world_size(), gen_tp=2).build_gen_mesh("cpu")
    out = {}
    for arch, folder in folders.items():
        model = from_pretrained(folder).model.eval()
        apply_tp(model, mesh["gen_tp"])
        out[arch] = _generate(model)
    return out


def _generate(model) -> dict:
    sampled = SamplingParams(temperature=0.9, top_k=50, max_new_tokens=NEW_TOKENS)
    requests = [Request(i, list(p), sampled) for i, p in enumerate(PROMPTS)]
    results = GenerationEngine(model, max_slots=2, max_len=32, seed=5).generate(requests)
    return {r.id: (r.tokens, r.logprobs) for r in results}


@pytest.mark.slow
def test_gen_tp2_instances_sample_what_one_process_samples(rank_pools, folders):
    even = [a for a, c in TINY_ARCHITECTURES.items() if c["num_attention_heads"] % 2 == c["num_key_value_heads"] % 2 == 0]
    assert len(even) == len(ARCHS) - 1  # all but the 9-head Llama
    paths = {arch: folders[arch][1] for arch in even}
    single = {arch: _generate(from_pretrained(folder).model.eval()) for arch, folder in paths.items()}
    for rank_out in rank_pools(2).run(_tp_generation, paths, timeout_s=240):
        for arch, results in rank_out.items():
            for i, (tokens, logprobs) in results.items():
                assert tokens == single[arch][i][0], (arch, i)
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(single[arch][i][1]), atol=1e-4, rtol=0)


def test_tiny_architectures_cover_every_family_and_feature():
    flavors: list[ModelFlavor] = [flavor_from_hf_config(c) for c in TINY_ARCHITECTURES.values()]
    assert {f.family for f in flavors} == {"llama", "mistral", "qwen2", "qwen3"}
    assert {f.tie_word_embeddings for f in flavors} == {True, False}
    assert any(f.head_dim * f.num_heads != f.embed_dim for f in flavors)
    assert any(f.attention_bias and f.qk_norm for f in flavors) and any(f.rope_scaling for f in flavors)
