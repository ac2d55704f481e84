"""A reasoning task: generated word problems of 1 to 4 operations whose worked answers vary in length.

A problem is a short story over one count of things, one sentence per operation, and a question::

    Mia has 4 bags with 6 stickers in each bag. She gives away 5 stickers. How many stickers does Mia have now?
    Think step by step, then give the final answer as 'Answer: <number>'.

The operations: a start (a count, or bags of equal counts: a product), adding or taking away some, packs of equal
counts bought (a product added), doubling, and sharing equally among friends (an exact division, always last).
``difficulty`` is the number of operations besides a plain start (1 to 4); names, things, containers and phrasings
vary. Every intermediate count stays a positive integer.

**The answer format**: the number after the response's last ``Answer:`` (any case, markdown asterisks allowed), or
else its last integer (GSM8K's convention). :func:`score` is the exact checker: 1.0 when the response ended with a
stop token and that number is the answer, else 0.0. :func:`reward_fn` is it as the trainer's rule-based reward;
:func:`reward_fn_with_format` adds :data:`FORMAT_BONUS` when the response states its answer in the format. The story
is read back from the prompt text (every sentence matches one template), so the checker needs nothing but the sample.

    python -m fusedrl.tasks.word_problems write --out data/word_problems.jsonl [--count 4096] [--difficulty 1,2]
    python -m fusedrl.tasks.word_problems eval --model FOLDER [--count 128] [--difficulty 1,2] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusedrl.components import length_stats
from fusedrl.tasks import HeldOut, Task, chat

INSTRUCTION = "Think step by step, then give the final answer as 'Answer: <number>'."
FORMAT_BONUS = 0.1
"""What :func:`reward_fn_with_format` adds for a response that states ``Answer: <number>``, right or wrong."""
DIFFICULTIES = (1, 2, 3, 4)

NAMES = (
    ("Tom", "he", "him", "his"),
    ("Mia", "she", "her", "her"),
    ("Ravi", "he", "him", "his"),
    ("Lena", "she", "her", "her"),
    ("Omar", "he", "him", "his"),
    ("Sara", "she", "her", "her"),
    ("Ken", "he", "him", "his"),
    ("Julia", "she", "her", "her"),
)
THINGS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "shells", "stamps", "balloons")
CONTAINERS = (("bag", "bags"), ("box", "boxes"), ("basket", "baskets"), ("jar", "jars"))


@dataclass(frozen=True)
class _Template:
    """One sentence form: ``text`` (str.format fields: name, he/him/his and capitalised He/His, things, container,
    containers, and the numbers n and k) and what it does to the running count."""

    text: str
    apply: Callable[[int, int, int], int]  # (count, n, k) -> the new count

    @property
    def pattern(self) -> re.Pattern[str]:
        parts = []
        for literal, field, _, _ in string.Formatter().parse(self.text):
            parts.append(re.escape(literal))
            if field in ("n", "k"):
                parts.append(rf"(?P<{field}>\d+)")
            elif field is not None:
                parts.append(r"[A-Za-z']+")
        return re.compile("".join(parts) + r"$")


PLAIN_STARTS = (
    _Template("{name} has {n} {things}.", lambda c, n, k: n),
    _Template("There are {n} {things} on {name}'s desk.", lambda c, n, k: n),
)
PRODUCT_START = _Template("{name} has {k} {containers} with {n} {things} in each {container}.", lambda c, n, k: k * n)
ADD = (
    _Template("{He} buys {n} more {things}.", lambda c, n, k: c + n),
    _Template("{He} finds {n} more {things}.", lambda c, n, k: c + n),
    _Template("A friend gives {him} {n} {things}.", lambda c, n, k: c + n),
)
SUBTRACT = (
    _Template("{He} gives away {n} {things}.", lambda c, n, k: c - n),
    _Template("{He} loses {n} of {his} {things}.", lambda c, n, k: c - n),
    _Template("{He} uses {n} {things}.", lambda c, n, k: c - n),
)
PACKS = _Template("{He} buys {k} packs with {n} {things} in each pack.", lambda c, n, k: c + k * n)
DOUBLE = _Template("Then {he} doubles the number of {his} {things}.", lambda c, n, k: 2 * c)
SHARE = _Template("{He} shares all {his} {things} equally among {k} friends.", lambda c, n, k: c // k)
QUESTIONS = (
    _Template("How many {things} does {name} have now?", lambda c, n, k: c),
    _Template("How many {things} does each friend get?", lambda c, n, k: c),
)
TEMPLATES = (*PLAIN_STARTS, PRODUCT_START, *ADD, *SUBTRACT, PACKS, DOUBLE, SHARE)
_PATTERNS = [(t, t.pattern) for t in TEMPLATES]
_QUESTION_PATTERNS = [q.pattern for q in QUESTIONS]
_SENTENCE = re.compile(r"[^.?]+[.?]")
_ANSWER = re.compile(r"answer\s*\**\s*[:=]\s*\**\s*\$?\s*(-?\d[\d,]*)", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d[\d,]*")


def sample_problem(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """A random ``(question, answer)`` of ``difficulty`` operations (1-4), the instruction included."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty}")
    name, he, him, his = rng.choice(NAMES)
    container, containers = rng.choice(CONTAINERS)
    fields = dict(name=name, he=he, him=him, his=his, He=he.capitalize(), His=his.capitalize())
    fields |= dict(things=rng.choice(THINGS), container=container, containers=containers)
    steps = difficulty
    if rng.random() < 0.3:  # a product start is the first operation
        template, n, k = PRODUCT_START, rng.randint(2, 9), rng.randint(2, 5)
        steps -= 1
    else:
        template, n, k = rng.choice(PLAIN_STARTS), rng.randint(3, 20), 0
    count = template.apply(0, n, k)
    sentences = [template.text.format(n=n, k=k, **fields)]
    question = QUESTIONS[0]
    for step in range(steps):
        last = step == steps - 1
        choices = [ADD, SUBTRACT, (PACKS,), (DOUBLE,)] + ([(SHARE,)] if last else [])
        while True:
            template = rng.choice(rng.choice(choices))
            n, k = rng.randint(1, 9), rng.randint(2, 5)
            if template in SUBTRACT:
                n = rng.randint(1, min(9, count - 1)) if count > 1 else 0
            if template is SHARE:
                divisors = [d for d in range(2, 7) if count % d == 0 and count // d >= 1]
                k = rng.choice(divisors) if divisors else 0
            if n >= 1 and (template is not SHARE or k):
                break
        count = template.apply(count, n, k)
        sentences.append(template.text.format(n=n, k=k, **fields))
        if template is SHARE:
            question = QUESTIONS[1]
    sentences.append(question.text.format(**fields))
    return " ".join(sentences) + "\n" + INSTRUCTION, count


def answer_of(prompt: str) -> int:
    """The answer to the problem inside ``prompt`` (any chat template around it); ValueError when it holds none."""
    start = prompt.find(INSTRUCTION)
    story = prompt[: start if start >= 0 else len(prompt)]
    sentences = [s.strip() for s in _SENTENCE.findall(story.splitlines()[-1] if story.strip() else "")]
    count, matched = 0, 0
    for i, sentence in enumerate(sentences):
        if any(q.match(sentence) for q in _QUESTION_PATTERNS):
            matched += 1
            continue
        for template, pattern in _PATTERNS:
            # the story's first sentence may follow a template's text on its line (e.g. Llama 2's "[INST] ")
            if m := (pattern.search if i == 0 else pattern.match)(sentence):
                groups = m.groupdict()
                count = template.apply(count, int(groups.get("n") or 0), int(groups.get("k") or 0))
                matched += 1
                break
    if start < 0 or not sentences or matched != len(sentences):
        raise ValueError(
            f"not a word-problems prompt (a story of this task's sentences, then {INSTRUCTION!r}): {prompt[-120:]!r}"
        )
    return count


def final_answer(response: str) -> tuple[int | None, bool]:
    """(the response's final answer, whether it is stated as ``Answer: <number>``): see the module's docstring."""
    stated = _ANSWER.findall(response)
    numbers = stated or _INTEGER.findall(response)
    if not numbers:
        return None, False
    return int(numbers[-1].replace(",", "")), bool(stated)


def score(prompt: str, response: str, finished: bool) -> float:
    """1.0 for a finished response whose final answer is right, else 0.0."""
    answer = answer_of(prompt)  # first: a prompt of another task raises whatever the response
    given, _ = final_answer(response)
    return float(finished and given == answer)


def score_with_format(prompt: str, response: str, finished: bool) -> float:
    """:func:`score` plus :data:`FORMAT_BONUS` for a finished response stating ``Answer: <number>``."""
    return score(prompt, response, finished) + FORMAT_BONUS * float(finished and final_answer(response)[1])


reward_fn = chat.text_reward(score)
""":func:`score` of each sample (``--model.reward_fn=task`` with this task, or
``--model.reward_fn=fusedrl.tasks.word_problems:reward_fn``)."""
reward_fn_with_format = chat.text_reward(score_with_format)
""":func:`score_with_format` of each sample (``--model.reward_fn=fusedrl.tasks.word_problems:reward_fn_with_format``)."""


def sample_problems(count: int, seed: int, difficulties: Sequence[int]) -> list[tuple[int, str, int]]:
    """``count`` problems as ``(difficulty, question, answer)``, difficulties drawn uniformly from ``difficulties``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        difficulty = rng.choice(list(difficulties))
        out.append((difficulty, *sample_problem(rng, difficulty)))
    return out


def write_prompts(path: str | Path, count: int, seed: int = 0, difficulties: Sequence[int] = (1, 2)) -> Path:
    """``count`` problems as a jsonl file of chat turns with their answers (:func:`.chat.write_chat_prompts`)."""
    return chat.write_chat_prompts(path, ((q, a) for _, q, a in sample_problems(count, seed, difficulties)))


def evaluate(
    folder: str | Path, count: int = 128, seed: int = 1, difficulties: Sequence[int] = (1, 2), max_new_tokens: int = 384
) -> dict[str, float]:
    """Greedy accuracy of the HF checkpoint ``folder`` on ``count`` unseen problems (``seed`` other than the training
    prompts' 0): overall and per difficulty (``accuracy_d<k>``), the fraction that finished and states ``Answer:
    <number>`` (``formatted``), the fraction that finished, and the response lengths in tokens."""
    problems = sample_problems(count, seed, difficulties)
    responses = chat.greedy_responses(folder, [q for _, q, _ in problems], max_new_tokens)
    per: dict[int, list[float]] = {}
    for (difficulty, _, _), r in zip(problems, responses):
        per.setdefault(difficulty, []).append(score(r.prompt, r.text, r.finished))
    every = [s for scores in per.values() for s in scores]
    out = {
        "accuracy": sum(every) / len(every),
        **{f"accuracy_d{d}": sum(v) / len(v) for d, v in sorted(per.items())},
        "formatted": sum(r.finished and final_answer(r.text)[1] for r in responses) / len(responses),
        "finished": sum(r.finished for r in responses) / len(responses),
    }
    return out | length_stats([r.tokens for r in responses])


def held_out_questions(count: int, seed: int) -> list[str]:
    """``count`` questions of difficulties 1 and 2 (the recipe's) from ``seed``, for ``[eval]``."""
    return [q for _, q, _ in sample_problems(count, seed, (1, 2))]


TASK = Task(name="word_problems", reward_fn=reward_fn, held_out=HeldOut(held_out_questions, score, chat=True))
"""The task as the trainer takes it (``job.task = "fusedrl.tasks.word_problems:TASK"`` with ``model.reward_fn =
"task"``); its prompts come from the file :func:`write_prompts` writes, rendered by the model's chat template; ``[eval]``
grades unseen ones with :func:`score`."""


def _difficulties(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(",") if x.strip())
    bad = [d for d in values if d not in DIFFICULTIES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give difficulties from {DIFFICULTIES}, comma-separated (e.g. 1,2)")
    return values


def main(argv: list[str] | None = None) -> None:
    parser, write, check = chat.task_command_line(
        "python -m fusedrl.tasks.word_problems",
        __doc__.split("\n\n")[0],
        items="problems",
        out=Path("data/word_problems.jsonl"),
        eval_count=128,
    )
    for command in (write, check):
        command.add_argument("--difficulty", type=_difficulties, default=(1, 2), help="operations per problem, e.g. 1,2")
    check.add_argument("--max-new-tokens", type=int, default=384)
    args = chat.parse_task_args(parser, argv)
    if args.command == "write":
        path = write_prompts(args.out, args.count, args.seed, args.difficulty)
        print(f"wrote {path} ({args.count} problems of difficulty {','.join(map(str, args.difficulty))})")
        return
    chat.print_figures(args.model, evaluate(args.model, args.count, args.seed, args.difficulty, args.max_new_tokens))


if __name__ == "__main__":
    main()
