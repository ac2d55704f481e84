"""Scoring of finished samples: Reference log-probs, Reward scores and Critic values (those of the models the job
has), micro-batched.

Runs on any instance that holds the three models (the Reference and Reward are frozen and loaded
once; the Critic is refreshed by the same weight sync as the Actor). Samples are sorted by length
and cut into micro-batches (:func:`scoring_micro_batches`: at most ``micro_batch_size`` rows and,
optionally, ``max_tokens`` padded tokens), each right-padded to its own longest sample; causal
attention keeps the padding from reaching real tokens, so no mask is needed. Each model runs its
body (:func:`decoder_hidden_states`); the Reference's LM head is applied a chunk of positions at a
time and on response tokens only (:func:`~fusedrl.rlhf.losses.chunked_token_logprobs`), so full-vocabulary logits
of a whole micro-batch never exist and prompt positions cost no head work; the Reward's and Critic's scalar heads are applied directly. Output follows
the :class:`~fusedrl.rlhf.Experience` layout (per-token tensors aligned with ``tokens``).

A rule-based reward (:class:`~fusedrl.rlhf.RuleReward`) adds ``weight * value`` to each sample's score, or
scores alone when there is no Reward model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from fusedrl.generation import RequestResult
from fusedrl.rlhf.advantages import last_token_index
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.losses import DEFAULT_LOGITS_BUDGET_BYTES, chunked_token_logprobs, shift_to_tokens
from fusedrl.rlhf.reward_fn import RuleReward


def decoder_hidden_states(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Final normed hidden states ``[B, S, D]`` of a torchtune ``TransformerDecoder`` (or a decoder-shaped
    module with ``tok_embeddings``, ``layers`` and ``norm``): its plain causal forward without the head.

    Invariant: ``model(tokens) == model.output(decoder_hidden_states(model, tokens)).float()`` for a model
    without KV caches. Positions are ``0 .. S-1`` and attention is causal (torchtune's attention uses
    ``is_causal`` when it gets no mask and has no KV cache), so right padding never reaches real tokens.
    Only the modules' own forwards run, so tensor-parallel (DTensor) layers work unchanged.
    """
    if any(getattr(m, "kv_cache", None) is not None for m in model.modules()):
        raise ValueError(
            "decoder_hidden_states needs a model without KV caches (with caches set up, torchtune's attention "
            "is not causal without a mask); score with a model that never ran setup_caches"
        )
    max_len = getattr(model, "max_seq_len", None)
    if max_len is not None and tokens.shape[1] > max_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len {max_len}")
    # casts: nn.Module.__getattr__ is typed Tensor | Module; these attributes are the decoder's submodules
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else cast(Iterable[nn.Module], model.layers)
    h = cast(nn.Module, model.tok_embeddings)(tokens)
    for layer in layers:
        h = layer(h)
    return cast(nn.Module, model.norm)(h)


def _head(model: nn.Module) -> nn.Module:
    """``model.output``, the head; cast as nn.Module.__getattr__ is typed Tensor | Module."""
    return cast(nn.Module, model.output)


def scoring_micro_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Cut samples of these ``lengths`` (in the given order, usually ascending) into consecutive micro-batches.

    Returns lists of indices into ``lengths``; concatenated they are ``0 .. len(lengths)-1`` in order.
    Each micro-batch has at most ``max_rows`` rows and, when ``max_tokens`` is given, at most
    ``max_tokens`` padded tokens (rows x its longest length), except that a sample longer than
    ``max_tokens`` forms a micro-batch of its own. Cuts are greedy: a micro-batch grows while both limits hold.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i, n in enumerate(lengths):
        grown = max(width, n)
        fits = len(current) < max_rows and (max_tokens is None or (len(current) + 1) * grown <= max_tokens)
        if current and not fits:
            out.append(current)
            current, grown = [], n
        current.append(i)
        width = grown
    if current:
        out.append(current)
    return out


@dataclass
class ScoringModels:
    """``reference``: policy role (LM head); ``reward`` and ``critic``: value role (scalar head). ``reward`` is
    None when a rule-based reward scores alone, ``critic`` with a critic-free advantage estimator, ``reference``
    without a KL term: their fields of the scored batch stay None."""

    reference: nn.Module | None
    reward: nn.Module | None
    critic: nn.Module | None

    def device(self) -> torch.device:
        """Where the models are (the CPU when a rule-based reward scores alone)."""
        for model in (self.reference, self.critic, self.reward):
            if model is not None:
                return next(model.parameters()).device
        return torch.device("cpu")


@dataclass
class Scorer:
    """Scores finished samples (the generation engine's results) in length-sorted micro-batches of at most
    ``micro_batch_size`` rows and, when set, ``max_tokens`` padded tokens (rows x longest sample; a longer
    sample is scored alone).

    ``temperature`` divides the Reference logits (use the sampling temperature the Actor's log-probs
    were taken at; the generation engine reports them at 1.0). ``logits_budget_bytes`` bounds one float32
    chunk of Reference logits (positions x rows x vocab x 4 bytes; see
    :func:`~fusedrl.rlhf.losses.chunked_token_logprobs`). Micro-batching changes no result.

    ``reward_fn``: a rule-based reward, called once per :meth:`score` call on its samples; a sample's score is
    the Reward model's plus ``reward_fn.weight`` times the function's value (the value alone, weighted, without
    a Reward model). A sample the function failed on (NaN value, ``on_failure="skip"``) keeps the Reward
    model's score (0 without one). A sample's own ``reward`` (its episode's environment reward, multi-turn) is added
    too; ``env_rewards=True`` lets it score alone. The response mask leaves a sample's observations out.
    """

    models: ScoringModels
    micro_batch_size: int = 8
    pad_id: int = 0
    temperature: float = 1.0
    max_tokens: int | None = None
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES
    reward_fn: RuleReward | None = None
    env_rewards: bool = False

    def __post_init__(self) -> None:
        if self.models.reward is None and self.reward_fn is None and not self.env_rewards:
            raise ValueError(
                "Scorer needs a Reward model (models.reward), a rule-based reward (reward_fn) or environments that "
                "reward their episodes (env_rewards=True)"
            )
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None (no token limit), got {self.max_tokens}")
        if self.logits_budget_bytes < 1:
            raise ValueError(f"logits_budget_bytes must be >= 1, got {self.logits_budget_bytes}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @torch.no_grad()
    def score(self, samples: Sequence[RequestResult]) -> Experience:
        """An :class:`Experience` with ``tokens``, ``response_mask``, ``logprobs`` (the samples' own),
        ``ref_logprobs``, ``values``, ``scores``, ``sample_ids`` and ``finished`` (ended with a stop token; and
        ``reward_fn_scores`` with a reward function), rows in the order of ``samples``."""
        if not samples:
            raise ValueError("Scorer.score got no samples; skip the call for an empty set")
        for s in samples:
            if not s.tokens:
                raise ValueError(f"sample {s.id} has an empty response; every scored sample needs >= 1 response token")
            if s.logprobs and len(s.logprobs) != len(s.tokens):
                raise ValueError(f"sample {s.id} has {len(s.logprobs)} log-probs for {len(s.tokens)} response tokens")
        order = sorted(range(len(samples)), key=lambda i: (samples[i].num_tokens, i))
        cuts = scoring_micro_batches([samples[i].num_tokens for i in order], self.micro_batch_size, self.max_tokens)
        parts = [self._score_micro_batch([samples[order[j]] for j in cut]) for cut in cuts]
        merged = Experience.concat(parts, pad_token_id=self.pad_id)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        exp = merged.select(inverse)
        if self.reward_fn is not None:
            values = self.reward_fn(samples)
            exp.reward_fn_scores = values
            assert exp.scores is not None  # _score_micro_batch sets scores on every part
            exp.scores = exp.scores + self.reward_fn.weight * values.nan_to_num(nan=0.0)
        if any(s.reward is not None for s in samples):  # an environment's reward of the sample's episode
            assert exp.scores is not None
            exp.scores = exp.scores + torch.tensor([s.reward or 0.0 for s in samples], dtype=exp.scores.dtype)
        return exp

    def _score_micro_batch(self, samples: list[RequestResult]) -> Experience:
        device = self.models.device()
        width = max(s.num_tokens for s in samples)
        tokens = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(samples), width)
        logprobs = torch.zeros(len(samples), width)
        for row, s in enumerate(samples):
            p, n = len(s.prompt), s.num_tokens
            tokens[row, :n] = torch.tensor([*s.prompt, *s.tokens])
            mask[row, p:n] = torch.tensor(s.sampled_mask, dtype=mask.dtype)  # observations: out of every loss
            if s.logprobs:
                logprobs[row, p:n] = torch.tensor(list(s.logprobs))
        dev_tokens, dev_mask = tokens.to(device), mask.to(device)
        ref_model, critic, reward_model = self.models.reference, self.models.critic, self.models.reward
        ref = values = None
        if ref_model is not None:
            ref = chunked_token_logprobs(
                decoder_hidden_states(ref_model, dev_tokens),
                _head(ref_model),
                dev_tokens,
                self.temperature,
                budget_bytes=self.logits_budget_bytes,
                mask=dev_mask,  # the head runs on response tokens only
            )
            ref = ref.cpu()
        if critic is not None:
            values = shift_to_tokens(_head(critic)(decoder_hidden_states(critic, dev_tokens)).squeeze(-1).float())
            values = (values * dev_mask).cpu()
        if reward_model is None:
            scores = torch.zeros(len(samples))
        else:
            reward = _head(reward_model)(decoder_hidden_states(reward_model, dev_tokens)).squeeze(-1).float()
            scores = reward.gather(1, last_token_index(dev_mask)[:, None]).squeeze(1)
        exp = Experience(
            tokens=tokens,
            response_mask=mask,
            logprobs=logprobs,
            ref_logprobs=ref,
            values=values,
            scores=scores.cpu(),
            sample_ids=torch.tensor([s.id for s in samples], dtype=torch.long),
            finished=torch.tensor([s.finish_reason == "stop" for s in samples]),
        )
        return exp
