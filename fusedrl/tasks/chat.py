"""What the chat-question tasks (:mod:`.arithmetic`, :mod:`.word_problems`) share: a prompt file of user turns with
their answers, their checkers as the trainer's reward functions, a checkpoint's greedy responses to questions
rendered by its chat template, and the tasks' ``write`` / ``eval`` command line."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusedrl.rlhf import RewardFn


def write_chat_prompts(path: str | Path, questions: Iterable[tuple[str, int]]) -> Path:
    """``(question, answer)`` pairs as a jsonl file of ``{"messages": [user turn], "answer": int}`` records (data.format
    = "jsonl", data.prompt_key = "messages": the tokenizer's chat template renders each), written whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for question, answer in questions:
            f.write(json.dumps({"messages": [{"role": "user", "content": question}], "answer": answer}) + "\n")
    tmp.replace(path)
    return path


def text_reward(score: Callable[[str, str, bool], float]) -> RewardFn:
    """``score(prompt, response, finished)`` of each sample as a reward function (:data:`fusedrl.rlhf.RewardFn`: the
    token ids are not needed)."""

    def reward_fn(
        prompts: Sequence[str],
        responses: Sequence[str],
        *,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        finished: Sequence[bool],
    ) -> list[float]:
        return [score(p, r, f) for p, r, f in zip(prompts, responses, finished, strict=True)]

    reward_fn.__doc__ = f"``{score.__module__}.{score.__name__}`` of each sample, as the trainer's rule-based reward."
    return reward_fn


def task_command_line(
    prog: str, description: str, *, items: str, out: Path, eval_count: int
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """(parser, its ``write`` command, its ``eval`` command) of a chat task's command line: ``write --out --count
    --seed`` (4096 ``items`` from seed 0 by default) and ``eval --model --count --seed`` (``eval_count`` unseen ones
    from seed 1); a task adds its own options to either. Parse with :func:`parse_task_args`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help=f"write the {items} as a jsonl file of chat messages")
    write.add_argument("--out", type=Path, default=out)
    write.add_argument("--count", type=int, default=4096)
    write.add_argument("--seed", type=int, default=0)
    check = commands.add_parser("eval", help=f"greedy accuracy of an HF checkpoint folder on unseen {items}")
    check.add_argument("--model", type=Path, required=True, help="HF folder with its tokenizer (e.g. an actor_hf export)")
    check.add_argument("--count", type=int, default=eval_count)
    check.add_argument("--seed", type=int, default=1, help=f"seed of the {items} (the training prompts use 0)")
    return parser, write, check


def parse_task_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s arguments; a ``--count`` below 1 is a one-line error."""
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count {args.count}: must be at least 1")
    return args


def print_figures(model: Path, figures: dict[str, float]) -> None:
    """An evaluation's figures: one readable line, then one JSON line."""
    print(f"{model}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    print(json.dumps(figures))


@dataclass(frozen=True)
class ChatResponse:
    prompt: str  # the rendered prompt text
    text: str  # the response, without its stop token
    finished: bool  # it ended with a stop token (False: it reached max_new_tokens)
    tokens: int  # generated tokens, the stop token included


def greedy_responses(folder: str | Path, questions: Sequence[str], max_new_tokens: int, *, slots: int = 32) -> list[ChatResponse]:
    """The greedy responses of the HF checkpoint ``folder`` (with its tokenizer) to ``questions``, each a user turn
    rendered by the tokenizer's chat template; in the order of ``questions``."""
    from fusedrl.components import load_tokenizer
    from fusedrl.generation import GenerationEngine, Request, SamplingParams
    from fusedrl.models import from_pretrained

    tokenizer = load_tokenizer(folder)
    render = getattr(tokenizer, "render_chat", None)
    if render is None:
        raise ValueError(f"the tokenizer of {folder} has no chat template; the questions are chat turns")
    model = from_pretrained(folder).model.eval()
    prompts = [render([{"role": "user", "content": q}]) for q in questions]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tokenizer.stop_token_ids)
    requests = [Request(i, tokenizer.encode(p, add_bos=False), greedy) for i, p in enumerate(prompts)]
    max_len = max(len(r.prompt) for r in requests) + max_new_tokens
    results = sorted(GenerationEngine(model, max_slots=slots, max_len=max_len).generate(requests), key=lambda r: r.id)
    stops = set(tokenizer.stop_token_ids)
    out = []
    for prompt, r in zip(prompts, results):
        finished = bool(r.tokens) and r.tokens[-1] in stops
        out.append(ChatResponse(prompt, tokenizer.decode(r.tokens[:-1] if finished else r.tokens), finished, len(r.tokens)))
    return out
