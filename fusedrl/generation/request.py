"""Requests, their sampling parameters and their results."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Literal

RequestId = int | str
FinishReason = Literal["stop", "length", "max_len", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy decoding. ``top_k = 0`` and ``top_p = 1.0`` disable those filters.
    ``target_len`` forces exactly that many new tokens (stop tokens are ignored); it is meant for
    benchmarks and synthetic workloads, and overrides ``max_new_tokens``.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    target_len: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.target_len is not None and self.target_len < 1:
            raise ValueError(f"target_len must be >= 1 or None, got {self.target_len}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def new_token_budget(self) -> int:
        """The most new tokens this request may produce."""
        return self.target_len if self.target_len is not None else self.max_new_tokens


@dataclass
class Request:
    """A prompt to complete. ``seed=None`` uses the engine's seed; the RNG is seeded from (seed, id).

    ``multi_turn``: a turn that ends (a stop token, or ``sampling.max_new_tokens`` tokens: the budget is per turn) does
    not end the request: the engine reports it (a result with ``awaiting``) and keeps its KV until
    :meth:`~fusedrl.generation.GenerationEngine.continue_request` appends an observation or
    :meth:`~fusedrl.generation.GenerationEngine.end_request` ends it.

    ``max_tokens``: the most tokens after the prompt over every turn, observations included (None: the engine's
    ``max_len`` alone bounds them); a turn that reaches it ends the request (finish reason ``"max_len"``)."""

    id: RequestId
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    multi_turn: bool = False
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        self.prompt = [int(t) for t in self.prompt]
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"request {self.id!r}: max_tokens must be >= 1 or None, got {self.max_tokens}")

    def turn_budget(self, turn_start: int) -> int:
        """The most tokens the turn that begins ``turn_start`` tokens after the prompt may produce."""
        budget = self.sampling.new_token_budget
        return budget if self.max_tokens is None else max(0, min(budget, self.max_tokens - turn_start))


@dataclass
class RequestResult:
    """A finished request (or, with ``awaiting``, a multi-turn request's finished turn): its ``tokens`` after the prompt
    (stop tokens included where turns stopped) and their log-probs. ``observations``: the ``[start, end)`` spans of
    ``tokens`` that environments appended between turns (not sampled: log-prob 0, out of every loss); the rest was
    sampled.

    ``logprobs[i]`` is log pi(tokens[i] | prefix) under the distribution the token was sampled from: the
    log-softmax of ``logits / temperature`` after the top-k / top-p filters (at temperature 0, greedy, of the
    unscaled logits), i.e. what the Actor's training forward computes for the same token at the same
    temperature (the trainer refuses filters, which the training forward does not apply). ``error`` is set (and ``finish_reason == "error"``) when the
    request was rejected; the other requests of the batch are unaffected.
    """

    request: Request
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    error: str | None = None
    observations: list[tuple[int, int]] = field(default_factory=list)
    awaiting: bool = False  # a multi-turn request's turn ended; it waits for continue_request / end_request
    reward: float | None = None  # what the sample earned outside the scorer (its episode's environment reward)

    @property
    def sampled_mask(self) -> list[bool]:
        """Per token of ``tokens``: sampled (True) or appended by an environment (False)."""
        mask = [True] * len(self.tokens)
        for start, end in self.observations:
            mask[start:end] = [False] * (end - start)
        return mask

    @property
    def id(self) -> RequestId:
        return self.request.id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.request.prompt) + len(self.tokens)

    @property
    def ok(self) -> bool:
        return self.error is None


_MASK64 = (1 << 64) - 1


def request_error(request: Request, max_len: int, vocab_size: int) -> str | None:
    """Why an engine of ``max_len`` positions over ``vocab_size`` token ids cannot run ``request``, if it cannot."""
    prompt = request.prompt
    if not prompt:
        return "empty prompt: give at least one token"
    if len(prompt) >= max_len:
        return (
            f"prompt has {len(prompt)} tokens but the engine's max_len is {max_len}: "
            f"shorten it to at most {max_len - 1} tokens or raise max_len"
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size}): fix the tokenizer/prompt"
    target = request.sampling.target_len
    if target is not None and len(prompt) + target > max_len:
        return f"prompt ({len(prompt)}) + target_len ({target}) exceeds max_len {max_len}"
    return None


def request_seed(seed: int, request_id: RequestId) -> int:
    """A 63-bit seed mixed from (seed, request id), stable across processes and Python runs."""
    if isinstance(request_id, str):
        rid = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    else:
        rid = int(request_id) & _MASK64
    # splitmix64 finaliser over the combined value: nearby ids give unrelated streams.
    z = (int(seed) * 0x9E3779B97F4A7C15 + rid + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
