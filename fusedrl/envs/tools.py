"""Tool-using environments: the model calls a tool by writing ``<tag>input</tag>`` in its turn and reads the tool's
output as the next user turn; a turn without a call is its final answer, which a subclass scores.

Tools (``tools=`` picks them, in the order the prompt lists them):

``calc``
    ``<calc>4 * 6 - 5</calc>``: :func:`fusedrl.envs.calculator.calculate` of the expression (``error: ...`` on failure).
``python``
    ``<python>print(4 * 6 - 5)</python>``: what the code prints, run by :func:`fusedrl.envs.sandbox.run_python` within
    ``python_limits`` (``error: ...`` and the output on failure).

A task's environment subclasses :class:`ToolEnv` and implements ``finish``; :func:`tool_instructions` describes the
tools for its system prompt. ``fusedrl.tasks.word_problems_tools`` is the word-problem recipe's.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from fusedrl.envs.base import Environment, EnvStep
from fusedrl.envs.calculator import calculate, extract_call
from fusedrl.envs.sandbox import SandboxLimits, run_python

TOOL_SYNTAX = {
    "calc": "<calc>expression</calc> computes arithmetic (numbers, + - * / // % ** and parentheses)",
    "python": "<python>code</python> runs Python code and shows what it prints",
}
"""Each tool's call syntax, as :func:`tool_instructions` tells the model."""
PYTHON_LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2.0)
"""The python tool's default limits: word-problem arithmetic needs well under a second."""
NO_OUTPUT = "(no output: print() what you want to see)"


def check_tools(tools: Sequence[str]) -> tuple[str, ...]:
    """``tools`` as a tuple when it names known tools, each once; else ValueError (one line)."""
    if isinstance(tools, str) or not tools or len(set(tools)) != len(tools) or not set(tools) <= set(TOOL_SYNTAX):
        raise ValueError(f"tools={tools!r}: name each tool once, from {tuple(TOOL_SYNTAX)}; e.g. tools=('calc',)")
    return tuple(tools)


def tool_instructions(tools: Sequence[str]) -> str:
    """How to call ``tools``, for a system message: the syntax of each, one call per turn, the result's arrival."""
    calls = "; ".join(TOOL_SYNTAX[name] for name in check_tools(tools))
    return f"Tools: {calls}. Write one call, then stop: its result comes back as the next message."


class ToolEnv(Environment):
    """An episode of tool calls ended by a final turn.

    ``step(text)``: when ``text`` holds a complete call of an enabled tool (the one that closes last, if several),
    the observation is the tool's output (never empty), reward 0, not done, ``info["tool"]`` its name and, when it
    failed, ``info["tool_error"]`` (``"error"`` for the calculator, the sandbox's status for python). Any other turn
    (a disabled tool's tag included) is final: ``finish(text)``'s EnvStep, which must end the episode.
    """

    def __init__(self, tools: Sequence[str] = ("calc",), *, python_limits: SandboxLimits = PYTHON_LIMITS) -> None:
        self.tools = check_tools(tools)
        self.python_limits = python_limits

    @abc.abstractmethod
    def finish(self, text: str) -> EnvStep:
        """Scores the final turn ``text`` (no tool call in it); returns an EnvStep with ``done=True``."""

    def find_call(self, text: str) -> tuple[str, str] | None:
        """(tool, its input) of the enabled tool call in ``text`` that closes last; None when there is none."""
        found: tuple[int, str, str] | None = None
        for name in self.tools:
            source = extract_call(text, name)
            end = text.rfind(f"</{name}>")
            if source is not None and (found is None or end > found[0]):
                found = (end, name, source)
        return None if found is None else found[1:]

    def step(self, text: str) -> EnvStep:
        call = self.find_call(text)
        if call is None:
            return self.finish(text)
        name, source = call
        if name == "calc":
            output = calculate(source)
            failure = "error" if output.startswith("error:") else None
        else:
            result = run_python(source, self.python_limits)
            output = result.observation or NO_OUTPUT
            failure = None if result.status == "ok" else result.status
        info: dict[str, str | float] = {"tool": name}
        if failure is not None:
            info["tool_error"] = failure
        return EnvStep(observation=output, info=info)
