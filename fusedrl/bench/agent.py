"""Multi-turn rollouts: per-request environment steps (fusedrl's) against turn-synchronous rollouts, at equal samples.

One process, the tool recipe's model, prompts and calculator environment (``train_configs/smollm2_135m_tool_grpo.toml``;
``--config`` another): ``--batch`` episodes (``generation.n`` samples per prompt) decoded by one engine, in two
schedules of the same work:

- ``per_request`` (fusedrl's :class:`~fusedrl.rlhf.Episodes`): a turn that ends goes to its environment at once; the
  engine decodes the other requests and admits new ones meanwhile, and the request continues as soon as its answer
  comes.
- ``turn_sync`` (what a simple loop does): every episode's turn k is decoded, then every environment step of turn k
  runs, and turn k + 1 starts when the slowest has answered.

Each schedule runs with the real calculator and with its steps delayed by a simulated tool latency: lognormal (sigma
1.5: a median 3.1x below the mean, p99 10x above the median), its mean ``--scales`` times the mean decode time of a
turn (measured in the zero-latency per-request run), so the 1x row is a workload whose tool time equals its decode
time. Workers: one per episode (a tool's latency is waiting, not computing). Both schedules sample the same episodes
where the engine's arithmetic does not depend on the batch (float32: each request's random stream and each tool's
answer depend on nothing else); in bf16 a batch of another size may round a near tie the other way, and a flipped
token changes the rest of its episode: the episodes that came out identical are counted and printed.
Reports samples/s per schedule and latency, the ratio per_request / turn_sync, turns per episode and response lengths.
The fusions on the same workload at 2 ranks: ``python -m fusedrl.bench.e2e --config CONFIG --apart`` (docs/agents.md).

Run: ``python -m fusedrl.bench.agent [--config FILE] [--batch 32] [--scales 0.25,1,4] [--repeats 1] [--threads 2]
[--json]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fusedrl.components import load_prompts_from_config, load_tokenizer
from fusedrl.config import load_config
from fusedrl.envs import Environment, EnvRunner, EnvStep, load_env_factory
from fusedrl.generation import GenerationEngine, Request, RequestResult, SamplingParams
from fusedrl.layouts import DTYPES
from fusedrl.models import from_pretrained
from fusedrl.rlhf import Episodes, observation_ids
from fusedrl.tasks import load_task, synthetic_prompts

SIGMA = 1.5  # the simulated latency's lognormal shape


class Delayed(Environment):
    """An environment whose steps take ``delay(text)`` seconds more (a tool call over a network, a slow sandbox)."""

    def __init__(self, inner: Environment, delay: Callable[[str], float]) -> None:
        self.inner, self.delay = inner, delay

    def opening(self) -> str | None:
        return self.inner.opening()

    def step(self, text: str) -> EnvStep:
        time.sleep(self.delay(text))
        return self.inner.step(text)


def _lognormal(mean_s: float, rng: random.Random) -> float:
    """Seconds from a lognormal of mean ``mean_s`` (sigma :data:`SIGMA`)."""
    return rng.lognormvariate(math.log(mean_s) - SIGMA**2 / 2, SIGMA) if mean_s > 0 else 0.0


def lognormal_delays(mean_s: float, seed: int) -> Callable[[str], float]:
    """One stream of :func:`_lognormal` seconds for every step, whatever its text; thread-safe."""
    rng, lock = random.Random(seed), threading.Lock()

    def draw(_text: str) -> float:
        with lock:
            return _lognormal(mean_s, rng)

    return draw


TOOL_LATENCY_VAR = "FUSEDRL_TOOL_LATENCY_S"
"""The mean simulated latency (seconds) of :func:`word_problems_calc_delayed`'s steps."""


def word_problems_calc_delayed(row: Mapping[str, Any]) -> Environment:
    """The tool recipe's environment (calculator and format bonus) with each step delayed by a simulated tool latency:
    lognormal (sigma :data:`SIGMA`) of mean ``$FUSEDRL_TOOL_LATENCY_S`` seconds, drawn from the prompt row and the
    model's turn, so that two runs of the same episodes wait alike. For the fusions at 2 ranks on a multi-turn workload:
    ``FUSEDRL_TOOL_LATENCY_S=2 python -m fusedrl.bench.e2e --config train_configs/smollm2_135m_tool_grpo.toml --apart
    --env.env=fusedrl.bench.agent:word_problems_calc_delayed`` (docs/benchmarks.md)."""
    from fusedrl.tasks.word_problems_tools import word_problems_calc_with_format

    value = os.environ.get(TOOL_LATENCY_VAR, "0")
    try:
        mean_s = float(value)
    except ValueError:
        raise ValueError(f"{TOOL_LATENCY_VAR}={value!r}: give the mean tool latency in seconds, e.g. 2") from None
    if not 0 <= mean_s < math.inf:
        raise ValueError(f"{TOOL_LATENCY_VAR}={value!r}: give a finite number of seconds >= 0")
    episode = json.dumps(row, sort_keys=True, default=str)

    def delay(text: str) -> float:  # a function of the problem and the model's turn: the same in every run
        digest = hashlib.sha256(f"{episode}\0{text}".encode()).digest()
        return _lognormal(mean_s, random.Random(int.from_bytes(digest[:8], "little")))

    return Delayed(word_problems_calc_with_format(row), delay)


def per_request(engine: GenerationEngine, episodes: Episodes, requests: list[Request]) -> list[RequestResult]:
    """fusedrl's schedule: the engine steps on while environments answer (as the migration controller drives it)."""
    for r in requests:
        engine.add_request(r)
    ended: list[RequestResult] = []
    while engine.has_work() or episodes.waiting:
        done = engine.step() if engine.has_work() else []
        ended += episodes.on_results(done)
        ended += episodes.pump(0.05 if not engine.has_work() else None)
    return ended


def turn_sync(
    engine: GenerationEngine, runner: EnvRunner, tokenizer, requests: list[Request], max_tokens: int
) -> list[RequestResult]:
    """The baseline: decode every episode's turn, then run every environment step of that turn, then the next turn."""
    for r in requests:
        engine.add_request(r)
    ended: list[RequestResult] = []
    turn_starts = {int(r.id): 0 for r in requests}
    while engine.has_work():
        turns: list[RequestResult] = []
        while engine.has_work():  # this turn of every episode
            turns += engine.step()
        for res in turns:
            if not res.awaiting:
                runner.close(int(res.id))
                ended.append(res)
                continue
            turn = res.tokens[turn_starts[int(res.id)] :]
            if turn and turn[-1] in res.request.sampling.stop_token_ids:
                turn = turn[:-1]
            runner.submit(int(res.id), tokenizer.decode(turn))
        answers: dict[int, EnvStep] = {}
        awaiting = {int(r.id): r for r in turns if r.awaiting}
        while len(answers) < len(awaiting):  # the slowest step of the turn holds everyone
            answers.update(runner.wait(1.0))
        for sid, step in answers.items():
            last = awaiting[sid]
            obs = step.observation
            if step.done or obs is None:
                ended.append(engine.end_request(sid))
                runner.close(sid)
                continue
            stops = last.request.sampling.stop_token_ids
            ids = observation_ids(tokenizer, "user", obs, stops) if isinstance(obs, str) else list(obs)
            if len(ids) >= min(max_tokens, engine.max_len - 1 - len(last.prompt)) - len(last.tokens):
                ended.append(engine.end_request(sid))
                runner.close(sid)
                continue
            engine.continue_request(sid, ids)
            turn_starts[sid] = len(last.tokens) + len(ids)
    return ended


def episode_ids(results: Sequence[RequestResult]) -> dict[int, list[int]]:
    """Each episode's ids after its prompt, by request id."""
    return {int(r.id): list(r.tokens) for r in results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="train_configs/smollm2_135m_tool_grpo.toml")
    parser.add_argument("--batch", type=int, default=32, help="episodes per rollout (generation.n per prompt)")
    parser.add_argument("--scales", default="0.25,1,4", help="simulated mean tool time / mean decode time of a turn")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each schedule and latency (best counts)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(["--job.config_file", args.config, *overrides])
    if not cfg.env.env:
        parser.error(f"{args.config} names no environment (env.env); give a multi-turn config")
    torch.set_num_threads(args.threads)
    if not cfg.model.actor_path:
        parser.error(f"{args.config} names no Actor checkpoint (model.actor_path); the benchmark decodes a real model")
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    model = from_pretrained(cfg.model.actor_path, dtype=DTYPES[cfg.training.rollout_dtype]).model.eval()
    engine = GenerationEngine.from_config(
        model, cfg.generation, max_len=cfg.sequence_budget, seed=cfg.job.seed, kv_dtype=DTYPES[cfg.training.kv_cache_dtype]
    )
    task = load_task(cfg.job.task)
    dataset = load_prompts_from_config(
        cfg.data, tokenizer, vocab_size=engine.vocab_size, texts=synthetic_prompts(cfg, task, count=args.batch), whole_rows=True
    )
    n = cfg.generation.n
    g = cfg.generation
    params = SamplingParams(
        temperature=g.temperature,
        max_new_tokens=g.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys((*tokenizer.stop_token_ids, *g.stop_token_ids))),
    )
    prompts = range(args.batch // n)
    factory = load_env_factory(cfg.env.env)
    rows: list[Mapping[str, Any]] = [dataset.rows[p] for p in prompts for _ in range(n)]

    def requests() -> list[Request]:
        return [Request(p * n + k, dataset.token_ids[p], params, seed=cfg.job.seed) for p in prompts for k in range(n)]

    def run(schedule: str, mean_delay_s: float) -> tuple[float, list[RequestResult], dict[str, Any]]:
        delays = lognormal_delays(mean_delay_s, seed=1)
        runner = EnvRunner(
            lambda row: Delayed(factory(row), delays),
            workers=len(rows),
            step_timeout_s=max(60.0, 100 * mean_delay_s),
            max_turns=cfg.env.max_turns,
        )
        episodes = Episodes(engine, runner, tokenizer, max_tokens=cfg.env.max_tokens, role=cfg.env.observation_role)
        reqs = episodes.begin(requests(), rows)  # starts the episodes (the schedules drive them after this)
        start = time.perf_counter()
        if schedule == "per_request":
            results = per_request(engine, episodes, reqs)
        else:
            results = turn_sync(engine, runner, tokenizer, reqs, cfg.env.max_tokens)
        seconds = time.perf_counter() - start
        figures = episodes.take_figures()
        runner.shutdown()
        return seconds, results, figures

    print(f"multi-turn rollouts, {args.config}: {args.batch} episodes, {args.threads} threads, warm-up first", flush=True)
    run("per_request", 0.0)  # compile / caches
    seconds, results, figures = run("per_request", 0.0)
    turns = sum(figures["turns"]) or 1
    decode_per_turn = seconds / turns * len(results)  # each episode's turns decode side by side: the mean turn's span
    lengths = [len(r.tokens) for r in results]
    print(
        f"zero-latency per-request rollout: {seconds:.2f} s, turns per episode mean {statistics.fmean(figures['turns']):.2f} "
        f"max {max(figures['turns'])}, response tokens p50 {statistics.median(lengths):.0f} max {max(lengths)}, "
        f"tool calls {figures['runner'].get('tool_calls', 0):.0f}; mean decode time of a turn {decode_per_turn:.3f} s",
        flush=True,
    )
    out: dict[str, Any] = {"config": args.config, "batch": args.batch, "decode_per_turn_s": decode_per_turn, "rows": []}
    print(f"{'tool latency':<28}{'per_request':>14}{'turn_sync':>14}{'ratio':>9}  same samples")
    for label, mean_delay in [
        ("real tool", 0.0),
        *((f"{s}x (mean {s * decode_per_turn:.3f} s)", s * decode_per_turn) for s in map(float, args.scales.split(","))),
    ]:
        best: dict[str, float] = {}
        episodes: dict[str, dict[int, list[int]]] = {}
        for _ in range(args.repeats):
            for schedule in ("per_request", "turn_sync"):
                t, res, _ = run(schedule, mean_delay)
                best[schedule] = min(best.get(schedule, math.inf), t)
                episodes[schedule] = episode_ids(res)
        rate = {s: args.batch / best[s] for s in best}
        ratio = rate["per_request"] / rate["turn_sync"]
        same = sum(episodes["per_request"][i] == ids for i, ids in episodes["turn_sync"].items())
        print(
            f"{label:<28}{rate['per_request']:>11.2f}/s{rate['turn_sync']:>11.2f}/s{ratio:>8.2f}x  {same}/{args.batch}",
            flush=True,
        )
        out["rows"].append(
            {"latency": label, "mean_delay_s": mean_delay, "samples_per_s": rate, "ratio": ratio, "same_samples": same}
        )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
