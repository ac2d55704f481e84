"""End-to-end PPO trainer on 4 CPU ranks (pp=2 x dp_shard=2): fusions on == off, Critic replicas == no replicas,
exact resume (also with replicas), config refusal."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fusedrl.hardware import host_heap_bytes
from fusedrl.testing import free_port
from fusedrl.testing.configs import TINY_DEBUG_RUN

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "train_configs" / "debug_ppo.toml")
# Tiny and fast: random-init debug models, 8 prompts (2 per rank), short responses, 2 iterations. A quarter of
# the vocabulary stops a response, so lengths vary and the tail migrates at the threshold.
TINY = [
    *TINY_DEBUG_RUN,
    "--fusion.schedule_search_budget_s=0.2",
    "--fusion.migration_threshold=0.5",
    "--fusion.migration_check_interval=1",
    "--training.steps=2",
    "--checkpoint.keep=0",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--metrics.timeline_interval=2",
    "--lr_scheduler.warmup_steps=0",
    "--optimizer.actor_lr=1e-3",
    "--optimizer.critic_lr=1e-3",
]
# Figures that must not depend on when work runs (timings, bubbles and migration counts do).
COMPARED = (
    "policy_loss",
    "value_loss",
    "kl",
    "reward_mean",
    "reward_std",
    "clip_frac",
    "entropy",
    "approx_kl",
    "explained_variance",
    "grad_norm_actor",
    "grad_norm_critic",
    "response_len_mean",
    "return_mean",
    "logprob_diff_mean",
    "importance_ratio_mean",
    "approx_kl_first",
    "clip_frac_first",
    "truncated_frac",
)
# Every run of the equality checks also uses the PPO options whose results must not depend on the fusions either:
# a sampling temperature other than 1, recomputed old log-probs with truncated importance sampling, the k2 KL
# estimator and a penalty on responses that hit max_new_tokens.
PPO_OPTIONS = (
    "--generation.temperature=0.8",
    "--ppo.recompute_logprobs=true",
    "--ppo.tis_cap=2.0",
    "--ppo.kl_estimator=k2",
    "--ppo.truncated=penalty",
)


# Both fusions on, the fused schedule with split backwards (the torchrun test below runs the F/B fused schedule).
FUSED = ("--fusion.inter_stage=true", "--fusion.intra_stage=true", "--fusion.split_backward=true")


# The Critic on one pipeline stage: 2 replicas, hybrid-sharded over (replica, dp_shard) = (2, 2).
REPLICAS = ("--parallelism.pp_critic=1",)


def _runs(out: str) -> dict[str, list[dict]]:
    """Fusions on (split-backward fused schedule, checkpoint every step), fusions off (with activation checkpointing
    and frozen-model offload), fusions on with the Critic as 2 replicas of 1 stage (checkpoint every step), and a
    resume of the first and the third run from their step 1."""
    from fusedrl.config import load_config
    from fusedrl.train import run

    def cfg(name: str, *extra: str):
        return load_config(["--job.config_file", CONFIG, *TINY, *PPO_OPTIONS, f"--job.output_dir={out}/{name}", *extra])

    histories = {
        "on": run(cfg("on", *FUSED, "--checkpoint.interval=1")),
        # the memory savers change no result either: the unfused run also recomputes layers in the backward and
        # keeps the Reference and Reward in host memory outside the rollout
        "off": run(
            cfg(
                "off",
                "--fusion.inter_stage=false",
                "--fusion.intra_stage=false",
                "--training.activation_checkpointing=full",
                "--training.offload_frozen=true",
            )
        ),
    }
    histories["replicas"] = run(cfg("replicas", *FUSED, *REPLICAS, "--checkpoint.interval=1"))
    for name, extra in (("on", FUSED), ("replicas", (*FUSED, *REPLICAS))):
        if dist.get_rank() == 0:  # the interrupted run: only the step-1 checkpoint of the run exists in its folder
            src = Path(out, name, "checkpoints")
            step1 = next(p for p in src.iterdir() if p.name.startswith("step-") and int(p.name[5:]) == 1)
            shutil.copytree(step1, Path(out, f"{name}_resumed", "checkpoints", step1.name))
        dist.barrier()
        histories[f"{name}_resumed"] = run(cfg(f"{name}_resumed", *extra, "--checkpoint.resume=true"))
    return histories


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def histories(train_dir, rank_pools) -> dict[str, list[dict]]:
    return rank_pools(4).run(_runs, str(train_dir), timeout_s=420.0)[0]


def _assert_close(a: dict, b: dict, keys, rel: float, what: str) -> None:
    for k in keys:
        x, y = a[k], b[k]
        if math.isnan(x) and math.isnan(y):
            continue
        assert x == pytest.approx(y, rel=rel, abs=1e-6), f"{what}: {k} differs: {x} vs {y}"


@pytest.mark.slow
def test_fusions_on_and_off_give_equal_losses_and_rewards(histories):
    on, off = histories["on"], histories["off"]
    assert [len(on), len(off)] == [2, 2]
    for step, (a, b) in enumerate(zip(on, off), start=1):
        _assert_close(a, b, COMPARED, 1e-4, f"step {step} on vs off")
    # the runs trained: the second iteration sampled from updated weights
    assert on[1]["lr_actor"] > 0 and on[0]["grad_norm_actor"] > 0
    if host_heap_bytes() is not None:  # CPU ranks under glibc 2.33+: the C allocator's bytes in use and free ones it keeps
        assert on[1]["host_heap_in_use_gib"] > 0 and on[1]["host_heap_free_gib"] >= 0
    # the recomputed old log-probs are the training forward's: the first minibatch starts at ratio 1; some responses
    # were truncated (and penalised)
    assert all(h["ratio_mean_first"] == pytest.approx(1.0, abs=1e-6) and h["clip_frac_first"] == 0 for h in on + off)
    assert all(h["time_recompute"] > 0 for h in on + off) and any(h["truncated_frac"] > 0 for h in on)
    # inter-stage fusion migrated the tail in the fused run, and only there
    assert any(h["migration_moved"] > 0 for h in on) and all(h["migration_moved"] == 0 for h in off)
    # every phase was timed in both modes; pipeline timelines only on the recorded step (timeline_interval=2)
    for h in (on[0], off[0]):
        assert all(h[f"time_{s}"] > 0 for s in ("weight_sync", "generation", "scoring", "advantages", "training", "step"))
        assert "bubble_ratio" not in h
    for h in (on[1], off[1]):
        assert 0.0 <= h["bubble_ratio"] < 1.0
    # time between iterations: nothing before a run's first step; the fused run then logged and checkpointed step 1
    assert on[0]["time_outside"] == 0.0 and on[1]["time_outside"] > 0.0
    # the config's task (job.task = the debug task) evaluated every iteration, after the timed phases
    assert all(-1.0 <= h["true_score"] <= 1.0 and h["time_eval"] > 0 for h in on + off)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["on", "replicas"])
def test_resume_continues_exactly(histories, name):
    run, resumed = histories[name], histories[f"{name}_resumed"]
    assert len(resumed) == 1, "the resumed run must start after the checkpointed step 1"
    _assert_close(resumed[0], run[1], COMPARED + ("true_score", "lr_actor", "lr_critic"), 1e-6, "resumed step 2")


@pytest.mark.slow
def test_critic_replicas_train_like_one_critic_pipeline(histories, train_dir):
    """pp_critic=1 at pp=2: two Critic replicas, each training half of the micro-batches, their gradients averaged by
    hybrid sharding: the same losses, rewards and gradient norms as the Critic split over both stages. The
    checkpoint holds one copy of the replicated Critic (its shards tile each tensor once)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    on, replicas = histories["on"], histories["replicas"]
    assert len(replicas) == 2
    for step, (a, b) in enumerate(zip(on, replicas), start=1):
        _assert_close(a, b, COMPARED, 1e-4, f"step {step} one Critic pipeline vs two replicas")
    saved = FileSystemReader(str(train_dir / "replicas" / "checkpoints" / "step-00000001")).read_metadata().state_dict_metadata
    critic = {k: v for k, v in saved.items() if k.startswith("model.critic_stage0.") and isinstance(v, TensorStorageMetadata)}
    assert any(".model.layers.1." in k for k in critic) and any(".optimizer." in k for k in critic)
    assert not any(k.startswith("model.critic_stage1.") for k in saved)  # one stage: every rank holds it
    for name, meta in critic.items():
        stored = sum(math.prod(c.sizes) for c in meta.chunks)
        assert stored == math.prod(meta.size), f"{name}: {stored} elements stored for a tensor of {math.prod(meta.size)}"


# ------------------------------------------------------------------------------------------- bad configs


BAD_CONFIGS = [
    (["--parallelism.dp_shard=1"], "must equal the world size 4"),
    (["--ppo.minibatch_size=12"], "must be a multiple of ppo.minibatch_size = 12 (command line)"),
    (["--ppo.clip_epss=0.1"], "unknown key in [ppo]; did you mean clip_eps?"),
    (["--generation.max_new_tokens=500"], "exceeds the max_seq_len 512 of model.actor"),
    (["--training.float8=true"], "float8 training needs CUDA"),
    (["--model.actor_path=/no/such/folder", "--model.critic_path=", "--model.reward_path="], "folder not found"),
    (["--parallelism.gen_tp=4"], "parallelism.gen_tp = 4: does not divide the KV heads of model.actor = 'debug' (2)"),
    (["--parallelism.gen_tp=3"], "parallelism.gen_tp = 3"),
    (
        [f"--model.{k}=llama3_1_8b" for k in ("actor", "critic", "reward")]
        + ["--model.actor_path=", "--model.critic_path=", "--model.reward_path="],
        "model.actor_path is unset: a random initialisation builds the whole 'llama3_1_8b' model in host memory",
    ),
    (["--data.chat_template=true"], "data.chat_template = true, but the tokenizer (model.tokenizer_path = "),
    (["--parallelism.pp_critic=3"], "parallelism.pp_critic = 3 (command line): must divide parallelism.pp = 2"),
    (
        ["--model.critic=debug_small", "--model.critic_path=", "--parallelism.pp_critic=2"],
        "model.critic = 'debug_small' has 1 layers, fewer than parallelism.pp_critic = 2 stages; lower pp_critic",
    ),
    (
        ["--ppo.minibatch_size=4", "--ppo.microbatch_size=2", "--parallelism.pp_critic=1"],
        "the 2 Critic replicas split each minibatch's 1 micro-batches per data-parallel shard evenly",
    ),
    (["--job.task="], 'data.format = "synthetic" takes its prompts from the task, but job.task is unset'),
    (["--job.task=fusedrl.tasks.debug:ASSET_FLAVOR"], "job.task = 'fusedrl.tasks.debug:ASSET_FLAVOR' is a str, not a fusedrl"),
    (["--job.task=no_such_module:TASK"], "job.task = 'no_such_module:TASK': cannot import module 'no_such_module'"),
    (
        ["--job.task=", "--model.reward_fn=task"],
        'model.reward_fn = "task" scores with the task\'s reward function, but job.task is unset',
    ),
]


@pytest.mark.parametrize(
    "overrides,message",
    BAD_CONFIGS,
    ids=[
        "world-size",
        "batch-divisibility",
        "typo",
        "too-long",
        "float8-cpu",
        "missing-weights",
        "kv-heads-gen-tp",
        "gen-tp-world",
        "random-init-8b",
        "no-chat-template",
        "pp-critic-divisor",
        "pp-critic-layers",
        "pp-critic-microbatches",
        "synthetic-without-task",
        "task-not-a-task",
        "task-not-importable",
        "task-reward-without-task",
    ],
)
def test_bad_configs_are_refused_before_any_process_group(overrides, message, monkeypatch):
    from fusedrl.config import ConfigError
    from fusedrl.train import prepare

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        prepare(["--job.config_file", "train_configs/debug_ppo.toml", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS[:1] + BAD_CONFIGS[3:])
def test_config_cli_with_world_size_runs_the_trainers_checks(overrides, message, monkeypatch, capsys):
    from fusedrl.config.__main__ import main

    monkeypatch.chdir(ROOT)
    assert main(["--job.config_file", "train_configs/debug_ppo.toml", *overrides, "--world_size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_a_bad_checkpoint_under_torchrun_is_one_line_from_one_rank_without_traceback(tmp_path):
    bad = tmp_path / "actor"
    shutil.copytree(ROOT / "assets" / "debug" / "actor", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "fusedrl.train",
            "--job.config_file",
            CONFIG,
            *TINY,
            "--parallelism.dp_shard=1",
            f"--model.actor_path={bad}",
            f"--job.output_dir={tmp_path / 'out'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hidden_size" in errors[0], proc.stderr[-4000:]
    assert f'File "{ROOT / "fusedrl"}' not in proc.stderr, proc.stderr[-4000:]  # no rank's traceback (torchrun has its own)
    assert "[rank" not in proc.stderr and "--checkpoint.resume" not in proc.stderr, proc.stderr[-4000:]
    # torchrun exits 1 for any failed worker; its summary shows the worker's own status
    assert proc.returncode == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.slow
def test_cli_refuses_a_bad_config_with_one_line_and_exit_status_2():
    # Rank 0 of 4 with a rendezvous nobody else joins: starting a process group would hang until the timeout.
    env = {
        **os.environ,
        "WORLD_SIZE": "4",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "fusedrl.train", "--job.config_file", "train_configs/debug_ppo.toml", "--parallelism.dp_shard=1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.rstrip().splitlines()[-1] == errors[0], proc.stderr
    assert "must equal the world size 4; set --parallelism.dp_shard=2 or launch 2 processes" in errors[0]


def test_ppo_doc_covers_every_config_key():
    from fusedrl.config.loader import section_keys, section_types

    doc = (ROOT / "docs" / "ppo.md").read_text()
    missing = [
        f"{s}.{k}"
        for s in section_types()
        for k in section_keys(s)
        if (s, k) != ("job", "config_file") and f"`{s}.{k}`" not in doc
    ]
    assert not missing, f"docs/ppo.md does not explain {missing}"


def test_empty_model_names_read_each_checkpoints_config_json(tmp_path, monkeypatch):
    """model.actor / critic / reward empty: the architecture is the path's config.json (the debug assets are a
    Llama); one the trainer cannot build, or a head count gen_tp cannot split, is one line naming the key."""
    import json

    from fusedrl.config import ConfigError
    from fusedrl.layouts import model_flavor
    from fusedrl.models import FLAVORS
    from fusedrl.train import prepare

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.chdir(ROOT)
    empty = [f"--model.{k}=" for k in ("actor", "critic", "reward")]
    cfg = prepare(["--job.config_file", "train_configs/debug_ppo.toml", *empty])
    assert {key: model_flavor(cfg, key) for key in ("actor", "critic", "reward")} == dict.fromkeys(
        ("actor", "critic", "reward"), FLAVORS["debug"]
    )
    assert model_flavor(cfg, "actor").name == "actor"  # named after its folder
    moe = tmp_path / "moe"
    moe.mkdir()
    config = json.loads((ROOT / "assets/debug/actor/config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(ConfigError, match=r"^model.actor: cannot build .*model_type='mixtral': fusedrl builds") as err:
        prepare(["--job.config_file", "train_configs/debug_ppo.toml", *empty, f"--model.actor_path={moe}"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="gen_tp = 4: does not divide the KV heads of model.actor_path.s llama model"):
        prepare(["--job.config_file", "train_configs/debug_ppo.toml", *empty, "--parallelism.gen_tp=4"])


def test_unnamed_models_without_paths_and_a_foreign_reference(tmp_path, monkeypatch):
    """An empty Critic / Reward name without a path takes the Actor's architecture; a path into the debug task's
    assets not built yet has their flavor; a reference_path of another architecture is refused at config check."""
    from fusedrl.config import ConfigError, load_config
    from fusedrl.models import FLAVORS, build_model, model_flavors, read_flavor, save_hf_checkpoint
    from fusedrl.train import prepare

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.chdir(ROOT)
    base = ["--job.config_file", "train_configs/debug_ppo.toml"]
    cfg = prepare([*base, "--model.actor=", "--model.critic=", "--model.critic_path="])
    flavors = model_flavors(cfg)
    assert flavors["critic"] == flavors["actor"] == read_flavor(ROOT / "assets/debug/actor")
    pending = tmp_path / "assets"
    cfg = load_config(
        [*base, *(f"--model.{k}=" for k in ("actor", "critic", "reward")), f"--model.actor_path={pending / 'actor'}"]
    )
    assert model_flavors(cfg, {pending: "debug"})["actor"] == FLAVORS["debug"]  # built later by the debug task
    qwen = save_hf_checkpoint(build_model("debug_qwen"), tmp_path / "qwen", "debug_qwen")
    with pytest.raises(
        ConfigError, match=r"model.reference_path = .*another architecture than the Actor's \(it differs in family"
    ):
        prepare([*base, f"--model.reference_path={qwen}"])


def test_the_training_command_keeps_openmp_threads_awake_on_cpu_ranks_unless_told_otherwise():
    """``fusedrl.train`` sets OMP_WAIT_POLICY before torch loads OpenMP (docs/ppo.md, "Threads") where its ranks compute
    on the CPU, leaves a GPU job's host threads to OpenMP's default, and leaves a value the environment gives alone."""
    ppo = ["--job.config_file", "train_configs/debug_ppo.toml"]
    cases = [  # (OMP_WAIT_POLICY given, command line, OMP_WAIT_POLICY expected)
        (None, ppo, "active"),  # device = "cpu" in the file
        ("passive", ppo, "passive"),
        (None, [*ppo, "--training.device=cuda"], "unset"),
        (None, ["--job.config_file", "train_configs/llama3_1_8b_ppo.toml"], "unset"),  # device = "cuda" in the file
    ]
    procs = []
    for given, args, _ in cases:  # each a fresh interpreter, started together: one core each, mostly importing
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if given is not None:
            env["OMP_WAIT_POLICY"] = given
        code = (
            f"import os, sys; sys.argv = ['fusedrl.train', *{args!r}]; import fusedrl.train; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY', 'unset'))"
        )
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    for proc, (given, args, expected) in zip(procs, cases):
        stdout, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0 and stdout.split()[-2:] == ["True", expected], (given, args, stdout)


def test_runs_on_cpu_reads_the_device_from_the_command_line_then_the_file_then_the_machine(tmp_path):
    from fusedrl.train import runs_on_cpu

    gpu_file, auto_file = tmp_path / "gpu.toml", tmp_path / "auto.toml"
    gpu_file.write_text('[training]\ndevice = "cuda"\n')
    auto_file.write_text("[training]\nsteps = 2\n")
    no_gpus = {"CUDA_VISIBLE_DEVICES": ""}
    assert not runs_on_cpu(["--job.config_file", str(gpu_file)], no_gpus)
    assert runs_on_cpu(["--job.config_file", str(gpu_file), "--training.device", "cpu"], no_gpus)  # the command line wins
    assert not runs_on_cpu([f"--job.config_file={auto_file}", "--training.device=cuda"], {})
    assert runs_on_cpu(["--job.config_file", str(auto_file)], no_gpus)  # "auto" with the GPUs hidden
    assert runs_on_cpu(["--job.config_file", str(tmp_path / "missing.toml")], no_gpus)  # load_config reports it later
    bad_shape, not_utf8 = tmp_path / "shape.toml", tmp_path / "latin1.toml"
    bad_shape.write_text('training = "cuda"\n')
    not_utf8.write_bytes("[job]\nname = 'caf\xe9'\n".encode("latin-1"))
    for bad in (bad_shape, not_utf8):  # no traceback before load_config can name the problem
        assert runs_on_cpu(["--job.config_file", str(bad)], no_gpus)
    if not Path("/proc/driver/nvidia/gpus").is_dir():  # this machine has no NVIDIA driver: "auto" is the CPU
        assert runs_on_cpu([], {})


def test_reuses_host_memory_reads_the_command_line_then_the_file_and_is_on_by_default(tmp_path):
    from fusedrl.train import reuses_host_memory

    off_file, plain_file = tmp_path / "off.toml", tmp_path / "plain.toml"
    off_file.write_text("[training]\nreuse_host_memory = false\n")
    plain_file.write_text("[training]\nsteps = 2\n")
    assert reuses_host_memory([]) and reuses_host_memory(["--job.config_file", str(plain_file)])
    assert not reuses_host_memory(["--job.config_file", str(off_file)])
    assert reuses_host_memory([f"--job.config_file={off_file}", "--training.reuse_host_memory=true"])  # the command line wins
    assert not reuses_host_memory(["--job.config_file", str(plain_file), "--training.reuse_host_memory=False"])
