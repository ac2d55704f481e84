"""Batched temperature / top-k / top-p sampling with one torch.Generator per row."""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V] (float32).

    Rows with temperature 0 are greedy and draw no random numbers. Every sampled row draws exactly
    V exponentials from its own generator per call, so a row's stream (and its result) does not depend
    on the other rows. Returns (tokens [B] int64, log-probs [B] of those tokens under log_softmax(logits)).
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = temperature > 0
    if bool(sampled.any()):
        rows = sampled.nonzero().flatten().tolist()
        scaled = logits[rows] / temperature[rows, None]
        scaled = _filter_top_k_top_p(scaled, top_k[rows], top_p[rows])
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            noise[i].exponential_(1.0, generator=generators[row])
        # Exponential race (Gumbel-max): argmax p_i / E_i is a draw from p.
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    if bool((top_k <= 0).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = rank[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
