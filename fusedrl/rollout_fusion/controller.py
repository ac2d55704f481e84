"""Inter-stage fusion: migrate the long generation tail onto a few instances and score on the freed ones.

One :class:`MigrationController` per rank runs the rollout (generation + scoring) of its generation
instance's requests. An instance is one rank, or ``gen_tp`` ranks holding a tensor-parallel engine that run the
same requests in lockstep; ``group`` holds one rank per instance (the ranks of the same TP index), so the
controllers of one TP index see the instances as a group of single ranks, take the same decisions from the
same all-gathered statistics, and move their own KV shards to the same TP index of another instance:

- fusion off: decode until every instance is done (a barrier), then every rank scores its own samples;
- fusion on: every ``check_interval`` decode steps the ranks start an all-gather of their unfinished count, remaining
  work and free KV capacity, and decide on the one started ``STATS_LAG`` checks earlier (so a rank does not wait for the
  slowest one at every check). When that global unfinished count is at most the threshold (a fraction of the batch, or
  ``"auto"``: the best threshold and number of kept instances found by simulating the rest of the rollout with lengths
  estimated from those finished, :mod:`.simulator`, :mod:`.remaining`), the plan, made from statistics gathered then,
  keeps the fewest instances that hold the tail (``auto`` may keep more; most remaining work first), moves every other
  instance's unfinished requests to them (KV + tokens over point-to-point, or tokens only in ``reprefill`` mode), and
  sends the kept instances' finished samples to the freed ones. The plan is verified (:func:`.plan.verify_plan`) before
  it runs. Freed instances then score while the tail decodes. A tail sample goes to a freed instance when that one asks
  for work (a credit it sends once it has nothing left to score), the longest first; once its tail has ended a kept
  instance scores the samples no freed one asked for itself, one at a time, so that the instances end their scoring
  about together however long the freed ones' own samples took. Each tail sample is scored alone, so which instance
  scores it changes no result.

``fusion="auto"`` (the config's default) fuses a rollout or not as :class:`FusionChoice` says: rank 0 simulates the
previous rollout both ways, calibrated by how far earlier replays of each way were off.

With a :class:`GroupTarget` (over-provisioned rollouts, :class:`fusedrl.rlhf.PartialRollouts`) the ranks also
all-gather the ids finished since the last check at every check (every ``check_interval`` decode steps, fusion on or
off) and stop decoding once enough whole groups have finished: each rank then exports its unfinished requests
(tokens and log-probs, no KV) as ``RolloutResult.carried``, which the next rollout resumes (``run(resume=...)``).
The target is checked until a migration; a rollout that migrates first decodes its tail to the end.

Multi-turn episodes (``episodes``) never migrate. A fused rollout instead scores where its instance would idle: when
every one of its requests waits for an environment's answer, it scores a few finished samples (:data:`GAP_SAMPLES`)
rather than wait, and takes the answers that came meanwhile afterwards (single-rank instances; an instance whose
requests are all done scores the rest in a thread, as without episodes).

Scoring arrives as a callable (``score``): the controller cuts finished samples into length-sorted
micro-batches and hands each to it; what it returns is collected, never inspected. Sampling uses
per-request RNG streams that travel with the request, so fusion changes no output. Request ids must be
ints. After the rollout every request id is checked to have been scored exactly once across the ranks.

Messages: request states (KV shards) go over ``group`` (the job's default backend: NCCL on GPUs) in the one
order every rank derives from the verified plan. Statistics, decisions and finished samples (token ids, small)
go over ``control_group`` (gloo; receives from any source for the tail streams); within an instance of several
ranks only its TP rank 0 sends and receives finished samples and hands them to its peers over
``instance_group`` (gloo), so that every rank of an instance scores the same samples in the same order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist

from fusedrl.components import ChromeTrace, Progress
from fusedrl.config import FusionSection
from fusedrl.distributed import group_devices
from fusedrl.generation import (
    GenerationEngine,
    PendingSend,
    Request,
    RequestProgress,
    RequestResult,
    RequestState,
    recv_states,
    send_states,
)
from fusedrl.rollout_fusion.plan import InstanceStats, MigrationPlan, MovedRequest, build_plan, choose_kept, verify_plan
from fusedrl.rollout_fusion.remaining import remaining_lengths
from fusedrl.rollout_fusion.simulator import (
    DEFAULT_FRACTIONS,
    STATS_LAG,
    RolloutConfig,
    RolloutCosts,
    SimRequest,
    admitted,
    best_migration,
    simulate_rollout,
)

log = logging.getLogger(__name__)

MigrationMode = Literal["kv", "reprefill"]
AUTO_FALLBACK_FRACTION = 0.1  # an "auto" threshold before costs are known, where no gain is required
AUTO_MIN_GAIN = 0.05  # inter_stage = "auto": a migration must be predicted to shorten the rollout this much
PROBE_MIN_STEPS = 64  # "auto" measures scoring mid-rollout only with at least this many decode steps left to gain in
PROBE_ROWS = 4  # the second measurement's rows: with the first (one sample) it separates a micro-batch's fixed cost
ENV_WAIT_S = 0.05  # an instance with nothing to decode waits this long for an environment's answer between checks
GAP_SAMPLES = 4  # most samples scored at a time while every request waits for its environment (answers wait that long)
TAIL_SHARE = 0.9  # a rollout's tail: its decoding after this share of an instance's requests ended
CALIBRATION_ROLLOUTS = 3  # "auto" fusion scales its simulated rollouts by measured / simulated over this many
HISTORY_SCORES, HISTORY_CHECKS, HISTORY_MIGRATIONS = 512, 512, 16  # the latest measurements "auto" fits costs to
T = TypeVar("T")
ScoreFn = Callable[[list[RequestResult]], T]
"""Scores one micro-batch of finished samples (at most ``micro_batch_size``, sorted by length)."""


class TurnHandler(Protocol):
    """Multi-turn episodes of the engine (:class:`fusedrl.rlhf.Episodes`): the controller hands it every engine step's
    results (turns that ended go to their environments; it returns the episodes that ended) and takes the
    environments' answers from it."""

    @property
    def waiting(self) -> int: ...

    def on_results(self, results: Sequence[RequestResult]) -> list[RequestResult]: ...

    def pump(self, timeout_s: float | None = None) -> list[RequestResult]: ...


@dataclass(frozen=True)
class GroupTarget:
    """Stop a rollout once ``groups`` whole groups have finished, and at least one sample in it. Request ``i`` belongs
    to group ``i // size``; ``finished`` holds ids that finished in earlier rollouts (their groups count too)."""

    size: int
    groups: int
    finished: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.size < 1 or self.groups < 1:
            raise ValueError(f"a group target needs size >= 1 and groups >= 1, got size {self.size}, groups {self.groups}")

    def reached(self, finished: set[int]) -> bool:
        return len(finished) > len(self.finished) and len(whole_groups(finished, self.size)) >= self.groups


def whole_groups(ids: Iterable[int], size: int) -> list[int]:
    """The groups (``id // size``) all ``size`` of whose distinct ids are among ``ids``."""
    counts = Counter(i // size for i in set(ids))
    return [g for g, c in counts.items() if c == size]


@dataclass
class MigrationStats:
    """What the migration did (identical on every rank)."""

    step: int  # decode step (of the lockstep checks) at which it ran
    time_s: float  # seconds into the rollout (the latest rank's)
    threshold: int  # unfinished-count threshold that triggered it
    unfinished: int  # global unfinished requests then
    moved: int  # requests moved
    moved_bytes: int  # bytes of request state sent (KV included in kv mode)
    sample_bytes: int  # bytes of finished samples sent from kept to freed ranks
    kept: tuple[int, ...]
    duration_s: float  # slowest rank's time in the transfers

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class Measurements:
    """Costs this rank measured, to fit :class:`RolloutCosts` (see :meth:`RolloutCosts.fit`)."""

    decode: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, cached tokens, s)
    prefill: list[tuple[int, float]] = field(default_factory=list)  # (tokens, s) of the engine's prefills (PrefillStats)
    score: list[tuple[int, int, float]] = field(default_factory=list)  # (rows, padded len, s) per micro-batch
    transfers: list[tuple[int, float]] = field(default_factory=list)  # (bytes, s)
    checks: list[float] = field(default_factory=list)  # s per check posting its statistics (its own cost)
    migrations: list[float] = field(default_factory=list)  # s per migration, besides its transfers


@dataclass
class FusionChoice:
    """Whether ``inter_stage = "auto"`` fused a rollout, and why (identical on every rank). Rank 0 simulates the
    previous rollout's requests (their measured lengths) fused and unfused with the costs measured so far, each
    scaled by how far the simulator was off replaying the last :data:`CALIBRATION_ROLLOUTS` rollouts run that way
    (measured / simulated: what it does not model, e.g. the fused rollout's checks waiting on a busy rank), and fuses
    where that fused rollout is shorter by at least the controller's ``min_gain``. Until it has replayed both, the
    first rollout runs unfused and the next fused (0 s: not simulated)."""

    fused: bool
    fused_s: float  # the previous rollout's requests, fused, as simulated and scaled
    unfused_s: float  # the same unfused


@dataclass
class AutoDecision:
    """The "auto" threshold's last decision in a rollout, from the rollout simulator (identical on every rank)."""

    threshold: int  # unfinished-count threshold chosen (0: never migrate, the simulated best)
    min_kept: int
    at_s: float  # seconds into the rollout when it was simulated
    predicted_s: float  # the simulated rollout's end with that choice, seconds from the rollout's start
    never_s: float  # the simulated rollout's end without migrating
    predicted_decode_end_s: float  # the simulated last decode step's end with that choice


@dataclass
class RolloutResult(Generic[T]):
    """One rank's outcome of a rollout (generation + scoring)."""

    scored: list[T]  # score()'s outputs on this rank, or every rank's with run(..., gather=True)
    rollout_s: float  # slowest rank's rollout time
    decode_end_s: float  # when the last decode step of any rank ended
    scoring_s: float  # this rank's time spent scoring
    migration: MigrationStats | None
    trace: ChromeTrace  # spans of every rank (pid = rank): decode, migrate, score
    measurements: Measurements
    auto: AutoDecision | None = None  # the "auto" threshold's last simulated decision (None: none was simulated)
    fused: bool = False  # whether the rollout ran fused (inter-stage fusion on, or "auto" chose it)
    fusion_choice: FusionChoice | None = None  # inter_stage = "auto": why it fused or not (None: not "auto")
    carried: list[RequestState] = field(default_factory=list)  # this rank's unfinished requests at a GroupTarget's stop
    env_idle_s: float = 0.0  # this rank's engine waited for environments with nothing to decode
    tail_s: float = 0.0  # the slowest instance's decoding after 90% of its requests had ended

    @property
    def scoring_exposed_s(self) -> float:
        """Rollout time after the last decode step (scoring that did not overlap decoding)."""
        return self.rollout_s - self.decode_end_s


class MigrationController(Generic[T]):
    """Runs generation + scoring for this rank's requests, with or without inter-stage fusion.

    Args:
        engine: this rank's generation instance (all ranks' engines must share the seed).
        score: scores one micro-batch of finished samples on this rank (e.g. ``Scorer.score``).
        micro_batch_size: most samples per ``score`` call.
        fusion: migrate the tail and overlap scoring (False: score only after all decoding ends). With it an instance
            whose own requests are done while others decode scores its finished samples meanwhile. ``"auto"``: each
            rollout is fused or not as :class:`FusionChoice` says (the first runs unfused and measures; with
            ``episodes`` every rollout is fused: the simulator does not model environments).
        threshold: migrate when global unfinished <= ``threshold * batch`` (0 < threshold < 1), or ``"auto"``.
        min_gain: with ``"auto"``, migrate only where the simulated rollout ends at least this fraction sooner than
            without migrating, and sooner by more than the last simulated rollout was off (until costs are known:
            never); with ``fusion="auto"``, fuse only where the calibrated fused rollout is this much shorter. Before
            any scoring was measured (the first rollout) and with :data:`PROBE_MIN_STEPS` decode steps or more left,
            ``"auto"`` scores rank 0's first finished sample at once (its cost per token stands for scoring's until
            more is measured), then a micro-batch of its next :data:`PROBE_ROWS` (the two give a micro-batch's fixed
            cost and its cost per token).
        mode: ``kv`` sends KV caches; ``reprefill`` sends tokens and recomputes the KV.
        check_interval: decode steps between statistics all-gathers.
        costs: rollout costs for ``auto``; default: fitted from this controller's own earlier measurements.
        group: one rank per generation instance (the ranks of this rank's TP index); None: all ranks, each an
            instance. Request states travel here.
        control_group: the same ranks on a gloo backend (statistics, decisions, finished samples); default
            ``group``.
        instance_group: this instance's ranks (gloo) when an instance spans several ranks (gen_tp > 1).
        episodes: the engine's multi-turn episodes: each engine step's results pass through it, an instance with
            nothing to decode waits for its environments' answers, and nothing migrates (the episodes' environments
            stay on their instance).
    """

    def __init__(
        self,
        engine: GenerationEngine,
        score: ScoreFn[T],
        *,
        micro_batch_size: int = 8,
        fusion: bool | Literal["auto"] = True,
        threshold: float | Literal["auto"] = "auto",
        min_gain: float = 0.0,
        mode: MigrationMode = "kv",
        check_interval: int = 8,
        costs: RolloutCosts | None = None,
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        instance_group: dist.ProcessGroup | None = None,
        episodes: TurnHandler | None = None,
    ) -> None:
        if threshold != "auto" and not (isinstance(threshold, (int, float)) and 0.0 < threshold < 1.0):
            raise ValueError(f'migration threshold must be a fraction in (0, 1) or "auto", got {threshold!r}')
        if mode not in ("kv", "reprefill"):
            raise ValueError(f"migration mode must be 'kv' or 'reprefill', got {mode!r}")
        if fusion not in (True, False, "auto"):
            raise ValueError(f'fusion must be true, false or "auto", got {fusion!r}')
        if check_interval < 1:
            raise ValueError(f"check_interval must be >= 1, got {check_interval}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.engine, self.score, self.micro_batch_size = engine, score, micro_batch_size
        self.fusion, self.threshold, self.mode, self.check_interval = fusion, threshold, mode, check_interval
        self.costs, self.group = costs, group
        self.min_gain, self.episodes = min_gain, episodes
        self.prediction_error = 0.0  # how far off the last simulated rollout's length was, relative to the measured one
        self.control_group = control_group if control_group is not None else group
        self.instance_group = instance_group if instance_group is not None and dist.get_world_size(instance_group) > 1 else None
        self.leader = self.instance_group is None or dist.get_rank(self.instance_group) == 0
        served = group_devices(group) if dist.is_initialized() else {"cpu"}
        # request-state buffers on the engine's device when the group carries it (NCCL), else through the host
        self.device = engine.device if engine.device.type in served else torch.device("cpu")
        # every instance's scoring, checks and migrations (the latest, bounded): "auto" fits its costs to them
        self._history = Measurements()
        self._last_lengths: list[tuple[int, bool]] = []  # the previous rollout's (length, censored), every rank's
        # the previous rollout's requests per instance (their measured lengths, admitted as the engine's slots free)
        # and its measurements: "auto" fusion simulates them fused and unfused before a rollout
        self._last_requests: list[list[SimRequest]] = []
        self._last_measured = Measurements()
        self._auto_choice = (0, 1)  # the last (migration threshold, fewest kept instances) "auto" chose (0: none yet)
        # fused -> measured / simulated time of the last rollouts run that way ("auto" fusion scales its predictions)
        self.calibration: dict[bool, deque[float]] = {m: deque(maxlen=CALIBRATION_ROLLOUTS) for m in (False, True)}
        self._last_costs: RolloutCosts | None = None  # rank 0: fitted as a rollout ends, for its replay and the next choice

    @classmethod
    def from_config(
        cls,
        engine: GenerationEngine,
        score: ScoreFn[T],
        section: FusionSection,
        *,
        micro_batch_size: int,
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        instance_group: dist.ProcessGroup | None = None,
        episodes: TurnHandler | None = None,
    ) -> MigrationController[T]:
        """A controller as the ``[fusion]`` section says (``inter_stage``: "auto" migrates where the simulator predicts
        at least :data:`AUTO_MIN_GAIN`; ``migration_*``)."""
        return cls(
            engine,
            score,
            micro_batch_size=micro_batch_size,
            fusion=section.inter_stage,
            threshold=section.migration_threshold,
            min_gain=AUTO_MIN_GAIN if section.inter_stage == "auto" else 0.0,
            mode=section.migration_mode,
            check_interval=section.migration_check_interval,
            group=group,
            control_group=control_group,
            instance_group=instance_group,
            episodes=episodes,
        )

    # ------------------------------------------------------------------------------------------ rollout
    def run(
        self,
        requests: Sequence[Request],
        *,
        resume: Sequence[RequestState] = (),
        target: GroupTarget | None = None,
        gather: bool = False,
        progress: Progress | None = None,
    ) -> RolloutResult[T]:
        """Generate and score this instance's ``requests`` and continue the unfinished request states ``resume`` (the
        same on every rank of an instance; a collective over the groups). With a ``target`` decoding stops once it is
        reached, and the requests left unfinished come back in ``RolloutResult.carried``. ``progress`` counts the
        requests this engine finishes (its total follows migration) and shows its decode tokens/s."""
        if not dist.is_initialized():
            raise RuntimeError(
                "MigrationController.run needs a process group (it exchanges request counts between generation "
                "instances): call torch.distributed.init_process_group (world_size=1 in one process), or in one process "
                "use engine.generate and scorer.score instead (docs/custom_loop.md)"
            )
        for r in [*requests, *(s.request for s in resume)]:
            if not isinstance(r.id, int):
                raise ValueError(f"request id {r.id!r} is not an int; the controller needs int ids (sample ids)")
        for r in requests:
            self.engine.add_request(r)
        for state in resume:
            self.engine.import_request(state)
        resumed = {int(s.id): len(s.generated) for s in resume}
        rank, world = dist.get_rank(self.control_group), dist.get_world_size(self.control_group)
        choice = self._choose_fusion() if rank == 0 and world > 1 else None
        gathered = self._all_gather(([r.id for r in requests] + [s.id for s in resume], choice))
        all_ids = [i for ids, _ in gathered for i in ids]
        if len(set(all_ids)) != len(all_ids):
            raise ValueError("request ids must be unique across ranks")
        choice = self._share(gathered[0][1])  # an instance's ranks follow its TP rank 0, whose group's rank 0 chose
        fused = world > 1 and (choice.fused if choice is not None else self.fusion is not False)
        if choice is not None and rank == 0:
            log.info(
                "inter-stage fusion %s for this rollout (%s)",
                "on" if fused else "off",
                f"the last rollout's requests simulated and calibrated: {choice.fused_s:.3g} s fused, "
                f"{choice.unfused_s:.3g} s unfused"
                if choice.fused_s
                else "measuring the rollout " + ("fused" if fused else "unfused") + " before choosing",
            )
        run = _Rollout(self, rank, world, len(all_ids), progress, target, fused)
        run.execute()
        end = run.clock()
        a = run.auto_decision
        if a is not None and rank == 0:
            chosen = f"migrate at <= {a.threshold} unfinished" if a.threshold else "no migration"
            log.info(
                "inter-stage fusion: %s (simulated %.1f s into the rollout: it ends at %.1f s, %.1f s without migrating; "
                "a gain of %.0f%% needed)",
                chosen if run.migration is None or not a.threshold else f"migrated ({chosen})",
                a.at_s,
                a.predicted_s,
                a.never_s,
                100 * self.required_gain(),
            )
        self._reconcile(run.scored_ids + [int(s.id) for s in run.carried], all_ids)
        scored = run.scored
        if gather:
            scored = [part for parts in self._all_gather(scored) for part in parts]
        tail = run.decode_end - run.tail_start if run.tail_start is not None else 0.0
        ranks = self._all_gather(
            dict(
                end=end,
                decode_end=run.decode_end,
                spans=run.spans,
                tail=tail,
                ended=run.ended_requests,
                carried=[len(s.generated) for s in run.carried],
                resumed=resumed,
                measured=run.measurements,
            )
        )
        rollout_s = max(r["end"] for r in ranks)
        if a is not None:  # every rank holds rank 0's decision and, now, the measured length
            self.prediction_error = abs(rollout_s - (a.predicted_s if run.migration is not None else a.never_s)) / rollout_s
        trace = ChromeTrace()
        for i, r in enumerate(ranks):
            trace.name_process(i, f"rank {i}")
            for kind, start, stop, args in r["spans"]:
                trace.complete(kind, start, stop - start, pid=i, tid=0, **args)
        # every instance's costs, so that every rank fits the same ones: the same hardware and engine settings
        measured: list[Measurements] = [r["measured"] for r in ranks]
        self._history.score += [x for m in measured for x in m.score]
        self._history.migrations += [x for m in measured for x in m.migrations]
        self._history.checks += [x for m in measured for x in m.checks]
        self._last_measured = Measurements(
            decode=[x for m in measured for x in m.decode], prefill=[x for m in measured for x in m.prefill]
        )
        if a is not None and a.threshold:
            self._auto_choice = (a.threshold, a.min_kept)
        # carried requests: unfinished at that length
        self._last_lengths = [x for r in ranks for x in _lengths(r["ended"]) + [(n, True) for n in r["carried"]]]
        # a resumed request decoded its earlier tokens in an earlier rollout: here they were context
        earlier = {i: n for r in ranks for i, n in r["resumed"].items()}
        ended = {i: (prompt + earlier.get(i, 0), max(1, n - earlier.get(i, 0))) for r in ranks for i, prompt, n, _ in r["ended"]}
        self._last_requests = [admitted([ended[i] for i in ids if i in ended], self.engine.max_slots) for ids, _ in gathered]
        h = self._history
        for kept, measurements in ((HISTORY_SCORES, h.score), (HISTORY_CHECKS, h.checks), (HISTORY_MIGRATIONS, h.migrations)):
            del measurements[:-kept]
        if choice is not None and rank == 0:  # the rank that chooses (its state is the one checkpoints save)
            self._last_costs = self._fitted_costs(self._last_measured)
            self._replay(run, rollout_s)
        return RolloutResult(
            scored=scored,
            rollout_s=rollout_s,
            decode_end_s=max(r["decode_end"] for r in ranks),
            tail_s=max(r["tail"] for r in ranks),
            scoring_s=run.scoring_s,
            migration=run.migration,
            trace=trace,
            measurements=run.measurements,
            auto=run.auto_decision,
            carried=run.carried,
            env_idle_s=run.env_idle_s,
            fused=fused,
            fusion_choice=choice,
        )

    def _reconcile(self, scored_ids: list[int], all_ids: list[int]) -> None:
        scored = [i for part in self._all_gather(scored_ids) for i in part]
        counts: dict[int, int] = {}
        for i in scored:
            counts[i] = counts.get(i, 0) + 1
        lost = sorted(set(all_ids) - set(counts))
        dup = sorted(i for i, c in counts.items() if c > 1)
        extra = sorted(set(counts) - set(all_ids))
        if lost or dup or extra:
            raise RuntimeError(
                f"rollout results do not reconcile: lost ids {lost[:5]}, duplicated {dup[:5]}, unknown {extra[:5]}"
            )

    def required_gain(self) -> float:
        """The shortening (a fraction of the rollout) an ``"auto"`` migration must promise: ``min_gain`` and, when that
        is set, no less than the last simulated rollout's error (a gain the simulator cannot tell from its error is
        none)."""
        return max(self.min_gain, self.prediction_error) if self.min_gain > 0 else 0.0

    # ------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, str]:
        """What "auto" learned (measurements, the last rollout's requests and lengths, calibrations, its last
        migration choice and prediction error): rank 0's, which chooses, on every rank (a collective); a resumed run
        decides as the run it continues would have."""
        h, last = self._history, self._last_measured
        state = json.dumps(
            {
                "score": h.score,
                "checks": h.checks,
                "migrations": h.migrations,
                "decode": last.decode,
                "prefill": last.prefill,
                "requests": [[[r.ctx, r.remaining, r.start] for r in rs] for rs in self._last_requests],
                "lengths": self._last_lengths,
                "calibration": {str(k): list(v) for k, v in self.calibration.items()},
                "auto_choice": self._auto_choice,
                "prediction_error": self.prediction_error,
            }
        )
        # the other ranks hold the same measurements but replay nothing, and a fit's last bits vary between processes
        return {"state": self._share(_broadcast(state, self.control_group)) if dist.is_initialized() else state}

    def load_state_dict(self, state: dict[str, str]) -> None:
        saved = json.loads(state["state"])
        self._history = Measurements(
            score=[tuple(x) for x in saved["score"]], checks=saved["checks"], migrations=saved["migrations"]
        )
        self._last_measured = Measurements(
            decode=[tuple(x) for x in saved["decode"]], prefill=[tuple(x) for x in saved["prefill"]]
        )
        self._last_requests = [[SimRequest(*r) for r in rs] for rs in saved["requests"]]
        self._last_lengths = [(int(n), bool(cut)) for n, cut in saved["lengths"]]
        for k, v in self.calibration.items():
            v.clear()
            v.extend(saved["calibration"][str(k)])
        self._auto_choice, self.prediction_error = tuple(saved["auto_choice"]), saved["prediction_error"]
        self._last_costs = self._fitted_costs(self._last_measured)

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.control_group)
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def _share(self, obj: Any) -> Any:
        """``obj`` of this instance's TP rank 0, on every rank of the instance."""
        return obj if self.instance_group is None else _broadcast(obj, self.instance_group)

    def _fitted_costs(self, rollout: Measurements, *, running: bool = False) -> RolloutCosts | None:
        """Costs fitted to one rollout's decode steps and prefills (the engine pads a step to its batch and length
        buckets) and every scoring micro-batch, migration and check measured so far, the ``running`` rollout's
        included (one scoring micro-batch alone: its cost per token, no fixed cost). None: too few measurements."""
        if self.costs is not None:
            return self.costs
        now = rollout if running else Measurements()
        score = self._history.score + now.score
        if len(rollout.decode) < 3 or not score:
            return None
        rows, length, seconds = score[0]
        checks = self._history.checks + now.checks
        return RolloutCosts.fit(
            rollout.decode,
            score if len(score) >= 2 else [],
            rollout.prefill,
            batch_buckets=self.engine.batch_buckets,
            len_buckets=self.engine.len_buckets,
            score_per_token_s=None if len(score) >= 2 else seconds / (rows * length),
            migrations=self._history.migrations + now.migrations,
            check_s=sum(checks) / len(checks) if checks else 0.0,
        )

    def _sim_config(self, *, prefill: bool) -> RolloutConfig:
        return RolloutConfig(
            max_slots=self.engine.max_slots,
            kv_capacity_tokens=self.engine.max_slots * self.engine.max_len,
            check_interval=self.check_interval,
            micro_batch_size=self.micro_batch_size,
            mode=self.mode,
            prefill=prefill,
        )

    def _migration(self, batch: int) -> tuple[int, int]:
        """(unfinished-count threshold, fewest kept instances) a fused rollout of ``batch`` requests migrates at: the
        fixed threshold, or the last choice of "auto" (:data:`AUTO_FALLBACK_FRACTION` of the batch before any)."""
        if self.threshold == "auto" and self._auto_choice[0]:
            return self._auto_choice
        return max(1, round((self.threshold if self.threshold != "auto" else AUTO_FALLBACK_FRACTION) * batch)), 1

    def _choose_fusion(self) -> FusionChoice | None:
        """Rank 0, before a rollout, where ``fusion`` is ``"auto"``: see :class:`FusionChoice`. The fused rollout
        migrates as :meth:`_migration` says (with an "auto" threshold: or never, whichever is shorter). With
        episodes every rollout is fused (None: the simulator does not model environments)."""
        if self.fusion != "auto" or self.episodes is not None:
            return None
        if not self.calibration[False] or not self.calibration[True]:
            return FusionChoice(bool(self.calibration[False]), 0.0, 0.0)
        costs = self._last_costs
        if costs is None:
            return FusionChoice(False, 0.0, 0.0)
        requests, config = self._last_requests, self._sim_config(prefill=True)
        unfused = simulate_rollout(requests, costs, config, fused=False).total_s
        threshold, min_kept = self._migration(sum(len(r) for r in requests))
        fused = simulate_rollout(requests, costs, config, fused=True, threshold=threshold, min_kept=min_kept).total_s
        if self.threshold == "auto":
            fused = min(fused, simulate_rollout(requests, costs, config, fused=True, threshold=0).total_s)
        fused *= statistics.fmean(self.calibration[True])
        unfused *= statistics.fmean(self.calibration[False])
        return FusionChoice(fused < (1 - self.min_gain) * unfused, fused, unfused)

    def _replay(self, run: _Rollout, measured_s: float) -> None:
        """Simulate the rollout that just ran on its requests' measured lengths, in the way it ran, and keep measured /
        simulated for that way (``calibration``)."""
        costs = self._last_costs
        if costs is None or measured_s <= 0:
            return
        m, config = run.migration, self._sim_config(prefill=True)
        threshold, kept = (m.threshold, len(m.kept)) if m is not None else (0, 1)
        replayed = simulate_rollout(
            self._last_requests, costs, config, fused=run.fused, threshold=threshold, min_kept=kept
        ).total_s
        if replayed > 0:
            self.calibration[run.fused].append(measured_s / replayed)


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """``obj`` of ``group``'s rank 0, on every rank of it."""
    box = [obj]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


_SAMPLES_TAG = 7  # finished samples (kept -> freed) travel on their own tag, request states on tag 0
_CREDIT_TAG = 8  # a freed rank asks a kept one for a tail sample (freed -> kept)


class _TailLender:
    """A kept rank's finished tail samples, lent to its freed ranks as they ask: a thread per freed rank receives its
    credits and answers each with the longest waiting sample at once (or, with none waiting, as soon as one finishes),
    whatever the rollout's thread is doing, decoding or scoring a sample itself. After :meth:`end` a credit finds the
    end of the stream (an empty batch). On the instance's TP rank 0 only."""

    def __init__(self, freed: Sequence[int], group: dist.ProcessGroup | None) -> None:
        self._group = group
        self._ready = threading.Condition()
        self._waiting: list[RequestResult] = []  # longest first
        self._ended = False
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._serve, args=(f,), name="fusedrl-tail-lender", daemon=True) for f in freed]
        for t in self._threads:
            t.start()

    def add(self, samples: list[RequestResult]) -> None:
        with self._ready:
            self._waiting = sorted(self._waiting + samples, key=lambda s: (-s.num_tokens, int(s.id)))
            self._ready.notify_all()

    def take(self) -> RequestResult | None:
        """The longest sample no freed rank has asked for yet, or None."""
        with self._ready:
            return self._waiting.pop(0) if self._waiting else None

    def end(self) -> None:
        """Answer every freed rank's next credit with the end of its stream; wait until each has had it."""
        with self._ready:
            self._ended = True
            self._ready.notify_all()
        for t in self._threads:
            t.join()
        if self._errors:
            raise self._errors[0]

    def _serve(self, freed: int) -> None:
        try:
            while True:
                dist.recv(torch.zeros(1, dtype=torch.int64), group=self._group, tag=_CREDIT_TAG, group_src=freed)
                with self._ready:
                    self._ready.wait_for(lambda: bool(self._waiting) or self._ended)
                    sample = self._waiting.pop(0) if self._waiting else None
                batch = [RequestState.of_result(sample)] if sample is not None else []
                send_states(batch, freed, group=self._group, tag=_SAMPLES_TAG)
                if sample is None:
                    return
        except BaseException as e:  # raised again by end(), in the rollout's own thread
            self._errors.append(e)
            with self._ready:  # a failed thread stops lending: the rest stay here for the rollout's thread
                self._ended = True


def _send_credit(dst: int, group: dist.ProcessGroup | None) -> PendingSend:
    buf = torch.ones(1, dtype=torch.int64)
    work = dist.isend(buf, group=group, tag=_CREDIT_TAG, group_dst=dst)
    assert work is not None  # the sender is in the group
    return PendingSend([work], [buf])


class _Rollout:
    """State of one rank during one rollout."""

    def __init__(
        self,
        ctl: MigrationController,
        rank: int,
        world: int,
        batch: int,
        progress: Progress | None,
        target: GroupTarget | None,
        fused: bool,
    ) -> None:
        self.ctl, self.engine, self.rank, self.world, self.batch = ctl, ctl.engine, rank, world, batch
        self.fused = fused
        self.progress, self.target = progress, target
        self.done_ids: set[int] = set(target.finished) if target is not None else set()  # every rank's, as of the last check
        self.unreported: list[int] = []  # finished here since the last check
        self.carried: list[RequestState] = []
        self.decoded = 0  # tokens this engine decoded (for the progress's tokens/s)
        self.finished: list[RequestResult] = []  # finished here, not yet scored
        self.scored: list[Any] = []
        self.scored_ids: list[int] = []
        self.spans: list[tuple[str, float, float, dict]] = []
        self.measurements = Measurements()
        self.migration: MigrationStats | None = None
        self.scoring_s = 0.0
        self.decode_end = 0.0
        self.steps = 0
        # (id, prompt tokens, generated tokens, censored: cut at its budget) of the requests that ended here
        self.ended_requests: list[tuple[int, int, int, bool]] = []
        # (length, censored) of finished samples, every rank's as of the last simulation ("auto"; the previous
        # rollout's first), which holds this rank's up to ended_requests[shared_lengths:]
        self.shared_lengths = 0
        self.observed_lengths: list[tuple[int, bool]] = list(ctl._last_lengths)
        self.auto_choice: tuple[int, int] | None = None  # (threshold, min_kept) from the last simulation
        self.auto_decision: AutoDecision | None = None  # the last simulation's choice and prediction
        self.auto_evaluated_at: int | None = None
        self.auto_fallback_logged = False
        self.idle_scoring: tuple[threading.Thread, list[BaseException]] | None = None
        self.episodes = ctl.episodes
        self.env_idle_s = 0.0  # waiting for environments with nothing to decode
        self.requests = self.engine.num_unfinished  # this instance's, as the rollout starts
        self.tail_start: float | None = None  # when TAIL_SHARE of them had ended
        dist.barrier(group=ctl.control_group)
        self.t0 = time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    # -------------------------------------------------------------------------------------- phases
    def execute(self) -> None:
        ctl = self.ctl
        if not self.fused:
            self._decode_until_done()
            dist.barrier(group=ctl.control_group)  # scoring starts only after every instance finished decoding
            self._score_finished()
            return
        plan = self._decode_until_threshold()
        self._join_idle_scoring()
        if plan is None:  # decoding ended before the threshold was reached
            self._score_finished()
            return
        if self.rank in plan.kept:
            self._decode_tail(plan)
        else:
            self._score_finished()
            self._score_tail_streams(plan)

    def _has_work(self) -> bool:
        """Whether this instance still decodes or waits for an environment's answer."""
        return self.engine.has_work() or (self.episodes is not None and self.episodes.waiting > 0)

    def _step(self) -> None:
        """One engine step; with episodes, the turns that ended go to their environments and their answers come in.
        Where the engine has nothing to decode, a fused rollout scores up to :data:`GAP_SAMPLES` finished samples (one
        micro-batch at most; the gap would idle otherwise), an unfused one waits up to :data:`ENV_WAIT_S` for an answer
        (it idles)."""
        stats, prefilled = self.engine.stats(), dataclasses.replace(self.engine.prefill_stats)
        start, graphs = self.clock(), self.engine.compile_stats.graphs
        results = self.engine.step() if self.engine.has_work() else []
        idle, gap = 0.0, False
        if self.episodes is not None:
            results = self.episodes.on_results(results)
            waiting = not self.engine.has_work()
            # an instance of several ranks would need them to agree on each gap: only single-rank instances score in gaps
            single = self.ctl.instance_group is None
            gap = waiting and single and self.fused and self.episodes.waiting > 0 and bool(self.finished)
            gap = gap and self.idle_scoring is None
            waited = self.clock()
            results += self.episodes.pump(ENV_WAIT_S if waiting and not gap else None)
            if waiting and not gap:
                idle = self.clock() - waited
                self.env_idle_s += idle
        for res in results:
            if not res.ok:
                raise ValueError(f"request {res.id} was rejected: {res.error}")
            self.finished.append(res)
            self.unreported.append(int(res.id))
            cut = res.finish_reason in ("length", "max_len")
            self.ended_requests.append((int(res.id), len(res.request.prompt), len(res.tokens), cut))
        end = self.clock()
        if self.tail_start is None and len(self.ended_requests) >= TAIL_SHARE * self.requests:
            self.tail_start = end
        if self.progress is not None:
            self.decoded += stats.active
            self.progress.update(len(results), tok_s=self.decoded / max(end, 1e-9))
        now = self.engine.prefill_stats
        if now.tokens > prefilled.tokens:  # the engine times its prefills apart (those that compiled nothing)
            self.measurements.prefill.append((now.tokens - prefilled.tokens, now.seconds - prefilled.seconds))
        if stats.waiting == 0 and stats.active and self.engine.compile_stats.graphs == graphs and not idle:
            self.measurements.decode.append((stats.active, stats.cached_tokens, end - start))
        self._span("decode", start, end)
        self.decode_end = end
        if gap and not self.engine.has_work():  # no answer came in meanwhile: score the oldest samples in the gap
            size = min(GAP_SAMPLES, self.ctl.micro_batch_size)  # one micro-batch
            chunk, self.finished = self.finished[:size], self.finished[size:]
            self._score(chunk)

    def _decode_until_done(self) -> None:
        if self.target is None:
            while self._has_work():
                self._step()
            return
        while True:  # lockstep checks of the target, until it is reached or every rank is done
            for _ in range(self.ctl.check_interval):
                if self._has_work():
                    self._step()
            reached, busy = self._check_target()
            if reached or not busy:
                return

    def _check_target(self) -> tuple[bool, bool]:
        """(the group target is reached, some rank still decodes), from every rank's ids finished since the last
        check (collective). When reached, this rank's unfinished requests leave the engine as ``carried``."""
        assert self.target is not None
        parts = self.ctl._all_gather((self.unreported, self.engine.has_work()))
        self.unreported = []
        for ids, _ in parts:
            self.done_ids.update(ids)
        reached = self.target.reached(self.done_ids)
        if reached:
            self.carried = [self.engine.export_request(i, mode="reprefill") for i in self.engine.unfinished_ids()]
            if self.progress is not None:
                self.progress.set_total(self.progress.done)
        return reached, any(busy for _, busy in parts)

    def _decode_until_threshold(self) -> MigrationPlan | None:
        """Decode with a check every ``check_interval`` steps. A check posts this instance's statistics (an
        all-gather that runs in the background) and decides on the all-gather posted ``STATS_LAG`` checks
        earlier: every rank decides on the same statistics, and a rank waits at a check only for a rank more
        than ``STATS_LAG`` intervals behind it, not for the slowest one at every check. The migration itself
        is planned on statistics gathered fresh."""
        ctl, k = self.ctl, self.ctl.check_interval
        posted: deque[Callable[[], list[InstanceStats]]] = deque()
        threshold = min_kept = unfinished = 0
        while True:
            for _ in range(k):
                if self._has_work():
                    self._step()
            self.steps += k
            if not self._has_work() and self.finished and self.target is None:
                self._score_while_idle()
            elif probe := self._probe():
                self.finished = [s for s in self.finished if all(s is not p for p in probe)]
                self._score(probe)
            if self.target is not None and self._check_target()[0]:
                for wait in posted:  # every rank posted them before this check: they complete
                    wait()
                return None
            start = self.clock()
            posted.append(self._post_stats())
            self.measurements.checks.append(self.clock() - start)
            if len(posted) <= STATS_LAG:
                continue
            unfinished = sum(s.unfinished for s in posted.popleft()())
            if unfinished == 0:
                break
            threshold, min_kept = self._threshold(unfinished)
            if unfinished <= threshold:
                break
        for wait in posted:  # every rank posted them before this check: they complete
            wait()
        if unfinished == 0:
            return None
        start = self.clock()
        stats: list[InstanceStats] = ctl._all_gather(self._instance_stats(self.engine.progress()))
        unfinished = sum(s.unfinished for s in stats)
        if unfinished == 0:  # the tail ended during the lag
            return None
        kept = choose_kept(stats, min_kept)
        if len(kept) == self.world:  # every rank computes the same: all skip together
            log.info("migration skipped at step %d: the %d unfinished requests need every instance", self.steps, unfinished)
            self._decode_until_done()
            return None
        return self._migrate(stats, kept, threshold, unfinished, start)

    def _post_stats(self) -> Callable[[], list[InstanceStats]]:
        """Start the all-gather of this instance's statistics; the returned function waits for every rank's."""
        mine = torch.tensor(astuple(self._instance_stats(self.engine.progress())), dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        work = dist.all_gather(out, mine, group=self.ctl.control_group, async_op=True)
        assert work is not None  # async_op=True on a member of the group

        def wait() -> list[InstanceStats]:
            work.wait()
            return [InstanceStats(*row.tolist()) for row in out]

        return wait

    def _instance_stats(self, progress: list[RequestProgress]) -> InstanceStats:
        s = self.engine.stats()
        return InstanceStats(
            rank=self.rank,
            unfinished=s.active + s.waiting + self.engine.num_awaiting,
            remaining_tokens=s.remaining_tokens,
            max_slots=self.engine.max_slots,
            kv_capacity_tokens=self.engine.max_slots * self.engine.max_len,
            kv_reserved_tokens=s.cached_tokens + s.remaining_tokens,
            largest_request_tokens=max((p.prompt_len + p.budget for p in progress), default=0),
            finished_unscored=len(self.finished),
        )

    # -------------------------------------------------------------------------------------- threshold
    def _threshold(self, unfinished: int) -> tuple[int, int]:
        """(unfinished-count threshold, fewest instances to keep)."""
        ctl = self.ctl
        if self.episodes is not None:  # episodes stay with their environments
            return 0, 1
        if ctl.threshold != "auto":
            return max(1, round(ctl.threshold * self.batch)), 1
        # No candidate threshold can trigger yet: do not simulate (it costs every rank a wait at this check).
        if unfinished > round(max(DEFAULT_FRACTIONS) * self.batch):
            return 0, 1
        # Re-simulate when the tail has shrunk by 10% since the last simulation; rank 0 decides on every rank's
        # requests and finished samples now (gathered here) and the lengths finished so far.
        if self.auto_evaluated_at is None or unfinished <= 0.9 * self.auto_evaluated_at:
            details = ctl._all_gather(
                (
                    _progress_summary(self.engine.progress()),
                    [s.num_tokens for s in self.finished],
                    _lengths(self.ended_requests[self.shared_lengths :]),
                )
            )
            self.shared_lengths = len(self.ended_requests)
            for _, _, lengths in details:
                self.observed_lengths += lengths
            choice: list[tuple[int, int, AutoDecision | None] | None] = [None]
            if self.rank == 0:
                choice[0] = self._simulate_threshold([(progress, finished) for progress, finished, _ in details])
            dist.broadcast_object_list(choice, group_src=0, group=ctl.control_group)
            # timings differ between an instance's ranks: all of them follow its TP rank 0 (hence instance 0's)
            shared = ctl._share(choice[0])
            assert shared is not None  # rank 0 always decides
            threshold, min_kept, decision = shared
            self.auto_choice, self.auto_evaluated_at = (threshold, min_kept), unfinished
            self.auto_decision = decision or self.auto_decision
        assert self.auto_choice is not None  # set together with auto_evaluated_at
        return self.auto_choice

    def _simulate_threshold(self, details: list) -> tuple[int, int, AutoDecision | None]:
        costs = self.ctl._fitted_costs(self.measurements, running=True)
        if costs is None:  # inter_stage = "auto" (a gain required) migrates on no guess; true takes a fixed share
            fallback = 0 if self.ctl.min_gain > 0 else max(1, round(AUTO_FALLBACK_FRACTION * self.batch))
            if not self.auto_fallback_logged:  # once per rollout, not at every re-simulation
                log.info(
                    "auto migration threshold: too few costs measured yet, %s",
                    f"using {100 * AUTO_FALLBACK_FRACTION:.0f}% of the batch" if fallback else "no migration",
                )
                self.auto_fallback_logged = True
            return fallback, 1, None
        estimates = remaining_lengths(
            [[(gen, budget) for _, gen, _, budget in progress] for progress, _ in details], self.observed_lengths
        )
        instances = [
            [
                SimRequest(ctx, max(1, forced - gen) if forced is not None else left)  # a forced length is exact
                for (ctx, gen, forced, _), left in zip(progress, lefts)
            ]
            for (progress, _), lefts in zip(details, estimates)
        ]
        config = self.ctl._sim_config(prefill=False)
        backlog = [finished for _, finished in details]
        now = self.clock()
        threshold, min_kept, times = best_migration(
            instances,
            costs,
            config,
            backlog=backlog,
            batch_size=self.batch,
            min_gain=self.ctl.required_gain(),
        )
        never = simulate_rollout(instances, costs, config, fused=True, threshold=0, backlog=backlog)
        return (
            threshold,
            min_kept,
            AutoDecision(threshold, min_kept, now, now + times.total_s, now + never.total_s, now + times.decode_end_s),
        )

    # -------------------------------------------------------------------------------------- migration
    def _migrate(
        self, stats: list[InstanceStats], kept: list[int], threshold: int, unfinished: int, gathered_at: float
    ) -> MigrationPlan:
        """Run the migration planned on ``stats`` (gathered from ``gathered_at`` on); its cost besides the transfers
        goes to the measurements."""
        ctl, start = self.ctl, self.clock()
        exported = []
        if self.rank not in kept:
            exported = [self.engine.export_request(i, mode=ctl.mode) for i in self.engine.unfinished_ids()]
        mine = {
            "moved": [
                MovedRequest(int(s.id), self.rank, s.cache_len, s.request.sampling.new_token_budget - len(s.generated))
                for s in exported
            ],
            "samples": [(s.id, s.num_tokens) for s in self.finished] if self.rank in kept else [],
            "load": float(sum(s.num_tokens for s in self.finished)),
        }
        parts = ctl._all_gather(mine)
        moved = [m for p in parts for m in p["moved"]]
        kept_samples = {r: parts[r]["samples"] for r in kept}
        plan = build_plan(stats, kept, moved, kept_samples, {r: parts[r]["load"] for r in range(self.world) if r not in kept})
        verify_plan(plan, stats, moved, kept_samples)
        planned = self.clock()

        states = {int(s.id): s for s in exported}
        by_id = {s.id: s for s in self.finished}
        sent_req = sent_samples = 0
        received_samples: list[RequestResult] = []
        for op, peer, t in plan.program(self.rank):
            t_start = self.clock()
            if t.kind == "request" and op == "send":
                nbytes = send_states([states.pop(t.ids[0])], peer, group=ctl.group, device=ctl.device)
                sent_req += nbytes
                self.measurements.transfers.append((nbytes, self.clock() - t_start))
            elif t.kind == "request":
                for state in recv_states(peer, group=ctl.group, device=ctl.device)[1]:
                    self.engine.import_request(state)
            elif op == "send":  # finished samples: the instance's TP rank 0 sends for all its ranks
                batch = [RequestState.of_result(by_id.pop(i)) for i in t.ids]
                if ctl.leader:
                    sent_samples += send_states(batch, peer, group=ctl.control_group, tag=_SAMPLES_TAG)
            elif ctl.leader:
                received = [s.to_result() for s in recv_states(peer, group=ctl.control_group, tag=_SAMPLES_TAG)[1]]
                if [s.id for s in received] != list(t.ids):
                    raise RuntimeError(
                        f"rank {self.rank} expected samples {t.ids} from rank {peer}, got {[s.id for s in received]}"
                    )
                received_samples += received
        transferred = self.clock()
        self.finished += ctl._share(received_samples)
        if states:
            raise RuntimeError(f"rank {self.rank} kept exported requests {sorted(states)} that the plan did not send")
        if self.rank in kept:
            self.finished = list(by_id.values())  # sent ones are scored elsewhere
        end = self.clock()
        if self.progress is not None:  # requests left or joined this engine
            self.progress.set_total(self.progress.done + self.engine.num_unfinished)
        self._span("migrate", start, end, moved=len(exported))
        own = (sent_req, sent_samples, end - start, start)
        if ctl.instance_group is not None:  # the instance's bytes: every rank's KV shards, its TP rank 0's samples
            ranks: list[Any] = [None] * dist.get_world_size(ctl.instance_group)
            dist.all_gather_object(ranks, own, group=ctl.instance_group)
            own = (sum(r[0] for r in ranks), sum(r[1] for r in ranks), max(r[2] for r in ranks), max(r[3] for r in ranks))
        totals = ctl._all_gather(own)
        self.migration = MigrationStats(
            step=self.steps,
            time_s=max(t[3] for t in totals),
            threshold=threshold,
            unfinished=unfinished,
            moved=len(moved),
            moved_bytes=sum(t[0] for t in totals),
            sample_bytes=sum(t[1] for t in totals),
            kept=plan.kept,
            duration_s=max(t[2] for t in totals),
        )
        self.measurements.migrations.append((planned - gathered_at) + (self.clock() - transferred))
        return plan

    # -------------------------------------------------------------------------------------- after it
    def _decode_tail(self, plan: MigrationPlan) -> None:
        """Kept rank: decode the tail, lending its finished samples to its freed ranks (``plan.tail_streams``) as they
        ask (:class:`_TailLender`); once the tail has ended, score the longest sample none has asked for, one at a
        time, until none is left. Within an instance its TP rank 0 lends and tells its peers which sample the
        instance scores next."""
        ctl = self.ctl
        if self.finished:
            raise RuntimeError(f"kept rank {self.rank} still holds finished samples after the migration")
        lender = _TailLender(plan.tail_streams(self.rank), ctl.control_group) if ctl.leader else None
        done: dict[int, RequestResult] = {}
        while self.engine.has_work():
            self._step()
            done.update((int(s.id), s) for s in self.finished)
            if lender is not None:
                lender.add(self.finished)
            self.finished = []
        while True:
            sample = lender.take() if lender is not None else None
            pick = ctl._share(None if sample is None else int(sample.id))
            if pick is None:
                break
            self._score([done[pick]])
        if lender is not None:
            lender.end()

    def _score_tail_streams(self, plan: MigrationPlan) -> None:
        """Freed rank: ask each kept rank that streams to it for a tail sample (a credit), score whichever sample comes
        first and ask its sender again, until every stream has ended. Within an instance TP rank 0 sends the credits,
        receives and hands each sample to its peers (None: all streams ended), so all score the same samples."""
        ctl = self.ctl
        streams = set(plan.tail_sources(self.rank))
        credits = [_send_credit(k, ctl.control_group) for k in sorted(streams)] if ctl.leader else []
        while True:
            batch: list[RequestResult] | None = None
            src = -1
            if ctl.leader:
                while streams and not batch:
                    src, states = recv_states(None, group=ctl.control_group, tag=_SAMPLES_TAG)
                    if states:
                        batch = [s.to_result() for s in states]
                    else:  # the end of src's stream
                        streams.discard(src)
            batch = ctl._share(batch)
            if not batch:
                break
            self._score(batch)
            if ctl.leader:
                credits.append(_send_credit(src, ctl.control_group))
        for c in credits:
            c.wait()

    def _probe(self) -> list[RequestResult]:
        """The finished samples the deciding rank (rank 0) of an "auto" threshold should score now to measure
        scoring's cost, while no earlier rollout measured it: its first finished sample, then a micro-batch of
        :data:`PROBE_ROWS` (one sample alone costs more per token than a micro-batch: its fixed cost is spread over
        fewer tokens, which made the first rollout's scoring ~3.5x dearer than measured on the reasoning recipe).
        Only with at least :data:`PROBE_MIN_STEPS` decode steps left, so that what the measurements let it decide
        can gain more than they cost."""
        ctl, measured = self.ctl, len(self.measurements.score)
        rows = 1 if measured == 0 else PROBE_ROWS
        if ctl.threshold != "auto" or self.rank != 0 or ctl._history.score or measured > 1 or len(self.finished) < rows:
            return []
        if max((p.budget - p.generated for p in self.engine.progress()), default=0) < PROBE_MIN_STEPS:
            return []
        return sorted(self.finished, key=lambda s: s.num_tokens)[:rows]

    def _score_while_idle(self) -> None:
        """This instance's requests are done while others decode: score its finished samples in a thread (in full
        micro-batches, as :meth:`_score` cuts them) while this one keeps posting the checks, so that no instance waits
        for it. Joined (:meth:`_join_idle_scoring`) before any other scoring here, so that every rank of an instance
        scores the same micro-batches in the same order."""
        if self.idle_scoring is not None:
            return
        samples, self.finished = self.finished, []
        errors: list[BaseException] = []

        def score() -> None:
            try:
                self._score(samples)
            except BaseException as e:  # raised again by the join, in the rollout's own thread
                errors.append(e)

        thread = threading.Thread(target=score, name="fusedrl-idle-scoring", daemon=True)
        self.idle_scoring = (thread, errors)
        thread.start()

    def _join_idle_scoring(self) -> None:
        if self.idle_scoring is None:
            return
        thread, errors = self.idle_scoring
        thread.join()
        self.idle_scoring = None
        if errors:
            raise errors[0]

    def _score_finished(self) -> None:
        samples, self.finished = self.finished, []
        self._score(samples)

    def _score(self, samples: list[RequestResult]) -> None:
        """Score ``samples`` in micro-batches of similar lengths (the shortest first), each timed."""
        if not samples:
            return
        start = self.clock()
        ordered = sorted(samples, key=lambda s: s.num_tokens)
        size = self.ctl.micro_batch_size
        for i in range(0, len(ordered), size):
            batch = ordered[i : i + size]
            t0 = time.perf_counter()
            self.scored.append(self.ctl.score(batch))
            self.measurements.score.append((len(batch), batch[-1].num_tokens, time.perf_counter() - t0))
            self.scored_ids += [int(s.id) for s in batch]
        end = self.clock()
        self.scoring_s += end - start
        self._span("score", start, end, samples=len(samples))

    def _span(self, kind: str, start: float, end: float, **args: Any) -> None:
        """Record a span; consecutive decode steps merge into one span."""
        if kind == "decode" and self.spans and self.spans[-1][0] == "decode" and start - self.spans[-1][2] < 1e-3:
            k, s, _, a = self.spans[-1]
            self.spans[-1] = (k, s, end, {"steps": a.get("steps", 1) + 1})
            return
        self.spans.append((kind, start, end, args or ({"steps": 1} if kind == "decode" else {})))


def _lengths(ended: Sequence[tuple[int, int, int, bool]]) -> list[tuple[int, bool]]:
    """(generated tokens, censored) of ended requests (``_Rollout.ended_requests``)."""
    return [(n, cut) for _, _, n, cut in ended]


def _progress_summary(progress: list[RequestProgress]) -> list[tuple[int, int, int | None, int]]:
    """(context tokens, generated, forced length or None, token budget) per unfinished request."""
    return [(p.seq_len, p.generated, p.budget if p.forced else None, p.budget) for p in progress]
