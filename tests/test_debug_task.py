import json
import random

import pytest
import torch

from fusedrl.components.tokenizer import load_tokenizer
from fusedrl.tasks.debug import (
    build,
    corrupt,
    ideal_response,
    parse_prompt,
    sample_prompts,
    sample_task,
    true_score,
)


def test_true_score_rules():
    p = "repeat ab 3 times:"
    assert parse_prompt("<|user|>" + p + "<|assistant|>") == ("ab", 3)
    assert ideal_response(p) == "ababab"
    assert true_score(p, "ababab") == 1.0
    assert true_score(p, "ababab", finished=False) == -1.0
    assert true_score(p, "abab") == pytest.approx(4 / 6 - 2 / 6)
    assert true_score(p, "abXbab") == pytest.approx(5 / 6)
    assert true_score(p, "abababab") == pytest.approx(1 - 2 / 6)
    assert true_score(p, "z" * 40) == -1.0
    assert true_score(p, "") == -1.0
    with pytest.raises(ValueError, match="not a debug-task prompt"):
        parse_prompt("hello")


def test_response_lengths_are_heavy_tailed():
    rng = random.Random(0)
    lengths = sorted(len(sample_task(rng)[1]) + 1 for _ in range(100_000))  # + EOS
    median, p999 = lengths[len(lengths) // 2], lengths[int(0.999 * len(lengths))]
    assert p999 >= 10 * median, (median, p999)
    assert sample_prompts(5, seed=1) == sample_prompts(5, seed=1) != sample_prompts(5, seed=2)


def test_corruptions_score_below_one():
    rng = random.Random(0)
    for _ in range(200):
        prompt, target, _ = sample_task(rng)
        unit, _ = parse_prompt(prompt)
        wrong = corrupt(target, unit, rng)
        assert (true_score(prompt, wrong) < 1.0) == (wrong != target)


def test_build_writes_loadable_assets(tmp_path):
    from fusedrl.models import build_model
    from fusedrl.models.hf import load_hf_checkpoint

    info = build(tmp_path, sft_steps=2, reward_steps=2, batch=4, eval_n=4, eval_max_new_tokens=4)
    assert json.loads((tmp_path / "info.json").read_text()).keys() == info.keys()
    assert -1.0 <= info["actor_true_score_mean"] <= 1.0
    actor = build_model("debug", "policy")
    load_hf_checkpoint(actor, tmp_path / "actor", "debug", "policy")
    reward = build_model("debug", "value")
    load_hf_checkpoint(reward, tmp_path / "reward", "debug", "value")
    tok = load_tokenizer(tmp_path / "tokenizer")
    assert tok.encode("repeat a 2 times:", add_bos=False) == list(b"repeat a 2 times:")
    assert reward(torch.tensor([tok.encode("repeat a 2 times:aa")])).shape[-1] == 1
