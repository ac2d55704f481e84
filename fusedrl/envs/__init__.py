"""Environments and tools for multi-turn rollouts: the model writes a turn, an environment answers with an
observation, the model writes again. Pure Python (no torch).

- :mod:`.base`: the interface: :class:`Environment` (one episode; ``step(text) -> EnvStep``), :class:`EnvStep`,
  :data:`EnvFactory` (prompt row -> episode), :func:`load_env_factory` (``"package.module:attribute"``), and the
  checks (:func:`check_step`, :func:`check_opening`, :class:`EnvError`).
- :mod:`.runner`: :class:`EnvRunner`, episodes on worker threads with a step timeout, a turn limit and metrics.
- :mod:`.tools`: :class:`ToolEnv`, the calculator and Python tool calls (``<calc>``, ``<python>``) of an episode.
- :mod:`.calculator`, :mod:`.sandbox`: the tools themselves.
- :mod:`.textarena`: TextArena's single-player games (optional: ``pip install fusedrl[textarena]``; imported on use).

The word-problem recipe's environment and prompts are :mod:`fusedrl.tasks.word_problems_tools`.
"""

from fusedrl.envs.base import EnvError, EnvFactory, Environment, EnvStep, check_opening, check_step, load_env_factory
from fusedrl.envs.runner import EnvRunner
from fusedrl.envs.tools import ToolEnv, tool_instructions

__all__ = [
    "EnvError",
    "EnvFactory",
    "EnvRunner",
    "EnvStep",
    "Environment",
    "ToolEnv",
    "check_opening",
    "check_step",
    "load_env_factory",
    "tool_instructions",
]
