"""Runs the PPO loop of docs/custom_loop.md exactly as written there, on two processes (pp=2)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from fusedrl.testing import run_multirank

DOC = Path(__file__).resolve().parents[1] / "docs" / "custom_loop.md"
PROMPTS = ["repeat ab 3 times:", "repeat c 5 times:", "repeat xy 2 times:", "repeat q 7 times:"]


def doc_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, f"{DOC} must hold exactly one python block (the loop the test runs)"
    return blocks[0]


def _run_doc_loop() -> list[dict]:
    namespace: dict = {"__name__": "custom_loop_doc"}
    exec(compile(doc_code(), str(DOC), "exec"), namespace)
    return namespace["ppo_loop"](PROMPTS, iterations=2)


def test_custom_loop_from_the_docs_trains():
    ranks = run_multirank(_run_doc_loop, 2, timeout_s=240.0)
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
