"""What the chat-question tasks (:mod:`.arithmetic`, :mod:`.word_problems`) share: a prompt file of user turns with
their answers, their checkers as the trainer's reward functions, and a checkpoint's greedy responses to questions
rendered by its chat template."""

from __future__ import annotations

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
