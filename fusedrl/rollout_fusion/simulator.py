"""Simulator of the rollout (generation + scoring), unfused (decode everything, then score) vs fused
(at a threshold, migrate the tail onto a few instances and score on the freed ones).

It mirrors what :class:`fusedrl.rollout_fusion.MigrationController` does: checks every ``check_interval`` decode
steps while fused, each deciding on the statistics of the check ``STATS_LAG`` before (an instance waits only for
one that many intervals behind), the same plan (:mod:`.plan`), transfers in one global order with blocking
send/receive, scoring in length-sorted micro-batches, each tail sample scored alone by whichever of its kept
instance and that one's freed ones is free first once it finished (longest first). It is used to pick
the ``auto`` threshold and, at paper scale, to estimate the gain; :meth:`RolloutCosts.fit` fits its costs to
measurements.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fusedrl.buckets import round_up
from fusedrl.hardware import DECODE_BW_UTIL, H100_SXM, MFU, Accelerator
from fusedrl.rollout_fusion.plan import InstanceStats, MovedRequest, build_plan, choose_kept

STATS_LAG = 2  # a check decides on the statistics all-gathered this many checks earlier (see MigrationController)
TOKEN_BYTES = 12  # a finished sample on the wire: int64 token + float32 log-prob per token (metadata aside)


@dataclass(frozen=True)
class RolloutCosts:
    """Per-instance costs in seconds.

    decode step = ``decode_base_s + decode_per_seq_s * batch + decode_per_row_s * rows +
    decode_per_ctx_token_s * attended``. Without buckets (a paged-attention engine) ``rows = batch`` and
    ``attended`` = the summed context of the batch. With ``batch_buckets`` / ``len_buckets`` (the
    :class:`~fusedrl.generation.GenerationEngine` pads its decode step to static shapes) ``rows`` is the
    batch rounded up to a batch bucket and ``attended = rows * L``, L the smallest length bucket above
    the longest cached position. Per sequence (sampling, bookkeeping) and per padded row (the forward
    pass) are separate terms. Prefill = ``prefill_per_token_s * tokens``; one scoring micro-batch
    (Reference, Reward, Critic) = ``score_base_s + score_per_token_s * rows * padded_len +
    score_per_token_sq_s * rows * padded_len**2`` (the last term: attention, quadratic in length); one transfer
    = ``transfer_latency_s + bytes / transfer_bytes_per_s``; ``check_s`` is what one check costs an
    instance besides waiting for others (starting the statistics all-gather and collecting an earlier one; with
    ``auto``, its share of re-simulating the threshold); ``migration_s`` what a migration costs every instance
    besides its transfers (its statistics and plan gathered, the plan verified, its figures gathered).
    """

    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    prefill_per_token_s: float
    score_base_s: float
    score_per_token_s: float
    transfer_latency_s: float
    transfer_bytes_per_s: float
    kv_bytes_per_token: float
    check_s: float = 0.0
    decode_per_row_s: float = 0.0
    score_per_token_sq_s: float = 0.0
    batch_buckets: tuple[int, ...] = ()
    len_buckets: tuple[int, ...] = ()
    migration_s: float = 0.0

    def padded_shape(self, batch: int, ctx_tokens: float, max_cached: float | None = None) -> tuple[float, float]:
        """(rows, attended tokens) of a decode step of ``batch`` requests holding ``ctx_tokens`` in all;
        ``max_cached`` (longest cached position) matters only with ``len_buckets`` (default: the mean)."""
        rows = round_up(batch, self.batch_buckets)
        if not self.len_buckets:
            return rows, ctx_tokens
        longest = max_cached if max_cached is not None else ctx_tokens / batch
        return rows, rows * round_up(int(longest), self.len_buckets, strictly_above=True)

    def decode_step_s(self, batch: int, ctx_tokens: int, max_cached: int | None = None) -> float:
        if batch <= 0:
            return 0.0
        rows, attended = self.padded_shape(batch, ctx_tokens, max_cached)
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch
            + self.decode_per_row_s * rows
            + self.decode_per_ctx_token_s * attended
        )

    def score_s(self, sample_tokens: Sequence[int], micro_batch_size: int) -> float:
        """Scoring time of samples of these lengths, length-sorted into micro-batches (as the Scorer does)."""
        lengths = sorted(sample_tokens)
        total = 0.0
        for i in range(0, len(lengths), micro_batch_size):
            mb = lengths[i : i + micro_batch_size]
            total += self.score_base_s + (self.score_per_token_s + self.score_per_token_sq_s * mb[-1]) * len(mb) * mb[-1]
        return total

    def transfer_s(self, nbytes: float) -> float:
        return self.transfer_latency_s + nbytes / self.transfer_bytes_per_s

    @classmethod
    def for_models(
        cls,
        *,
        actor_params: float,
        scorer_params: float,
        kv_bytes_per_token: float,
        gpus_per_instance: int = 1,
        actor_layers: int = 0,
        gpu: Accelerator = H100_SXM,
        decode_bw_util: float = DECODE_BW_UTIL,
        mfu: float = MFU,
        bytes_per_param: float = 2.0,
        step_overhead_s: float = 2e-3,
        per_seq_s: float = 2e-5,
        allreduce_s: float = 15e-6,
        transfer_latency_s: float = 50e-6,
        check_s: float = 1e-4,
    ) -> RolloutCosts:
        """Roofline costs of one instance of ``gpus_per_instance`` GPUs (tensor parallel): a decode step
        reads the Actor's weight shard and the batch's KV cache once (memory bound) and, with TP > 1, runs
        two all-reduces per layer (``allreduce_s`` each, latency bound at decode sizes); prefill and
        scoring are compute bound (2 FLOPs per parameter per token, attention FLOPs left out) on all the
        instance's GPUs. ``scorer_params`` is the sum of the Reference, Reward and Critic sizes. A transfer
        between instances moves every TP rank's shard in parallel over its own link (``gpu.link_bytes_per_s``).
        Defaults: H100 SXM, :data:`fusedrl.hardware.DECODE_BW_UTIL` of its bandwidth in decode and
        :data:`fusedrl.hardware.MFU`."""
        if gpus_per_instance < 1:
            raise ValueError(f"gpus_per_instance must be >= 1, got {gpus_per_instance}")
        tp = gpus_per_instance
        bw = gpu.hbm_bytes_per_s * decode_bw_util * tp
        flops = gpu.flops_per_s * mfu * tp
        comm = 2 * actor_layers * allreduce_s if tp > 1 else 0.0
        return cls(
            decode_base_s=step_overhead_s + comm + actor_params * bytes_per_param / bw,
            decode_per_seq_s=per_seq_s,
            decode_per_ctx_token_s=kv_bytes_per_token / bw,
            prefill_per_token_s=2 * actor_params / flops,
            score_base_s=step_overhead_s,
            score_per_token_s=2 * scorer_params / flops,
            transfer_latency_s=transfer_latency_s,
            transfer_bytes_per_s=gpu.link_bytes_per_s * tp,
            kv_bytes_per_token=kv_bytes_per_token,
            check_s=check_s,
        )

    @classmethod
    def fit(
        cls,
        decode: Sequence[tuple[int, int, float]],
        score: Sequence[tuple[int, int, float]],
        prefill: Sequence[tuple[int, float]] = (),
        transfers: Sequence[tuple[int, float]] = (),
        kv_bytes_per_token: float = 0.0,
        check_s: float = 0.0,
        batch_buckets: Sequence[int] = (),
        len_buckets: Sequence[int] = (),
        score_per_token_s: float | None = None,
        migrations: Sequence[float] = (),
    ) -> RolloutCosts:
        """Least-squares fit to measurements: decode (batch, cached tokens, s), score (rows, padded_len, s),
        prefill (tokens, s), transfers (bytes, s), migrations (s besides transfers: their mean is ``migration_s``).
        Negative coefficients are clamped to 0. With the
        engine's buckets the decode fit uses :meth:`decode_step_s`'s padded terms; the longest cached
        position of a measured step is taken as its mean (exact when its requests started together). Given
        ``score_per_token_s`` (from fewer than two scoring measurements), or from micro-batches all within 1.5x of one
        size (as with transfers), scoring costs that per padded token and nothing per micro-batch."""
        estimated = score_per_token_s is not None
        if len(decode) < 3 or (len(score) < 2 and not estimated):
            raise ValueError(
                "fit needs >= 3 decode and >= 2 scoring measurements (or score_per_token_s); run more steps/micro-batches"
            )
        bb, lb = tuple(batch_buckets), tuple(len_buckets)
        shape = cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, math.inf, 0.0, batch_buckets=bb, len_buckets=lb).padded_shape
        rows = [[1.0, float(n), *map(float, shape(n, ctx))] for n, ctx, _ in decode]
        if not bb:  # rows == batch: one per-sequence term
            rows = [r[:2] + r[3:] for r in rows]
        coef = _lstsq(rows, [s for *_, s in decode])
        a, b, c = coef[0], coef[1], coef[-1]
        row = coef[2] if bb else 0.0
        p = sum(s for _, s in prefill) / max(1, sum(t for t, _ in prefill)) if prefill else 0.0
        sizes = [r * plen for r, plen, _ in score]
        if score_per_token_s is None and max(sizes) < 1.5 * min(sizes):
            # micro-batches of about one size cannot tell a fixed cost from a cost per token: all of it per token
            score_per_token_s = sum(s for *_, s in score) / max(1, sum(sizes))
        if score_per_token_s is not None:
            s0, s1, s2 = 0.0, score_per_token_s, []
        else:
            quadratic = len(score) >= 4  # the attention term needs one more measurement than the linear fit
            s0, s1, *s2 = _lstsq(
                [[1.0, r * plen, r * plen * plen][: 3 if quadratic else 2] for r, plen, _ in score], [s for *_, s in score]
            )
        lat, bw = fit_transfers(transfers)
        migration = statistics.fmean(migrations) if migrations else 0.0
        return cls(a, b, c, p, s0, s1, lat, bw, kv_bytes_per_token, check_s, row, s2[0] if s2 else 0.0, bb, lb, migration)


def fit_transfers(transfers: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, bytes/s) fitted to (bytes, seconds) measurements. When the sizes barely vary the
    bandwidth cannot be told from the latency: then the mean time is the latency (infinite bandwidth)."""
    sizes = [nb for nb, _ in transfers]
    if len(transfers) >= 3 and min(sizes) > 0 and max(sizes) / min(sizes) >= 1.5:
        lat, inv_bw = _lstsq([[1.0, nb] for nb, _ in transfers], [s for _, s in transfers])
    else:
        lat, inv_bw = (statistics.fmean(s for _, s in transfers), 0.0) if transfers else (0.0, 0.0)
    return lat, 1.0 / inv_bw if inv_bw > 0 else math.inf


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (mean-unbiased: slow steps on a busy machine are real
    time and stay in). A coefficient that comes out negative is dropped (set to 0) and the rest refitted,
    so that, while the intercept stays, the fitted times still sum to the measured ones."""
    a = torch.tensor(rows, dtype=torch.float64)
    scale = a.abs().amax(0).clamp_min(1e-30)
    a, target = a / scale, torch.tensor(y, dtype=torch.float64)[:, None]
    active = list(range(a.shape[1]))
    sol = torch.zeros(a.shape[1], dtype=torch.float64)
    while active:
        part = torch.linalg.lstsq(a[:, active], target).solution[:, 0]
        if bool((part >= 0).all()):
            sol[active] = part
            break
        active.pop(int(part.argmin()))
    return [float(x) for x in sol / scale]


@dataclass(frozen=True)
class SimRequest:
    """A request as the simulator sees it: tokens in its context now, tokens still to generate, and the decode step
    after which it starts (0: it decodes now; later: it waits for a free slot, see :func:`admitted`)."""

    ctx: int
    remaining: int
    start: int = 0

    @property
    def end(self) -> int:
        """The decode step that generates its last token."""
        return self.start + self.remaining


def admitted(requests: Sequence[tuple[int, int]], slots: int) -> list[SimRequest]:
    """``(prompt, generated)`` token counts in admission order, as continuous batching on ``slots`` slots runs them:
    each starts once the first slot is free."""
    free = [0] * slots  # the decode step after which each slot is free (a heap)
    out = []
    for prompt, generated in requests:
        start = heapq.heappop(free)
        out.append(SimRequest(prompt, generated, start))
        heapq.heappush(free, start + generated)
    return out


@dataclass(frozen=True)
class RolloutConfig:
    """Instance capacities and controller settings."""

    max_slots: int
    kv_capacity_tokens: int
    check_interval: int = 8
    micro_batch_size: int = 8
    mode: Literal["kv", "reprefill"] = "kv"
    prefill: bool = True  # requests start with a prefill of their context (False: resuming mid-rollout)
    # Unfused scoring: "own" = each instance scores its own samples (what MigrationController does with
    # fusion off); "balanced" = all samples length-sorted into micro-batches, spread over all instances
    # longest first to the least loaded (a tuned baseline).
    unfused_scoring: Literal["own", "balanced"] = "own"


@dataclass
class RolloutTimes:
    """Outcome of one simulated rollout (seconds from its start)."""

    total_s: float
    decode_end_s: float
    migration_step: int | None = None
    migration_start_s: float | None = None
    migration_s: float = 0.0
    moved: int = 0
    moved_bytes: float = 0.0
    kept: tuple[int, ...] = ()
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)  # (instance, kind, start, end)


def _step_times(reqs: Sequence[SimRequest], costs: RolloutCosts, steps: int) -> torch.Tensor:
    """Per-step decode time of one instance for steps 1..steps (0 while none of its requests decodes)."""
    if not reqs or steps <= 0:
        return torch.zeros(max(steps, 0), dtype=torch.float64)
    start = torch.tensor([min(r.start, steps) for r in reqs], dtype=torch.int64)
    end = torch.tensor([min(r.end, steps) for r in reqs], dtype=torch.int64)
    # context at step i + 1 (i from 0): ctx + i - start
    ctx = torch.tensor([float(r.ctx - r.start) for r in reqs], dtype=torch.float64)
    # A request is active in steps start + 1 .. end: +1 at its start, -1 at its end, summed over the steps, give the
    # batch size and the summed context of the active requests at each step.
    batch = (torch.bincount(start, minlength=steps + 1) - torch.bincount(end, minlength=steps + 1)).cumsum(0)[:steps].double()
    ctx0 = (torch.bincount(start, ctx, minlength=steps + 1) - torch.bincount(end, ctx, minlength=steps + 1)).cumsum(0)[:steps]
    s = torch.arange(steps, dtype=torch.float64)
    rows, attended = batch, ctx0 + s * batch
    rows = round_up(batch, costs.batch_buckets)
    if costs.len_buckets:
        if bool((start == 0).all()):  # the active requests at a step are those ending after it: a reverse running max
            longest0 = (
                torch.zeros(steps + 1, dtype=torch.float64)
                .scatter_reduce(0, end, ctx, "amax")
                .flip(0)
                .cummax(0)
                .values.flip(0)[1:]
            )
        else:  # queued requests: the largest context offset over each request's own steps, one slice at a time
            longest0 = torch.zeros(steps, dtype=torch.float64)
            for a, b, c in sorted(zip(start.tolist(), end.tolist(), ctx.tolist()), key=lambda r: r[2]):
                longest0[a:b] = c  # ascending: the largest offset of the requests active at a step is written last
        # the engine caches all but the pending token; a step nobody decodes costs nothing (and has no length)
        cached = torch.where(batch > 0, longest0 + s - 1, torch.zeros((), dtype=torch.float64))
        attended = rows * round_up(cached, costs.len_buckets, strictly_above=True)
    t = (
        costs.decode_base_s
        + costs.decode_per_seq_s * batch
        + costs.decode_per_row_s * rows
        + costs.decode_per_ctx_token_s * attended
    )
    return torch.where(batch > 0, t, torch.zeros_like(t))


def _check_clock(interval_s: torch.Tensor, start: Sequence[float], check_s: float, last: int) -> float:
    """When every instance has reached check ``last`` (0-based): instance i posts check c after its own decode
    steps of interval c (``interval_s[i, c]``; idle once past its requests) and ``check_s``, then waits for
    every instance's post of check c - STATS_LAG (the all-gather it decides on)."""
    d = interval_s.tolist()
    n = len(d)
    depart, posts = list(start), []
    for c in range(last + 1):
        post = [depart[i] + (d[i][c] if c < len(d[i]) else 0.0) + check_s for i in range(n)]
        posts.append(post)
        ready = max(posts[c - STATS_LAG]) if c >= STATS_LAG else 0.0
        depart = [max(p, ready) for p in post]
    return max(posts[last]) if posts else max(start, default=0.0)


def simulate_rollout(
    instances: Sequence[Sequence[SimRequest]],
    costs: RolloutCosts,
    config: RolloutConfig,
    *,
    fused: bool,
    threshold: int | None = None,
    backlog: Sequence[Sequence[int]] | None = None,
    min_kept: int = 1,
) -> RolloutTimes:
    """Time of the rollout. ``instances[i]`` are instance i's unfinished requests; ``backlog[i]`` the token
    counts of its finished, unscored samples. ``threshold``: migrate when at most this many requests are
    unfinished at a check (fused only); ``min_kept``: keep at least this many instances decoding. Fused, an
    instance whose own requests are done scores its samples while the others decode (shortest first)."""
    n = len(instances)
    backlog_tokens = [list(b) for b in backlog] if backlog is not None else [[] for _ in range(n)]
    start = [costs.prefill_per_token_s * sum(r.ctx for r in reqs) if config.prefill else 0.0 for reqs in instances]
    horizon = max((r.end for reqs in instances for r in reqs), default=0)
    steps = [_step_times(reqs, costs, horizon) for reqs in instances]
    final = [backlog_tokens[i] + [r.ctx + r.remaining for r in instances[i]] for i in range(n)]
    spans: list[tuple[int, str, float, float]] = []

    if not fused or n == 1 or threshold is None:
        ends = [start[i] + float(steps[i].sum()) for i in range(n)]
        dec_end = max(ends, default=0.0)
        for i in range(n):
            spans.append((i, "decode", 0.0, ends[i]))
        score = _unfused_scoring(final, costs, config)
        for i in range(n):
            spans.append((i, "score", dec_end, dec_end + score[i]))
        return RolloutTimes(dec_end + max(score, default=0.0), dec_end, spans=spans)

    # Checks every k steps until one decides on a count of at most `threshold` unfinished requests.
    k = config.check_interval
    intervals = -(-horizon // k)
    per_step = torch.stack(steps) if steps else torch.zeros(0, horizon, dtype=torch.float64)
    per_step = torch.nn.functional.pad(per_step, (0, intervals * k - horizon))
    rem_all = torch.tensor(sorted(r.end for reqs in instances for r in reqs), dtype=torch.int64)
    check_steps = torch.arange(1, intervals + 1) * k
    unfinished = len(rem_all) - torch.searchsorted(rem_all, check_steps, right=True)
    # Check c decides on the count posted at check c - STATS_LAG; a rollout resumed mid-way (no prefill) takes
    # its starting count for the checks before its start, a fresh one decides from check STATS_LAG + 1 on. The
    # count reaches 0 by check `intervals`, so some check decides; it migrates if requests are unfinished then.
    counts = torch.cat([unfinished, torch.zeros(max(1, intervals) - intervals + STATS_LAG, dtype=torch.int64)])
    decides = torch.cat([torch.full((STATS_LAG,), len(rem_all)), counts])[: len(counts)] <= threshold
    if config.prefill:
        decides[:STATS_LAG] = False
    first = int(decides.nonzero()[0])
    t = _check_clock(per_step.view(n, intervals, k).sum(-1), start, costs.check_s, first)
    s0 = int(check_steps[first]) if counts[first] > 0 else None
    own_end = [start[i] + float(steps[i].sum()) for i in range(n)]
    if s0 is None:  # decoding ended before the threshold: everyone scores its own samples, from its own end on
        score = _unfused_scoring(final, costs, config)
        ends = [max(t, own_end[i] + score[i]) for i in range(n)]
        for i in range(n):
            spans += [(i, "decode", 0.0, own_end[i]), (i, "score", own_end[i], ends[i])]
        return RolloutTimes(max(ends), t, spans=spans)

    done = [[r.ctx + r.remaining for r in reqs if r.end <= s0] for reqs in instances]
    alive = [
        [SimRequest(r.ctx + max(0, s0 - r.start), r.end - max(s0, r.start), max(0, r.start - s0)) for r in reqs if r.end > s0]
        for reqs in instances
    ]
    unscored = [backlog_tokens[i] + done[i] for i in range(n)]
    for i in range(n):  # an instance done before the migration scored its shortest samples meanwhile
        if not alive[i] and own_end[i] < t:
            unscored[i] = _unscored_after(unscored[i], t - own_end[i], costs, config.micro_batch_size)
            if unscored[i] != backlog_tokens[i] + done[i]:
                spans.append((i, "score", own_end[i], t))
    stats = [
        InstanceStats(
            rank=i,
            unfinished=len(alive[i]),
            remaining_tokens=sum(r.remaining for r in alive[i]),
            max_slots=config.max_slots,
            kv_capacity_tokens=config.kv_capacity_tokens,
            kv_reserved_tokens=sum(r.ctx + r.remaining for r in alive[i]),
            largest_request_tokens=max((r.ctx + r.remaining for r in alive[i]), default=0),
            finished_unscored=len(unscored[i]),
        )
        for i in range(n)
    ]
    kept = choose_kept(stats, min_kept)
    if len(kept) == n:  # no instance can be freed: the controller skips migration, decodes on and scores its own
        ends = [t + float(_step_times(alive[i], costs, horizon - s0).sum()) for i in range(n)]
        score = [costs.score_s(final[i], config.micro_batch_size) for i in range(n)]
        for i in range(n):
            spans += [(i, "decode", 0.0, ends[i]), (i, "score", ends[i], ends[i] + score[i])]
        return RolloutTimes(max(e + c for e, c in zip(ends, score)), max(ends), spans=spans)
    for i in range(n):
        spans.append((i, "decode", 0.0, t))
    ids: dict[int, Any] = {}  # synthetic id -> moved SimRequest or kept sample's token count
    moved: list[MovedRequest] = []
    kept_samples: dict[int, list[tuple[int, int]]] = {}
    for i in range(n):
        if i in kept:
            kept_samples[i] = []
            for tok in unscored[i]:
                ids[len(ids)] = tok
                kept_samples[i].append((len(ids) - 1, tok))
        else:
            for r in alive[i]:
                ids[len(ids)] = SimRequest(r.ctx, r.remaining)  # one still queued decodes at once where it lands
                moved.append(MovedRequest(len(ids) - 1, i, r.ctx, r.remaining))
    freed_load = {i: float(sum(unscored[i])) for i in range(n) if i not in kept}
    plan = build_plan(stats, kept, moved, kept_samples, freed_load)

    # Transfers in the global order after the plan; each occupies both endpoints (blocking send/recv).
    free_at = [t + costs.migration_s] * n
    moved_bytes = 0.0
    received: dict[int, list[SimRequest]] = {k_: [] for k_ in kept}
    for tr in plan.transfers:
        if tr.kind == "request":
            r = ids[tr.ids[0]]
            nbytes = TOKEN_BYTES * r.ctx + (costs.kv_bytes_per_token * (r.ctx - 1) if config.mode == "kv" else 0.0)
            received[tr.dst].append(r)
        else:
            nbytes = TOKEN_BYTES * sum(ids[i] for i in tr.ids)
        moved_bytes += nbytes
        begin = max(free_at[tr.src], free_at[tr.dst])
        free_at[tr.src] = free_at[tr.dst] = begin + costs.transfer_s(nbytes)
    mig_end = max(free_at)
    for i in range(n):
        if free_at[i] > t:
            spans.append((i, "migrate", t, free_at[i]))

    # Freed instances score their own finished samples and the kept ones' they received.
    busy: dict[int, float] = {}
    for f in plan.freed:
        got = [ids[i] for tr in plan.transfers if tr.kind == "samples" and tr.dst == f for i in tr.ids]
        dur = costs.score_s(unscored[f] + got, config.micro_batch_size)
        busy[f] = free_at[f] + dur
        spans.append((f, "score", free_at[f], busy[f]))

    # Kept instances decode the tail. A freed instance, once its own scoring is done, takes the longest tail sample
    # finished so far on the kept ones that stream to it, one at a time; a kept instance, once its tail has ended,
    # scores its own that are still waiting the same way (the controller's credits).
    tail_end = {}
    ready: dict[int, list[tuple[float, int]]] = {}  # kept rank -> (finish time, tokens) of its tail samples
    for k_ in kept:
        reqs = alive[k_] + received[k_]
        clock = free_at[k_]
        if config.mode == "reprefill" and received[k_]:
            clock += costs.prefill_per_token_s * sum(r.ctx for r in received[k_])
        st = _step_times(reqs, costs, max((r.end for r in reqs), default=0))
        step_ends = clock + torch.cumsum(st, 0)
        ready[k_] = [(float(step_ends[r.end - 1]), r.ctx + r.remaining) for r in reqs]
        tail_end[k_] = float(step_ends[-1]) if len(step_ends) else clock
        spans.append((k_, "decode", clock, tail_end[k_]))
        busy[k_] = tail_end[k_]
        if unscored[k_]:
            spans.append((k_, "send", t, free_at[k_]))
    sources = {**{f: plan.tail_sources(f) for f in plan.freed}, **{k_: [k_] for k_ in kept}}
    while active := [w for w in sources if any(ready[k_] for k_ in sources[w])]:
        w = min(active, key=lambda w: (busy[w], w))
        waiting = [(tokens, -at, k_) for k_ in sources[w] for at, tokens in ready[k_] if at <= busy[w]]
        if not waiting:  # nothing finished yet: wait for the first sample of its streams
            busy[w] = min(at for k_ in sources[w] for at, _ in ready[k_])
            continue
        tokens, neg_at, k_ = max(waiting)
        ready[k_].remove((-neg_at, tokens))
        dur = costs.score_s([tokens], config.micro_batch_size)
        spans.append((w, "score", busy[w], busy[w] + dur))
        busy[w] += dur
    total = max(busy.values())
    return RolloutTimes(
        total_s=total,
        decode_end_s=max(tail_end.values()),
        migration_step=s0,
        migration_start_s=t,
        migration_s=mig_end - t,
        moved=len(moved),
        moved_bytes=moved_bytes,
        kept=tuple(kept),
        spans=spans,
    )


def _unscored_after(samples: list[int], seconds: float, costs: RolloutCosts, micro_batch_size: int) -> list[int]:
    """What is left of ``samples`` (token counts) after ``seconds`` of scoring them one at a time, shortest first."""
    left = sorted(samples)
    while left and costs.score_s(left[:1], micro_batch_size) <= seconds:
        seconds -= costs.score_s(left[:1], micro_batch_size)
        left.pop(0)
    return left


def _unfused_scoring(samples: list[list[int]], costs: RolloutCosts, config: RolloutConfig) -> list[float]:
    """Each instance's scoring time once decoding has ended everywhere (see ``RolloutConfig.unfused_scoring``)."""
    mbs = config.micro_batch_size
    if config.unfused_scoring == "own":
        return [costs.score_s(s, mbs) for s in samples]
    lengths = sorted(t for s in samples for t in s)
    batches = sorted((costs.score_s(lengths[i : i + mbs], mbs) for i in range(0, len(lengths), mbs)), reverse=True)
    load = [0.0] * len(samples)
    for b in batches:
        load[load.index(min(load))] += b
    return load


DEFAULT_FRACTIONS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.16, 0.2, 0.25, 0.3, 0.4, 0.5)


def kept_candidates(num_instances: int) -> list[int]:
    """Kept-instance counts ``auto`` tries: 1, 2, 4, ... below the number of instances."""
    return [m for m in (1 << i for i in range(num_instances.bit_length())) if m < num_instances] or [1]


def best_migration(
    instances: Sequence[Sequence[SimRequest]],
    costs: RolloutCosts,
    config: RolloutConfig,
    *,
    backlog: Sequence[Sequence[int]] | None = None,
    batch_size: int | None = None,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    min_gain: float = 0.0,
) -> tuple[int, int, RolloutTimes]:
    """(threshold, min_kept, simulated rollout) with the shortest simulated rollout. Thresholds: ``fractions``
    of ``batch_size`` and 0 (never migrate: when scoring everything on the freed instances costs more; also when
    the best migration ends less than ``min_gain`` of the rollout sooner); min_kept: :func:`kept_candidates` (fewer
    kept instances free more for scoring, more decode the tail faster)."""
    batch = batch_size if batch_size is not None else sum(len(r) for r in instances)
    thresholds = sorted({max(1, round(f * batch)) for f in fractions})
    unfinished = sum(len(r) for r in instances)
    at_once = [t for t in thresholds if t >= unfinished]  # all of these migrate at the first check: simulate one
    thresholds = [t for t in thresholds if t < unfinished] + at_once[:1]
    never = (0, 1, simulate_rollout(instances, costs, config, fused=True, threshold=0, backlog=backlog))
    best = never
    for m in kept_candidates(len(instances)):
        for c in thresholds:
            res = simulate_rollout(instances, costs, config, fused=True, threshold=c, backlog=backlog, min_kept=m)
            if res.total_s < best[2].total_s - 1e-12:
                best = (c, m, res)
    return best if best[2].total_s <= (1 - min_gain) * never[2].total_s else never


def split_round_robin(lengths: Sequence[int], prompt_lens: Sequence[int] | int, num_instances: int) -> list[list[SimRequest]]:
    """Requests i -> instance i % num_instances (how a batch is spread over instances)."""
    prompts = [prompt_lens] * len(lengths) if isinstance(prompt_lens, int) else list(prompt_lens)
    out: list[list[SimRequest]] = [[] for _ in range(num_instances)]
    for i, (length, p) in enumerate(zip(lengths, prompts)):
        out[i % num_instances].append(SimRequest(p, length))
    return out
