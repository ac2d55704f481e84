"""TextArena's single-player games as environments, unchanged (``pip install fusedrl[textarena]``; tested with
textarena 0.7.4).

``TextArenaEnv(env_id)`` makes the game with ``ta.make(env_id)`` and resets it for one player. Its ``opening()`` is
the game's first observation (rules and board), each ``step(text)`` passes the model's turn as the action and returns
what the game said since, and the step that ends the game returns the game's reward for player 0.

Use a game's ``-raw`` id (e.g. ``"TowerOfHanoi-v0-raw"``, ``"GuessTheNumber-v0-raw"``): its observations are the
game's new messages, rendered here one per line without the echo of the model's own action, which the chat already
holds. A wrapped id's observation is whatever its wrapper renders (the default ``LLMObservationWrapper`` repeats the
whole history each turn). ``tests/test_envs.py`` plays TowerOfHanoi-v0-raw with the network off; some other games load
nltk corpora or call web APIs and need the network.

The factory for a config is :func:`from_row`: the row names its game (``{"env_id": "TowerOfHanoi-v0-raw",
"seed": 3}``, ``messages`` may be empty: the opening is the first user message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusedrl.envs.base import Environment, EnvStep


class TextArenaEnv(Environment):
    """One single-player TextArena game. ``seed`` goes to the game's ``reset`` (TextArena then seeds Python's global
    ``random`` with it, process-wide); None leaves the global generator alone."""

    def __init__(self, env_id: str, *, seed: int | None = None) -> None:
        try:
            import textarena as ta
        except ImportError as e:
            raise ImportError(f"TextArenaEnv needs the textarena package ({e}); pip install fusedrl[textarena]") from None
        self.env_id = env_id
        self._player_action = ta.ObservationType.PLAYER_ACTION
        self._env = ta.make(env_id)
        self._env.reset(num_players=1, seed=seed)
        self._closed = False

    def opening(self) -> str:
        return self._observation()

    def step(self, text: str) -> EnvStep:
        done, _ = self._env.step(text)
        if not done:
            return EnvStep(observation=self._observation())
        rewards, game_info = self._env.close()
        self._closed = True
        reason = (game_info or {}).get(0, {}).get("reason")
        return EnvStep(reward=float((rewards or {}).get(0, 0.0)), done=True, info={"reason": str(reason)} if reason else {})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._env.close()

    def _observation(self) -> str:
        """The current player's observation as text: a wrapper's string as it is, else the new messages."""
        _, observation = self._env.get_observation()
        if isinstance(observation, str):
            return observation
        return "\n".join(message for _, message, kind in observation if kind != self._player_action)


def from_row(row: Mapping[str, Any]) -> TextArenaEnv:
    """The environment factory: the game ``row["env_id"]``, reset with ``row.get("seed")``
    (``"fusedrl.envs.textarena:from_row"``)."""
    env_id = row.get("env_id")
    if not isinstance(env_id, str):
        raise ValueError(f"TextArena row has env_id={env_id!r}; give the game's id as a str, e.g. 'TowerOfHanoi-v0-raw'")
    return TextArenaEnv(env_id, seed=row.get("seed"))
