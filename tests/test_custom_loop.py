"""Runs the PPO loops of docs/custom_loop.md exactly as written there: the loop from the pieces on two processes
(pp=2), the loop on the job's layouts on four (pp=2 x dp_shard=2, a tied-embedding Actor) against the Trainer's
losses at the same seed."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "custom_loop.md"
PROMPTS = ["repeat ab 3 times:", "repeat c 5 times:", "repeat xy 2 times:", "repeat q 7 times:"]


def doc_function(name: str):
    """The function ``name`` of the doc's python block that defines it, executed as the doc holds it."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if f"\ndef {name}(" in b]
    assert len(blocks) == 1, f"{DOC} must hold exactly one python block defining {name}"
    namespace: dict = {"__name__": "custom_loop_doc"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    return namespace[name]


DEBUG = ROOT / "assets" / "debug"
TASK_PROMPTS = ["repeat ab 3 times:", "repeat c 5 times:", "repeat xy 2 times:", "repeat q 4 times:"]


def test_one_process_grpo_with_the_engine_sharing_the_trained_model():
    # no process group, the engine over the very Actor that trains (fused AdamW, the CPU layouts on): every step
    # samples from the current weights, so the engine's log-probs equal the training forward's before each update,
    # and the run is the copy + WeightSync run, reward for reward
    grpo_loop = doc_function("grpo_loop")
    shared = grpo_loop(TASK_PROMPTS, str(DEBUG / "actor"), str(DEBUG / "tokenizer"))
    copied = grpo_loop(TASK_PROMPTS, str(DEBUG / "actor"), str(DEBUG / "tokenizer"), share_model=False)
    assert len(shared) == 3
    for step in shared + copied:
        assert step["logprob_diff_max"] <= 1e-5, step
    assert [s["reward"] for s in shared] == [c["reward"] for c in copied]
    assert [s["loss"] for s in shared] == [c["loss"] for c in copied]
    assert len({s["reward"] for s in shared}) == 3  # the policy moved: each step samples anew


def test_one_process_ppo_with_a_critic():
    history = doc_function("ppo_loop_one_process")(TASK_PROMPTS, str(DEBUG / "actor"), str(DEBUG / "tokenizer"))
    assert len(history) == 3
    assert abs(history[0]["kl"]) < 1e-5  # step 0 samples from the Reference's weights
    assert abs(history[2]["kl"]) > 1e-4  # then the policy moved away, and the engine sampled from the moved one
    assert all(h["logprob_diff_max"] <= 1e-5 for h in history), history  # the engine sampled from the trained weights
    assert all(math.isfinite(h["policy_loss"]) and math.isfinite(h["value_loss"]) for h in history)


def _run_doc_loop() -> list[dict]:
    return doc_function("ppo_loop")(PROMPTS, iterations=2)


@pytest.mark.slow
def test_custom_loop_from_the_docs_trains(two_ranks):
    ranks = two_ranks.run(_run_doc_loop, timeout_s=240.0)
    for history in ranks:
        assert len(history) == 2
    # both ranks generated and scored the same samples
    for a, b in zip(*ranks):
        assert a["reward"] == b["reward"] and a["kl"] == b["kl"]
    first, second = ranks[0]
    # iteration 0 samples from the Reference's weights (the engine's log-probs match the Reference's up to
    # rounding); the update and the weight sync move the policy away
    assert abs(first["kl"]) < 1e-5
    assert abs(second["kl"]) > 1e-4 and math.isfinite(second["kl"])
    # each loss is reported by the rank holding its model's last stage: Actor on rank 1, Critic on rank 0
    assert ranks[0][0]["policy_loss"] is None and ranks[1][0]["value_loss"] is None
    assert all(math.isfinite(h["policy_loss"]) for h in ranks[1]) and all(math.isfinite(h["value_loss"]) for h in ranks[0])


# The debug config on tiny models, the Actor with tied embeddings (from a checkpoint; the Critic and the Reward
# randomly initialised); 8 prompts, 2 iterations of 2 epochs (two differently shuffled updates each); a quarter of
# the vocabulary stops a response, so lengths vary.
LAYOUT_CONFIG = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_ppo.toml"),
    "--model.actor=debug_qwen",
    "--model.critic_path=",
    "--model.reward_path=",
    "--generation.stop_token_ids=" + ",".join(map(str, range(0, 512, 4))),
    "--generation.max_new_tokens=8",
    "--generation.max_slots=4",
    "--data.max_prompt_len=32",
    "--ppo.batch_size=8",
    "--ppo.minibatch_size=8",
    "--ppo.microbatch_size=2",
    "--ppo.epochs=2",
    "--fusion.schedule_search_budget_s=0.2",
    "--training.steps=2",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--lr_scheduler.warmup_steps=0",
    "--optimizer.actor_lr=1e-3",
    "--optimizer.critic_lr=1e-3",
]


def _layout_loop_and_trainer(out: str, actor_path: str) -> tuple[list[dict], list[dict]]:
    from fusedrl.config import load_config
    from fusedrl.train import run

    def cfg(name: str):
        return load_config([*LAYOUT_CONFIG, f"--model.actor_path={actor_path}", f"--job.output_dir={out}/{name}"])

    loop = doc_function("ppo_loop_on_layouts")(cfg("loop"))
    return loop, run(cfg("trainer"))


@pytest.mark.slow
def test_custom_loop_on_the_layouts_gives_the_trainers_losses(tmp_path, four_ranks):
    import torch

    from fusedrl.models import build_model, save_hf_checkpoint

    # A tied Actor whose embedding has a language model's scale (std 0.02): at torch's N(0, 1) initialisation a tied
    # head's logits peak on the input token and the policy only repeats it (no gradient to compare).
    torch.manual_seed(0)
    actor = build_model("debug_qwen")
    torch.nn.init.normal_(actor.tok_embeddings.weight, std=0.02)
    path = save_hf_checkpoint(actor, tmp_path / "actor", "debug_qwen")
    loop, trainer = four_ranks.run(_layout_loop_and_trainer, str(tmp_path), str(path), timeout_s=480.0)[0]
    assert len(loop) == len(trainer) == 2
    for step, (a, b) in enumerate(zip(loop, trainer), start=1):
        for key in ("reward_mean", "kl", "policy_loss", "value_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (
                f"step {step}: {key} {a[key]} (loop) vs {b[key]} (trainer)"
            )
    # the second iteration sampled from the updated Actor
    assert abs(loop[1]["kl"]) > 1e-6
