"""The word-problems task: generated problems read back exactly, the final-answer checker on hand-written responses,
the format reward, the prompt file and the command line."""

import json
import random

import pytest

from fusedrl.tasks import word_problems as wp

CHATML = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
STICKERS = (
    "Mia has 4 bags with 6 stickers in each bag. She gives away 5 stickers. How many stickers does Mia have now?\n"
    + wp.INSTRUCTION
)  # 4 x 6 - 5 = 19
SHARED = (
    "There are 7 cards on Ken's desk. He buys 2 packs with 4 cards in each pack. Then he doubles the number of his "
    "cards. He shares all his cards equally among 5 friends. How many cards does each friend get?\n" + wp.INSTRUCTION
)  # (7 + 2 x 4) x 2 / 5 = 6


def test_hand_written_problems_read_back():
    assert wp.answer_of(CHATML.format(STICKERS)) == 19
    assert wp.answer_of(CHATML.format(SHARED)) == 6
    assert wp.answer_of(STICKERS) == 19  # without a chat template
    assert wp.answer_of(f"<s>[INST] {STICKERS} [/INST]") == 19  # a template's text on the story's line


@pytest.mark.parametrize("difficulty", wp.DIFFICULTIES)
def test_generated_problems_read_back_with_their_answers(difficulty):
    rng = random.Random(difficulty)
    for _ in range(300):
        question, answer = wp.sample_problem(rng, difficulty)
        assert wp.answer_of(CHATML.format(question)) == answer >= 1
        story = question.splitlines()[0]
        sentences = story.count(".") + story.count("?")
        # a plain start, one sentence per operation and the question; a product start is itself an operation
        assert sentences == difficulty + (1 if " in each " in story.split(".")[0] else 2)


def test_problems_vary():
    rng = random.Random(0)
    questions = [wp.sample_problem(rng, 2)[0] for _ in range(200)]
    assert len(set(questions)) > 190
    assert all(any(name in q for q in questions) for name, *_ in wp.NAMES)
    assert all(any(t in q for q in questions) for t in wp.THINGS)


@pytest.mark.parametrize(
    "response,finished,expected",
    [
        ("4 x 6 = 24 stickers. 24 - 5 = 19.\nAnswer: 19", True, 1.0),
        ("24 - 5 = 19\n**Answer:** 19", True, 1.0),
        ("**Answer**: 19 stickers", True, 1.0),
        ("answer = 19", True, 1.0),
        ("She has 24 and gives away 5, so she has 19", True, 1.0),  # no stated answer: the last integer
        ("Answer: 19. Check: 19 + 5 = 24", True, 1.0),  # a stated answer wins over later numbers
        ("Answer: 24", True, 0.0),
        ("Answer: 19", False, 0.0),  # hit the token limit
        ("nineteen", True, 0.0),
        ("Answer: 18\nAnswer: 19", True, 1.0),  # the last stated answer
    ],
)
def test_score_reads_the_final_answer_of_a_finished_response(response, finished, expected):
    assert wp.score(CHATML.format(STICKERS), response, finished) == expected


def test_final_answer_reads_thousands_and_says_whether_it_was_stated():
    assert wp.final_answer("Answer: 1,200") == (1200, True)
    assert wp.final_answer("so 1,200 in all") == (1200, False)
    assert wp.final_answer("no number") == (None, False)


def test_rewards_and_format_bonus():
    prompts = [CHATML.format(STICKERS)] * 4
    responses = ["Answer: 19", "so 19", "Answer: 3", "Answer: 19"]
    finished = [True, True, True, False]
    ids = dict(prompt_ids=[[1]] * 4, response_ids=[[2]] * 4, finished=finished)
    assert wp.reward_fn(prompts, responses, **ids) == [1.0, 1.0, 0.0, 0.0]
    assert wp.reward_fn_with_format(prompts, responses, **ids) == [1.0 + wp.FORMAT_BONUS, 1.0, wp.FORMAT_BONUS, 0.0]


@pytest.mark.parametrize(
    "prompt",
    [
        CHATML.format("What is 7 + 5? Answer with the number only."),  # another task
        CHATML.format("Mia has 4 stickers. She paints 2 stickers. How many stickers does Mia have now?\n" + wp.INSTRUCTION),
        CHATML.format("Mia has 4 stickers. How many stickers does Mia have now?"),  # no instruction
    ],
)
def test_answer_of_refuses_prompts_it_cannot_read_whole(prompt):
    with pytest.raises(ValueError, match="not a word-problems prompt"):
        wp.reward_fn([prompt], ["Answer: 4"], prompt_ids=[[1]], response_ids=[[2]], finished=[True])


def test_prompt_file_is_seeded_and_holds_the_answers(tmp_path):
    path = wp.write_prompts(tmp_path / "p.jsonl", 60, seed=3, difficulties=(3, 4))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 60 and all(r["messages"][0]["role"] == "user" for r in records)
    assert all(wp.answer_of(r["messages"][0]["content"]) == r["answer"] for r in records)
    assert path.read_text() == wp.write_prompts(tmp_path / "q.jsonl", 60, seed=3, difficulties=(3, 4)).read_text()
    assert path.read_text() != wp.write_prompts(tmp_path / "r.jsonl", 60, seed=4, difficulties=(3, 4)).read_text()


def test_bad_difficulty_is_one_line_error(capsys):
    with pytest.raises(ValueError, match="difficulty must be one of"):
        wp.sample_problem(random.Random(0), 5)
    with pytest.raises(SystemExit):
        wp.main(["write", "--out", "unused.jsonl", "--difficulty", "0,2"])
    assert "give difficulties from (1, 2, 3, 4)" in capsys.readouterr().err
