"""A damaged copy of the real SmolLM2-135M-Instruct folder is refused at startup, before any process group: one line
naming the [model] key, the folder, the problem and its fix (the trainer would otherwise fail while loading)."""

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(os.environ.get("FUSEDRL_SMOLLM2", ROOT / "models" / "SmolLM2-135M-Instruct"))
pytestmark = pytest.mark.skipif(
    not (FOLDER / "config.json").is_file(),
    reason=f"no SmolLM2 folder at {FOLDER}: build it with scripts/smollm2_from_gguf.py (or set FUSEDRL_SMOLLM2)",
)
WEIGHTS = "model.safetensors"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _truncate(folder: Path) -> None:
    (folder / WEIGHTS).unlink()
    with open(FOLDER / WEIGHTS, "rb") as f:
        (folder / WEIGHTS).write_bytes(f.read(1 << 20))  # the header and the first MiB of data


def _drop_a_shard(folder: Path) -> None:
    # an index over two shards of which only the first was copied (an interrupted download)
    from safetensors import safe_open

    with safe_open(FOLDER / WEIGHTS, "pt") as f:
        names = list(f.keys())
    (folder / WEIGHTS).rename(folder / SHARDS[0])
    weight_map = {name: SHARDS[i % 2] for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _edit_config(text: str | None = None, *, vocab_size: int | None = None):
    """Replace the copy's config.json by ``text``, or by the real one with another ``vocab_size`` (read when the test
    runs: a machine without the folder collects this module and skips it)."""

    def edit(folder: Path) -> None:
        new = (
            text
            if vocab_size is None
            else json.dumps({**json.loads((FOLDER / "config.json").read_text()), "vocab_size": vocab_size})
        )
        assert new is not None
        (folder / "config.json").unlink()
        (folder / "config.json").write_text(new)

    return edit


def _prompts(tmp_path: Path) -> Path:
    """The recipe's prompt file (data/ is not part of a checkout: the startup's data check runs before the models')."""
    from fusedrl.tasks.arithmetic import write_prompts

    return write_prompts(tmp_path / "arithmetic.jsonl", 16)


@pytest.mark.parametrize(
    "damage,expected",
    [
        (_truncate, ["model.safetensors is truncated: 1048576 bytes on disk", "Fix: re-download or re-export model.safetensors"]),
        (
            _drop_a_shard,
            [f"model.safetensors.index.json names shard(s) that do not exist: {SHARDS[1]}", "Fix: copy the missing shard"],
        ),
        (
            _edit_config(vocab_size=1000),
            ["vocab mismatch: model.embed_tokens.weight has 49152 rows but", "has vocab_size 1000", "Fix: "],
        ),
        (_edit_config('{"model_type": "llama", '), ["config.json is not valid JSON"]),
    ],
    ids=["truncated", "missing-shard", "vocab", "config-not-json"],
)
def test_a_damaged_real_checkpoint_is_one_line_before_any_process_group(tmp_path, monkeypatch, damage, expected):
    from fusedrl.config import ConfigError
    from fusedrl.train import prepare

    folder = tmp_path / "SmolLM2"
    folder.mkdir()
    for f in FOLDER.iterdir():  # links to the real files; the damaged one is replaced by a copy
        (folder / f.name).symlink_to(f)
    damage(folder)
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        prepare(
            [
                "--job.config_file=train_configs/smollm2_135m_grpo.toml",
                f"--data.path={_prompts(tmp_path)}",
                f"--model.actor_path={folder}",
                f"--model.tokenizer_path={folder}",
            ],
            world_size=2,
        )
    message = str(err.value)
    assert message.startswith("model.actor") and str(folder) in message and "\n" not in message, message
    assert all(part in message for part in expected), message
    assert not dist.is_initialized()


def test_the_intact_real_checkpoint_passes_the_same_checks(tmp_path, monkeypatch):
    from fusedrl.train import prepare

    monkeypatch.chdir(ROOT)
    cfg = prepare(["--job.config_file=train_configs/smollm2_135m_grpo.toml", f"--data.path={_prompts(tmp_path)}"], world_size=2)
    assert cfg.model.actor_path == "models/SmolLM2-135M-Instruct"
