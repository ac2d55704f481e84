"""Over-provisioned rollouts (``[rollout] over_provision``): partial rollouts or tail batching.

Each generation instance keeps ``ceil(batch groups x (1 + over_provision) / instances)`` prompt groups in flight. A
rollout stops decoding once the batch's worth of whole groups has finished (:class:`GroupTarget`); the iteration
trains on whole groups only, oldest first. ``rollout.unfinished`` says what becomes of the rest:

- ``carry`` (partial rollouts): they go on in the next iteration: unfinished requests as token states (re-prefilled
  under the next iteration's weights, their random streams continuing where they stopped) and finished, scored
  samples of groups not trained yet. Every response token is tagged with the iteration (policy version) that sampled
  it; a group whose oldest token would lag the trained policy by more than ``rollout.max_staleness`` iterations is
  discarded (its tokens counted as wasted) and its prompt starts again. The stale tokens' importance correction is
  ``ppo.tis_cap``'s: the policy loss weighs each token by ``min(pi_old / pi_sampled, tis_cap)``, ``pi_sampled`` being
  the log-prob the engine recorded when it sampled the token.
- ``defer`` (tail batching): a group unfinished when the rollout stops is dropped (its tokens counted as wasted) and
  its prompt joins the long queue; whole groups past the batch start again first. Once the long queue holds a
  batch's worth of prompts, the next rollout is a long round: those prompts alone, fresh, decoded to the end, without
  over-provisioning. Every trained token was sampled by the policy it trains.

Everything but the carried request states is the same on every rank (decided from all-gathered figures), so a
checkpoint saves one copy: the prompts of the groups in flight, of the queue and of the long queue, which a resumed
run starts again (their tokens are regenerated, none is lost). docs/algorithms.md states the semantics.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fusedrl.components import PromptBatch, PromptLoader, length_stats
from fusedrl.config import JobConfig
from fusedrl.generation import Request, RequestState
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.rollout import build_requests
from fusedrl.rollout_fusion import GroupTarget, RolloutResult, whole_groups

Prompt = tuple[int, int, list[int]]  # (prompt sample id, dataset index, token ids)


@dataclass
class _Group:
    prompt: Prompt
    started: int  # the iteration that sampled its first tokens: its oldest policy version
    instance: int  # the generation instance that decodes its unfinished requests


@dataclass
class RolloutPlan:
    """One rollout of this instance: fresh requests, carried request states to resume, and when to stop."""

    requests: list[Request]
    resume: list[RequestState]
    target: GroupTarget | None  # None: decode every request to its end


class PartialRollouts:
    """Plans over-provisioned rollouts (and, deferring, long rounds) and selects the whole groups each iteration trains
    on.

    Args:
        cfg: the job config (``rollout``, ``generation`` and ``ppo.batch_size``).
        loader: the global prompt stream (unsharded: ``world_size = 1``); every rank draws the same prompts.
        stop_ids: the tokenizer's stop tokens (with ``generation.stop_token_ids``).
        instance, instances: this rank's generation instance and their number.
        pad_id: the padding token of the experience batches.
    """

    def __init__(
        self, cfg: JobConfig, loader: PromptLoader, stop_ids: tuple[int, ...], *, instance: int, instances: int, pad_id: int
    ) -> None:
        if loader.world_size != 1:
            raise ValueError("PartialRollouts draws the global prompt stream: give it an unsharded loader (world_size = 1)")
        self.cfg, self.loader, self.stop_ids, self.pad_id = cfg, loader, stop_ids, pad_id
        self.instance, self.instances = instance, instances
        self.n = cfg.generation.n
        self.batch_groups = cfg.ppo.batch_size // self.n
        self.max_staleness = cfg.rollout.max_staleness
        self.defer = cfg.rollout.unfinished == "defer"
        self.in_flight = math.ceil(self.batch_groups * (1 + cfg.rollout.over_provision) / instances)
        self.queue: deque[Prompt] = deque()  # prompts not started yet
        self.long: deque[Prompt] = deque()  # deferred prompts, for the next long round
        self.groups: dict[int, _Group] = {}  # started, not trained or discarded; by prompt sample id
        self.stretches: dict[int, list[tuple[int, int]]] = {}  # request id -> (token offset, iteration) per stretch
        self.carried_lengths: dict[int, int] = {}  # every instance's carried request id -> tokens generated so far
        self.states: list[RequestState] = []  # this instance's carried requests
        self.rows: Experience | None = None  # finished, scored samples not trained yet
        self._figures: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ planning
    def plan(self, step: int) -> RolloutPlan:
        """Discard groups too stale to train at ``step``, then top each instance up to its groups in flight; deferring,
        a long round instead once the long queue holds a batch's worth of prompts."""
        if self.defer and len(self.long) >= self.batch_groups:
            prompts = [self.long.popleft() for _ in range(self.batch_groups)]
            mine = [p for k, p in enumerate(prompts) if self._start(p, step, k % self.instances)]
            self._add({"rollout_long_rounds": 1})
            return RolloutPlan(self._requests(mine, step), [], None)
        stale = [g for g, group in self.groups.items() if step - group.started > self.max_staleness]
        for gid in reversed(stale):  # each goes to the queue's front: the oldest ends first, as the groups started
            self._discard(gid)
        for rid, generated in self.carried_lengths.items():
            if self.stretches[rid][-1][1] != step:  # a second round of the same iteration samples with the same weights
                self.stretches[rid].append((generated, step))
        busy = [0] * self.instances
        for gid in {rid // self.n for rid in self.carried_lengths}:
            busy[self.groups[gid].instance] += 1
        mine = []
        for inst in range(self.instances):
            for _ in range(self.in_flight - busy[inst]):
                prompt = self._next_prompt()
                if self._start(prompt, step, inst):
                    mine.append(prompt)
        finished = frozenset() if self.rows is None else frozenset(self._sample_ids(self.rows))
        states, self.states = self.states, []
        return RolloutPlan(self._requests(mine, step), states, GroupTarget(self.n, self.batch_groups, finished))

    def _start(self, prompt: Prompt, step: int, instance: int) -> bool:
        """Start ``prompt``'s group at ``step`` on ``instance``; whether that is this rank's instance."""
        self.groups[prompt[0]] = _Group(prompt, step, instance)
        self.stretches.update({prompt[0] * self.n + k: [(0, step)] for k in range(self.n)})
        return instance == self.instance

    def _requests(self, prompts: list[Prompt], step: int) -> list[Request]:
        batch = PromptBatch([p[2] for p in prompts], [p[1] for p in prompts], [p[0] for p in prompts])
        return build_requests(self.cfg, batch, step, self.stop_ids)

    def _next_prompt(self) -> Prompt:
        if not self.queue:
            b = self.loader.next_batch()
            self.queue.extend(zip(b.sample_ids, b.dataset_indices, b.token_ids))
        return self.queue.popleft()

    def _discard(self, gid: int) -> None:
        """Drop group ``gid``; its prompt starts again first."""
        self.queue.appendleft(self._drop(gid))
        self._add({"rollout_discarded_groups": 1})

    def _defer(self, gid: int) -> None:
        """Drop group ``gid``; its prompt waits for the next long round."""
        self.long.append(self._drop(gid))
        self._add({"rollout_deferred_groups": 1})

    def _drop(self, gid: int) -> Prompt:
        """Forget group ``gid``'s samples, carried requests and tags (their tokens counted as wasted); its prompt."""
        ids = range(gid * self.n, (gid + 1) * self.n)
        wasted = sum(self.carried_lengths.pop(i, 0) for i in ids)
        if self.rows is not None:
            drop = torch.tensor([i // self.n == gid for i in self._sample_ids(self.rows)], dtype=torch.bool)
            wasted += int(self.rows.response_mask[drop].sum())
            self.rows = self.rows.select(~drop) if not drop.all() else None
        self.states = [s for s in self.states if int(s.id) // self.n != gid]
        for i in ids:
            self.stretches.pop(i, None)
        self._add({"rollout_wasted_tokens": wasted})
        return self.groups.pop(gid).prompt

    # ------------------------------------------------------------------------------------------------ selection
    def collect(self, step: int, result: RolloutResult[Any], scored: Experience) -> Experience:
        """The batch to train at ``step``: ``ppo.batch_size`` samples of whole groups (the oldest first, in sample-id
        order), from this rollout's ``scored`` samples (every rank's) and the ones carried from earlier rollouts;
        the rest and ``result.carried`` (this rank's unfinished requests) carry over (collective)."""
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (self.instance, [(int(s.id), len(s.generated)) for s in result.carried]))
        self.carried_lengths = {}
        for inst, carried in parts:
            for rid, generated in carried:
                self.carried_lengths[rid] = generated
                self.groups[rid // self.n].instance = inst
        self.states = list(result.carried)
        pool = scored if self.rows is None else Experience.concat([self.rows, scored], pad_token_id=self.pad_id)
        ids = self._sample_ids(pool)
        complete = sorted(whole_groups(ids, self.n), key=lambda g: (self.groups[g].started, g))
        if len(complete) < self.batch_groups:
            raise RuntimeError(
                f"step {step}: {len(complete)} whole groups finished, the batch needs {self.batch_groups}: the rollout "
                "stopped before its group target"
            )
        chosen = set(complete[: self.batch_groups])
        take = torch.tensor([i // self.n in chosen for i in ids])
        order = torch.argsort(torch.tensor(ids)[take])
        trained = pool.select(take).select(order)
        self.rows = pool.select(~take) if not take.all() else None
        self._tag(step, trained)
        for gid in chosen:
            del self.groups[gid]
        if self.defer:  # whole groups past the batch start again first, in order; the unfinished wait for a long round
            for gid in sorted(complete[self.batch_groups :], reverse=True):
                self._discard(gid)
            for gid in sorted(self.groups):
                self._defer(gid)
        lengths = scored.response_mask.sum(1)
        self._add({"rollout_finished_samples": scored.batch_size})
        self._figures.update(length_stats(lengths, "rollout_finished_len"))
        self._figures.update(
            {
                "rollout_carried_requests": len(self.carried_lengths),
                "rollout_carried_samples": 0 if self.rows is None else self.rows.batch_size,
                "rollout_groups_in_flight": len(self.groups),
            }
        )
        return trained

    def _tag(self, step: int, trained: Experience) -> None:
        """Count the trained tokens by staleness (iterations between the one that sampled a token and ``step``)."""
        counts = [0] * (self.max_staleness + 1)
        for rid, length in zip(self._sample_ids(trained), trained.response_mask.sum(1).tolist()):
            stretches = self.stretches.pop(rid)
            ends = [off for off, _ in stretches[1:]] + [int(length)]
            for (off, version), end in zip(stretches, ends):
                counts[step - version] += max(0, min(end, int(length)) - off)
        self._add({f"rollout_staleness_{k}_tokens": c for k, c in enumerate(counts)})

    def figures(self) -> dict[str, float]:
        """This iteration's figures (its rounds' counts summed), then reset: discarded groups, wasted tokens, trained
        tokens per staleness, carried requests and samples, and the length distribution of the samples that finished
        in the rollout (``rollout_finished_len_*``, beside the trained samples' ``response_len_*``: the selection's
        bias toward short responses)."""
        out, self._figures = self._figures, {}
        stale = [out.get(f"rollout_staleness_{k}_tokens", 0.0) for k in range(self.max_staleness + 1)]
        total = sum(stale)
        out["rollout_stale_tokens_frac"] = (total - stale[0]) / total if total else 0.0
        out["rollout_staleness_max"] = max((k for k, c in enumerate(stale) if c), default=0)
        out.setdefault("rollout_discarded_groups", 0)
        out.setdefault("rollout_wasted_tokens", 0)
        if self.defer:
            out.setdefault("rollout_long_rounds", 0)
            out.setdefault("rollout_deferred_groups", 0)
            out["rollout_long_queue"] = len(self.long)
        return out

    def _add(self, counts: dict[str, float]) -> None:
        for k, v in counts.items():
            self._figures[k] = self._figures.get(k, 0) + v

    @staticmethod
    def _sample_ids(exp: Experience) -> list[int]:
        assert exp.sample_ids is not None  # Scorer.score sets sample_ids on every scored batch
        return exp.sample_ids.tolist()

    # ------------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, str]:
        """The prompts of the groups in flight (oldest first) and of the queue, and those of the long queue; a resumed
        run starts them again."""
        started = sorted(self.groups.values(), key=lambda g: (g.started, g.prompt[0]))
        return {
            "prompts": json.dumps([list(g.prompt) for g in started] + [list(p) for p in self.queue]),
            "long": json.dumps([list(p) for p in self.long]),
        }

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.queue, self.long = (
            deque((int(sid), int(index), [int(t) for t in tokens]) for sid, index, tokens in json.loads(saved))
            for saved in (state["prompts"], state.get("long", "[]"))  # checkpoints from before tail batching: no "long"
        )
        self.groups, self.stretches, self.carried_lengths, self.states, self.rows = {}, {}, {}, [], None
