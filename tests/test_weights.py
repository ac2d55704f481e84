"""Slice-by-slice loading into plain, split, TP / FSDP2 / TP x FSDP2 sharded decoders (fusedrl.models.weights)."""

from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard
from torchtune.models.convert_weights import hf_to_tune, tune_to_hf
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune, qwen2_tune_to_hf

import fusedrl.models.hf as hf_module
import fusedrl.models.weights as weights_module
from fusedrl.distributed import ParallelDims, apply_fsdp, apply_tp, split_decoder
from fusedrl.models import (
    FLAVORS,
    CheckpointError,
    build_model,
    hf_to_tune_state,
    load_hf_checkpoint,
    load_hf_weights,
    load_state_slices,
    save_hf_checkpoint,
    tune_to_hf_state,
)
from fusedrl.models.weights import fill_slices, hf_name, hf_to_tune_rows, local_indices, shard_indices, tune_to_hf_rows


def _random_model(flavor: str, role: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(flavor, role)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too, so that every tensor is checked
            p.normal_(0.0, 0.5)
    return model.eval()


def _tokens(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))


def _select(full: torch.Tensor, idx: list[torch.Tensor]) -> torch.Tensor:
    for d, i in enumerate(idx):
        full = full.index_select(d, i)
    return full


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """HF checkpoints of random debug models: (flavor, role) -> folder."""
    root = tmp_path_factory.mktemp("ckpts")
    return {
        (flavor, role): save_hf_checkpoint(_random_model(flavor, role, seed), root / f"{flavor}-{role}", flavor, role)
        for seed, (flavor, role) in enumerate(
            [("debug", "policy"), ("debug", "value"), ("debug_qwen", "policy"), ("debug_qwen", "value")]
        )
    }


def _full_load(folder: Path, flavor: str, role: str, **kwargs) -> dict[str, torch.Tensor]:
    model = build_model(flavor, role)
    load_hf_checkpoint(model, folder, flavor, role, **kwargs)
    return model.state_dict()


# ---------------------------------------------------------------------------- names and RoPE layout


@pytest.mark.parametrize("flavor", ["debug", "debug_qwen"])
def test_names_and_permutation_equal_torchtune_converters(flavor):
    f = FLAVORS[flavor]
    dims = dict(num_heads=f.num_heads, num_kv_heads=f.num_kv_heads, dim=f.embed_dim)
    state = _random_model(flavor, "policy", 0).state_dict()
    ours = tune_to_hf_state(state, flavor)
    if f.family == "qwen2":
        theirs = qwen2_tune_to_hf(state, tie_word_embeddings=f.tie_word_embeddings, **dims)
        back = qwen2_hf_to_tune(theirs, tie_word_embeddings=f.tie_word_embeddings, **dims)
    else:
        theirs = tune_to_hf(state, **dims)
        back = hf_to_tune(theirs, **dims)
    assert list(ours) == list(theirs) and len(ours) == len(state)  # every tensor, same order
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    ours_back = hf_to_tune_state(theirs, flavor)
    assert ours_back.keys() == back.keys() == state.keys()
    assert all(torch.equal(ours_back[k], back[k]) and torch.equal(back[k], state[k]) for k in state)
    # Llama permutes q/k rows, Qwen does not.
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], state["layers.0.attn.q_proj.weight"]) == (
        f.family == "qwen2"
    )


def test_value_head_names():
    state = _random_model("debug_qwen", "value", 0).state_dict()
    hf = tune_to_hf_state(state, "debug_qwen", "value")
    assert list(hf)[-1] == "score.weight" and hf["score.weight"].shape == (1, 64) and "lm_head.weight" not in hf
    assert torch.equal(hf_to_tune_state(hf, "debug_qwen", "value")["output.weight"], state["output.weight"])


def test_row_permutation_formula():
    hd, heads = 8, 3
    t = torch.arange(heads * hd * 2).reshape(heads * hd, 2)
    out = hf_to_tune_rows(t, hd)
    for h in range(heads):
        for i in range(hd // 2):
            for j in range(2):
                assert torch.equal(out[h * hd + 2 * i + j], t[h * hd + j * (hd // 2) + i])
    assert torch.equal(tune_to_hf_rows(out, hd), t)
    assert torch.equal(hf_to_tune_rows(torch.arange(hd), hd), torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]))


# ---------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_checkpoint_loads_into_fp32_and_bf16_models(folders, tmp_path, file_dtype):
    folder = save_hf_checkpoint(
        {k: v.to(file_dtype) for k, v in _random_model("debug", "policy", 3).state_dict().items()},
        tmp_path / "low",
        "debug",
    )
    stored = hf_to_tune_state(load_file(folder / "model.safetensors"), "debug")
    assert all(t.dtype == file_dtype for t in stored.values())
    for model_dtype in (torch.float32, torch.bfloat16):
        model = build_model("debug").to(model_dtype)
        load_hf_weights(model, folder, "debug")
        loaded = model.state_dict()
        assert loaded.keys() == stored.keys()
        for name, t in stored.items():
            assert loaded[name].dtype == model_dtype and torch.equal(loaded[name], t.to(model_dtype)), name


# ---------------------------------------------------------------------------- meta-built pipeline stages


@pytest.mark.parametrize(("flavor", "role"), [("debug", "policy"), ("debug_qwen", "policy"), ("debug_qwen", "value")])
@pytest.mark.parametrize("source", ["hf", "memory"])
def test_meta_split_stages_get_the_full_models_tensors(folders, flavor, role, source):
    folder = folders[flavor, role]
    reference = build_model(flavor, role).eval()
    load_hf_checkpoint(reference, folder, flavor, role)
    full = reference.state_dict()

    stages = split_decoder(build_model(flavor, role, device="meta"), 2)
    for stage in stages:
        stage.to_empty(device="cpu")
        if source == "hf":
            load_hf_weights(stage, folder, flavor, role)
        else:
            load_state_slices(stage, full)
    tied = role == "policy" and FLAVORS[flavor].tie_word_embeddings
    assert ("output.weight" in full) == (not tied) and "output.weight" in stages[-1].state_dict()
    for stage in stages:
        for name, t in stage.state_dict().items():
            want = full["tok_embeddings.weight" if tied and name == "output.weight" else name]
            assert torch.equal(t, want), name

    tokens = _tokens()
    with torch.no_grad():
        h = tokens
        for stage in stages:  # RoPE buffers were recomputed: the chained stages compute the full model
            h = stage.eval()(h)
        torch.testing.assert_close(h, reference(tokens), rtol=0, atol=0)


def test_meta_module_and_wrong_flavor_are_refused(folders):
    with pytest.raises(ValueError, match=r"meta device .*call module.to_empty\(device=\.\.\.\)"):
        load_hf_weights(build_model("debug", device="meta"), folders["debug", "policy"], "debug")
    wrong = r"module does not match flavor 'debug' role 'policy': .* layers.\{0-1\}.attn.q_proj.bias"
    with pytest.raises(ValueError, match=wrong):
        load_hf_weights(build_model("debug_qwen"), folders["debug", "policy"], "debug")


def test_load_state_slices_checks_before_writing():
    model = _random_model("debug", "policy", 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = _random_model("debug", "policy", 2).state_dict()
    state.pop("norm.scale")
    state["layers.1.mlp.w2.weight"] = torch.zeros(64, 100)
    with pytest.raises(
        ValueError,
        match=r"layers.1.mlp.w2.weight has shape \[64, 100\], the module's is \[64, 192\]; norm.scale is missing. Fix:",
    ):
        load_state_slices(model, state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------- bad checkpoints


@pytest.mark.parametrize(
    ("tensor", "edit", "message"),
    [
        (
            "model.layers.1.mlp.up_proj.weight",
            lambda t: t.to(torch.float8_e4m3fn),
            "unsupported dtype: model.layers.1.mlp.up_proj.weight is torch.float8_e4m3fn",
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            lambda t: t.to(torch.int8),
            "unsupported dtype: model.layers.0.self_attn.q_proj.weight is torch.int8",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            lambda t: t[:16],
            "wrong shape: model.layers.0.self_attn.k_proj.weight expected [32, 64], found [16, 64]",
        ),
    ],
)
def test_bad_tensor_raises_before_any_parameter_changes(folders, tmp_path, tensor, edit, message):
    tensors = load_file(folders["debug", "policy"] / "model.safetensors")
    tensors[tensor] = edit(tensors[tensor]).contiguous()
    (tmp_path / "bad").mkdir()
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    model = _random_model("debug", "policy", 9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_hf_weights(model, tmp_path / "bad", "debug")
    assert message in str(err.value) and "Fix:" in str(err.value) and len(err.value.problems) == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------- local shard indices


@pytest.mark.parametrize("size", [8, 7, 5, 3, 1])
@pytest.mark.parametrize(
    "placements",
    [
        (Shard(0), Shard(0)),
        (_StridedShard(0, split_factor=2), Shard(0)),  # FSDP over TP on the same dim
        (Shard(0), _StridedShard(0, split_factor=2)),  # shards that are not contiguous in the global tensor
        (Shard(0), Replicate()),
        (Replicate(), Shard(0)),
        (Shard(0), Shard(1)),
    ],
)
def test_shard_indices_follow_torchs_placement_semantics(size, placements):
    """Each coordinate's indices equal what torch's own placement splitting (private, test-only) gives."""
    mesh_shape = (2, 2)
    full = torch.arange(size * 3).reshape(size, 3)
    for coordinate in [(a, b) for a in range(2) for b in range(2)]:
        local = full
        for mesh_dim, p in enumerate(placements):
            if not p.is_replicate():
                local = p._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)[0][coordinate[mesh_dim]]
        idx = shard_indices(full.shape, placements, mesh_shape, coordinate)
        assert torch.equal(_select(full, idx), local), (coordinate, idx)


def test_fill_gathers_non_contiguous_shards_and_reads_whole_heads(folders, monkeypatch):
    """A shard that is not one box is cut from its bounding box; Llama q rows read the heads covering them."""
    folder = folders["debug", "policy"]
    full = _full_load(folder, "debug", "policy")
    rows, cols = torch.tensor([5, 6, 20, 21, 22]), torch.tensor([1, 3, 4])
    monkeypatch.setattr(weights_module, "local_indices", lambda t: [rows, cols])
    reads = []
    path = folder / "model.safetensors"
    found = {n: (path, t.dtype, tuple(t.shape)) for n, t in load_file(path).items()}
    with ExitStack() as stack:
        reader = hf_module._SliceReader(found, FLAVORS["debug"], "policy", stack)
        targets = {name: torch.empty(5, 3) for name in ("layers.0.attn.q_proj.weight", "layers.1.mlp.w1.weight")}
        fill_slices(targets, lambda name, box: reads.append(box) or reader.read(name, box))
    assert reads == [(slice(5, 23), slice(1, 5))] * 2
    for name, t in targets.items():
        assert torch.equal(t, full[name][rows][:, cols]), name


# ---------------------------------------------------------------------------- several ranks


def _assert_layout_matches(model: torch.nn.Module, full: dict[str, torch.Tensor], tied_head: bool = False) -> int:
    """Every local shard equals the slice of the full tensor; every DTensor's full_tensor() the full tensor."""
    n_dtensors = 0
    for name, t in model.state_dict().items():
        want = full["tok_embeddings.weight" if tied_head and name == "output.weight" else name]
        local = t.to_local() if isinstance(t, DTensor) else t
        assert torch.equal(local, _select(want, local_indices(t))), name
        if isinstance(t, DTensor):
            n_dtensors += 1
            assert torch.equal(t.full_tensor(), want), name
    return n_dtensors


def _load_sharded(
    layout: str, folders: dict, flavor: str, role: str = "policy", source: str = "hf", init_value_head_from_lm: bool = False
) -> set[str]:
    """Build on meta, shard as ``layout`` ("tp", "fsdp", "tp_fsdp"), to_empty, load; compare to a full load."""
    dp_shard, tp = {"tp": (1, 2), "fsdp": (2, 1), "tp_fsdp": (2, 2)}[layout]
    dims = ParallelDims(dp_shard=dp_shard, tp=tp)
    mesh = dims.build_mesh("cpu")
    folder = folders[flavor, "policy" if init_value_head_from_lm else role]
    reference = build_model(flavor, role).eval()
    torch.manual_seed(7)  # the same RNG state for both loads: a fresh value head must come out the same
    load_hf_checkpoint(reference, folder, flavor, role, init_value_head_from_lm=init_value_head_from_lm)
    full = reference.state_dict()

    model = build_model(flavor, role, device="meta")
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if dims.dp_shard > 1:
        apply_fsdp(model, mesh["dp_shard"])
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    if source == "hf":
        load_hf_weights(model, folder, flavor, role, init_value_head_from_lm=init_value_head_from_lm)
    else:
        load_state_slices(model, full)
    assert _assert_layout_matches(model, full) > 0
    with torch.no_grad():  # RoPE buffers recomputed, FSDP2 picks up the loaded shards
        torch.testing.assert_close(model.eval()(_tokens()), reference(_tokens()), rtol=1e-5, atol=1e-5)
    return {str(t.placements) for t in model.state_dict().values() if isinstance(t, DTensor)}


def _two_rank_layouts(folders: dict) -> None:
    for layout in ("tp", "fsdp"):
        for flavor in ("debug", "debug_qwen"):
            _load_sharded(layout, folders, flavor)
    _load_sharded("fsdp", folders, "debug", source="memory")
    # Value head [1, 64] over 2 FSDP ranks: rank 1's shard is empty; a fresh head is equal on every rank.
    _load_sharded("fsdp", folders, "debug", "value")
    _load_sharded("fsdp", folders, "debug_qwen", "value", init_value_head_from_lm=True)

    # The tied head of a last pipeline stage, FSDP-sharded: rows of the embedding.
    full = _full_load(folders["debug_qwen", "policy"], "debug_qwen", "policy")
    stage = split_decoder(build_model("debug_qwen", device="meta"), 2)[1]
    apply_fsdp(stage, ParallelDims(dp_shard=2).build_mesh("cpu")["dp_shard"])
    stage.to_empty(device="cpu")
    load_hf_weights(stage, folders["debug_qwen", "policy"], "debug_qwen")
    assert _assert_layout_matches(stage, full, tied_head=True) > 0
    assert stage.output.weight.to_local().shape == (256, 64)


@pytest.mark.slow
def test_tp_and_fsdp_shards_equal_the_full_model(two_ranks, folders):
    two_ranks.run(_two_rank_layouts, folders)


@contextmanager
def _counting_safe_open(real, counts: dict[str, int], path, framework):
    class Slice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def __getitem__(self, index):
            t = self.inner[index]
            counts[self.name] = counts.get(self.name, 0) + t.numel() * t.element_size()
            return t

    class Handle:
        def __init__(self, inner):
            self.inner = inner

        def get_slice(self, name):
            return Slice(name, self.inner.get_slice(name))

        def get_tensor(self, name):
            raise AssertionError(f"whole tensor {name} read")

    with real(path, framework=framework) as handle:
        yield Handle(handle)


def _bytes_read(folders: dict, layout: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Bytes this rank read per HF tensor, each tensor's size, and the size of this rank's shard of it."""
    model = build_model("debug", device="meta")
    if layout == "tp":
        apply_tp(model, ParallelDims(tp=2).build_mesh("cpu")["tp"])
    else:
        apply_fsdp(model, ParallelDims(dp_shard=2).build_mesh("cpu")["dp_shard"])
    model.to_empty(device="cpu")
    counts: dict[str, int] = {}
    real = hf_module.safe_open
    hf_module.safe_open = lambda path, framework: _counting_safe_open(real, counts, path, framework)
    try:
        load_hf_weights(model, folders["debug", "policy"], "debug")
    finally:
        hf_module.safe_open = real
    sizes = {n: t.numel() * t.element_size() for n, t in load_file(folders["debug", "policy"] / "model.safetensors").items()}
    local = {
        hf_name(n): (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
        for n, t in model.state_dict().items()
    }
    return counts, sizes, local


def test_sharded_ranks_read_only_their_slices(two_ranks, folders):
    """TP rank: each Colwise (q/k/v, w1/w3, the LM head's vocabulary rows) or Rowwise (o, w2, the embedding's
    vocabulary rows) weight costs exactly half its bytes (Llama q/k rows are read per whole head, and 2-way TP cuts
    between heads), replicated tensors (norms) all of theirs. FSDP rank: exactly
    its shard's bytes for every tensor (shards of q/k cover whole heads here). No whole-tensor reads at all."""
    for counts, sizes, _ in two_ranks.run(_bytes_read, folders, "tp"):
        assert counts.keys() == sizes.keys()
        for name, n in sizes.items():
            split = any(k in name for k in ("_proj.weight", "mlp.", "embed_tokens", "lm_head"))
            assert counts[name] == (n // 2 if split else n), name
        assert sum(counts.values()) < 0.75 * sum(sizes.values())
    for counts, sizes, local in two_ranks.run(_bytes_read, folders, "fsdp"):
        assert counts == local and sum(counts.values()) == sum(sizes.values()) // 2


def _tp_fsdp_2d(folders: dict) -> None:
    placements = set()
    for flavor in ("debug", "debug_qwen"):
        placements |= _load_sharded("tp_fsdp", folders, flavor)
    _load_sharded("tp_fsdp", folders, "debug_qwen", source="memory")
    assert any("_StridedShard" in p for p in placements), placements  # FSDP over TP on the same dim


@pytest.mark.slow
def test_tp_x_fsdp_2d_mesh_shards_equal_the_full_model(rank_pools, folders):
    rank_pools(4).run(_tp_fsdp_2d, folders, timeout_s=400)
