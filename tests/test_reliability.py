"""Reliability cases of issue 8 not proven elsewhere (see docs/reliability.md for the full map).

- generation parameters refused by SamplingParams (the config side is in tests/test_config.py);
- NaN/inf in rewards, losses or gradients: the PPO update is skipped with a logged reason, or the run stops,
  depending on training.nan_policy; the weights and optimizer state are never touched by a skipped update
  (one rank with the update alone; 4 ranks with the whole trainer);
- a rank SIGKILLed mid-iteration under torchrun: the job ends (no hang) and the failure names the dead rank.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedrl.generation.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_ppo.toml")


# ------------------------------------------------------------------------------------- generation parameters


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"target_len": 0}, "target_len"),
    ],
)
def test_sampling_params_refuse_bad_values_with_one_line(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert fragment in message and "\n" not in message, message


def test_sampling_params_accept_the_edges():
    # The boundaries that must stay legal: greedy, top_p = 1 (disabled), one new token.
    p = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=1)
    assert p.new_token_budget == 1


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("--generation.temperature=nan", "generation.temperature"),
        ("--generation.top_p=-0.1", "generation.top_p"),
        ("--generation.max_new_tokens=-1", "generation.max_new_tokens"),
    ],
)
def test_config_refuses_bad_generation_parameters(override, fragment):
    from fusedrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(["--job.config_file", DEBUG, override])
    assert fragment in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ numerics


@pytest.fixture()
def single_rank_group():
    """ppo_update all-reduces its stats: a one-process gloo group makes that a no-op."""
    from fusedrl.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.barrier()
    dist.destroy_process_group()


def _experience(batch: int, bad_score: float | None):
    from fusedrl.rlhf.experience import Experience

    g = torch.Generator().manual_seed(0)
    seq = 6
    mask = torch.zeros(batch, seq)
    mask[:, 2:] = 1.0
    scores = torch.rand(batch, generator=g)
    if bad_score is not None:
        scores[batch // 2] = bad_score
    return Experience(
        tokens=torch.randint(0, 512, (batch, seq), generator=g),
        response_mask=mask,
        logprobs=-torch.rand(batch, seq, generator=g),
        ref_logprobs=-torch.rand(batch, seq, generator=g),
        values=torch.rand(batch, seq, generator=g),
        scores=scores,
        sample_ids=torch.arange(batch),
    )


def _ppo_step(
    monkeypatch, nan_policy: str, bad_score: float | None = None, poison: str | None = None, models: dict | None = None
):
    """One real ppo_update (config, advantages, clipping, optimizers, schedulers) on two Linear "stages".

    The pipeline executor is replaced by a loss that depends on the minibatch's advantages and returns, so a
    NaN/inf reward reaches the loss and the gradients as it does in the trainer. ``poison`` injects a
    non-finite value directly: "grad" into one actor gradient, "loss" into the reported policy loss only.
    """
    import fusedrl.rlhf as rlhf
    from fusedrl.components.lr_schedule import build_lr_scheduler
    from fusedrl.components.optimizer import build_optimizer
    from fusedrl.config import load_config

    cfg = load_config(["--job.config_file", DEBUG, "--ppo.epochs=1", f"--training.nan_policy={nan_policy}"])
    torch.manual_seed(0)
    actor, critic = nn.Linear(4, 1), nn.Linear(4, 1)
    if models is not None:
        models.update(actor=actor, critic=critic, before=[p.detach().clone() for m in (actor, critic) for p in m.parameters()])

    def fake_minibatch(cfg, layout, executor, mb, record=False):
        x = torch.ones(mb.batch_size, 4)
        adv = (mb.advantages * mb.response_mask).sum(1)
        ret = (mb.returns * mb.response_mask).sum(1)
        policy_loss = -(actor(x).squeeze(1) * adv).mean()
        value_loss = ((critic(x).squeeze(1) - ret) ** 2).mean()
        (policy_loss + value_loss).backward()
        if poison == "grad":
            actor.weight.grad[0, 1] = float("inf")
        reported = torch.tensor(float("nan")) if poison == "loss" else policy_loss.detach()
        stats = {
            k: torch.zeros(()) for keys in (rlhf.POLICY_STATS, rlhf.FIRST_MINIBATCH_STATS, rlhf.VALUE_STATS) for k in keys
        } | {
            "policy_loss": reported,
            "value_loss": value_loss.detach(),
        }
        return stats, mb.batch_size * mb.seq_len  # and the positions computed

    monkeypatch.setattr(rlhf.update, "_forward_backward", fake_minibatch)  # what train_minibatch calls
    layout = SimpleNamespace(
        dp=1,
        pp_group=None,
        critic_group=None,
        actor_stage=actor,
        critic_stage=critic,
        tied=SimpleNamespace(uncounted=[], sum_gradients=lambda: None),
    )
    opts = []
    for m in (actor, critic):
        o = build_optimizer(m, 1e-2, 0.0)
        opts += [o, build_lr_scheduler(o, 0, 10, "linear", 1.0)]
    opt = rlhf.Optimizers(opts[0], opts[2], opts[1], opts[3])
    exp, stats = rlhf.compute_advantages(cfg, _experience(cfg.ppo.minibatch_size * 2, bad_score))
    before = [p.detach().clone() for p in (*actor.parameters(), *critic.parameters())]
    out = rlhf.ppo_update(cfg, layout, SimpleNamespace(), opt, exp, step=1).figures
    after = [p.detach() for p in (*actor.parameters(), *critic.parameters())]
    changed = any(not torch.equal(a, b) for a, b in zip(before, after))
    return out, stats, changed, opt


def test_finite_update_is_applied(single_rank_group, monkeypatch):
    # The control: without a bad value, both minibatches update the weights.
    out, stats, changed, _ = _ppo_step(monkeypatch, "skip")
    assert out["skipped_updates"] == 0 and changed and math.isfinite(stats["reward_mean"])


@pytest.mark.parametrize(
    "bad, poison",
    [(float("nan"), None), (float("inf"), None), (None, "grad"), (None, "loss")],
    ids=["nan-reward", "inf-reward", "inf-gradient", "nan-loss"],
)
def test_non_finite_update_is_skipped_with_a_logged_reason(single_rank_group, monkeypatch, caplog, bad, poison):
    with caplog.at_level(logging.WARNING, logger="fusedrl"):
        out, _, changed, opt = _ppo_step(monkeypatch, "skip", bad_score=bad, poison=poison)
    # A NaN/inf reward poisons the batch-wide whitening, so both minibatches are skipped; the injected
    # gradient/loss poison is applied to every minibatch as well.
    assert out["skipped_updates"] == 2, out
    assert not changed, "a skipped update changed the weights"
    assert all(not o.state for o in (opt.actor, opt.critic)), "a skipped update touched the optimizer state"
    assert "skipped an update: non-finite loss or gradient norm" in caplog.text


@pytest.mark.parametrize("bad, poison", [(float("nan"), None), (None, "grad")], ids=["nan-reward", "inf-gradient"])
def test_nan_policy_stop_raises_and_applies_nothing(single_rank_group, monkeypatch, bad, poison):
    models: dict = {}
    with pytest.raises(FloatingPointError, match=r'non-finite loss or gradient norm.*training.nan_policy = "stop"'):
        _ppo_step(monkeypatch, "stop", bad_score=bad, poison=poison, models=models)
    after = [p.detach() for m in (models["actor"], models["critic"]) for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(models["before"], after)), "the stopping update changed the weights"


# --------------------------------------------------------------------------------------------------- faults

# Two ranks set up exactly as the trainer's entry point does (torchrun + init_distributed), all-reducing every
# iteration like the PPO loop; rank 1 is SIGKILLed in iteration 3, mid-collective for rank 0.
_KILLED_RANK_SCRIPT = """
import os, signal, time
import torch, torch.distributed as dist
from fusedrl.distributed import init_distributed
torch.set_num_threads(1)
init_distributed("cpu", timeout_s=30.0)
rank = dist.get_rank()
for it in range(1000):
    if rank == 1 and it == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == 2.0
    print(f"rank {rank} iteration {it} done", flush=True)
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_killed_rank_stops_the_others_with_a_message_naming_it(tmp_path):
    import subprocess

    from fusedrl.testing.launcher import job_env, kill_job, torchrun_command

    script = tmp_path / "job.py"
    script.write_text(_KILLED_RANK_SCRIPT)
    cmd = torchrun_command(str(script))
    env = job_env(ROOT)
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=300)  # a hang guard: the job ends in ~15 s on a quiet machine
    except subprocess.TimeoutExpired:
        kill_job(proc)
        out = proc.stdout.read()
        pytest.fail(f"the job hung after a rank was killed:\n{out[-3000:]}")
    assert proc.returncode != 0, out[-3000:]
    assert "rank 0 iteration 2 done" in out and "rank 1 iteration 3 done" not in out, out[-3000:]
    # torchrun's failure summary names the dead rank as the root cause, with its signal.
    root_cause = out[out.index("Root Cause") :] if "Root Cause" in out else ""
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*exitcode\s*:\s*-9", root_cause), out[-3000:]


# ------------------------------------------------------------------------------------- NaN in a full trainer run


def _local_checksum(module: nn.Module) -> float:
    """Sum of this rank's parameter shards (FSDP parameters are DTensors: their local shard)."""
    return float(sum((p.to_local() if hasattr(p, "to_local") else p).detach().double().sum() for p in module.parameters()))


def _nan_reward_run(out: str) -> tuple[list[dict], list[tuple[float, float]]]:
    from fusedrl.config import load_config
    from fusedrl.testing.stress import SMALL
    from fusedrl.trainer import Trainer

    cfg = load_config(
        [
            "--job.config_file",
            DEBUG,
            *SMALL,
            f"--job.output_dir={out}",
            "--training.steps=3",
            *(
                f"--model.{k}={ROOT / 'assets' / 'debug' / v}"
                for k, v in (("actor_path", "actor"), ("critic_path", "reward"), ("reward_path", "reward"))
            ),
        ]
    )
    trainer = Trainer(cfg)
    run_rollout, train_step = trainer.controller.run, trainer.train_step

    def poisoned_rollout(requests, **options):
        result = run_rollout(requests, **options)
        if trainer.step == 2:  # one sample's reward of iteration 2 is NaN, on every rank (same gathered parts)
            result.scored[0].scores[0] = float("nan")
        return result

    checksums = []

    def checked_step(step: int) -> dict:
        stages = (trainer.layout.actor_stage, trainer.layout.critic_stage)
        before = sum(map(_local_checksum, stages))
        record = train_step(step)
        checksums.append((before, sum(map(_local_checksum, stages))))
        return record

    trainer.controller.run, trainer.train_step = poisoned_rollout, checked_step
    return trainer.train(), checksums


@pytest.mark.slow
def test_nan_reward_in_a_full_trainer_run_skips_that_update_on_every_rank(tmp_path, four_ranks):
    """End to end on 4 ranks (pp=2 x dp_shard=2) through the pipeline executor and FSDP: the NaN reaches
    every rank's loss via KL shaping, GAE and whitening; all ranks skip together and then train on."""

    results = four_ranks.run(_nan_reward_run, str(tmp_path), timeout_s=300)
    for history, checksums in results:
        assert [h["skipped_updates"] for h in history] == [0, 1, 0]
        assert checksums[1][0] == checksums[1][1]  # iteration 2 changed no weight on this rank
        assert checksums[0][0] != checksums[0][1] and checksums[2][0] != checksums[2][1]
        assert math.isfinite(history[2]["policy_loss"]) and math.isfinite(history[2]["value_loss"])
