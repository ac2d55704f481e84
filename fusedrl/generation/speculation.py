"""Speculative decoding for :class:`~fusedrl.generation.GenerationEngine` (``speculative = "history"``): a request's
next tokens drafted from what the rollout has (:mod:`.drafts`), verified in one forward over its pending token and
its drafts, each position sampled as decoding would sample it (the request's seeded stream at that token count, its
temperature and filters, the accepted drafts as context). Drafts are accepted while they equal what was sampled and
the first sampled token that differs is kept, so the tokens are those of decoding without speculation."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from fusedrl.generation.drafts import HistoryDrafter
from fusedrl.generation.sampling import sample_tokens
from fusedrl.generation.slot_forward import SlotForward, SlotState


@dataclass
class SpecStats:
    """Speculative decoding of an engine so far: verify steps, tokens drafted, accepted and produced by them (a verify
    step produces its accepted drafts and one token sampled after them per request)."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    produced: int = 0


@dataclass(frozen=True)
class VerifyRow:
    """One decoding request as a verify step sees it: it sits in row ``row`` of the slot state, ``pending`` is its
    last sampled token (not yet in its KV cache, which holds ``cache_len`` positions), and it may produce at most
    ``limit + 1`` tokens (its turn's budget and the cache's room)."""

    request_id: Hashable
    row: int
    pending: int
    cache_len: int
    limit: int


class SpeculationGate:
    """Whether verify steps pay at a number of decoding rows: each way's tokens per second at that row count (the mean
    of its steps, then a moving average; each way's first step at a row count is not counted: it meets new shapes),
    taken alternately until each has :data:`MIN_STEPS`, then the faster, with one step the other way after
    :data:`PROBE_EVERY` (acceptance and context lengths change as a rollout goes on)."""

    MIN_STEPS = 4
    PROBE_EVERY = 64
    SMOOTHING = 0.2  # weight of the latest step in the moving average

    def __init__(self) -> None:
        self._rate: dict[tuple[bool, int], float] = {}  # (verify, rows) -> tokens/s
        self._steps: dict[tuple[bool, int], int] = {}
        self._since_other: dict[int, int] = {}  # rows -> steps taken the faster way since the last other one

    def speculate(self, rows: int) -> bool:
        verified, decoded = self._steps.get((True, rows), 0), self._steps.get((False, rows), 0)
        if min(verified, decoded) < self.MIN_STEPS:
            return verified <= decoded
        return self._faster(rows) != (self._since_other.get(rows, 0) >= self.PROBE_EVERY)

    def observe(self, verify: bool, rows: int, tokens: int, seconds: float) -> None:
        """A step ``verify`` or not over ``rows`` requests produced ``tokens`` in ``seconds``."""
        if seconds <= 0:
            return
        if (True, rows) in self._rate and (False, rows) in self._rate:  # a step the slower way restarts the count
            self._since_other[rows] = self._since_other.get(rows, 0) + 1 if verify == self._faster(rows) else 0
        key = (verify, rows)
        steps = self._steps[key] = self._steps.get(key, 0) + 1
        if steps > 1:
            last = self._rate.get(key, 0.0)
            self._rate[key] = last + max(self.SMOOTHING, 1 / (steps - 1)) * (tokens / seconds - last)

    def _faster(self, rows: int) -> bool:
        return self._rate[(True, rows)] >= self._rate[(False, rows)]


class Speculator:
    """An engine's drafter, the requests it holds, and the verify step.

    ``rows``: speculate only while at most this many requests decode (a verify step computes rows x drafted
    positions). ``measured``: the engine's steps are timed as they run (it reads each step's tokens at once, alone: no
    tensor-parallel peers that must take the same kind of step), and a :class:`SpeculationGate` turns verify steps off
    at a row count where they produce fewer tokens per second than decode steps; otherwise every step at most
    ``rows`` verifies."""

    def __init__(self, *, max_draft: int, rows: int, measured: bool) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.drafter = HistoryDrafter(max_draft=max_draft)
        self.rows = rows
        self.gate = SpeculationGate() if measured else None
        self.stats = SpecStats()
        self._held: set[Hashable] = set()

    def wants(self, rows: int) -> bool:
        """Whether a step over ``rows`` decoding requests should try to verify drafts."""
        return rows <= self.rows and (self.gate is None or self.gate.speculate(rows))

    def observe(self, verify: bool, rows: int, tokens: int, seconds: float) -> None:
        """A timed step (:meth:`SpeculationGate.observe`); at more than ``rows`` rows, nothing to judge."""
        if self.gate is not None and rows <= self.rows:
            self.gate.observe(verify, rows, tokens, seconds)

    def start(self, request_id: Hashable, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """A request takes a slot: fresh, or imported (its draft state rebuilt from its tokens); a request the drafter
        already holds (continued after an observation) is kept as it is."""
        if request_id not in self._held:
            self.drafter.start(request_id, prompt, generated)
            self._held.add(request_id)

    def extend(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """``tokens`` were appended to the request's tokens (sampled, or an observation). A request not held (imported
        while it waited between turns) is left alone: :meth:`start` rebuilds it from its tokens when it takes a slot."""
        if request_id in self._held:
            self.drafter.extend(request_id, tokens)

    def finish(self, request_id: Hashable, keep: bool) -> None:
        """The request leaves its engine (``keep``: it ended there, its tokens join its prompt's history)."""
        if request_id in self._held:
            self._held.discard(request_id)
            self.drafter.finish(request_id, keep=keep)

    def take_figures(self) -> dict[str, int]:
        """``verify_steps`` and ``produced`` tokens since the last call, and the drafter's counters (``drafted`` /
        ``accepted`` in all and per source: ``drafted_siblings``, ...)."""
        stats, self.stats = self.stats, SpecStats()
        figures = {k: v for k, v in self.drafter.stats().items() if k.startswith(("drafted", "accepted"))}
        self.drafter.reset_stats()
        return {"verify_steps": stats.verify_steps, "produced": stats.produced} | figures

    @torch.no_grad()
    def verify(
        self, forward: SlotForward, state: SlotState, rows: Sequence[VerifyRow], any_sampled: bool, any_filtered: bool
    ) -> list[tuple[list[int], list[float]]] | None:
        """One verify step over ``rows`` (every decoding request, in slot order): the KV of each row's pending token and
        drafts is written to its cache, and each row's produced tokens and log-probs (its accepted drafts and the token
        sampled after them) are returned. None, with nothing computed, when no row has a draft."""
        drafts = [self.drafter.propose(r.request_id, limit=max(0, r.limit)) for r in rows]
        if not any(d.tokens for d in drafts):
            return None
        device = state.ints.device
        lengths = [1 + len(d.tokens) for d in drafts]
        tokens = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
        for i, (r, d) in enumerate(zip(rows, drafts)):
            tokens[i, : lengths[i]] = torch.tensor([r.pending, *d.tokens])
        slots = torch.tensor([r.row for r in rows], device=device)
        starts = torch.tensor([r.cache_len for r in rows], device=device)
        hidden = forward.extend(tokens.to(device), slots, starts, torch.tensor(lengths, device=device))
        # every real position of every row, sampled with its row's state at that token count
        which = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)], device=device)
        offset = torch.tensor([j for n in lengths for j in range(n)], device=device)
        ints, floats = state.ints[slots[which]], state.floats[slots[which]]
        sampled, logprobs = sample_tokens(
            forward.logits(hidden[which, offset]),
            floats[:, SlotState.TEMPERATURE],
            ints[:, SlotState.TOP_K],
            floats[:, SlotState.TOP_P],
            ints[:, SlotState.SEED],
            ints[:, SlotState.COUNT] + offset,
            any_sampled=any_sampled,
            any_filtered=any_filtered,
        )
        host = torch.stack([sampled.double(), logprobs.double()]).tolist()  # token ids are exact in float64
        produced, at = [], 0
        for r, d, n in zip(rows, drafts, lengths):
            toks, lps = [int(t) for t in host[0][at : at + n]], host[1][at : at + n]
            at += n
            accepted = next((j for j, (t, drafted) in enumerate(zip(toks, d.tokens)) if t != drafted), len(d.tokens))
            produced.append((toks[: accepted + 1], lps[: accepted + 1]))
            if d.tokens:
                self.drafter.record(r.request_id, d, accepted)
            self.stats.drafted += len(d.tokens)
            self.stats.accepted += accepted
        self.stats.verify_steps += 1
        self.stats.produced += sum(len(t) for t, _ in produced)
        return produced
