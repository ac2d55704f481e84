"""What a :class:`~fusedrl.generation.GenerationEngine` reports: the compile and prefill work it did, its load for a
migration controller, and where each unfinished request stands."""

from __future__ import annotations

from dataclasses import dataclass

from fusedrl.generation.request import RequestId


@dataclass
class CompileStats:
    """What torch.compile cost an engine so far: graphs compiled and the wall time of the calls that compiled one
    (compilation plus that call's own run)."""

    graphs: int = 0
    seconds: float = 0.0


@dataclass
class PrefillStats:
    """The prefills an engine ran so far that compiled no graph: the tokens computed (a prompt shared by several
    requests once) and their wall time, sampling of the first tokens included."""

    tokens: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    """What a migration controller needs to know about an engine."""

    active: int
    waiting: int
    free_slots: int
    remaining_tokens: int  # upper bound: sum of each unfinished request's unused token budget
    cached_tokens: int


@dataclass(frozen=True)
class RequestProgress:
    """Where one unfinished request stands (for remaining-work estimates)."""

    id: RequestId
    prompt_len: int
    generated: int
    budget: int  # the current turn's most tokens: target_len if forced, else max_new_tokens; within Request.max_tokens
    forced: bool  # True when target_len fixes the length exactly
    active: bool  # holds a slot (False: waiting)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generated
