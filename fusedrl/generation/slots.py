"""A request while it holds one of an engine's slots, and the host's read of a decode step's sampled tokens (at once, or
one step late while the next step runs on a CUDA device)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusedrl.generation.request import FinishReason, Request
from fusedrl.generation.state import RequestState, sampled_count


def reads_lag_a_step(device: torch.device) -> bool:
    """Whether an engine on ``device`` reads a decode step's sampled tokens one step late by default: on a CUDA device
    the host launches step t+1 (its inputs are on the device already) before it waits for step t's tokens, so the device
    never idles while the host copies them and updates its slots. On a CPU every operation runs in the caller's thread:
    a late read would only decode finished rows once more."""
    return device.type == "cuda"


@dataclass(eq=False)
class Slot:
    """An active request: its tokens so far (the last one pending, not yet in the slot's KV cache) and its log-probs."""

    request: Request
    seed: int  # request_seed(seed, id): the key of the request's random stream
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    observations: list[tuple[int, int]] = field(default_factory=list)  # spans of generated an environment appended
    turn_start: int = 0  # where the current turn began in generated (its token budget counts from there)

    @property
    def cache_len(self) -> int:
        return len(self.request.prompt) + len(self.generated) - 1

    @property
    def sampled(self) -> int:
        return sampled_count(self.generated, self.observations)

    def state(self, reason: FinishReason | None = None) -> RequestState:
        """This slot's request as a state without KV (``reason``: its turn ended)."""
        return RequestState(
            self.request,
            list(self.generated),
            list(self.logprobs),
            observations=list(self.observations),
            turn_start=self.turn_start,
            finish_reason=reason,
        )

    def finish_reason(self, token: int, max_len: int) -> FinishReason | None:
        """Why the request (its turn, for a multi-turn request) ends after its last sampled ``token``, if it does, in
        an engine of ``max_len`` positions."""
        p = self.request.sampling
        n = len(self.generated) - self.turn_start
        if p.target_len is not None:
            if n >= p.target_len:
                return "length"
        elif token in p.stop_token_ids:
            return "stop"
        elif n >= p.max_new_tokens:
            return "length"
        room = max_len - len(self.request.prompt)
        if self.request.max_tokens is not None:  # a request's own cap over every turn
            room = min(room, self.request.max_tokens)
        return "max_len" if len(self.generated) >= room else None


def sampling_flags(slots: list[Slot]) -> tuple[bool, bool]:
    """(some slot samples at temperature > 0, some slot sets top-k or top-p): False skips that work."""
    params = [s.request.sampling for s in slots]
    return any(p.temperature > 0 for p in params), any(p.top_k > 0 or p.top_p < 1.0 for p in params)


@dataclass(eq=False)
class Launched:
    """A decode step's sampled tokens and log-probs ([2, rows] float64) on their way to the host, for ``slots`` (rows
    in order); ``done``: the CUDA event after the copy (None: already on the host)."""

    slots: list[Slot]
    values: torch.Tensor
    done: torch.cuda.Event | None

    def read(self) -> tuple[list[int], list[float]]:
        """The tokens and log-probs, row by row (waits for the copy)."""
        if self.done is not None:
            self.done.synchronize()
        tokens, logprobs = self.values.tolist()
        return [int(t) for t in tokens], logprobs


def copy_out(slots: list[Slot], tokens: torch.Tensor, logprobs: torch.Tensor) -> Launched:
    """Start copying the sampled ``tokens`` and ``logprobs`` of ``slots`` to the host (one copy)."""
    values = torch.stack([tokens.double(), logprobs.double()])  # token ids are exact in float64
    if values.device.type != "cuda":
        return Launched(slots, values, None)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)  # an asynchronous copy needs pinned memory
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return Launched(slots, host, done)
