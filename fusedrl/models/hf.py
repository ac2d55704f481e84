"""HF-format safetensors checkpoints of Llama, Mistral, Qwen2 and Qwen3 decoders.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, with tensor names as
in HF ``transformers`` (``model.layers.0.self_attn.q_proj.weight``, ...). Names and the Llama RoPE
permutation of q/k are converted by :mod:`fusedrl.models.weights`. The head is named by role:
``lm_head.weight`` for a policy (absent when embeddings are tied) and ``score.weight`` ([1, dim],
as in HF ``*ForSequenceClassification`` reward models) for a value model.

The architecture comes from ``config.json`` (:func:`~fusedrl.models.hf_config.read_flavor`) or from a named
flavor, which is then checked against ``config.json`` field by field; what fusedrl cannot build exactly is refused
before any weight is read.

Loading validates every header of the folder first, then reads, per tensor the module holds,
only the slice covering its local shard (``safe_open(...).get_slice``), so a meta-built, sharded,
``to_empty``'d module is filled without any rank reading the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from fusedrl.models.hf_config import (
    CONFIG_FILE,
    CheckpointError,
    config_differences,
    hf_config,
    json_ids,
    read_config_file,
    read_flavor,
)
from fusedrl.models.registry import ModelFlavor, Role, build_model, check_role, resolve_flavor
from fusedrl.models.weights import (
    EMBED_KEY,
    LM_HEAD_KEY,
    TUNE_HEAD_KEY,
    VALUE_HEAD_KEY,
    cast_parameters,
    fill_slices,
    hf_name,
    hf_to_tune_rows,
    init_rope_buffers,
    module_targets,
    rope_head_dim,
    tune_to_hf_state,
)

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Files an existing checkpoint folder may hold; anything else makes save refuse to replace it.
_TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "added_tokens.json",
    "chat_template.jinja",  # HF's file of the chat template; fusedrl's Tokenizer.save copies it too
}

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,
}
# Checkpoint dtypes cast to the model's dtype on load; anything else (float8, integers) is refused.
_LOADABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def save_hf_checkpoint(
    model: nn.Module | Mapping[str, torch.Tensor],
    folder: str | os.PathLike,
    flavor: str | ModelFlavor,
    role: str = "policy",
    max_shard_bytes: int | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> Path:
    """Write ``model`` (or its full torchtune-format state dict) as an HF checkpoint folder.

    With ``max_shard_bytes`` the tensors are split over shards of at most that size (a single
    larger tensor gets its own shard) and an index is written. The folder is written next to its
    final place and renamed into it; an existing checkpoint folder is replaced (tokenizer files in
    it are kept). The folder and files get the modes a plain ``mkdir`` / ``open`` gives under the
    process umask (0755 / 0644 under the usual 022), so other users and serving containers can read them.

    The special token ids (of the tokenizer the model was trained with) go into ``config.json`` and,
    when any is given, into ``generation_config.json``, so that transformers' ``generate()`` stops
    where fusedrl's generation does (``eos_token_id``: every stop id).
    """
    resolve_flavor(flavor)
    check_role(role)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}; pass None for one file")
    folder = Path(folder)
    keep = _files_to_keep(folder)
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    hf = {name: t.detach().cpu().contiguous() for name, t in tune_to_hf_state(state, flavor, role).items()}
    dtype = next(iter(hf.values())).dtype
    token_ids = {"bos_token_id": bos_token_id, "eos_token_id": json_ids(eos_token_id), "pad_token_id": pad_token_id}

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()  # not tempfile.mkdtemp, which makes it 0700 whatever the umask
    try:
        shards = _pack_shards(hf, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE_FILE, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / name, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in hf.values())
            _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(
            tmp / CONFIG_FILE,
            hf_config(flavor, role, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id),
        )
        if any(i is not None for i in token_ids.values()):
            _write_json(tmp / GENERATION_CONFIG_FILE, token_ids)
        file_mode = tmp.stat().st_mode & 0o666  # what open() gives under the umask; safetensors writes 0600
        for path in tmp.iterdir():
            path.chmod(file_mode)
        for name in keep:
            if not (tmp / name).exists():  # a generation config written just now wins over the old one
                shutil.copy2(folder / name, tmp / name)
        _replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def load_hf_weights(
    module: nn.Module,
    folder: str | os.PathLike,
    flavor: str | ModelFlavor,
    role: str = "policy",
    *,
    init_value_head_from_lm: bool = False,
) -> None:
    """Fill ``module``'s parameters and persistent buffers from the HF checkpoint ``folder``.

    ``module`` is a decoder from ``build_model(flavor, role)`` or a ``split_decoder`` stage of one,
    with plain or DTensor (TP, FSDP2, both) tensors, materialised (e.g. built on meta, sharded, then
    ``to_empty``'d). For each tensor only the slice of the checkpoint tensor covering this rank's
    local shard is read; a tied policy's ``output.weight`` (on a last stage) comes from
    ``model.embed_tokens.weight``. bf16 / fp16 / fp32 tensors are cast to each tensor's dtype.

    Before anything is written, every header of the folder is checked against the full flavor
    (names, shapes, vocab size, loadable dtypes, ``config.json``); all problems are reported together
    in one :class:`CheckpointError`. RoPE buffers are then recomputed (they are not in checkpoints).

    ``init_value_head_from_lm=True`` starts a value model from a policy (LM) checkpoint: the
    backbone is loaded, ``lm_head.weight`` is ignored and the scalar head is drawn fresh from
    N(0, (1 / (embed_dim + 1))^2) on the CPU with torch's global RNG, small enough that initial values
    are near 0 while the backbone still gets gradients. The full head is drawn whether or not
    ``module`` holds it, so equal RNG states give every rank the same head and the same RNG state after.
    """
    f = resolve_flavor(flavor)
    check_role(role)
    if init_value_head_from_lm and role != "value":
        raise ValueError("init_value_head_from_lm=True needs role='value'; a policy loads its own LM head")
    folder = Path(folder)
    targets = module_targets(module)
    full = _full_shapes(f, cast(Role, role))  # a valid Role: check_role passed above
    _check_module(targets, full, f, role)

    found, fresh_head, ignored = _validated(folder, f, role, init_value_head_from_lm)
    if ignored:
        log.info("checkpoint %s: ignored %d tensor(s): %s", folder, len(ignored), _group(sorted(ignored)))
    head = targets.pop(TUNE_HEAD_KEY, None) if fresh_head else None
    try:
        with ExitStack() as stack:
            fill_slices(targets, _SliceReader(found, f, role, stack).read)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read HF checkpoint {folder}: {e}. Fix: re-download or re-export it.", [str(e)]) from e
    if fresh_head:
        fresh = torch.empty(1, f.embed_dim).normal_(0.0, 1.0 / (f.embed_dim + 1))
        if head is not None:
            fill_slices({TUNE_HEAD_KEY: head}, lambda name, box: fresh[box])
        log.info("checkpoint %s: value model started from an LM checkpoint with a fresh %s", folder, VALUE_HEAD_KEY)
    init_rope_buffers(module)


def check_hf_checkpoint(
    folder: str | os.PathLike, flavor: str | ModelFlavor, role: str = "policy", *, init_value_head_from_lm: bool = False
) -> None:
    """The checks :func:`load_hf_weights` runs before it reads any tensor, from the files' headers alone: tensor names
    and shapes against the full flavor, vocabulary size, loadable dtypes, truncated files, shards an index names but
    the folder lacks, ``config.json``. Raises :class:`CheckpointError` naming every problem and its fix in one line
    (the trainer's startup check calls it for each model folder before any process group exists)."""
    f = resolve_flavor(flavor)
    check_role(role)
    _validated(Path(folder), f, role, init_value_head_from_lm)


def _validated(
    folder: Path, f: ModelFlavor, role: str, init_value_head_from_lm: bool
) -> tuple[dict[str, tuple[Path, torch.dtype, tuple[int, ...]]], bool, list[str]]:
    """(the tensors the checkpoint holds: name -> file, dtype, shape; whether the value head is drawn fresh; the
    tensors it holds that are not loaded), after checking every header of ``folder`` against the full flavor;
    CheckpointError with all problems otherwise."""
    full = _full_shapes(f, cast(Role, role))
    problems: list[str] = []
    fixes: list[str] = []
    files = _checkpoint_files(folder, problems, fixes)
    found: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
    readable = 0
    for path, names in files.items():
        header = _read_header(path, problems, fixes)
        if header is None:
            continue
        readable += 1
        if names is not None:
            absent = sorted(set(names) - set(header))
            if absent:
                problems.append(f"the index maps {_group(absent)} to {path.name}, which does not contain them")
                fixes.append("re-export the checkpoint (its index and shards do not match)")
        for name, (dtype, shape) in header.items():
            found[name] = (path, dtype, shape)
    _check_config(folder, f, role, problems, fixes)
    if not readable:  # nothing to compare tensors against: report the file problems alone
        _raise(folder, f, role, problems, fixes)

    tied = role == "policy" and f.tie_word_embeddings  # no lm_head: a stage's output.weight reads the embedding
    expected = {hf_name(name, role): shape for name, shape in full.items() if not (tied and name == TUNE_HEAD_KEY)}
    ignored = [name for name in found if "rotary_emb.inv_freq" in name]
    if LM_HEAD_KEY in found and LM_HEAD_KEY not in expected and (f.tie_word_embeddings or init_value_head_from_lm):
        ignored.append(LM_HEAD_KEY)
    fresh_head = init_value_head_from_lm and VALUE_HEAD_KEY in expected
    if fresh_head:
        if VALUE_HEAD_KEY in found:
            problems.append(f"init_value_head_from_lm=True but the checkpoint already has a value head {VALUE_HEAD_KEY!r}")
            fixes.append("load a value checkpoint with init_value_head_from_lm=False")
            ignored.append(VALUE_HEAD_KEY)
        del expected[VALUE_HEAD_KEY]
    _compare(found, expected, set(ignored), f, role, problems, fixes)
    if problems:
        _raise(folder, f, role, problems, fixes)
    return found, fresh_head, ignored


def load_hf_checkpoint(
    model: nn.Module,
    folder: str | os.PathLike,
    flavor: str | ModelFlavor,
    role: str = "policy",
    *,
    init_value_head_from_lm: bool = False,
) -> None:
    """Load an HF checkpoint folder into a full ``model``; the same as :func:`load_hf_weights`."""
    load_hf_weights(model, folder, flavor, role, init_value_head_from_lm=init_value_head_from_lm)


class PretrainedModel(NamedTuple):
    """What :func:`from_pretrained` returns: the loaded model and the flavor (architecture) that builds it."""

    model: nn.Module
    flavor: ModelFlavor


def from_pretrained(
    folder: str | os.PathLike,
    role: str = "policy",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    init_value_head_from_lm: bool = False,
) -> PretrainedModel:
    """Build and load an HF Llama / Mistral / Qwen2 / Qwen3 checkpoint folder, its architecture read from its
    ``config.json`` (:func:`read_flavor`).

    The model is built on the meta device with its parameters in ``dtype`` (RoPE tables stay float32), materialised
    on ``device`` and filled by :func:`load_hf_weights` (same checks, same ``init_value_head_from_lm``).
    ``model, flavor = from_pretrained(folder)``.
    """
    check_role(role)
    flavor = read_flavor(folder, role)
    model = cast_parameters(build_model(flavor, cast(Role, role), device="meta"), dtype)  # a valid Role: check_role passed
    model.to_empty(device=device)
    load_hf_weights(model, folder, flavor, role, init_value_head_from_lm=init_value_head_from_lm)
    return PretrainedModel(model, flavor)


class _SliceReader:
    """Reads boxes of torchtune tensors from the checkpoint's files (opened once, on first use)."""

    def __init__(
        self, found: Mapping[str, tuple[Path, torch.dtype, tuple[int, ...]]], f: ModelFlavor, role: str, stack: ExitStack
    ) -> None:
        self.found, self.f, self.role, self.stack = found, f, role, stack
        self.handles: dict[Path, Any] = {}

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The ``box`` of torchtune tensor ``name``; Llama q/k rows are read as the whole heads covering it."""
        tied = name == TUNE_HEAD_KEY and self.role == "policy" and self.f.tie_word_embeddings
        source = EMBED_KEY if tied else hf_name(name, self.role)
        path = self.found[source][0]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(path, framework="pt"))
        tensor = self.handles[path].get_slice(source)
        head_dim = rope_head_dim(name, self.f)
        if head_dim is None:
            return tensor[box]
        rows = box[0]
        first = rows.start // head_dim * head_dim
        block = tensor[(slice(first, -(-rows.stop // head_dim) * head_dim), *box[1:])]
        return hf_to_tune_rows(block, head_dim)[rows.start - first : rows.stop - first]


def _full_shapes(f: ModelFlavor, role: Role) -> dict[str, tuple[int, ...]]:
    """torchtune name -> global shape of every tensor of the full model (a tied policy's head included)."""
    state = build_model(f, role, device="meta").state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    if TUNE_HEAD_KEY not in shapes and role == "policy":  # tied: a last stage's head is the embedding
        shapes[TUNE_HEAD_KEY] = shapes["tok_embeddings.weight"]
    return shapes


def _check_module(targets: Mapping[str, torch.Tensor], full: Mapping[str, tuple[int, ...]], f: ModelFlavor, role: str) -> None:
    """Every tensor of ``module`` must be a tensor of the full model, with its global shape."""
    wrong = [n for n, t in targets.items() if full.get(n) != tuple(t.shape)]
    if wrong:
        raise ValueError(
            f"module does not match {f.describe()} role {role!r}: that model lacks or shapes differently "
            f"{_group(wrong)}; pass the flavor and role the module was built with (build_model(flavor, role))"
        )


def _raise(folder: Path, f: ModelFlavor, role: str, problems: list[str], fixes: list[str]) -> None:
    fix = "; ".join(dict.fromkeys(fixes))
    raise CheckpointError(
        f"cannot load HF checkpoint {folder} as {f.describe()} role {role!r}: {len(problems)} problem(s): "
        + "; ".join(problems)
        + f". Fix: {fix}.",
        problems,
    )


# ---------------------------------------------------------------------------- validation


def _compare(found, expected, ignored, f: ModelFlavor, role, problems, fixes) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - ignored)
    if missing:
        problems.append(f"missing tensors: {_group(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_group(unexpected)}")
    if role == "value" and VALUE_HEAD_KEY in missing:
        fixes.append("to start a value model from an LM (policy) checkpoint pass init_value_head_from_lm=True")
    elif role == "policy" and VALUE_HEAD_KEY in unexpected:
        fixes.append("this is a value-model checkpoint: load it with role='value'")
    if set(missing + unexpected) - {LM_HEAD_KEY, VALUE_HEAD_KEY}:
        fixes.append(f"check that {f.describe()} matches the checkpoint's architecture (see its config.json)")

    wrong_shape: dict[tuple, list[str]] = {}
    wrong_dtype: dict[torch.dtype, list[str]] = {}
    for name in sorted(set(found) & set(expected)):
        _, dtype, shape = found[name]
        want_shape = expected[name]
        if dtype not in _LOADABLE_DTYPES:
            wrong_dtype.setdefault(dtype, []).append(name)
        if shape != want_shape:
            if name in (EMBED_KEY, LM_HEAD_KEY) and shape[1:] == want_shape[1:]:
                problems.append(f"vocab mismatch: {name} has {shape[0]} rows but {f.describe()} has vocab_size {f.vocab_size}")
                fixes.append("use the flavor whose vocab_size equals the checkpoint's embedding rows")
            else:
                wrong_shape.setdefault((want_shape, shape), []).append(name)
    for (want, got), names in wrong_shape.items():
        problems.append(f"wrong shape: {_group(names)} expected {list(want)}, found {list(got)}")
    if wrong_shape:
        fixes.append(f"check that {f.describe()} matches the checkpoint's architecture (see its config.json)")
    for got, names in wrong_dtype.items():
        problems.append(f"unsupported dtype: {_group(names)} is {got}, expected a float tensor (bf16, fp16 or fp32)")
    if wrong_dtype:
        fixes.append(
            "convert the checkpoint to bf16 first (quantized float8 / integer weights need their scales, "
            "which this loader does not apply)"
        )


def _check_config(folder: Path, f: ModelFlavor, role: str, problems: list[str], fixes: list[str]) -> None:
    path = folder / CONFIG_FILE
    if not path.is_file():
        log.debug("checkpoint %s has no %s; only tensor names and shapes are checked", folder, CONFIG_FILE)
        return
    try:
        config = read_config_file(path)
    except ValueError as e:
        problems.append(str(e))
        fixes.append(f"repair or delete {path}")
        return
    for m in config_differences(config, f):
        if m.field == "model_type":
            problems.append(f"{CONFIG_FILE} has model_type={m.got!r} but {f.describe()} is a {m.want!r} model")
            fixes.append(f"use a flavor of the checkpoint's model family (model_type {m.got!r})")
            continue
        kind = "vocab mismatch: " if m.field == "vocab_size" else ""
        has = f"does not set {m.field} (transformers' default {m.got!r})" if m.absent else f"has {m.field}={m.got!r}"
        want = f"max_seq_len {f.max_seq_len}, which the window would cut" if m.field.endswith("sliding_window") else repr(m.want)
        problems.append(f"{kind}{CONFIG_FILE} {has} but {f.describe()} has {want}")
        fixes.append(
            f"leave the model's flavor empty to read its architecture from {CONFIG_FILE}, or use the flavor that "
            f"matches {CONFIG_FILE}, or correct {CONFIG_FILE}"
        )


def _checkpoint_files(folder: Path, problems: list[str], fixes: list[str]) -> dict[Path, list[str] | None]:
    """Checkpoint files mapped to the tensor names the index promises in each (None: no index)."""
    if not folder.is_dir():
        problems.append(f"{folder} is not a folder")
        fixes.append("pass the path of an HF-format checkpoint folder")
        return {}
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
            problems.append(f"{INDEX_FILE} is not a valid index (needs a 'weight_map' object): {e!r}")
            fixes.append("re-export the checkpoint")
            return {}
        shards: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(folder / shard, []).append(name)
        absent = sorted(p.name for p in shards if not p.is_file())
        if absent:
            problems.append(f"{INDEX_FILE} names shard(s) that do not exist: {', '.join(absent)}")
            fixes.append("copy the missing shard files into the folder (the download is incomplete)")
        return {p: names for p, names in shards.items() if p.is_file()}
    if (folder / SINGLE_FILE).is_file():
        return {folder / SINGLE_FILE: None}
    present = sorted(p.name for p in folder.iterdir())
    problems.append(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (it holds: {', '.join(present) or 'nothing'})")
    fixes.append("point to an HF-format safetensors folder (convert .bin/.pt weights to safetensors first)")
    return {}


def _read_header(path: Path, problems: list[str], fixes: list[str]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]] | None:
    """Parse and validate a safetensors header without reading the tensor data."""
    fix = f"re-download or re-export {path.name}"
    size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
        if length is None or length > size - 8:
            problems.append(f"{path.name} is not a safetensors file (or its header is cut off)")
            fixes.append(fix)
            return None
        try:
            header = json.loads(fh.read(length))
            assert isinstance(header, dict)
        except (UnicodeDecodeError, json.JSONDecodeError, AssertionError):
            problems.append(f"{path.name} is not a safetensors file (its header is not a JSON object)")
            fixes.append(fix)
            return None
    header.pop("__metadata__", None)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    data_end = 0
    for name, info in header.items():
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{path.name} has a corrupt header entry for {name!r}: {info!r}")
            fixes.append(fix)
            return None
        if end - start != math.prod(shape) * dtype.itemsize:
            problems.append(f"{path.name} has a corrupt header entry for {name!r}: byte range does not fit its shape")
            fixes.append(fix)
            return None
        tensors[name] = (dtype, shape)
        data_end = max(data_end, end)
    if data_end > size - 8 - length:
        problems.append(f"{path.name} is truncated: {size} bytes on disk, its header needs {8 + length + data_end}")
        fixes.append(fix)
        return None
    return tensors


def _group(names: list[str]) -> str:
    """Names with the layer index folded: model.layers.{0-3,7}.mlp.up_proj.weight."""
    groups: dict[str, list[int]] = {}
    for name in names:
        m = re.search(r"\.(\d+)\.", name)
        key = name[: m.start(1)] + "{}" + name[m.end(1) :] if m else name
        groups.setdefault(key, []).append(int(m.group(1)) if m else -1)
    parts = []
    for key, layers in groups.items():
        if "{}" not in key:
            parts.append(key)
        elif len(layers) == 1:
            parts.append(key.replace("{}", str(layers[0])))
        else:
            parts.append(key.replace("{}", "{" + _ranges(sorted(layers)) + "}"))
    return ", ".join(parts)


def _ranges(values: list[int]) -> str:
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            lo, hi = values[start], values[i - 1]
            out.append(str(lo) if lo == hi else f"{lo}-{hi}")
            start = i
    return ",".join(out)


# ---------------------------------------------------------------------------- writing


def _pack_shards(hf: Mapping[str, torch.Tensor], max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in hf.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and used + nbytes > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += nbytes
    return shards


def _files_to_keep(folder: Path) -> list[str]:
    """Tokenizer files of an existing checkpoint folder; refuses folders holding anything else."""
    if not folder.exists():
        return []
    if not folder.is_dir():
        raise ValueError(f"checkpoint path {folder} is a file; pass a folder path")
    ours = {CONFIG_FILE, SINGLE_FILE, INDEX_FILE}
    names = [p.name for p in folder.iterdir()]
    stray = [n for n in names if n not in ours and n not in _TOKENIZER_FILES and not _SHARD_RE.fullmatch(n)]
    if stray:
        raise ValueError(
            f"refusing to replace {folder}: it holds files that are not part of an HF checkpoint "
            f"({', '.join(sorted(stray)[:5])}); save to a new or empty folder"
        )
    return [n for n in names if n in _TOKENIZER_FILES]


def _replace_folder(tmp: Path, folder: Path) -> None:
    if not folder.exists():
        os.replace(tmp, folder)
        return
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
