"""Draft tokens for speculative decoding from what was already generated, with no draft model.

The engine asks :meth:`HistoryDrafter.propose` for a request's next tokens, verifies them with its own seeded sampler
(accepting while the sampled token equals the drafted one) and reports back with :meth:`HistoryDrafter.record`; a
wrong draft costs compute and never changes a sample.

Sources, for one request, in order of preference at equal match length:

1. ``"siblings"``: what the other requests of its group (same prompt tokens, started while the group is live) have
   generated, finished ones included; ``"self"``: its own generated tokens (a response repeating itself). Both live in
   one group index, so between them the most recent occurrence wins.
2. ``"history"``: responses to the same prompt kept from earlier groups (``finish(keep=True)``), as they were when the
   group started.
3. ``"prompt"``: its prompt tokens (a response quoting its prompt).

Matching: the longest suffix of the request's context (prompt + generated) of ``max_ngram`` down to ``min_ngram``
tokens that occurs in a source, followed there by at least one token, gives the draft: the tokens that followed its
most recent occurrence, up to k. A ``"self"`` match at distance d < k extends periodically (the last d tokens
repeated), so a looping response gets full drafts.

Adaptive k, per request: ``rate`` starts at 1 (k = ``max_draft``); each recorded draft sets
``rate = (rate + accepted / len(draft)) / 2`` and ``k = floor(max_draft * rate + 1/2)``. Rejections halve the rate
(8, 4, 2, 1, 1, then 0 with the default ``max_draft``); at k = 0 the request drafts nothing, except every
``probe_every``-th :meth:`~HistoryDrafter.propose` call (or the first call after that with a match), which drafts one
token: an accepted probe brings k back to about ``max_draft / 2``. With a steady a tokens accepted per draft, k
settles near ``sqrt(max_draft * a)``, a little above a.

Invariants:

- Deterministic: results depend only on the calls made, in order (no ``hash()`` of strings, no sets; dicts are read
  by key or in insertion order).
- Cost: an appended token updates at most ``max_ngram - min_ngram + 1`` index entries; :meth:`~HistoryDrafter.propose`
  does at most 3 dict lookups per n-gram length plus the copy of the draft. Starting a group indexes its prompt and
  its history once (O(tokens): about 9 ms on one core for a 2048-token prompt and a full 8192-token history).
- Memory: a group's tokens and indexes are freed when its last request finishes; the history holds at most
  ``history_prompts`` prompts (least recently used dropped first) of at most ``history_tokens_per_prompt`` generated
  tokens each (oldest responses dropped first; a longer response keeps its first tokens).
"""

from __future__ import annotations

import operator
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

SOURCES = ("siblings", "self", "history", "prompt")
_STATE_VERSION = 1

NGram = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Draft:
    """Proposed next tokens of one request; empty ``tokens`` (and ``source == ""``) is no proposal."""

    tokens: tuple[int, ...] = ()
    source: str = ""  # one of SOURCES, or "" for no proposal


NO_DRAFT = Draft()


def _prompt_key(prompt: Sequence[int]) -> bytes:
    # Compact and exact (8 bytes a token); also rejects non-integer tokens.
    return array("q", prompt).tobytes()


class _Group:
    """The live requests of one prompt: their sequences (prompt tail + generated) and indexes."""

    __slots__ = ("key", "prompt", "prompt_index", "seqs", "index", "history", "history_index", "active")

    def __init__(self, key: bytes, prompt: list[int]) -> None:
        self.key = key
        self.prompt = prompt
        self.prompt_index: dict[NGram, int] = {}  # n-gram -> position in prompt of the token after its latest occurrence
        self.seqs: list[list[int]] = []  # one per request of the group, finished ones included
        self.index: dict[NGram, tuple[int, int]] = {}  # n-gram -> (seq number, position of the next token)
        self.history: list[list[int]] = []  # earlier responses, each behind the prompt tail
        self.history_index: dict[NGram, tuple[int, int]] = {}
        self.active = 0


class _Request:
    __slots__ = ("group", "sno", "seq", "rate", "k", "idle")

    def __init__(self, group: _Group, sno: int, k: int) -> None:
        self.group = group
        self.sno = sno
        self.seq = group.seqs[sno]
        self.rate = 1.0
        self.k = k
        self.idle = 0  # propose calls since k reached 0 or the last probe


class HistoryDrafter:
    """Proposes draft tokens from group siblings, kept history and the prompt (module docstring: sources, rule, bounds).

    Defaults: ``max_draft=8`` verifies up to 9 tokens in a step, still about the cost of one in memory-bound decode,
    and long enough for the long runs that siblings and earlier responses share; adaptivity trims it where drafts fail.
    ``max_ngram=4`` is specific enough to pick the right occurrence in reasoning text; longer suffixes add lookups and
    rarely change the pick. ``min_ngram=2``: a single token (a space, "the") recurs everywhere, its continuations are
    mostly wrong and would drive a request's k down before the good drafts come. ``history_prompts=256`` covers a few
    iterations of a usual GRPO batch of prompts, and ``history_tokens_per_prompt=8192`` a group of 8 to 16 responses of
    a typical length, at 8 bytes a token (16 MiB at most in all, plus the prompts) and an index built only while the prompt is live.
    ``probe_every=16``: at k = 0 a one-token probe costs about one drafted token in 16 steps.
    """

    def __init__(
        self,
        *,
        max_draft: int = 8,
        max_ngram: int = 4,
        min_ngram: int = 2,
        history_prompts: int = 256,
        history_tokens_per_prompt: int = 8192,
        probe_every: int = 16,
    ) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if history_prompts < 0 or history_tokens_per_prompt < 0:
            raise ValueError(
                f"history_prompts and history_tokens_per_prompt must be >= 0 (0 keeps no history), "
                f"got {history_prompts} and {history_tokens_per_prompt}"
            )
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.max_draft = max_draft
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history_prompts = history_prompts
        self.history_tokens_per_prompt = history_tokens_per_prompt
        self.probe_every = probe_every
        self._requests: dict[Hashable, _Request] = {}
        self._groups: dict[bytes, _Group] = {}
        # prompt key -> (prompt, responses oldest first, their token count); least recently used first
        self._history: OrderedDict[bytes, tuple[list[int], deque[array[int]], int]] = OrderedDict()
        self.reset_stats()

    # ---- requests ----

    def start(self, request_id: Hashable, prompt: Sequence[int], generated: Sequence[int] = ()) -> None:
        """A request enters: fresh, or resumed with ``generated`` tokens (indexed as if extended one by one)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already started; finish() it first or use a new id")
        key = _prompt_key(prompt)
        tokens = list(map(operator.index, generated))  # checked before any state changes
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = self._new_group(key, list(map(operator.index, prompt)))
        group.seqs.append(group.prompt[-self.max_ngram :])
        group.active += 1
        req = self._requests[request_id] = _Request(group, len(group.seqs) - 1, self.max_draft)
        self._append(req, tokens)

    def extend(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Tokens the request sampled (one per decode step, or several after a verified draft)."""
        self._append(self._get(request_id, "extend"), tokens)

    def finish(self, request_id: Hashable, keep: bool = True) -> None:
        """The request is done; ``keep``: its response joins its prompt's history (False: exported, not kept).

        Its tokens stay a sibling source until its group's last request finishes."""
        req = self._get(request_id, "finish")
        del self._requests[request_id]
        group = req.group
        if keep:
            self._keep(group.key, group.prompt, req.seq[min(self.max_ngram, len(group.prompt)) :])
        group.active -= 1
        if group.active == 0:
            del self._groups[group.key]

    # ---- drafting ----

    def propose(self, request_id: Hashable, limit: int | None = None) -> Draft:
        """Up to ``min(limit, k)`` draft tokens for the request; ``NO_DRAFT`` when none."""
        req = self._get(request_id, "propose")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None (no cap), got {limit}")
        if limit == 0:
            return NO_DRAFT
        stats = self._stats
        k = req.k
        if k == 0:
            req.idle += 1
            if req.idle < self.probe_every:
                stats["skipped"] += 1
                return NO_DRAFT
            k = 1
        draft = self._match(req, k if limit is None else min(k, limit))
        n = len(draft.tokens)
        if n == 0:
            stats["misses"] += 1
            return draft
        if req.k == 0:
            req.idle = 0
            stats["probes"] += 1
        stats["proposals"] += 1
        stats["drafted"] += n
        stats["drafted_" + draft.source] += n
        return draft

    def record(self, request_id: Hashable, draft: Draft, accepted: int) -> None:
        """How many of ``draft``'s tokens the engine accepted; recording an empty draft does nothing."""
        req = self._get(request_id, "record")
        n = len(draft.tokens)
        if not 0 <= accepted <= n:
            raise ValueError(f"accepted must be in [0, len(draft.tokens)] = [0, {n}], got {accepted}")
        if n == 0:
            return
        if draft.source not in SOURCES:
            raise ValueError(f"draft.source must be one of {SOURCES}, got {draft.source!r}; record the Draft propose() returned")
        req.rate = (req.rate + accepted / n) / 2
        req.k = int(self.max_draft * req.rate + 0.5)
        stats = self._stats
        stats["verify_steps"] += 1
        stats["accepted"] += accepted
        stats["accepted_" + draft.source] += accepted

    # ---- counters, sizes, checkpoints ----

    def stats(self) -> dict[str, int]:
        """Counters since creation or :meth:`reset_stats`.

        ``proposals``: non-empty drafts returned (``probes`` of them at k = 0); ``misses``: calls no source matched;
        ``skipped``: calls at k = 0 between probes; ``verify_steps``: non-empty drafts recorded; ``drafted`` /
        ``accepted``: tokens proposed / recorded accepted, also per source as ``drafted_<source>`` /
        ``accepted_<source>`` (they sum to the totals)."""
        return dict(self._stats)

    def reset_stats(self) -> None:
        keys = ["proposals", "probes", "misses", "skipped", "verify_steps", "drafted", "accepted"]
        keys += [f"{kind}_{source}" for source in SOURCES for kind in ("drafted", "accepted")]
        self._stats = dict.fromkeys(keys, 0)

    def sizes(self) -> dict[str, int]:
        """What is held now: live ``requests`` and ``groups``; ``indexed_tokens`` (groups' prompts, responses and
        history snapshots) and their ``index_entries`` (at most ``max_ngram - min_ngram + 1`` per indexed token);
        ``history_prompts`` and ``history_tokens`` kept."""
        indexed = entries = 0
        for group in self._groups.values():
            indexed += len(group.prompt) + sum(map(len, group.seqs)) + sum(map(len, group.history))
            entries += len(group.prompt_index) + len(group.index) + len(group.history_index)
        return {
            "requests": len(self._requests),
            "groups": len(self._groups),
            "indexed_tokens": indexed,
            "index_entries": entries,
            "history_prompts": len(self._history),
            "history_tokens": sum(total for _, _, total in self._history.values()),
        }

    def state_dict(self) -> dict[str, Any]:
        """The history (not live requests, not counters) as plain lists and ints, least recently used prompt first."""
        return {
            "version": _STATE_VERSION,
            "history": [[list(prompt), [seq.tolist() for seq in seqs]] for prompt, seqs, _ in self._history.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces the history with ``state``'s, within this drafter's bounds; groups started before keep theirs."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION or not isinstance(state.get("history"), list):
            raise ValueError(f"not a HistoryDrafter state (version {_STATE_VERSION}); pass what state_dict() returned")
        old, self._history = self._history, OrderedDict()
        try:
            for prompt, seqs in state["history"]:
                for seq in seqs:
                    self._keep(_prompt_key(prompt), prompt, list(map(operator.index, seq)))
        except (TypeError, ValueError, OverflowError) as e:
            self._history = old
            raise ValueError(f"malformed HistoryDrafter state ({e}); pass what state_dict() returned") from None

    # ---- internals ----

    def _get(self, request_id: Hashable, call: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"{call}(): unknown request {request_id!r}; start() it first (finished requests are forgotten)")
        return req

    def _new_group(self, key: bytes, prompt: list[int]) -> _Group:
        group = _Group(key, prompt)
        lo, hi = self.min_ngram, self.max_ngram
        pindex = group.prompt_index
        for i in range(1, len(prompt)):
            for n in range(lo, min(hi, i) + 1):
                pindex[tuple(prompt[i - n : i])] = i
        kept = self._history.get(key)
        if kept is not None:
            self._history.move_to_end(key)
            lead = prompt[-hi:]
            hindex = group.history_index
            for sno, response in enumerate(kept[1]):
                seq = lead + response.tolist()
                group.history.append(seq)
                for i in range(len(lead), len(seq)):
                    for n in range(lo, min(hi, i) + 1):
                        hindex[tuple(seq[i - n : i])] = (sno, i)
        return group

    def _append(self, req: _Request, tokens: Sequence[int]) -> None:
        seq, sno, index = req.seq, req.sno, req.group.index
        lo, hi = self.min_ngram, self.max_ngram
        for token in list(map(operator.index, tokens)):  # all checked before the first is appended
            i = len(seq)
            seq.append(token)
            for n in range(lo, min(hi, i) + 1):
                index[tuple(seq[i - n : i])] = (sno, i)

    def _match(self, req: _Request, k: int) -> Draft:
        seq, group = req.seq, req.group
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            ngram = tuple(seq[-n:])
            hit = group.index.get(ngram)
            if hit is not None:
                sno, pos = hit
                if sno != req.sno:
                    return Draft(tuple(group.seqs[sno][pos : pos + k]), "siblings")
                period = seq[pos:]  # the tokens since the earlier occurrence, repeated
                return Draft(tuple(period[:k] if len(period) >= k else (period * (k // len(period) + 1))[:k]), "self")
            hit = group.history_index.get(ngram)
            if hit is not None:
                sno, pos = hit
                return Draft(tuple(group.history[sno][pos : pos + k]), "history")
            at = group.prompt_index.get(ngram)
            if at is not None:
                return Draft(tuple(group.prompt[at : at + k]), "prompt")
        return NO_DRAFT

    def _keep(self, key: bytes, prompt: Sequence[int], response: Sequence[int]) -> None:
        cap = self.history_tokens_per_prompt
        if not response or self.history_prompts == 0 or cap == 0:
            return
        kept = self._history.pop(key, None)
        prompt_list, seqs, total = kept if kept is not None else (list(prompt), deque(), 0)
        seq = array("q", response[:cap])
        seqs.append(seq)
        total += len(seq)
        while total > cap:
            total -= len(seqs.popleft())
        self._history[key] = (prompt_list, seqs, total)
        while len(self._history) > self.history_prompts:
            self._history.popitem(last=False)
