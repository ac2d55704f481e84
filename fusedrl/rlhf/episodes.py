"""Multi-turn episodes of one generation instance: the model writes a turn, its environment answers, the model writes
again, without a barrier between turns.

:class:`Episodes` joins a :class:`~fusedrl.generation.GenerationEngine` and an :class:`~fusedrl.envs.EnvRunner`. Every
request is a ``multi_turn`` one: when its turn ends the engine reports it and keeps its KV off the decode batch;
:meth:`Episodes.on_results` hands the turn's text to its environment, which runs on the runner's threads while the
engine decodes the other requests and admits new ones; :meth:`Episodes.pump` takes the environments' answers: an
observation is appended to the request (its chat-template turn as token ids, computed once) and its next turn queued,
a finished episode ends the request, whose result carries the episode's reward.

Token in, token out: a sample is exactly its prompt, what it sampled and what its environments appended, never the
conversation rendered and re-tokenized; ``RequestResult.observations`` marks the appended spans, which every loss
leaves out. A text observation becomes the ids the tokenizer's chat template writes between the model's turn and its
next one (:func:`observation_ids`): the template is rendered once around a placeholder turn, and the text after the
placeholder's end of turn is tokenized alone.

Limits: ``max_tokens`` after the prompt, strict (the engine cuts a turn at it, which ends the episode; an observation
that would pass it, or the engine's room, ends the episode: ``env_limit_tokens``), the runner's turns and step timeout.
An episode a limit ended is not finished (finish reason ``"max_len"`` or, for the turn limit, ``"length"``), whatever
its last turn did, so that ``ppo.truncated`` treats it as the truncated response it is. Episodes never migrate between
instances (their environments live here): the migration controller leaves requests with an environment where they
are.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fusedrl.components import Tokenizer, length_stats
from fusedrl.envs import EnvRunner, EnvStep
from fusedrl.generation import FinishReason, GenerationEngine, Request, RequestResult

_PLACEHOLDER = "\u2063fusedrl-turn\u2063"  # a turn's content the model never writes


def observation_ids(tokenizer: Tokenizer, role: str, text: str, stop_token_ids: Sequence[int]) -> list[int]:
    """The ids of ``text`` as a ``role`` message after a model turn that ended on a stop token: what the tokenizer's
    chat template writes after that stop token up to the start of the next assistant turn (a tokenizer without a
    template: ``text`` itself). After a turn that ended without a stop token they begin with the template's end of
    turn."""
    render = getattr(tokenizer, "render_chat", None)
    if render is None or getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer.encode(text, add_bos=False))
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PLACEHOLDER}]
    rendered = render([*turn, {"role": role, "content": text}])
    after = rendered[rendered.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
    for stop in stop_token_ids:
        end = tokenizer.decode([stop], skip_special_tokens=False)
        if end and after.startswith(end):
            return list(tokenizer.encode(after[len(end) :], add_bos=False))
    return list(tokenizer.encode(after, add_bos=False))


@dataclass
class _Live:
    """One episode under way."""

    last: RequestResult | None = None  # its request's latest turn (tokens so far, sampling)
    turn_start: int = 0  # where the current turn begins in the request's tokens
    submitted_at: float | None = None  # when its last turn went to the environment (None: decoding)
    turns: int = 0


@dataclass
class EpisodeStats:
    """What this instance's episodes did since the last :meth:`Episodes.figures`."""

    turns: list[int] = field(default_factory=list)  # per ended episode
    observation_tokens: int = 0
    sampled_tokens: int = 0
    wait_s: float = 0.0  # summed over requests: from a turn's end to its environment's answer
    waiting_wall_s: float = 0.0  # wall time during which at least one request waited
    limit_tokens: int = 0  # episodes ended for want of room (max_tokens, the engine's max_len)


class Episodes:
    """Multi-turn episodes of ``engine`` with ``runner``'s environments (module docstring). ``role``: the chat role of
    text observations; ``max_tokens``: an episode's tokens after its prompt."""

    def __init__(
        self, engine: GenerationEngine, runner: EnvRunner, tokenizer: Tokenizer, *, max_tokens: int, role: str = "user"
    ) -> None:
        self.engine, self.runner, self.tokenizer = engine, runner, tokenizer
        self.max_tokens, self.role = max_tokens, role
        self._live: dict[int, _Live] = {}
        self.stats = EpisodeStats()
        self._counted: dict[str, float] = {}  # the runner's counters at the last take_figures
        self._waiting_since: float | None = None  # since when some request waits (None: none does)

    def begin(self, requests: Sequence[Request], rows: Sequence[Mapping[str, Any]]) -> list[Request]:
        """Start an episode per request (``rows[i]``: request ``i``'s prompt row) and return the requests to add:
        ``multi_turn``, and where an environment writes its opening message, that message (a user turn through the
        chat template) as the prompt."""
        if len(rows) != len(requests):
            raise ValueError(f"Episodes.begin got {len(rows)} prompt rows for {len(requests)} requests")
        for r, row in zip(requests, rows):
            self.runner.start(int(r.id), row)
            self._live[int(r.id)] = _Live()
        out = []
        for r in requests:
            opening = self.runner.opening(int(r.id))
            prompt = r.prompt
            if opening is not None:
                render = getattr(self.tokenizer, "render_chat", None)
                text = render([{"role": "user", "content": opening}]) if render is not None else opening
                prompt = list(self.tokenizer.encode(text, add_bos=render is None))
            out.append(dataclasses.replace(r, prompt=prompt, multi_turn=True, max_tokens=self.max_tokens))
        return out

    @property
    def waiting(self) -> int:
        """Requests waiting for their environment's answer."""
        return sum(live.submitted_at is not None for live in self._live.values())

    def on_results(self, results: Sequence[RequestResult]) -> list[RequestResult]:
        """Results of ``engine.step()``: a turn that ended goes to its environment; returns the episodes that ended
        (a request the engine ended for want of room, or a rejected one)."""
        ended = []
        for res in results:
            live = self._live.get(int(res.id))
            if live is None:  # not an episode of this instance
                ended.append(res)
                continue
            live.turns += 1
            if not res.awaiting:  # the engine ended it (max_len): no room for another turn
                self.stats.limit_tokens += res.finish_reason == "max_len"
                ended.append(self._finish(res))
                continue
            turn = res.tokens[live.turn_start :]
            if turn and turn[-1] in res.request.sampling.stop_token_ids:
                turn = turn[:-1]
            live.last, live.submitted_at = res, time.perf_counter()
            self.runner.submit(int(res.id), self.tokenizer.decode(turn))
        self._track_waiting()
        return ended

    def pump(self, timeout_s: float | None = None) -> list[RequestResult]:
        """The environments' answers so far (``timeout_s``: first waiting up to that long for one): observations are
        appended and their requests continue; returns the episodes that ended."""
        answers = self.runner.poll() if timeout_s is None else self.runner.wait(timeout_s)
        ended = []
        for sid, step in answers:
            result = self._answer(sid, step)
            if result is not None:
                ended.append(result)
        self._track_waiting()
        return ended

    def _track_waiting(self) -> None:
        now, waiting = time.perf_counter(), self.waiting > 0
        if waiting and self._waiting_since is None:
            self._waiting_since = now
        elif not waiting and self._waiting_since is not None:
            self.stats.waiting_wall_s += now - self._waiting_since
            self._waiting_since = None

    def _answer(self, sid: int, step: EnvStep) -> RequestResult | None:
        live = self._live[sid]
        assert live.submitted_at is not None and live.last is not None  # only a submitted turn is answered
        self.stats.wait_s += time.perf_counter() - live.submitted_at
        live.submitted_at = None
        if step.done:  # cut by the turn limit: the model never answered the last observation
            return self._finish(self.engine.end_request(sid), "length" if step.info.get("limit") == "turns" else None)
        assert step.observation is not None  # the runner's check: an observation unless done
        last = live.last
        # the template's end of turn follows the sampled stop token; a turn cut at its length gets it from the template
        ended = (last.tokens[-1],) if last.tokens and last.tokens[-1] in last.request.sampling.stop_token_ids else ()
        obs = step.observation
        try:
            ids = observation_ids(self.tokenizer, self.role, obs, ended) if isinstance(obs, str) else list(obs)
        except Exception as e:  # noqa: BLE001 - the chat template refused the role or the text: this episode ends
            ids, problem = [], f"the chat template cannot render it as a {self.role!r} message ({type(e).__name__}: {e})"
        else:
            bad = next((t for t in ids if not 0 <= t < self.engine.vocab_size), None)
            problem = (
                "it has no tokens"
                if not ids
                else f"token id {bad} is outside [0, {self.engine.vocab_size})"
                if bad is not None
                else ""
            )
        if problem:
            self.runner.record_error(sid, "invalid", f"observation: {problem}")
            return self._finish(self.engine.end_request(sid))
        room = min(self.max_tokens, self.engine.max_len - 1 - len(last.prompt)) - len(last.tokens)
        if len(ids) >= room:  # the observation and at least one more sampled token must fit
            self.stats.limit_tokens += 1
            return self._finish(self.engine.end_request(sid), "max_len")
        self.engine.continue_request(sid, ids)
        live.turn_start = len(last.tokens) + len(ids)
        return None

    def _finish(self, result: RequestResult, limit: FinishReason | None = None) -> RequestResult:
        """``result`` of an ended episode with the episode's reward; the episode is closed. ``limit``: the finish reason
        of an episode a limit cut (its last turn may have stopped, the episode did not: ``ppo.truncated`` applies)."""
        sid = int(result.id)
        live = self._live.pop(sid)
        episode = self.runner.close(sid)
        observed = sum(end - start for start, end in result.observations)
        self.stats.turns.append(live.turns)
        self.stats.observation_tokens += observed
        self.stats.sampled_tokens += len(result.tokens) - observed
        return dataclasses.replace(result, reward=float(episode["reward"]), finish_reason=limit or result.finish_reason)

    def close(self) -> None:
        """End every open episode and stop the environments' worker threads (a step still running is left to finish;
        see :meth:`~fusedrl.envs.EnvRunner.shutdown`)."""
        self._live.clear()
        self.runner.shutdown()

    def take_figures(self) -> dict[str, Any]:
        """This instance's figures since the last call (to combine over instances with :func:`episode_metrics`): the
        ended episodes' turns, token and wait sums, and the runner's counters since the last call."""
        s, self.stats = self.stats, EpisodeStats()
        totals = self.runner.stats()
        counters = {k: v - self._counted.get(k, 0.0) for k, v in totals.items() if k not in _RUNNER_GAUGES}
        self._counted = totals
        return {
            "turns": s.turns,
            "observation": s.observation_tokens,
            "sampled": s.sampled_tokens,
            "wait_s": s.wait_s,
            "waiting_wall_s": s.waiting_wall_s,
            "limit_tokens": s.limit_tokens,
            "runner": counters,
        }


_RUNNER_GAUGES = ("env_open", "env_pending", "env_stuck")  # the runner's figures of now, not counts since construction


def episode_metrics(parts: Sequence[Mapping[str, Any]], idle_s: float) -> dict[str, float]:
    """One iteration's multi-turn figures from every instance's :meth:`Episodes.take_figures` (``idle_s``: seconds
    the engines waited for environments with nothing to decode, summed over instances): turns per episode (mean,
    p50, p90, max), observation (masked) and sampled tokens, seconds requests waited for their environments (summed
    over requests), the share of the time some request waited that its engine filled with decoding others or, fused,
    with scoring (``env_wait_filled``), episodes ended for want of room; the runners' steps, tool calls, errors by kind and step
    seconds."""
    turns = [t for p in parts for t in p["turns"]]
    out: dict[str, float] = {
        "env_observation_tokens": sum(p["observation"] for p in parts),
        "env_sampled_tokens": sum(p["sampled"] for p in parts),
        "env_wait_s": sum(p["wait_s"] for p in parts),
        "env_idle_s": idle_s,
        "env_wait_filled": 1.0 - idle_s / max(sum(p["waiting_wall_s"] for p in parts), 1e-9),
        "env_limit_tokens": sum(p["limit_tokens"] for p in parts),
    }
    if turns:
        stats = length_stats(turns, prefix="env_turns")
        out |= {k: stats[k] for k in ("env_turns_mean", "env_turns_p50", "env_turns_p90", "env_turns_max")}
    for key in sorted({k for p in parts for k in p["runner"]}):
        out[key] = sum(p["runner"].get(key, 0.0) for p in parts)
    return out
