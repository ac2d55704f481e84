"""Schedule IR shared by the planner, the lowering pass and the fused executor.

An :class:`Action` is one unit of pipeline work: ``(model, stage, microbatch, kind)``. A schedule
is an ordered list of actions per pipeline rank. Placement (:class:`Placement`) maps a model's
stage to its rank: Actor stage ``i`` on rank ``i``; Critic stage ``j`` on rank ``N-1-j``. A Critic
with fewer stages than the Actor runs as ``K = pp_actor // pp_critic`` replicas on consecutive
rank blocks in reverse order: replica ``r`` puts stage ``j`` on rank ``(r+1)*pp_critic-1-j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ACTOR = "actor"
CRITIC = "critic"
MODELS: tuple[str, str] = (ACTOR, CRITIC)

Kind = Literal["F", "B", "I", "W"]
"""F: forward; B: full backward; I: input-gradient backward; W: weight-gradient backward (I/W: the two
halves of a split backward, which the executor runs when a schedule holds them)."""
COMPUTE_KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")


@dataclass(frozen=True, order=True)
class Action:
    model: str
    stage: int
    microbatch: int
    kind: Kind | str  # a compute Kind, or a SEND/RECV kind inserted by the lowering pass
    replica: int = 0  # Critic replica when the Critic has fewer stages than the Actor

    def __str__(self) -> str:
        rep = f"r{self.replica}" if self.replica else ""
        return f"{self.model}{rep}:{self.kind}{self.stage}.mb{self.microbatch}"


Schedule = dict[int, list[Action]]
"""Ordered actions per pipeline rank."""


@dataclass(frozen=True)
class Placement:
    """Where each model's stages live on ``pp`` pipeline ranks."""

    pp: int
    critic_stages: int | None = None  # defaults to pp

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ValueError(f"pp must be >= 1, got {self.pp}")
        c = self.num_stages(CRITIC)
        if c < 1 or self.pp % c:
            raise ValueError(f"critic_stages={c} must divide pp={self.pp} (the Critic runs as pp/critic_stages replicas)")

    @property
    def critic_replicas(self) -> int:
        return self.pp // self.num_stages(CRITIC)

    def num_stages(self, model: str) -> int:
        if model == ACTOR:
            return self.pp
        if model == CRITIC:
            return self.critic_stages if self.critic_stages is not None else self.pp
        raise ValueError(f"unknown model {model!r}; valid models: {', '.join(MODELS)}")

    def rank_of(self, model: str, stage: int, replica: int = 0) -> int:
        n = self.num_stages(model)
        if not 0 <= stage < n:
            raise ValueError(f"{model} stage {stage} out of range [0, {n})")
        if model == ACTOR:
            return stage
        if not 0 <= replica < self.critic_replicas:
            raise ValueError(f"critic replica {replica} out of range [0, {self.critic_replicas})")
        return (replica + 1) * n - 1 - stage

    def stage_at(self, model: str, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of ``model`` on pipeline rank ``rank``: the inverse of :meth:`rank_of` (every rank holds
        one stage of each model)."""
        if not 0 <= rank < self.pp:
            raise ValueError(f"pipeline rank {rank} out of range [0, {self.pp})")
        n = self.num_stages(model)
        return (rank, 0) if model == ACTOR else (n - 1 - rank % n, rank // n)
