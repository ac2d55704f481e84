"""The arithmetic task's exact checker and prompt file (the real-model recipe's reward)."""

import json
import random

import pytest

from fusedrl.tasks import arithmetic

CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "question,response,finished,expected",
    [
        ("Which number is larger, 37 or 52? Answer with the number only.", "52", True, 1.0),
        ("Which number is larger, 37 or 52? Answer with the number only.", "Between 37 and 52, 52 is larger.", True, 1.0),
        ("Which number is larger, 37 or 52? Answer with the number only.", "52 is larger than 37", True, 0.0),  # last number
        ("Which number is larger, 37 or 52? Answer with the number only.", "52", False, 0.0),  # hit the token limit
        ("What is 7 + 5? Answer with the number only.", "7 + 5 = 12", True, 1.0),
        ("What is 7 + 5? Answer with the number only.", "twelve", True, 0.0),
        ("What is 7 + 5? Answer with the number only.", "-12", True, 0.0),
    ],
)
def test_score_reads_the_last_integer_of_a_finished_response(question, response, finished, expected):
    assert arithmetic.score(CHATML.format(question), response, finished) == expected


def test_reward_fn_scores_a_batch_and_refuses_other_prompts():
    prompts = [CHATML.format("What is 3 + 4? Answer with the number only."), CHATML.format("repeat ab 3 times:")]
    assert arithmetic.reward_fn(prompts[:1], ["7"], prompt_ids=[[1]], response_ids=[[2]], finished=[True]) == [1.0]
    with pytest.raises(ValueError, match="not an arithmetic-task prompt"):
        arithmetic.reward_fn(prompts, ["7", "ab"], prompt_ids=[[1], [1]], response_ids=[[2], [2]], finished=[True, True])


def test_questions_have_the_answers_the_checker_computes(tmp_path):
    rng = random.Random(3)
    for _ in range(200):
        question, answer = arithmetic.sample_question(rng)
        assert arithmetic.answer_of(question) == answer
    path = arithmetic.write_prompts(tmp_path / "p.jsonl", 50, seed=3)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 50 and {r["messages"][0]["role"] for r in records} == {"user"}
    assert all(arithmetic.answer_of(r["messages"][0]["content"]) == r["answer"] for r in records)
    kinds = {"larger" if "larger" in r["messages"][0]["content"] else "sum" for r in records}
    assert kinds == {"larger", "sum"}
    assert path.read_text() == arithmetic.write_prompts(tmp_path / "q.jsonl", 50, seed=3).read_text()  # seeded
