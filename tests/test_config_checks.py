"""The startup checks: one registry (the entry-point group ``fusedrl.config_checks``) finds every owner, each rule is
refused by its one owner, and the trainer and ``python -m fusedrl.config --world_size N`` run the same checks."""

from __future__ import annotations

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from fusedrl.config import ConfigError, InputError, JobConfig, Startup, load_config
from fusedrl.config import checks as registry

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/debug_ppo.toml"

# the package that owns each check (the layer whose code it guards)
OWNERS = {
    "task": "tasks",
    "parallelism": "distributed",
    "nodes": "distributed",
    "resume": "components",
    "reward": "rlhf",
    "sampling": "generation",
    "engine_compile": "generation",
    "recompute": "rlhf",
    "partial_rollouts": "rlhf",
    "env": "rlhf",
    "data": "components",
    "models": "models",
    "lora": "models",
    "model_split": "distributed",
    "schedule_memory": "rlhf",
    "packing": "rlhf",
    "device": "distributed",
    "float8": "distributed",
    "training_compile": "distributed",
    "tokenizer": "components",
}


def test_the_registry_finds_every_owner_in_the_stated_order():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][registry.GROUP]
    installed = {ep.name: ep.value for ep in entry_points(group=registry.GROUP)}
    assert installed == declared, "the installed metadata is stale: run `pip install -e .`"
    checks = registry.registered_checks()
    assert [name for name, _ in checks] == list(registry.ORDER) == list(OWNERS)
    assert {name: f.__module__.split(".")[1] for name, f in checks} == OWNERS
    assert len({f for _, f in checks}) == len(checks)  # one function per check


def test_an_unregistered_check_is_one_line_naming_the_fix(monkeypatch, capsys):
    from fusedrl.config.__main__ import main

    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    with pytest.raises(InputError, match=r"^no startup checks are registered .*; run `pip install -e \.`") as err:
        registry.run_checks(JobConfig(), 1)
    assert "\n" not in str(err.value)
    monkeypatch.chdir(ROOT)
    assert main(["--job.config_file", CONFIG, "--world_size", "4"]) == 2
    out = capsys.readouterr().err
    assert out.startswith("error: no startup checks are registered") and out.count("\n") == 1, out
    stale = [ep for ep in entry_points(group=registry.GROUP) if ep.name != "tokenizer"]  # metadata older than the code
    monkeypatch.setattr(registry, "entry_points", lambda group: stale)
    with pytest.raises(InputError, match=r"^the startup checks tokenizer are not registered .*pip install -e"):
        registry.run_checks(JobConfig(), 1)


def test_a_users_check_runs_after_fusedrls(monkeypatch):
    """Another package registers a check for its own component under the same group; it runs after fusedrl's."""
    found = list(entry_points(group=registry.GROUP))
    ran: list[str] = []

    class Plugin:
        name, value = "my_component", "my_package.checks:check"

        def load(self):
            return lambda startup: ran.append(f"{self.name} {startup.world_size}")

    monkeypatch.setattr(registry, "entry_points", lambda group: [Plugin(), *found])
    assert [name for name, _ in registry.registered_checks()] == [*registry.ORDER, "my_component"]
    monkeypatch.chdir(ROOT)
    registry.run_checks(load_config(["--job.config_file", CONFIG]), 4)
    assert ran == ["my_component 4"]


def test_a_duplicate_or_broken_registration_is_one_line_never_a_silent_replacement(monkeypatch):
    """A package registering one of fusedrl's names would replace its check; a registered module that cannot be
    imported would end every run with a traceback: both are one-line input errors naming the fix."""
    found = list(entry_points(group=registry.GROUP))

    class Plugin:
        name, value, dist = "models", "other_package.checks:check", None

        def load(self):
            raise ModuleNotFoundError("No module named 'other_package'")

    monkeypatch.setattr(registry, "entry_points", lambda group: [*found, Plugin()])
    with pytest.raises(InputError, match=r"^two startup checks are registered as 'models' .*rename or uninstall") as e:
        registry.registered_checks()
    assert "other_package.checks:check" in str(e.value) and "\n" not in str(e.value)
    Plugin.name = "other_component"
    with pytest.raises(InputError, match=r"^the startup check 'other_component' .* cannot be loaded .*fix or uninstall"):
        registry.registered_checks()


def test_the_trainer_and_the_config_cli_run_the_same_checks(monkeypatch):
    from fusedrl import train
    from fusedrl.config import __main__ as cli

    assert train.run_checks is cli.run_checks is registry.run_checks
    calls: list[tuple[str, int, int | None, str]] = []

    def recorded() -> list[tuple[str, registry.StartupCheck]]:
        def record(s: Startup) -> None:
            calls.append((s.cfg.job.config_file or "", s.world_size, s.local_world_size, s.cfg.ppo.clip_eps))

        return [("record", record)]

    monkeypatch.setattr(registry, "registered_checks", recorded)
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    argv = ["--job.config_file", CONFIG, "--ppo.clip_eps=0.3"]
    train.prepare(argv, 4)
    assert cli.main([*argv, "--world_size", "4"]) == 0
    assert cli.main([*argv, "--world_size", "4", "--local_world_size", "2"]) == 0
    assert calls == [(CONFIG, 4, None, 0.3), (CONFIG, 4, None, 0.3), (CONFIG, 4, 2, 0.3)]


# Each rule's refusal, with the check that owns it: the first to refuse, and the only one that refuses in these words
# (a config breaking one rule may break another: gen_tp = 3 divides neither the world size nor the models' heads).
RULES = [
    (["--parallelism.dp_shard=1"], "parallelism", "must equal the world size 4"),
    (["--parallelism.gen_tp=3"], "parallelism", "parallelism.gen_tp = 3 (command line): must divide the world size 4"),
    (["--parallelism.pp_critic=3"], "parallelism", "parallelism.pp_critic = 3 (command line): must divide parallelism.pp"),
    (
        ["--ppo.minibatch_size=4", "--ppo.microbatch_size=2", "--parallelism.pp_critic=1"],
        "parallelism",
        "the 2 Critic replicas split each minibatch's 1 micro-batches",
    ),
    (
        ["--ppo.batch_size=6", "--ppo.minibatch_size=6", "--ppo.microbatch_size=3"],
        "parallelism",
        "ppo.batch_size = 6: must be a multiple of the number of generation instances 4",
    ),
    (["--model.reward=none", "--model.reward_path="], "reward", 'model.reward = "none", model.reward_fn and env.env are unset'),
    (["--generation.temperature=0"], "sampling", "generation.temperature = 0.0 (command line): PPO samples"),
    (["--generation.top_k=5"], "sampling", "generation.top_k = 5 (command line): the PPO ratio and KL"),
    (
        ["--generation.compile=true", "--generation.compile_mode=reduce-overhead"],
        "engine_compile",
        "generation.compile_mode = reduce-overhead (command line) records CUDA graphs of the whole decode step",
    ),
    (
        ["--generation.compile=true", "--parallelism.gen_tp=2"],
        "engine_compile",
        "generation.compile = true (command line) with parallelism.gen_tp = 2: the compiled decode does not take",
    ),
    (["--ppo.tis_cap=2", "--ppo.recompute_logprobs=false"], "recompute", "ppo.tis_cap = 2.0 (command line): truncated"),
    (
        ["--generation.quantize=int8_weight_only", "--ppo.recompute_logprobs=false"],
        "recompute",
        "generation.quantize = 'int8_weight_only' with ppo.recompute_logprobs = false",
    ),
    (["--data.format=jsonl", "--data.path=/no/prompts.jsonl"], "data", 'data.path = "/no/prompts.jsonl" (command line)'),
    (["--model.critic_path=/no/such/folder"], "models", 'model.critic_path = "/no/such/folder" (command line): folder not'),
    (["--generation.max_new_tokens=500"], "models", "exceeds the max_seq_len 512 of model.actor"),
    (
        [f"--model.{k}=llama3_1_8b" for k in ("actor", "critic", "reward")]
        + ["--model.actor_path=", "--model.critic_path=", "--model.reward_path="],
        "models",
        "model.actor_path is unset: a random initialisation builds the whole 'llama3_1_8b' model",
    ),
    (["--parallelism.gen_tp=4"], "model_split", "parallelism.gen_tp = 4: does not divide the KV heads of model.actor"),
    (
        ["--model.critic=debug_small", "--model.critic_path=", "--parallelism.pp_critic=2"],
        "model_split",
        "model.critic = 'debug_small' has 1 layers, fewer than parallelism.pp_critic = 2 stages",
    ),
    (["--fusion.schedule_memory_gib=1e-9"], "schedule_memory", "fusion.schedule_memory_gib = 1e-09"),
    (["--ppo.microbatch_tokens=100"], "packing", "ppo.microbatch_tokens = 100 (command line) is smaller than the longest"),
    (
        ["--training.compile=true", "--parallelism.gen_tp=2"],
        "training_compile",
        "training.compile = true with parallelism.gen_tp = 2",
    ),
    (["--data.chat_template=true"], "tokenizer", "data.chat_template = true, but the tokenizer"),
    (["--model.tokenizer_path=/no/tokenizer.json"], "tokenizer", 'model.tokenizer_path = "/no/tokenizer.json" (command'),
]
CPU_ONLY = [
    (["--training.device=cuda"], "device", 'training.device = "cuda": no CUDA device is available'),
    (["--training.float8=true"], "float8", "training.float8 = true: float8 training needs CUDA"),
]


CASES = RULES + ([] if torch.cuda.is_available() else CPU_ONLY)


@pytest.mark.parametrize("overrides,owner,message", CASES, ids=[f"{owner}:{' '.join(o)}" for o, owner, _ in CASES])
def test_each_rule_is_refused_by_its_one_owner(overrides, owner, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(["--job.config_file", CONFIG, *overrides])
    refused = {}
    for name, check in registry.registered_checks():
        try:
            check(Startup(cfg, 4))
        except ConfigError as e:
            refused[name] = str(e)
    assert next(iter(refused), None) == owner, refused
    assert [name for name, text in refused.items() if message in text] == [owner], refused
    assert "\n" not in refused[owner]


def test_run_checks_stops_at_the_first_refusal(tmp_path, monkeypatch):
    """The node rules (with a ranks-per-node count only), a resume without a checkpoint, an unknown flavor."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(
        ["--job.config_file", CONFIG, "--parallelism.gen_tp=2", "--checkpoint.resume=true", f"--job.output_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match=r"^parallelism.gen_tp = 2 \(command line\): a generation instance"):
        registry.run_checks(cfg, 4, 1)
    with pytest.raises(ConfigError, match=r"^LOCAL_WORLD_SIZE = 3 \(ranks per node\): must divide the world size 4"):
        registry.run_checks(cfg, 4, 3)
    with pytest.raises(ConfigError, match=r"^checkpoint.resume = true \(command line\): no complete checkpoint"):
        registry.run_checks(cfg, 4, 2)
    with pytest.raises(ConfigError, match=r"^model.actor = 'nonesuch': unknown model flavor"):
        registry.run_checks(load_config(["--job.config_file", CONFIG, "--model.actor=nonesuch"]), 4)


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "train_configs").glob("smollm2_135m_*.toml")))
def test_each_smollm2_recipe_fits_the_ranks_its_header_launches(recipe: str) -> None:
    from fusedrl.distributed.parallel_dims import check_parallelism

    path = ROOT / "train_configs" / recipe
    assert "torchrun --nproc_per_node 2 " in path.read_text()  # the header's command (README: the recipes' table)
    cfg = load_config(["--job.config_file", str(path)])
    check_parallelism(Startup(cfg, world_size=2))  # the loader refused already a micro-batch that splits no shard
