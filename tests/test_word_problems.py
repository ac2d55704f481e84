"""The word-problems task: hand-written problems of every sentence kind read back to answers worked out by hand,
generated problems read back to the answers of a reader written here, the final-answer checker on hand-written
responses, the format reward, the prompt file and the command line."""

import json
import random
import re

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

# Stories written out here, not by the generator, with their answers worked by hand: every sentence kind the checker
# reads (test_hand_written_stories_hold_every_sentence_kind), each where reading it with the wrong operation (adding
# for taking away, doubling in the wrong place, a product for a sum) changes the answer.
HAND_WRITTEN = [
    ("Mia has 4 bags with 6 stickers in each bag. She gives away 5 stickers. How many stickers does Mia have now?", 19),
    # 4 x 6 = 24; 24 - 5 = 19
    (
        "There are 7 cards on Ken's desk. He buys 2 packs with 4 cards in each pack. Then he doubles the number of his "
        "cards. He shares all his cards equally among 5 friends. How many cards does each friend get?",
        6,
    ),
    # 7; 7 + 2 x 4 = 15; 15 x 2 = 30; 30 / 5 = 6
    ("Tom has 12 marbles. He loses 5 of his marbles. A friend gives him 3 marbles. How many marbles does Tom have now?", 10),
    # 12; 12 - 5 = 7; 7 + 3 = 10
    (
        "Lena has 9 pencils. She buys 6 more pencils. She uses 4 pencils. Then she doubles the number of her pencils. "
        "How many pencils does Lena have now?",
        22,
    ),
    # 9; 9 + 6 = 15; 15 - 4 = 11; 11 x 2 = 22
    (
        "Omar has 3 jars with 5 shells in each jar. He finds 7 more shells. He uses 2 shells. He shares all his shells "
        "equally among 4 friends. How many shells does each friend get?",
        5,
    ),
    # 3 x 5 = 15; 15 + 7 = 22; 22 - 2 = 20; 20 / 4 = 5
    (
        "There are 20 cookies on Sara's desk. She gives away 8 cookies. She loses 3 of her cookies. She buys 2 packs "
        "with 6 cookies in each pack. How many cookies does Sara have now?",
        21,
    ),
    # 20; 20 - 8 = 12; 12 - 3 = 9; 9 + 2 x 6 = 21
    ("Ravi has 10 stamps. A friend gives him 4 stamps. He gives away 6 stamps. How many stamps does Ravi have now?", 8),
    # 10; 10 + 4 = 14; 14 - 6 = 8 (a friend's gift adds, giving away takes away)
    (
        "Julia has 2 baskets with 8 apples in each basket. Then she doubles the number of her apples. She buys 3 more "
        "apples. She loses 9 of her apples. How many apples does Julia have now?",
        26,
    ),
    # 2 x 8 = 16; 16 x 2 = 32; 32 + 3 = 35; 35 - 9 = 26
]


def _sentences(story: str) -> list[str]:
    return [s.strip() for s in re.findall(r"[^.?]+[.?]", story)]


def test_hand_written_problems_read_back():
    assert wp.answer_of(CHATML.format(STICKERS)) == 19
    assert wp.answer_of(CHATML.format(SHARED)) == 6
    assert wp.answer_of(STICKERS) == 19  # without a chat template
    assert wp.answer_of(f"<s>[INST] {STICKERS} [/INST]") == 19  # a template's text on the story's line


@pytest.mark.parametrize("story,answer", HAND_WRITTEN, ids=[f"story{i}" for i in range(len(HAND_WRITTEN))])
def test_hand_written_stories_of_every_sentence_kind_read_back_to_their_worked_answers(story, answer):
    prompt = CHATML.format(f"{story}\n{wp.INSTRUCTION}")
    assert wp.answer_of(prompt) == answer
    assert wp.answer_of(f"{story}\n{wp.INSTRUCTION}") == answer  # without a chat template
    assert wp.score(prompt, f"Answer: {answer}", True) == 1.0
    assert wp.score(prompt, f"Answer: {answer + 1}", True) == 0.0


def test_hand_written_stories_hold_every_sentence_kind():
    """Each sentence form the checker reads (a new one must get a hand-written story above) is in some story."""
    sentences = [s for story, _ in HAND_WRITTEN for s in _sentences(story)]
    for template in (*wp.TEMPLATES, *wp.QUESTIONS):
        assert any(template.pattern.match(s) for s in sentences), f"no hand-written sentence of the form {template.text!r}"
    for kind in ("gives away", "loses", "buys", "A friend gives", "uses", "finds", "doubles", "shares", "packs"):
        assert any(kind in s for s in sentences), kind


def _worked(story: str) -> int:
    """The answer of a generated story, read here by its words (not the module's templates or their operations)."""
    count = 0
    for sentence in _sentences(story):
        numbers = [int(x) for x in re.findall(r"\d+", sentence)]
        if sentence.startswith("How many"):
            assert not numbers, sentence
        elif " packs with " in sentence:  # k packs of n more
            k, n = numbers
            count += k * n
        elif " in each " in sentence:  # a start of k containers of n
            k, n = numbers
            count = k * n
        elif " has " in sentence or sentence.startswith("There are "):  # a start of n
            (count,) = numbers
        elif "doubles" in sentence:
            assert not numbers, sentence
            count *= 2
        elif "shares" in sentence:  # among k friends, exactly
            (k,) = numbers
            assert count % k == 0, sentence
            count //= k
        elif "gives away" in sentence or " loses " in sentence or " uses " in sentence:
            (n,) = numbers
            count -= n
        elif " more " in sentence or sentence.startswith("A friend gives"):
            (n,) = numbers
            count += n
        else:
            raise AssertionError(f"a sentence this reader does not know: {sentence!r}")
        assert count >= 1, (story, sentence)  # every intermediate count stays a positive integer
    return count


@pytest.mark.parametrize("difficulty", wp.DIFFICULTIES)
def test_generated_problems_read_back_with_their_answers(difficulty):
    rng = random.Random(difficulty)
    for _ in range(300):
        question, answer = wp.sample_problem(rng, difficulty)
        story = question.splitlines()[0]
        assert question.splitlines()[1:] == [wp.INSTRUCTION]
        assert wp.answer_of(CHATML.format(question)) == answer == _worked(story)
        sentences = story.count(".") + story.count("?")
        # a plain start, one sentence per operation and the question; a product start is itself an operation
        assert sentences == difficulty + (1 if " in each " in story.split(".")[0] else 2)


def test_problems_vary():
    rng = random.Random(0)
    questions = [wp.sample_problem(rng, 2)[0] for _ in range(200)]
    assert len(set(questions)) > 190
    assert all(any(name in q for q in questions) for name, *_ in wp.NAMES)
    assert all(any(t in q for q in questions) for t in wp.THINGS)
    sentences = [s for q in questions for s in _sentences(q.splitlines()[0])]
    for template in (*wp.TEMPLATES, *wp.QUESTIONS):  # the generator writes every sentence form
        assert any(template.pattern.match(s) for s in sentences), template.text


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
