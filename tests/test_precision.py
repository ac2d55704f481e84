"""A bf16 run (bf16 training compute with float32 master weights, bf16 frozen models, rollout copies and KV
cache) tracks the float32 run of the shipped debug config over a few PPO iterations (4 CPU ranks).

Tolerances: sampling at temperature 1 with the same random streams, both runs sample the same responses (a bf16
rounding could flip a draw near a tie; it does not in these iterations, and the test checks the lengths and
rule-based scores are the same, so a flip would show). The bf16 run recomputes PPO's old log-probs
(``ppo.recompute_logprobs = "auto"``); the float32 one does not need to. bf16 keeps 8 significant bits (relative
rounding 2^-8 = 0.4% per operation); the debug models are 2 layers deep, so a value or a log-prob is off by about 1%
of its magnitude: rewards and values (|x| <= 1.5) within 0.02, losses within 5% (plus 1e-3 absolute for losses
near 0), gradient norms within 5%. The KL to the Reference is a difference of two sums of sampled-token
log-probs, each of magnitude about length x entropy, so it is checked within 1% of both sums together.
"""

import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "train_configs" / "debug_ppo.toml")
SMALL = [
    "--ppo.batch_size=16",
    "--ppo.minibatch_size=16",
    "--ppo.microbatch_size=4",
    "--ppo.epochs=1",
    "--generation.max_new_tokens=48",
    "--generation.temperature=1",
    "--training.steps=3",
    "--checkpoint.interval=0",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--fusion.schedule_search_budget_s=0",
    "--metrics.jsonl=false",
    *(
        f"--model.{k}={ROOT / 'assets' / 'debug' / v}"
        for k, v in (("actor_path", "actor"), ("critic_path", "reward"), ("reward_path", "reward"))
    ),
]
BF16 = [
    "--training.mixed_precision_param=bfloat16",
    "--training.frozen_dtype=bfloat16",
    "--training.rollout_dtype=bfloat16",
    "--training.kv_cache_dtype=bfloat16",
]


def _train(out: str, extra: list[str]) -> list[dict]:
    from fusedrl.config import load_config
    from fusedrl.trainer import Trainer

    return Trainer(load_config(["--job.config_file", CONFIG, *SMALL, f"--job.output_dir={out}", *extra])).train()


@pytest.mark.slow
def test_bf16_run_tracks_the_fp32_run(tmp_path, four_ranks):
    fp32 = four_ranks.run(_train, str(tmp_path / "fp32"), [], timeout_s=300)[0]
    bf16 = four_ranks.run(_train, str(tmp_path / "bf16"), BF16, timeout_s=300)[0]
    for step, (a, b) in enumerate(zip(fp32, bf16), start=1):
        assert a["response_len_mean"] == b["response_len_mean"] and a["true_score"] == b["true_score"], step
        assert abs(a["reward_mean"] - b["reward_mean"]) <= 0.02, (step, a["reward_mean"], b["reward_mean"])
        kl_tol = 0.01 * 2 * a["response_len_mean"] * a["entropy"]
        assert abs(a["kl"] - b["kl"]) <= kl_tol, (step, a["kl"], b["kl"], kl_tol)
        for key in ("value_loss", "policy_loss"):
            assert math.isclose(a[key], b[key], rel_tol=0.05, abs_tol=1e-3), (step, key, a[key], b[key])
        for key in ("grad_norm_actor", "grad_norm_critic"):
            assert math.isclose(a[key], b[key], rel_tol=0.05), (step, key, a[key], b[key])
