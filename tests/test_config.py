"""Config system: TOML + overrides, printing round-trip, one-line errors, world-size and path checks, docs in sync."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fusedrl.components import check_data, check_tokenizer
from fusedrl.config import (
    ConfigError,
    JobConfig,
    Startup,
    config_to_toml,
    load_config,
    run_checks,
    validate_config,
)
from fusedrl.config.__main__ import markdown_table
from fusedrl.config.loader import section_keys, section_types
from fusedrl.distributed import check_dims
from fusedrl.models import check_models

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_ppo.toml")


def _load(*overrides: str) -> JobConfig:
    return load_config(["--job.config_file", DEBUG, *overrides])


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fusedrl.config", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_debug_config_has_every_section_and_key_and_fits_four_ranks(monkeypatch):
    with open(DEBUG, "rb") as f:
        raw = tomllib.load(f)
    assert list(raw) == list(section_types())
    for section in section_types():
        expected = [k for k in section_keys(section) if (section, k) != ("job", "config_file")]
        assert sorted(raw[section]) == sorted(expected), section
    cfg = _load()
    assert (cfg.parallelism.pp, cfg.parallelism.dp_shard, cfg.parallelism.tp, cfg.parallelism.gen_tp) == (2, 2, 1, 1)
    assert cfg.model.actor == cfg.model.critic == cfg.model.reward == "debug"
    assert cfg.fusion.inter_stage and cfg.fusion.intra_stage and cfg.data.format == "synthetic"
    assert cfg.model.actor_path == "assets/debug/actor" and cfg.model.reference_path is None  # "" means unset
    monkeypatch.chdir(ROOT)  # its paths are relative to the checkout
    run_checks(cfg, 4)


def test_every_key_is_documented():
    for section in section_types():
        for key, (_, meta) in section_keys(section).items():
            assert len(meta["help"]) > 10, f"{section}.{key}"


def test_print_then_load_gives_an_equal_config(tmp_path):
    cfg = _load(
        "--job.name",
        'odd "name" \\ with\ttabs, ünïcode and \x01 control',
        "--optimizer.actor_lr=3e-7",
        "--fusion.migration_threshold=0.125",
        "--fusion.inter_stage=false",
        "--metrics.trace=1,5",
        "--generation.stop_token_ids=[7, 9]",
        "--model.actor_path=/some/folder",
        "--data.format=jsonl",
        "--data.path=prompts.jsonl",
        "--ppo.kl_estimator=k3",
    )
    text = config_to_toml(cfg)
    assert "set on the command line: job.name, model.actor_path, data.path, data.format" in text
    out = tmp_path / "printed.toml"
    out.write_text(text, encoding="utf-8")
    again = load_config(["--job.config_file", str(out)])
    assert again == cfg
    assert again.job.name == 'odd "name" \\ with\ttabs, ünïcode and \x01 control'
    assert config_to_toml(again).splitlines()[1:] == text.splitlines()[1:]
    # The defaults round-trip as well, including unset paths and "auto".
    assert load_config(["--job.config_file", _write(tmp_path, config_to_toml(JobConfig()))]) == JobConfig()


def test_override_syntax_and_parsing():
    cfg = _load(
        "--ppo.epochs",
        "3",  # separate value
        "--job.seed",
        "-0",  # a value starting with '-' is still a value
        "--checkpoint.resume",  # bare bool flag -> true
        "--metrics.jsonl=FALSE",
        "--optimizer.grad_clip=2",  # int text for a float key
        "--generation.stop_token_ids=",  # empty list
        "--metrics.trace=[3, 4]",
        "--fusion.migration_threshold=auto",
        "--ppo.clip_eps=0.1",
        "--ppo.clip_eps=0.3",  # the last one wins
    )
    assert cfg.ppo.epochs == 3 and cfg.job.seed == 0
    assert cfg.checkpoint.resume is True and cfg.metrics.jsonl is False
    assert cfg.optimizer.grad_clip == 2.0 and isinstance(cfg.optimizer.grad_clip, float)
    assert cfg.generation.stop_token_ids == [] and cfg.metrics.trace == [3, 4]
    assert cfg.fusion.migration_threshold == "auto" and cfg.ppo.clip_eps == 0.3
    assert cfg.sources["ppo.clip_eps"] == "command line" and cfg.sources["ppo.batch_size"] == DEBUG
    # The file is read first wherever it appears; overrides still win.
    late = load_config(["--ppo.epochs=5", "--job.config_file", DEBUG])
    assert late.ppo.epochs == 5 and late.parallelism.pp == 2
    assert load_config([]) == JobConfig()


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("--ppo.clip_epz=0.2", ["ppo.clip_epz", "command line", "unknown key", "did you mean clip_eps"]),
        ("--ppo.actor_lr=1e-5", ["ppo.actor_lr", "did you mean optimizer.actor_lr"]),
        ("--optimiser.actor_lr=1", ["optimiser.actor_lr", "unknown section", "did you mean optimizer"]),
        ("--clip_eps=0.3", ["unexpected argument", "--ppo.clip_eps"]),
        ("--ppo.epochs=two", ["ppo.epochs", "command line", "expected int", "'two'"]),
        ("--fusion.intra_stage=yes", ["fusion.intra_stage", "true/false"]),
        ("--metrics.trace=1,x", ["metrics.trace", "expected int"]),
        ("--data.format=json", ["data.format", '"synthetic"', 'did you mean "jsonl"']),
        ("--fusion.migration_threshold=half", ["fusion.migration_threshold", 'float or "auto"']),
        ("--ppo.clip_eps", ["ppo.clip_eps", "needs a value"]),
        ("--optimizer.actor_lr=-1e-5", ["optimizer.actor_lr = -1e-05", "command line", ">= 0"]),
        ("--optimizer.critic_lr=inf", ["optimizer.critic_lr", "finite"]),
        ("--generation.temperature=-0.5", ["generation.temperature", ">= 0"]),
        ("--generation.top_p=1.5", ["generation.top_p = 1.5", "(0, 1]"]),
        ("--generation.top_p=0", ["generation.top_p", "(0, 1]"]),
        ("--generation.max_new_tokens=0", ["generation.max_new_tokens", ">= 1"]),
        ("--parallelism.dp_shard=0", ["parallelism.dp_shard", ">= 1"]),
        ("--parallelism.tp=-2", ["parallelism.tp", ">= 1"]),
        ("--fusion.migration_threshold=1.0", ["fusion.migration_threshold", "(0, 1)", '"auto"']),
        ("--ppo.batch_size=40", ["ppo.batch_size = 40", "command line", "ppo.minibatch_size = 32", DEBUG, "1, 2, 4, 5, 8"]),
        ("--ppo.microbatch_size=3", ["ppo.microbatch_size = 3", "= 32 / 2 = 16", "1, 2, 4, 8, 16"]),
        ("--ppo.minibatch_size=2", ["ppo.microbatch_size = 4", DEBUG, "ppo.minibatch_size / parallelism.dp_shard = 2 / 2 = 1"]),
        ("--ppo.minibatch_size=1", ["ppo.minibatch_size = 1", "multiple of parallelism.dp_shard = 2"]),
        ("--data.format=parquet", ["data.path", "unset", "parquet"]),
        ("--job.config_file=nowhere.toml", ["job.config_file = 'nowhere.toml'", "not found"]),
    ],
)
def test_bad_override_gives_one_line_naming_the_key(override, fragments):
    argv = [override] if override.startswith("--job.config_file") else ["--job.config_file", DEBUG, override]
    message = _error(argv)
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    "other, fragments",
    [
        ("--fusion.intra_stage=false", ["fusion.split_backward = true (command line)", "fusion.intra_stage = true"]),
        ("--training.activation_checkpointing=full", ["fusion.split_backward", 'activation_checkpointing = "full"']),
    ],
)
def test_split_backward_needs_the_fused_schedule_without_recomputation(other, fragments):
    assert load_config(["--job.config_file", DEBUG, "--fusion.split_backward"]).fusion.split_backward
    message = _error(["--job.config_file", DEBUG, "--fusion.split_backward", other])
    for fragment in fragments:
        assert fragment in message, message


def _write(tmp_path: Path, text: str, name: str = "bad.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("[ppo]\nclip_epz = 0.2\n", ["ppo.clip_epz", "did you mean clip_eps"]),
        ("[ppo]\nepochs = 1.5\n", ["ppo.epochs", "expected int", "1.5"]),
        ('[ppo]\nwhiten_advantages = "true"\n', ["ppo.whiten_advantages", "true/false"]),
        ("[generation]\ntop_p = 2\n", ["generation.top_p = 2.0", "(0, 1]"]),
        ("[generaton]\ntop_p = 0.5\n", ["[generaton]", "unknown section", "did you mean generation"]),
        ("seed = 3\n", ["seed", "outside any section", "[job]"]),
        ("[job]\nconfig_file = 'x.toml'\n", ["job.config_file", "command line"]),
        ("[ppo]\nclip_eps = \n", ["invalid TOML"]),
        ("[ppo.extra]\nx = 1\n", ["ppo.extra", "unknown key"]),
    ],
)
def test_bad_file_gives_one_line_naming_the_key_and_the_file(tmp_path, text, fragments):
    path = _write(tmp_path, text)
    message = _error(["--job.config_file", path])
    assert path in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_validate_config_checks_configs_built_in_python():
    cfg = JobConfig()
    validate_config(cfg)
    cfg.ppo.clip_eps = -0.1
    with pytest.raises(ConfigError, match=r"ppo\.clip_eps = -0\.1 \(set in Python\): must be > 0"):
        validate_config(cfg)
    cfg = JobConfig()
    cfg.ppo.epochs = "2"
    with pytest.raises(ConfigError, match=r"ppo\.epochs \(set in Python\): expected int"):
        validate_config(cfg)
    cfg = JobConfig()
    cfg.optimizer.actor_lr = 1  # an int for a float key is normalised
    validate_config(cfg)
    assert isinstance(cfg.optimizer.actor_lr, float)


def test_world_size_check():
    """The parallel layout's check of its degrees (fusedrl.distributed.check_dims, run by the startup checks)."""
    cfg = _load()
    check_dims(cfg, 4)
    with pytest.raises(ConfigError) as info:
        check_dims(cfg, 8)
    message = str(info.value)
    assert "2 * 2 * 1 = 4" in message and "world size 8" in message and "--parallelism.dp_shard=4" in message
    assert DEBUG in message
    with pytest.raises(ConfigError, match="parallelism.pp"):
        check_dims(_load("--parallelism.pp=3"), 4)
    with pytest.raises(ConfigError, match=r"parallelism\.gen_tp = 3 \(command line\): must divide the world size 4"):
        check_dims(_load("--parallelism.gen_tp=3"), 4)
    check_dims(_load("--parallelism.gen_tp=4"), 4)
    check_dims(_load("--parallelism.pp=1", "--parallelism.dp_shard=1"), 1)


def test_validate_paths(tmp_path, monkeypatch):
    """Each path is checked by its owner: model folders by the models' check, the tokenizer and the dataset by theirs."""
    monkeypatch.chdir(ROOT)
    from fusedrl.models import build_model, save_hf_checkpoint

    actor = save_hf_checkpoint(build_model("debug", "policy"), tmp_path / "actor", "debug")
    check_models(Startup(_load(f"--model.actor_path={actor}"), 4))
    (tmp_path / "empty").mkdir()  # a folder without weights: refused from its listing, before any process starts
    with pytest.raises(ConfigError, match=r"model\.actor_path: cannot load HF checkpoint .*no model\.safetensors"):
        check_models(Startup(_load(f"--model.actor_path={tmp_path / 'empty'}"), 4))
    with pytest.raises(ConfigError, match=r"model\.critic_path = \"/no/such/folder\" \(command line\): folder not found"):
        check_models(Startup(_load("--model.critic_path=/no/such/folder"), 4))
    with pytest.raises(ConfigError, match=r"model\.tokenizer_path = \"/no/tokenizer.json\" \(command line\): not found"):
        check_tokenizer(Startup(_load("--model.tokenizer_path=/no/tokenizer.json"), 4))
    with pytest.raises(ConfigError, match=r"data\.path = \"/no/prompts.jsonl\" \(command line\): not found"):
        check_data(Startup(_load("--data.format=jsonl", "--data.path=/no/prompts.jsonl"), 4))
    pending = tmp_path / "assets"  # a folder a task builds after the checks: its paths are taken as they will be
    assets = {pending: "debug"}
    check_models(Startup(_load(f"--model.critic_path={pending / 'actor'}"), 4, assets=assets))
    check_tokenizer(Startup(_load(f"--model.tokenizer_path={pending / 'tokenizer.json'}"), 4, assets=assets))
    check_data(Startup(_load("--data.format=jsonl", f"--data.path={pending / 'prompts.jsonl'}"), 4, assets=assets))


# ---------------------------------------------------------------------------- command line


def test_cli_print_round_trips(tmp_path):
    done = _cli("--job.config_file", DEBUG, "--ppo.epochs=2", "--print")
    assert done.returncode == 0, done.stderr
    printed = _write(tmp_path, done.stdout, "printed.toml")
    assert load_config(["--job.config_file", printed]) == _load("--ppo.epochs=2")
    again = _cli("--job.config_file", printed, "--world_size", "4")
    assert again.returncode == 0 and "config ok" in again.stdout, again.stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--ppo.clip_epz=0.2"], "ppo.clip_epz (command line): unknown key in [ppo]; did you mean clip_eps?"),
        (["--ppo.epochs=two"], "ppo.epochs (command line): expected int"),
        (["--generation.top_p=1.5"], "generation.top_p = 1.5 (command line): must be in (0, 1]"),
        (["--world_size=8"], "must equal the world size 8"),
    ],
)
def test_cli_errors_are_one_stderr_line_with_exit_code_2(args, fragment):
    done = _cli("--job.config_file", DEBUG, *args, "--print")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_cli_help_lists_every_key_and_docs_table_is_current():
    done = _cli("--help")
    assert done.returncode == 0
    for section in section_types():
        for key, (_, meta) in section_keys(section).items():
            assert f"--{section}.{key}" in done.stdout and meta["help"] in done.stdout
    docs = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert markdown_table() in docs, "docs/config.md is stale: regenerate with python -m fusedrl.config --markdown"


def test_config_error_is_a_value_error_with_one_line():
    assert issubclass(ConfigError, ValueError)
    assert str(ConfigError("a\nb")) == "a b"
