"""End-to-end critic-free training (GRPO, and RLOO with DAPO's options) on 4 CPU ranks (pp=2 x dp_shard=2): no Critic
is built, fusions on == off (samples, scores, advantages, losses; the Actor alone on split-backward pipelines, or the
F/B fused schedule, against sequential 1F1B), the loss independent of how a minibatch is split, exact resume with
groups."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from test_train import COMPARED as TRAIN_COMPARED
from test_train import TINY as TRAIN_TINY

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "train_configs" / "debug_grpo.toml")
# test_train.py's tiny run (random-init models, a quarter of the vocabulary stops a response, so lengths vary and the
# tail migrates) without the Critic's and the Reward model's keys, as 4 prompts x 4 samples at temperature 0.8. The
# task's rule scores (most random responses score -1, so some groups have equal scores).
TINY = [
    *(arg for arg in TRAIN_TINY if not arg.startswith(("--model.critic", "--model.reward", "--optimizer.critic"))),
    "--ppo.batch_size=16",
    "--generation.temperature=0.8",
    "--metrics.timeline_interval=0",
]
# test_train.py's figures that must not depend on when work runs, less the Critic's, and the critic-free ones
CRITIC_FIGURES = ("value_loss", "explained_variance", "grad_norm_critic")
COMPARED = (
    *(k for k in TRAIN_COMPARED if k not in CRITIC_FIGURES),
    "kl_loss",
    "return_std",
    "advantage_mean",
    "advantage_std",
    "zero_std_groups_frac",
    "true_score",
)
# RLOO with DAPO's options: asymmetric clipping, dynamic sampling, the soft overlong punishment, Dr.GRPO's aggregation
DAPO = (
    "--ppo.advantage_estimator=rloo",
    "--ppo.clip_eps_low=0.2",
    "--ppo.clip_eps_high=0.28",
    "--ppo.dynamic_sampling=true",
    "--ppo.dynamic_sampling_max_rounds=3",
    "--ppo.overlong_buffer=4",
    "--ppo.loss_agg_mode=seq-mean-token-sum-norm",
)
OFF = ("--fusion.inter_stage=false", "--fusion.intra_stage=false")
# the fused GRPO runs schedule the Actor alone with split backwards (the RLOO one with the F/B fused schedule)
SPLIT_BACKWARD = ("--fusion.split_backward=true",)
SPLIT = ("--parallelism.pp=1", "--parallelism.dp_shard=4", "--ppo.microbatch_size=1")


def _runs(out: str) -> dict:
    from fusedrl.config import load_config
    from fusedrl.train import Trainer, run

    def cfg(name: str, *extra: str):
        return load_config(["--job.config_file", CONFIG, *TINY, f"--job.output_dir={out}/{name}", *extra])

    built = Trainer(cfg("built", *SPLIT_BACKWARD))
    layout = {
        "critic_stage": built.layout.critic_stage is None,
        "rollout_critic": built.rollout.critic is None,
        "optimizer": built.opt.critic is None,
        "syncs": len(built.syncs),
        "plan": built.executor.plan_method,
        "reference": built.rollout.reference is not None,
    }
    del built
    without_kl = Trainer(cfg("without_kl", "--ppo.kl_loss_coef=0"))
    layout["reference_without_kl"] = without_kl.rollout.reference is not None
    del without_kl
    histories = {
        "on": run(cfg("on", *SPLIT_BACKWARD, "--checkpoint.interval=1")),
        "off": run(cfg("off", *OFF)),
        "dapo_on": run(cfg("dapo_on", *DAPO)),
        "dapo_off": run(cfg("dapo_off", *DAPO, *OFF)),
        # the same minibatches cut differently: 4 data-parallel shards of one stage, micro-batches of one sample
        "dapo_split": run(cfg("dapo_split", *DAPO, *OFF, *SPLIT)),
        # no KL term: no Reference is built, and scoring runs no model (the task's rule scores alone)
        "no_kl": run(cfg("no_kl", "--ppo.kl_loss_coef=0")),
    }
    if dist.get_rank() == 0:  # the interrupted run: only the step-1 checkpoint exists in its folder
        src = Path(out, "on", "checkpoints")
        step1 = next(p for p in src.iterdir() if p.name.startswith("step-") and int(p.name[5:]) == 1)
        shutil.copytree(step1, Path(out, "resumed", "checkpoints", step1.name))
    dist.barrier()
    histories["resumed"] = run(cfg("resumed", *SPLIT_BACKWARD, "--checkpoint.resume=true"))
    return {"layout": layout, "histories": histories}


@pytest.fixture(scope="module")
def result(tmp_path_factory, rank_pools) -> dict:
    return rank_pools(4).run(_runs, str(tmp_path_factory.mktemp("grpo")), timeout_s=420.0)[0]


def _assert_equal_runs(a: list[dict], b: list[dict], keys, rel: float, what: str) -> None:
    assert len(a) == len(b) == 2
    for step, (x, y) in enumerate(zip(a, b), start=1):
        for k in keys:
            assert x[k] == pytest.approx(y[k], rel=rel, abs=1e-6), f"{what}, step {step}: {k} differs: {x[k]} vs {y[k]}"


@pytest.mark.slow
def test_grpo_builds_no_critic_and_plans_split_backward(result):
    layout = result["layout"]
    assert layout["critic_stage"] and layout["rollout_critic"] and layout["optimizer"] and layout["syncs"] == 1
    assert layout["reference"]  # the KL loss term needs it
    assert layout["plan"].startswith("split"), layout["plan"]  # the Actor alone: a split-backward schedule
    h = result["histories"]["on"]
    assert all("value_loss" not in r and "grad_norm_critic" not in r and "lr_critic" not in r for r in h)
    assert all(r["kl_loss"] >= 0 and 0 <= r["zero_std_groups_frac"] <= 1 for r in h)
    assert h[0]["grad_norm_actor"] > 0


@pytest.mark.slow
def test_grpo_fusions_on_and_off_give_equal_samples_scores_advantages_and_losses(result):
    hs = result["histories"]
    _assert_equal_runs(hs["on"], hs["off"], COMPARED, 1e-4, "GRPO fusions on vs off")
    assert any(r["migration_moved"] > 0 for r in hs["on"]) and all(r["migration_moved"] == 0 for r in hs["off"])


@pytest.mark.slow
def test_rloo_with_dapo_options_fused_equals_unfused_and_counts_dynamic_sampling(result):
    hs = result["histories"]
    keys = (*COMPARED, "clip_frac_low", "clip_frac_high", "dynamic_sampling_rounds", "dynamic_sampling_dropped_groups")
    _assert_equal_runs(hs["dapo_on"], hs["dapo_off"], keys, 1e-4, "RLOO + DAPO fusions on vs off")
    for r in hs["dapo_on"]:
        assert 1 <= r["dynamic_sampling_rounds"] <= 3
        # the kept batch holds groups of differing scores first; filling with dropped ones only after the last round
        if r["dynamic_sampling_filled_groups"] == 0:
            assert r["zero_std_groups_frac"] == 0.0
        else:
            assert r["dynamic_sampling_rounds"] == 3
    assert any(r["dynamic_sampling_dropped_groups"] > 0 for r in hs["dapo_on"])


@pytest.mark.slow
def test_grpo_resume_continues_exactly(result):
    hs = result["histories"]
    assert len(hs["resumed"]) == 1
    for k in (*COMPARED, "lr_actor"):
        assert hs["resumed"][0][k] == pytest.approx(hs["on"][1][k], rel=1e-6, abs=1e-9), k


@pytest.mark.slow
def test_loss_aggregation_does_not_depend_on_how_a_minibatch_is_split(result):
    """seq-mean-token-sum-norm over pp = 2 x dp_shard = 2 with micro-batches of 2 samples and over dp_shard = 4 with
    micro-batches of 1: the same losses, advantages and gradient norms (the weights are made per whole minibatch)."""
    hs = result["histories"]
    keys = (*COMPARED, "clip_frac_low", "clip_frac_high")
    _assert_equal_runs(hs["dapo_off"], hs["dapo_split"], keys, 1e-4, "pp2 x dp2, micro-batch 2 vs dp4, micro-batch 1")


@pytest.mark.slow
def test_grpo_without_a_kl_term_trains_without_a_reference(result):
    assert not result["layout"]["reference_without_kl"]
    h = result["histories"]["no_kl"]
    assert len(h) == 2 and all(r["kl"] == 0.0 and "kl_loss" not in r for r in h)
    assert h[0]["grad_norm_actor"] > 0 and h[0]["true_score"] == result["histories"]["on"][0]["true_score"]
