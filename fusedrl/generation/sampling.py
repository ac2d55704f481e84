"""Batched temperature / top-k / top-p sampling on the device, with a counter-based random stream per request.

A request's random numbers are a pure function of its 63-bit seed, the number of tokens it has sampled so far
and the vocabulary index (a 32-bit integer hash computed with tensor ops): no generator objects, no per-row
loop and no host synchronization, the whole batch in one set of kernels. A request samples the same tokens
whatever batch, slot, engine or rank it runs in, and resuming it elsewhere needs nothing but its seed and its
tokens (migration sends no RNG state).
"""

from __future__ import annotations

import torch

from fusedrl.config import ConfigError, Startup
from fusedrl.config.loader import source_of

_MASK32 = 0xFFFFFFFF


def _int32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 ``x`` as an int32 tensor (the same bit pattern)."""
    low = x & _MASK32
    return (low - ((low >> 31) << 32)).to(torch.int32)


def _const32(c: int) -> int:
    """A 32-bit constant as the int32 with its bit pattern (int32 products wrap modulo 2**32)."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _shr32(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (``>>`` on int32 shifts the sign in)."""
    return (x >> n) & ((1 << (32 - n)) - 1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int32 bit patterns: an avalanching bijection of 32-bit words."""
    x = x ^ _shr32(x, 16)
    x = x * _const32(0x85EBCA6B)
    x = x ^ _shr32(x, 13)
    x = x * _const32(0xC2B2AE35)
    return x ^ _shr32(x, 16)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard exponential draws ``[B, vocab_size]`` (float32), row ``b`` a function of ``(seeds[b], counters[b])``.

    32-bit integer arithmetic throughout (int32 tensors holding the words' bit patterns: products wrap modulo
    2**32, shifts are made logical), so the ``[B, V]`` hash costs a few int32 ops per element."""
    device = seeds.device
    seeds, counters = seeds.to(torch.int64), counters.to(torch.int64)
    key = _mix32(_mix32(_int32(seeds)) ^ _int32(seeds >> 32))
    key = _mix32(key ^ (_int32(counters) * _const32(0x9E3779B1)))
    index = torch.arange(vocab_size, device=device, dtype=torch.int32)
    bits = _mix32(key[:, None] ^ (index * _const32(0x632BE5AB))[None, :])
    uniform = (_shr32(bits, 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits in (0, 1)
    return -torch.log(uniform)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    *,
    any_sampled: bool = True,
    any_filtered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V] (float32).

    Rows with temperature 0 are greedy. Sampled rows take the Gumbel-max form of the categorical draw:
    ``argmax(p / E)`` with ``E`` the row's exponentials (:func:`exponential_noise`), ``p = softmax(filter(logits
    / T))``. ``any_sampled`` / ``any_filtered`` are what the caller knows on the host (some row has temperature > 0
    / top-k or top-p set); False skips that work. Returns (tokens [B] int64, log-probs [B] of those tokens under
    the distribution that drew them: ``log p``; a greedy row's of its unscaled logits after its own filters).
    """
    if not any_sampled:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    sampled = temperature > 0
    scaled = logits / torch.where(sampled, temperature, 1.0)[:, None]  # a greedy row keeps its logits
    if any_filtered:
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)  # filters nothing on a row without top-k / top-p
    draws = (torch.softmax(scaled, dim=-1) / exponential_noise(seeds, counters, logits.shape[-1])).argmax(dim=-1)
    tokens = torch.where(sampled, draws, logits.argmax(dim=-1))
    # log_softmax as the training forward computes it (a logsumexp differs by up to 3e-5 at a 128k vocabulary in
    # float32, which would read as an engine-vs-trainer gap)
    return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = rank[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def check_sampling(startup: Startup) -> None:
    """Startup check (raises ConfigError): PPO needs the log-probs of the distribution that sampled, so a temperature
    > 0 (greedy decoding has none) and no top-k / top-p filter (the training forward's log-probs would be of the
    unfiltered distribution, whose support differs)."""
    cfg = startup.cfg
    g = cfg.generation
    if g.temperature <= 0:
        raise ConfigError(
            f"generation.temperature = {g.temperature} ({source_of(cfg, 'generation.temperature')}): PPO samples from the "
            "policy, and greedy decoding has no sampling distribution; use a temperature > 0 (1.0: the model's own)"
        )
    for key, value, off in (("top_k", g.top_k, 0), ("top_p", g.top_p, 1.0)):
        if value != off:
            raise ConfigError(
                f"generation.{key} = {value} ({source_of(cfg, f'generation.{key}')}): the PPO ratio and KL need the "
                f"log-probs of the distribution that sampled, and a filtered one's support moves with the policy; set "
                f"--generation.{key}={off} (lower generation.temperature to sharpen sampling)"
            )
