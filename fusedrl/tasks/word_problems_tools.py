"""Word problems solved with tools: :mod:`.word_problems`'s problems as multi-turn episodes.

The model may call the calculator (and, with ``tools=("calc", "python")``, Python) any number of turns, reading each
result as the next user turn; its first turn without a call is its final answer, scored by the task's checker
(:func:`.word_problems.final_answer` against the row's ``answer``, plus :data:`.word_problems.FORMAT_BONUS` when
``format_bonus``, as :func:`.word_problems.score_with_format` does). The final turn counts as finished (ended by a stop
token): a turn cut at the token limit is the caller's to score.

For a config's environment factory::

    "fusedrl.tasks.word_problems_tools:word_problems_calc"     # the calculator
    "fusedrl.tasks.word_problems_tools:word_problems_python"   # the calculator and Python

Prompts: :func:`tool_prompt_messages` (one worked example, then the problem, each with the tool instruction); the task
:data:`TASK` (``job.task``) generates them for ``data.format = "synthetic"`` (with ``data.prompt_key = "messages"``,
the rows the environment reads) and for ``[eval]``, where each episode is graded by its environment's reward.

This lives with the tasks, not in :mod:`fusedrl.envs`: environments come before tasks in the package layers
(tests/test_import_graph.py), and this uses the task's checker.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from fusedrl.envs import EnvStep
from fusedrl.envs.sandbox import SandboxLimits
from fusedrl.envs.tools import PYTHON_LIMITS, ToolEnv, check_tools
from fusedrl.tasks import HeldOut, Task
from fusedrl.tasks.word_problems import FORMAT_BONUS, INSTRUCTION, answer_of, final_answer, sample_problems

EXAMPLE_PROBLEM = (
    f"Tom has 4 boxes with 6 cards in each box. He gives away 5 cards. How many cards does Tom have now?\n{INSTRUCTION}"
)
CALL_FORMS = {"calc": "<calc>expression</calc>", "python": "<python>code</python>"}
TOOL_SUFFIX = "to compute, then give the final answer as 'Answer: <number>'."


def tool_instruction(tools: Sequence[str]) -> str:
    """What follows a problem's question in a tool prompt (instead of :data:`.word_problems.INSTRUCTION`)."""
    return f"Use {' or '.join(CALL_FORMS[t] for t in check_tools(tools))} {TOOL_SUFFIX}"


EXAMPLE_CALL = {"calc": "<calc>4 * 6 - 5</calc>", "python": "<python>print(4 * 6 - 5)</python>"}
EXAMPLE_RESULT = {"calc": "19", "python": "19\n"}  # exactly what each tool returns for its call
EXAMPLE_ANSWER = 19


class WordProblemToolEnv(ToolEnv):
    """One word problem with tools. The row is :func:`.word_problems.write_prompts`'s: ``{"messages": [...],
    "answer": int}``; without ``answer`` the answer is read from its last user message, as the checker does."""

    def __init__(
        self,
        row: Mapping[str, Any],
        *,
        tools: Sequence[str] = ("calc",),
        python_limits: SandboxLimits = PYTHON_LIMITS,
        format_bonus: bool = False,
    ) -> None:
        super().__init__(tools, python_limits=python_limits)
        self.answer = _answer(row)
        self.format_bonus = format_bonus

    def finish(self, text: str) -> EnvStep:
        given, stated = final_answer(text)
        reward = float(given == self.answer) + (FORMAT_BONUS * stated if self.format_bonus else 0.0)
        return EnvStep(reward=reward, done=True)


word_problems_calc = functools.partial(WordProblemToolEnv, tools=("calc",))
"""The environment factory with the calculator."""
word_problems_python = functools.partial(WordProblemToolEnv, tools=("calc", "python"))
"""The environment factory with the calculator and Python."""
word_problems_calc_with_format = functools.partial(WordProblemToolEnv, tools=("calc",), format_bonus=True)
"""The calculator, and :data:`.word_problems.FORMAT_BONUS` for a final answer stated as ``Answer: <number>`` (a signal
for groups whose samples are all wrong, as the reasoning recipe's ``reward_fn_with_format``)."""


def tool_prompt_messages(problem_text: str, tools: Sequence[str] = ("calc",)) -> list[dict[str, str]]:
    """The chat turns of one problem (a word problem's question, its instruction line replaced): one worked example
    (the example problem with the tool instruction, a turn that is the first tool's call, the tool's result, the final
    ``Answer: 19`` turn), then the problem with the tool instruction. No system message: SmolLM2-135M-Instruct opened
    17 of 32 sampled answers with a tool call so (14 well-formed), against 0 of 32 with the tools described in a
    system message before the same example (temperature 1, docs/agents.md)."""
    tools = check_tools(tools)
    instruction = tool_instruction(tools)
    return [
        {"role": "user", "content": f"{_story(EXAMPLE_PROBLEM)} {instruction}"},
        {"role": "assistant", "content": EXAMPLE_CALL[tools[0]]},
        {"role": "user", "content": EXAMPLE_RESULT[tools[0]]},
        {"role": "assistant", "content": f"Answer: {EXAMPLE_ANSWER}"},
        {"role": "user", "content": f"{_story(problem_text)} {instruction}"},
    ]


def _story(problem_text: str) -> str:
    """A word problem's question without its instruction line."""
    return problem_text.split(INSTRUCTION)[0].strip()


def _answer(row: Mapping[str, Any]) -> int:
    answer = row.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer
    if answer is not None:
        raise ValueError(f"word-problem row has answer={answer!r}; give the exact answer as an int")
    messages = row.get("messages")
    users = (
        [m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if isinstance(messages, list)
        else []
    )
    if not users or not isinstance(users[-1], str):
        raise ValueError("word-problem row has neither 'answer' nor a user message; write rows with word_problems.write_prompts")
    return problem_answer(users[-1])


def problem_answer(text: str) -> int:
    """The answer to the last word problem in ``text`` (a question with the task's or a tool instruction, or a whole
    rendered tool prompt)."""
    if TOOL_SUFFIX in text:
        story = text.rsplit(TOOL_SUFFIX, 1)[0].rsplit(" Use ", 1)[0].rsplit("\n", 1)[-1].strip()
        return answer_of(f"{story}\n{INSTRUCTION}")
    return answer_of(text)


def tool_prompts(count: int, seed: int, tools: Sequence[str] = ("calc",)) -> list[list[dict[str, str]]]:
    """``count`` problems of difficulties 1 and 2 from ``seed`` (the reasoning recipe's), each as
    :func:`tool_prompt_messages`."""
    return [tool_prompt_messages(q, tools) for _, q, _ in sample_problems(count, seed, (1, 2))]


def grade(prompt: str, response: str, finished: bool) -> float:
    """1.0 for a finished response whose final answer is the answer to the tool prompt's own problem (not the worked
    example's), as :func:`.word_problems.score` grades."""
    given, _ = final_answer(response)
    return float(finished and given == problem_answer(prompt))


TASK = Task(
    name="word_problems_tools",
    prompts=tool_prompts,
    held_out=HeldOut(tool_prompts, grade, chat=True),
)
"""Word problems with the calculator (``job.task = "fusedrl.tasks.word_problems_tools:TASK"`` with ``env.env =
"fusedrl.tasks.word_problems_tools:word_problems_calc"``; train_configs/smollm2_135m_tool_grpo.toml)."""
