"""Issue 8's stress run: 50 PPO iterations of the debug config on 4 ranks, random migration settings per
iteration, bad rows mixed into the prompt file; nothing lost or duplicated."""

from __future__ import annotations

import json

import pytest

from fusedrl.components.data import load_prompts
from fusedrl.components.tokenizer import load_tokenizer
from fusedrl.testing.stress import BAD_ROWS, stress, write_prompt_file


def test_prompt_file_reports_every_injected_row_at_its_line(tmp_path):
    prompts = [f"{i} + 1 =" for i in range(40)]
    injected = write_prompt_file(tmp_path / "p.jsonl", prompts, max_prompt_len=16, seed=3, bad_fraction=0.5)
    lines = (tmp_path / "p.jsonl").read_bytes().splitlines()
    assert len(lines) == 60 and len(injected) == 20
    good = [json.loads(line)["prompt"] for i, line in enumerate(lines, 1) if i not in injected]
    assert good == prompts  # the good rows keep their order
    report = load_prompts(tmp_path / "p.jsonl", load_tokenizer("byte"), max_prompt_len=16).report
    overlong = {i for i, k in injected.items() if k == "over-long prompt"}
    assert sorted(int(b.where.split()[-1]) for b in report.bad) == sorted(set(injected) - overlong)
    assert report.overlong_dropped == len(overlong) and report.kept == 40
    assert set(injected.values()) <= set(BAD_ROWS)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # past the ranks' 600 s and their start-up's 300: its failure names the ranks that hung
def test_fifty_iterations_with_random_migrations_and_bad_prompts_lose_nothing(tmp_path, four_ranks):
    r = stress(tmp_path, steps=50, nproc=4, seed=0, timeout_s=600, pool=four_ranks)
    assert r["steps"] == 50
    assert r["requested"] == r["scored"] == 50 * 16 and r["lost"] == 0 and r["duplicated"] == 0
    assert r["steps_not_reconciled"] == []
    # the settings really varied, and migrations (with moved requests) happened under them
    assert {m for _, m, _ in r["settings"]} == {"kv", "reprefill"} and "auto" in {t for t, _, _ in r["settings"]}
    assert len({t for t, _, _ in r["settings"]}) >= 5 and len({k for _, _, k in r["settings"]}) >= 3
    assert r["migrations"] >= 10 and r["moved"] > 0
    assert max(r["kept_counts"]) >= 2  # several kept ranks streaming tail samples to the freed ones at once
    assert sum(r["bad_rows_injected"].values()) == 51 and all(r["bad_rows_injected"].values())
