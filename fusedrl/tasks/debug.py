"""The embedded debug task: "repeat <unit> <k> times:" with heavy-tailed response lengths.

The ideal response to ``repeat ab 3 times:`` is ``ababab`` followed by EOS. ``k`` is drawn from a
capped Pareto law, so the ideal response length (in byte tokens, EOS included) has median 7 and
99.9th percentile 81 (> 10x the median), the long-tail shape inter-stage fusion targets.

:func:`true_score` is the rule-based score in [-1, 1] (1 only for the exact answer) that the trainer
logs next to the neural reward; :func:`reward_fn` offers it as a rule-based reward to train on
(``--model.reward_fn=fusedrl.tasks.debug:reward_fn``). ``python -m fusedrl.tasks.debug build --out assets/debug``
trains, on CPU in a few minutes:

- an SFT Actor (``debug`` flavor, policy) on *noisy* demonstrations (a fraction has a wrong length
  or a wrong character), so it is imperfect in ways PPO can fix;
- a Reward model (``debug`` flavor, value role) regressing the true score of the actor's kind of
  responses plus extra corruptions; its score for a sequence is the model's output at the
  sequence's last token (the EOS, or the last generated token when unfinished).

and saves both as HF safetensors folders (``actor/``, ``reward/``), the byte tokenizer
(``tokenizer/``) and ``info.json`` (training figures, score and correlation checks). The trainer builds
them on first use (:func:`ensure_assets`) and logs :func:`evaluate`'s ``true_score`` each iteration.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedrl.components import ByteTokenizer, Tokenizer
from fusedrl.config import JobConfig
from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.models import build_model, save_hf_checkpoint
from fusedrl.rlhf import Experience
from fusedrl.tasks import HeldOut, Task, TaskAssets

log = logging.getLogger(__name__)

ASSET_FLAVOR = "debug"  # the SFT Actor and the Reward model the task builds
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
MAX_REPEATS = 40
MAX_UNIT_LEN = 2
_PROMPT = re.compile(r"repeat ([a-z]+) (\d+) times:")


def sample_task(rng: random.Random) -> tuple[str, str, int]:
    """A random ``(prompt, ideal response without EOS, repeats)``."""
    unit = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, MAX_UNIT_LEN)))
    k = min(MAX_REPEATS, math.ceil(2.0 * (1.0 - rng.random()) ** (-1 / 1.5)))
    return f"repeat {unit} {k} times:", unit * k, k


def sample_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [sample_task(rng)[0] for _ in range(n)]


def parse_prompt(prompt: str) -> tuple[str, int]:
    """``(unit, repeats)`` of a task prompt (a chat template around it is fine)."""
    m = _PROMPT.search(prompt)
    if m is None:
        raise ValueError(f"not a debug-task prompt (expected 'repeat <letters> <n> times:'): {prompt[:80]!r}")
    return m.group(1), int(m.group(2))


def ideal_response(prompt: str) -> str:
    unit, k = parse_prompt(prompt)
    return unit * k


def true_score(prompt: str, response: str, finished: bool = True) -> float:
    """Rule-based score in [-1, 1]: the fraction of correct characters minus the relative length error.

    ``response`` excludes the stop token; ``finished=False`` (no EOS before the token limit) scores -1.
    """
    if not finished:
        return -1.0
    target = ideal_response(prompt)
    correct = sum(a == b for a, b in zip(response, target))
    length_error = min(1.0, abs(len(response) - len(target)) / len(target))
    return correct / len(target) - length_error


def reward_fn(
    prompts: list[str], responses: list[str], *, prompt_ids: list[list[int]], response_ids: list[list[int]], finished: list[bool]
) -> list[float]:
    """:func:`true_score` as the trainer's rule-based reward (``--model.reward_fn=fusedrl.tasks.debug:reward_fn``):
    the example of the reward-function signature (docs/ppo.md, "Reward functions"). Token ids are not needed;
    a prompt that is not a debug-task prompt raises ValueError (``training.nan_policy`` handles it)."""
    return [true_score(p, r, f) for p, r, f in zip(prompts, responses, finished, strict=True)]


# ---------------------------------------------------------------------------- training data


def corrupt(target: str, unit: str, rng: random.Random) -> str:
    """A plausible wrong answer: a length off by a few units, or a substituted character."""
    kind = rng.random()
    k = len(target) // len(unit)
    if kind < 0.6:
        delta = rng.choice([-1, 1]) * rng.randint(1, max(1, k // 3))
        return unit * max(1, k + delta)
    chars = list(target)
    for _ in range(rng.randint(1, 2)):
        chars[rng.randrange(len(chars))] = rng.choice(ALPHABET)
    return "".join(chars)


def sft_example(rng: random.Random, noise: float) -> tuple[str, str]:
    prompt, target, _ = sample_task(rng)
    unit, _ = parse_prompt(prompt)
    return prompt, (corrupt(target, unit, rng) if rng.random() < noise else target)


def reward_example(rng: random.Random) -> tuple[str, str, bool]:
    """A (prompt, response, finished) covering good, near-miss and bad answers."""
    prompt, target, _ = sample_task(rng)
    unit, _ = parse_prompt(prompt)
    u = rng.random()
    if u < 0.35:
        return prompt, target, True
    if u < 0.8:
        return prompt, corrupt(target, unit, rng), True
    if u < 0.9:  # far off: random letters of a random length
        return prompt, "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 2 * len(target) + 2))), True
    return prompt, unit * rng.randint(len(target) // len(unit), MAX_REPEATS + 10), False  # unfinished


def encode_pair(tokenizer, prompt: str, response: str, finished: bool = True) -> tuple[list[int], int]:
    """Token ids of prompt + response (+ EOS when finished) and the prompt's length in tokens."""
    p = tokenizer.encode(prompt, add_bos=True)
    r = tokenizer.encode(response, add_bos=False, add_eos=finished)
    return p + r, len(p)


def _pad(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(map(len, seqs))
    return torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])


# ---------------------------------------------------------------------------- build


def _bucketed(make, steps: int, batch: int, rng: random.Random, key=lambda e: len(e[0]), pool_batches: int = 8):
    """``steps`` batches of ``batch`` examples; each pool of ``pool_batches`` batches is sorted by length so
    a batch pads to similar lengths (heavy-tailed lengths otherwise make every batch as wide as its longest)."""
    done = 0
    while done < steps:
        pool = sorted((make() for _ in range(batch * pool_batches)), key=key)
        batches = [pool[i : i + batch] for i in range(0, len(pool), batch)]
        rng.shuffle(batches)
        yield from batches[: steps - done]
        done += min(pool_batches, steps - done)


def train_sft(tokenizer, steps: int, batch: int, noise: float, seed: int, lr: float = 3e-3):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = build_model(ASSET_FLAVOR, "policy")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.1, 1 - s / steps))
    losses = []
    for pool in _bucketed(lambda: encode_pair(tokenizer, *sft_example(rng, noise)), steps, batch, rng):
        seqs, prompt_lens = zip(*pool)
        tokens = _pad(list(seqs), tokenizer.pad_id)
        labels = tokens.clone()
        for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
            labels[i, :p] = -100
            labels[i, len(s) :] = -100
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        losses.append(_optimizer_step(model, opt, sched, loss))
    return model, losses


def _optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, loss: torch.Tensor) -> float:
    """One clipped AdamW step of the asset-building loops; returns the loss value."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def reward_inputs(tokenizer, examples: list[tuple[str, str, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and the index of each sequence's last token (where the score is read)."""
    seqs = [encode_pair(tokenizer, p, r, f)[0] for p, r, f in examples]
    return _pad(seqs, tokenizer.pad_id), torch.tensor([len(s) - 1 for s in seqs])


def reward_scores(model, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Reward model score per sequence: its output at the sequence's last token."""
    out = model(tokens).squeeze(-1)
    return out.gather(1, last[:, None]).squeeze(1)


def train_reward(tokenizer, steps: int, batch: int, seed: int, lr: float = 3e-3):
    torch.manual_seed(seed)
    rng = random.Random(seed + 1)
    model = build_model(ASSET_FLAVOR, "value")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.1, 1 - s / steps))
    losses = []
    for examples in _bucketed(lambda: reward_example(rng), steps, batch, rng, key=lambda e: len(e[0]) + len(e[1])):
        target = torch.tensor([true_score(p, r, f) for p, r, f in examples])
        tokens, last = reward_inputs(tokenizer, examples)
        loss = F.mse_loss(reward_scores(model, tokens, last), target)
        losses.append(_optimizer_step(model, opt, sched, loss))
    return model, losses


def sample_responses(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0, seed: int = 0):
    """Sample with fusedrl's generation engine; returns ``(response ids without EOS, finished)``."""
    seqs = [tokenizer.encode(p, add_bos=True) for p in prompts]
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,))
    engine = GenerationEngine(model, max_slots=len(seqs), max_len=max(map(len, seqs)) + max_new_tokens, seed=seed)
    results = engine.generate([Request(i, s, params) for i, s in enumerate(seqs)])
    finished = [r.finish_reason == "stop" for r in results]
    return [r.tokens[:-1] if f else r.tokens for r, f in zip(results, finished)], finished


def _pearson(x: list[float], y: list[float]) -> float:
    a, b = torch.tensor(x), torch.tensor(y)
    a, b = a - a.mean(), b - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def build(
    out: str | Path,
    sft_steps: int = 600,
    reward_steps: int = 800,
    batch: int = 64,
    seed: int = 0,
    eval_n: int = 128,
    eval_max_new_tokens: int = 96,
    threads: int = 1,
) -> dict:
    """Train and save the debug assets; returns the figures also written to ``info.json``."""
    torch.set_num_threads(threads)
    out = Path(out)
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    actor, sft_losses = train_sft(tok, sft_steps, batch, noise=0.4, seed=seed)
    t_sft = time.perf_counter() - t0
    reward, rm_losses = train_reward(tok, reward_steps, batch, seed=seed)
    t_rm = time.perf_counter() - t0 - t_sft

    actor.eval()
    reward.eval()
    prompts = sample_prompts(eval_n, seed=seed + 12345)
    response_ids, finished = sample_responses(actor, tok, prompts, eval_max_new_tokens, seed=seed)
    responses = [tok.decode(r) for r in response_ids]
    scores = [true_score(p, r, f) for p, r, f in zip(prompts, responses, finished)]
    with torch.no_grad():
        tokens, last = reward_inputs(tok, list(zip(prompts, responses, finished)))
        rm = reward_scores(reward, tokens, last).tolist()
        held_out = [reward_example(random.Random(seed + 99 + i)) for i in range(eval_n)]
        tokens, last = reward_inputs(tok, held_out)
        rm_held = reward_scores(reward, tokens, last).tolist()
    lengths = sorted(len(r) + f for r, f in zip(response_ids, finished))
    info = {
        "sft_steps": sft_steps,
        "reward_steps": reward_steps,
        "batch": batch,
        "seconds_sft": round(t_sft, 1),
        "seconds_reward": round(t_rm, 1),
        "sft_final_loss": sum(sft_losses[-20:]) / 20,
        "reward_final_mse": sum(rm_losses[-20:]) / 20,
        "actor_true_score_mean": sum(scores) / len(scores),
        "actor_exact_fraction": sum(s == 1.0 for s in scores) / len(scores),
        "actor_finished_fraction": sum(finished) / len(finished),
        "actor_response_len_p50": lengths[len(lengths) // 2],
        "actor_response_len_max": lengths[-1],
        "reward_true_corr_on_actor_samples": _pearson(rm, scores),
        "reward_true_corr_held_out": _pearson(rm_held, [true_score(*e) for e in held_out]),
    }
    save_hf_checkpoint(actor, out / "actor", ASSET_FLAVOR, "policy")
    save_hf_checkpoint(reward, out / "reward", ASSET_FLAVOR, "value")
    tok.save(out / "tokenizer")
    tmp = out / "info.json.tmp"  # written last and renamed: its presence means the assets are complete
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(out / "info.json")
    return info


# ---------------------------------------------------------------------------- in the trainer


def evaluate(exp: Experience, tokenizer: Tokenizer) -> dict[str, float]:
    """The trainer's evaluation hook: ``true_score``, the mean rule-based score of the batch's samples, or
    nothing unless every prompt is a debug-task prompt. A response counts as finished when it ends with a
    stop token (which is not part of the scored text)."""
    stops = set(tokenizer.stop_token_ids)
    scores = []
    for tokens, mask in zip(exp.tokens.tolist(), exp.response_mask.bool().tolist()):
        start = mask.index(True)
        prompt = tokenizer.decode(tokens[:start])
        response = [t for t, m in zip(tokens, mask) if m]
        finished = response[-1] in stops
        try:
            scores.append(true_score(prompt, tokenizer.decode(response[:-1] if finished else response), finished))
        except ValueError:  # not a debug-task prompt
            return {}
    return {"true_score": sum(scores) / len(scores)}


ASSET_PARTS = ("actor", "reward")


def missing_assets(cfg: JobConfig) -> Path | None:
    """The asset folder to build: the synthetic task names ``<folder>/actor`` or ``<folder>/reward`` and they
    do not exist yet (None otherwise)."""
    if cfg.data.format != "synthetic":
        return None
    for key in ("actor_path", "reward_path", "critic_path", "reference_path"):
        path = getattr(cfg.model, key)
        if path is not None and Path(path).name in ASSET_PARTS and not Path(path).is_dir():
            return Path(path).parent
    return None


def ensure_assets(cfg: JobConfig) -> None:
    """Build the SFT Actor and Reward model when the config names missing ones (before any process group).

    Runs on local rank 0 only; the other local ranks wait for its ``info.json``.
    """
    folder = missing_assets(cfg)
    if folder is None:
        return
    info = folder / "info.json"
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        while missing_assets(cfg) is not None or not info.is_file():
            time.sleep(1.0)
        return
    log.info("building the debug task assets in %s (SFT Actor + Reward model; a few minutes on CPU, once) ...", folder)
    start = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)  # the other local ranks only wait
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(30.0):
            log.info("... still building the debug assets (%.0fs)", time.perf_counter() - start)

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        figures = build(folder)
    finally:
        done.set()
    log.info(
        "debug assets ready in %.0fs: SFT true score %.3f, reward/true-score correlation %.2f",
        time.perf_counter() - start,
        figures["actor_true_score_mean"],
        figures["reward_true_corr_on_actor_samples"],
    )


TASK = Task(
    name="debug",
    prompts=sample_prompts,
    reward_fn=reward_fn,
    evaluate=evaluate,
    held_out=HeldOut(sample_prompts, true_score),
    assets=TaskAssets(flavor=ASSET_FLAVOR, missing=missing_assets, build=ensure_assets),
)
"""The debug task as the trainer takes it (``job.task = "fusedrl.tasks.debug:TASK"``, the default)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.tasks.debug", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="train and save the debug Actor, Reward model and tokenizer")
    b.add_argument("--out", default="assets/debug")
    b.add_argument("--sft-steps", type=int, default=600)
    b.add_argument("--reward-steps", type=int, default=800)
    b.add_argument("--batch", type=int, default=64)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: more threads rarely help)")
    args = parser.parse_args(argv)
    info = build(args.out, args.sft_steps, args.reward_steps, args.batch, args.seed, threads=args.threads)
    size = sum(p.stat().st_size for p in Path(args.out).rglob("*") if p.is_file())
    print(json.dumps({**info, "assets_bytes": size}, indent=2))


if __name__ == "__main__":
    main()
