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


class Speculator:
    """An engine's drafter, the requests it holds, and the verify step.

    ``rows``: speculate only while at most this many requests decode (a verify step computes rows x drafted
    positions)."""

    def __init__(self, *, max_draft: int, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.drafter = HistoryDrafter(max_draft=max_draft)
        self.rows = rows
        self.stats = SpecStats()
        self._held: set[Hashable] = set()

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
