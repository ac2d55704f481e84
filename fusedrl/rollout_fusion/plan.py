"""Migration plans: which instances keep decoding, where each unfinished request goes, and a checker.

Pure functions over per-instance statistics, shared by the controller (:mod:`.controller`) and the rollout
simulator (:mod:`.simulator`) so that the simulated plan is the one that would run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class InstanceStats:
    """What one generation instance reports at a check (every k decode steps)."""

    rank: int
    unfinished: int
    remaining_tokens: int  # estimate of the decode work left (tokens still to generate)
    max_slots: int
    kv_capacity_tokens: int
    kv_reserved_tokens: int  # KV its unfinished requests need until they finish (cached + remaining)
    largest_request_tokens: int  # KV the largest of them needs until it finishes (0: none unfinished)
    finished_unscored: int = 0

    @property
    def free_kv_tokens(self) -> int:
        return self.kv_capacity_tokens - self.kv_reserved_tokens


@dataclass(frozen=True)
class MovedRequest:
    """An unfinished request of a freed instance: its id, holder, cached tokens and tokens left."""

    id: int
    src: int
    cache_len: int
    remaining: int

    @property
    def final_tokens(self) -> int:
        return self.cache_len + self.remaining


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message: a request's state (``request``) or finished samples as tokens (``samples``)."""

    src: int
    dst: int
    kind: Literal["request", "samples"]
    ids: tuple[int, ...]


@dataclass(frozen=True)
class MigrationPlan:
    """Kept/freed instances and the transfers, in the one global order every rank executes them in."""

    kept: tuple[int, ...]
    freed: tuple[int, ...]
    transfers: tuple[Transfer, ...]

    def program(self, rank: int) -> list[tuple[Literal["send", "recv"], int, Transfer]]:
        """This rank's ops, in order: (``send``, dst, t) or (``recv``, src, t)."""
        ops: list[tuple[Literal["send", "recv"], int, Transfer]] = []
        for t in self.transfers:
            if t.src == rank:
                ops.append(("send", t.dst, t))
            elif t.dst == rank:
                ops.append(("recv", t.src, t))
        return ops

    def tail_streams(self, kept_rank: int) -> tuple[int, ...]:
        """Freed ranks that score ``kept_rank``'s tail samples: the freed ranks dealt out over the kept ones (one
        shared freed rank each when there are fewer freed than kept), so that samples finishing at the same time
        on different kept ranks go to different freed ranks."""
        i = self.kept.index(kept_rank)
        return self.freed[i :: len(self.kept)] or (self.freed[i % len(self.freed)],)

    def tail_sources(self, freed_rank: int) -> list[int]:
        """Kept ranks whose tail samples ``freed_rank`` scores (those it asks for samples): the inverse of
        :meth:`tail_streams`."""
        return [k for k in self.kept if freed_rank in self.tail_streams(k)]

    @property
    def moved_ids(self) -> list[int]:
        return [i for t in self.transfers if t.kind == "request" for i in t.ids]


class PlanError(ValueError):
    """A migration plan broke an invariant (lost/duplicated request, capacity, unmatched transfer)."""


def choose_kept(stats: Sequence[InstanceStats], at_least: int = 1) -> list[int]:
    """Fewest instances (but ``at_least``), most remaining work first, that can take every unfinished request
    of the others. Keeping more than the fewest spreads the tail's KV reads over more instances: a decode
    step reads every cached token of its batch, so a tail crammed onto one instance can decode slower.

    A kept instance's room is counted in requests of the largest moved size (free slots, and free KV tokens
    over that size), so :func:`assign_requests` always finds a place for each request: summed free KV
    alone can be fragmented over instances that each lack room for the largest request."""
    if at_least < 1:
        raise ValueError(f"at_least must be >= 1, got {at_least}")
    order = sorted(stats, key=lambda s: (-s.remaining_tokens, -s.unfinished, s.rank))
    for m in range(min(at_least, len(order)), len(order) + 1):
        kept, freed = order[:m], order[m:]
        moved = sum(s.unfinished for s in freed)
        largest = max((s.largest_request_tokens for s in freed if s.unfinished), default=1)
        if sum(min(free_slots(s), max(0, s.free_kv_tokens) // max(1, largest)) for s in kept) >= moved:
            return sorted(s.rank for s in kept)
    raise PlanError(f"the unfinished requests do not fit into all {len(stats)} instances' KV memory")


def free_slots(s: InstanceStats) -> int:
    """Slots a kept instance can give to moved requests: an instance whose own requests already queue gets none,
    so a migration never makes a queue longer."""
    return max(0, s.max_slots - s.unfinished)


def assign_requests(moved: Sequence[MovedRequest], kept: Sequence[InstanceStats]) -> dict[int, int]:
    """Request id -> kept rank: longest remaining first, onto the kept instance with the least work that fits."""
    slots = {s.rank: free_slots(s) for s in kept}
    kv = {s.rank: s.free_kv_tokens for s in kept}
    work = {s.rank: s.remaining_tokens for s in kept}
    out = {}
    for r in sorted(moved, key=lambda r: (-r.remaining, r.id)):
        fits = [k for k in slots if slots[k] > 0 and kv[k] >= r.final_tokens]
        if not fits:
            raise PlanError(f"request {r.id} (needs {r.final_tokens} KV tokens) fits on no kept instance; raise max_slots")
        dst = min(fits, key=lambda k: (work[k], k))
        out[r.id] = dst
        slots[dst] -= 1
        kv[dst] -= r.final_tokens
        work[dst] += r.remaining
    return out


def assign_samples(samples: Mapping[int, Sequence[tuple[int, int]]], freed_load: dict[int, float]) -> dict[int, int]:
    """Finished samples of kept ranks ({rank: [(id, tokens)]}) -> freed rank, balancing scored tokens."""
    load = dict(freed_load)
    out = {}
    items = sorted(((tok, sid) for ss in samples.values() for sid, tok in ss), key=lambda x: (-x[0], x[1]))
    for tok, sid in items:
        dst = min(load, key=lambda f: (load[f], f))
        out[sid] = dst
        load[dst] += tok
    return out


def build_plan(
    stats: Sequence[InstanceStats],
    kept: Sequence[int],
    moved: Sequence[MovedRequest],
    kept_samples: Mapping[int, Sequence[tuple[int, int]]],
    freed_load: dict[int, float],
) -> MigrationPlan:
    """Requests first (freed -> kept), then finished samples (kept -> freed), each sorted by (src, dst)."""
    kept = tuple(sorted(kept))
    freed = tuple(sorted(s.rank for s in stats if s.rank not in kept))
    by_rank = {s.rank: s for s in stats}
    req_dst = assign_requests(moved, [by_rank[k] for k in kept]) if freed else {}
    src_of = {r.id: r.src for r in moved}
    requests = sorted((Transfer(src_of[i], d, "request", (i,)) for i, d in req_dst.items()), key=lambda t: (t.src, t.dst, t.ids))
    sample_dst = assign_samples(kept_samples, {f: freed_load.get(f, 0.0) for f in freed}) if freed else {}
    grouped: dict[tuple[int, int], list[int]] = defaultdict(list)
    for k in sorted(kept_samples):
        for sid, _ in kept_samples[k]:
            grouped[(k, sample_dst[sid])].append(sid)
    samples = [Transfer(s, d, "samples", tuple(ids)) for (s, d), ids in sorted(grouped.items())]
    return MigrationPlan(kept, freed, tuple(requests + samples))


def verify_plan(
    plan: MigrationPlan,
    stats: Sequence[InstanceStats],
    moved: Sequence[MovedRequest],
    kept_samples: Mapping[int, Sequence[tuple[int, int]]],
) -> None:
    """Raise :class:`PlanError` unless every moved request and kept-side finished sample has exactly one
    destination of the right side, capacities hold, and every rank's sends and receives pair up without deadlock."""
    ranks = {s.rank for s in stats}
    if set(plan.kept) | set(plan.freed) != ranks or set(plan.kept) & set(plan.freed) or not plan.kept:
        raise PlanError(f"kept {plan.kept} and freed {plan.freed} must split the ranks {sorted(ranks)} with >= 1 kept")
    by_rank = {s.rank: s for s in stats}
    expected_moves = {r.id: r for r in moved}
    if {r.src for r in moved} - set(plan.freed) or any(
        by_rank[r].unfinished and r not in {m.src for m in moved} for r in plan.freed
    ):
        raise PlanError("moved requests must be exactly the unfinished requests of the freed ranks")
    for r in plan.freed:
        n = sum(1 for m in moved if m.src == r)
        if n != by_rank[r].unfinished:
            raise PlanError(f"rank {r} reports {by_rank[r].unfinished} unfinished requests but {n} are moved")
    seen: dict[int, int] = {}
    for t in plan.transfers:
        for i in t.ids:
            seen[i] = seen.get(i, 0) + 1
        if t.kind == "request":
            if (
                len(t.ids) != 1
                or t.ids[0] not in expected_moves
                or expected_moves[t.ids[0]].src != t.src
                or t.dst not in plan.kept
            ):
                raise PlanError(f"bad request transfer {t}: it must move one unfinished request from its holder to a kept rank")
        elif t.src not in plan.kept or t.dst not in plan.freed or any(i not in dict(kept_samples.get(t.src, ())) for i in t.ids):
            raise PlanError(f"bad sample transfer {t}: it must send finished samples of a kept rank to a freed rank")
    dup = sorted(i for i, c in seen.items() if c > 1)
    lost = sorted(set(expected_moves) - set(seen))
    lost += sorted(i for k in plan.kept for i, _ in kept_samples.get(k, ()) if i not in seen)
    if dup or lost:
        raise PlanError(f"plan duplicates ids {dup[:5]} and loses ids {lost[:5]}")
    for k in plan.kept:
        incoming = [expected_moves[t.ids[0]] for t in plan.transfers if t.kind == "request" and t.dst == k]
        s = by_rank[k]
        if len(incoming) > free_slots(s) or sum(r.final_tokens for r in incoming) > s.free_kv_tokens:
            raise PlanError(
                f"kept rank {k} over capacity: {len(incoming)} moved requests for {free_slots(s)} free slots "
                f"({s.unfinished} own unfinished, {s.max_slots} slots)"
            )
    _check_rendezvous(plan, sorted(ranks))


def _check_rendezvous(plan: MigrationPlan, ranks: list[int]) -> None:
    """Blocking point-to-point semantics: a send completes with the peer's matching receive; all must finish."""
    programs = {r: plan.program(r) for r in ranks}
    pc = dict.fromkeys(ranks, 0)
    progressed = True
    while progressed:
        progressed = False
        for r in ranks:
            if pc[r] >= len(programs[r]):
                continue
            op, peer, t = programs[r][pc[r]]
            if pc[peer] < len(programs[peer]):
                pop, ppeer, pt = programs[peer][pc[peer]]
                if pop != op and ppeer == r and pt == t:
                    pc[r] += 1
                    pc[peer] += 1
                    progressed = True
    stuck = {r: programs[r][pc[r]][:2] for r in ranks if pc[r] < len(programs[r])}
    if stuck:
        raise PlanError(f"transfers do not pair up (would deadlock): next ops {stuck}")
