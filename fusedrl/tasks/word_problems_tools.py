"""Word problems solved with tools: :mod:`.word_problems`'s problems as multi-turn episodes.

The model may call the calculator (and, with ``tools=("calc", "python")``, Python) any number of turns, reading each
result as the next user turn; its first turn without a call is its final answer, scored by the task's checker
(:func:`.word_problems.final_answer` against the row's ``answer``, plus :data:`.word_problems.FORMAT_BONUS` when
``format_bonus``, as :func:`.word_problems.score_with_format` does). The final turn counts as finished (ended by a stop
token): a turn cut at the token limit is the caller's to score.

For a config's environment factory::

    "fusedrl.tasks.word_problems_tools:word_problems_calc"     # the calculator
    "fusedrl.tasks.word_problems_tools:word_problems_python"   # the calculator and Python

Prompts: :func:`tool_prompt_messages` (a system message on the tools, one worked example, the problem).

This lives with the tasks, not in :mod:`fusedrl.envs`: environments come before tasks in the package layers
(tests/test_import_graph.py), and this uses the task's checker.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from fusedrl.envs import EnvStep
from fusedrl.envs.sandbox import SandboxLimits
from fusedrl.envs.tools import PYTHON_LIMITS, ToolEnv, check_tools, tool_instructions
from fusedrl.tasks.word_problems import FORMAT_BONUS, INSTRUCTION, answer_of, final_answer

EXAMPLE_PROBLEM = (
    f"Tom has 4 boxes with 6 cards in each box. He gives away 5 cards. How many cards does Tom have now?\n{INSTRUCTION}"
)
EXAMPLE_REASONING = "4 boxes of 6 cards, minus the 5 he gives away."
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


def tool_prompt_messages(problem_text: str, tools: Sequence[str] = ("calc",)) -> list[dict[str, str]]:
    """The chat turns of one problem: a system message describing ``tools``, one worked example (the problem, a turn
    calling the first tool, the tool's result, the final ``Answer: 19`` turn), then ``problem_text`` as the last user
    message."""
    tools = check_tools(tools)
    first = tools[0]
    system = f"Solve the math word problem. {tool_instructions(tools)} When you know the answer, write 'Answer: <number>'."
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": EXAMPLE_PROBLEM},
        {"role": "assistant", "content": f"{EXAMPLE_REASONING} {EXAMPLE_CALL[first]}"},
        {"role": "user", "content": EXAMPLE_RESULT[first]},
        {"role": "assistant", "content": f"Answer: {EXAMPLE_ANSWER}"},
        {"role": "user", "content": problem_text},
    ]


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
    return answer_of(users[-1])
