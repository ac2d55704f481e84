"""A verifiable-reward task for small instruct models: two kinds of one-line arithmetic questions with integer answers.

- ``Which number is larger, 37 or 52? Answer with the number only.`` (two different numbers from 10 to 99)
- ``What is 7 + 5? Answer with the number only.`` (two numbers from 1 to 9)

:func:`reward_fn` is the exact checker: 1.0 when the response ended with a stop token and the last integer in it
is the answer, else 0.0 (GSM8K's convention of reading the final number). The question is read back from the
prompt text, so the checker needs nothing but the sample; any chat template around the question is fine.
SmolLM2-135M-Instruct answers about a quarter of these right at temperature 1, which leaves PPO room to climb
(``train_configs/smollm2_135m_ppo.toml``). Write a prompt file of chat messages, and measure a checkpoint's greedy
accuracy on fresh questions (e.g. the trained Actor, ``<output_dir>/actor_hf``), with::

    python -m fusedrl.tasks.arithmetic write --out data/arithmetic.jsonl [--count 4096] [--seed 0]
    python -m fusedrl.tasks.arithmetic eval --model FOLDER [--count 256] [--seed 1]
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from fusedrl.tasks import HeldOut, Task, chat

LARGER = "Which number is larger, {a} or {b}? Answer with the number only."
SUM = "What is {a} + {b}? Answer with the number only."
_LARGER = re.compile(r"Which number is larger, (\d+) or (\d+)\?")
_SUM = re.compile(r"What is (\d+) \+ (\d+)\?")
_INTEGER = re.compile(r"-?\d+")


def sample_question(rng: random.Random) -> tuple[str, int]:
    """A random ``(question, answer)``, either kind with probability 1/2."""
    if rng.random() < 0.5:
        a, b = rng.sample(range(10, 100), 2)
        return LARGER.format(a=a, b=b), max(a, b)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return SUM.format(a=a, b=b), a + b


def answer_of(prompt: str) -> int:
    """The answer to the question inside ``prompt``; ValueError when it holds none of this task's questions."""
    if m := _LARGER.search(prompt):
        return max(int(m.group(1)), int(m.group(2)))
    if m := _SUM.search(prompt):
        return int(m.group(1)) + int(m.group(2))
    raise ValueError(f"not an arithmetic-task prompt (expected {LARGER!r} or {SUM!r}): {prompt[-80:]!r}")


def score(prompt: str, response: str, finished: bool) -> float:
    """1.0 for a finished response whose last integer is the answer, else 0.0."""
    answer = answer_of(prompt)  # first: a prompt of another task raises whatever the response
    numbers = _INTEGER.findall(response)
    return float(finished and bool(numbers) and int(numbers[-1]) == answer)


reward_fn = chat.text_reward(score)
""":func:`score` of each sample, as the trainer's rule-based reward (``--model.reward_fn=fusedrl.tasks.arithmetic:reward_fn``)."""


def write_prompts(path: str | Path, count: int, seed: int = 0) -> Path:
    """``count`` questions as a jsonl file of chat turns with their answers (:func:`.chat.write_chat_prompts`)."""
    rng = random.Random(seed)
    return chat.write_chat_prompts(path, (sample_question(rng) for _ in range(count)))


def held_out_questions(count: int, seed: int) -> list[str]:
    """``count`` questions from ``seed``, for ``[eval]``."""
    rng = random.Random(seed)
    return [sample_question(rng)[0] for _ in range(count)]


def evaluate(folder: str | Path, count: int = 256, seed: int = 1, max_new_tokens: int = 32) -> dict[str, float]:
    """Greedy accuracy of the HF checkpoint ``folder`` (with its tokenizer) on ``count`` fresh questions (``seed``
    other than the training prompts' 0), overall and per kind, and the mean response length in tokens."""
    questions = held_out_questions(count, seed)
    scores: dict[str, list[float]] = {"larger": [], "sum": []}
    lengths: list[int] = []
    for question, r in zip(questions, chat.greedy_responses(folder, questions, max_new_tokens)):
        scores["larger" if _LARGER.search(question) else "sum"].append(score(r.prompt, r.text, r.finished))
        lengths.append(r.tokens)
    every = scores["larger"] + scores["sum"]
    out = {"accuracy": sum(every) / len(every), "response_len_mean": sum(lengths) / len(lengths)}
    out.update({f"accuracy_{kind}": sum(v) / len(v) for kind, v in scores.items() if v})
    return out


TASK = Task(name="arithmetic", reward_fn=reward_fn, held_out=HeldOut(held_out_questions, score, chat=True))
"""The task as the trainer takes it (``job.task = "fusedrl.tasks.arithmetic:TASK"`` with ``model.reward_fn = "task"``);
its prompts come from the file :func:`write_prompts` writes, rendered by the model's chat template; ``[eval]`` grades unseen
ones with :func:`score`."""


def main(argv: list[str] | None = None) -> None:
    parser, _, _ = chat.task_command_line(
        "python -m fusedrl.tasks.arithmetic",
        __doc__.split("\n\n")[0],
        items="questions",
        out=Path("data/arithmetic.jsonl"),
        eval_count=256,
    )
    args = chat.parse_task_args(parser, argv)
    if args.command == "write":
        print(f"wrote {write_prompts(args.out, args.count, args.seed)} ({args.count} prompts)")
        return
    chat.print_figures(args.model, evaluate(args.model, args.count, args.seed))


if __name__ == "__main__":
    main()
