"""Packed training micro-batches (``ppo.microbatch_tokens`` > 0): each micro-batch is one row holding several
sequences back to back (document-causal attention, positions restarting at 0: :mod:`fusedrl.models.documents`), so
the forward and backward compute no padding between sequences, only at the end of a row.

Sequences are spread over rows of at most ``microbatch_tokens`` tokens, longest first into the least-filled row, the
same count on every data-parallel shard (FSDP2's collectives run once per micro-batch): at pp = 1 the fewest rows that
hold every shard, at pp >= 2 the pipeline program's micro-batch count (one row per micro-batch; longest first into the
least-filled row keeps a row below (``microbatch_size`` + 1) x the longest sequence). All rows of a step have one
length, rounded up to a multiple of 1/64 of the budget (at least 8 tokens). Every per-token field is laid
out the same way, so the losses are unchanged: a loss weight is per token (:func:`~fusedrl.rlhf.update.loss_weights`
of the whole minibatch), and position ``t`` of a row predicts token ``t + 1``, which at a document's end is the next
document's first token: a prompt token, never scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusedrl.buckets import evenly_spaced, round_up


def sequence_lengths(response_mask: torch.Tensor) -> list[int]:
    """Prompt + response tokens of each right-padded row: up to its last response token (1 for a row without one,
    which no loss counts)."""
    m = response_mask.bool()
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return (torch.where(m, positions, 0).amax(dim=1) + 1).tolist()


def pack_rows(lengths_by_shard: Sequence[Sequence[int]], capacity: int, count: int | None = None) -> list[list[list[int]]]:
    """For each data-parallel shard, its sequences (indices into its ``lengths``) in rows of at most ``capacity``
    tokens, longest first into the least-filled row, the same row count on each shard: the fewest rows that hold
    every shard, or exactly ``count`` (a pipeline program's micro-batch count; ValueError when they cannot hold a
    shard). Deterministic: every rank computes the same rows."""
    longest = max((n for lengths in lengths_by_shard for n in lengths), default=0)
    if longest > capacity:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit ppo.microbatch_tokens = {capacity}; raise it to at least the "
            "longest sequence (data.max_prompt_len + generation.max_new_tokens, or + env.max_tokens with an environment)"
        )
    if count is not None:
        rows = [_fill(lengths, count, capacity) for lengths in lengths_by_shard]
        if any(r is None for r in rows):
            raise ValueError(
                f"the minibatch does not fit {count} packed rows of ppo.microbatch_tokens = {capacity} tokens (the "
                "pipeline program's micro-batch count); raise ppo.microbatch_tokens to (ppo.microbatch_size + 1) x "
                "the longest sequence, which always fits"
            )
        return [r for r in rows if r is not None]
    count = max(1, max(-(-sum(lengths) // capacity) for lengths in lengths_by_shard))
    while True:
        packed = [_fill(lengths, count, capacity) for lengths in lengths_by_shard]
        if all(rows is not None for rows in packed):
            return [rows for rows in packed if rows is not None]
        count += 1


def _fill(lengths: Sequence[int], count: int, capacity: int) -> list[list[int]] | None:
    """``lengths``' indices in ``count`` rows, longest first into the least-filled one; None when one does not fit."""
    rows: list[list[int]] = [[] for _ in range(count)]
    filled = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = min(range(count), key=lambda r: (filled[r], r))
        if filled[row] + lengths[i] > capacity:
            return None
        rows[row].append(i)
        filled[row] += lengths[i]
    return [sorted(r) for r in rows]


@dataclass(frozen=True)
class PackedRows:
    """Where each sequence of a ``[B, S]`` batch goes in ``[rows, length]`` packed rows (:meth:`pack` lays a per-token
    tensor out so), and the rows' document ids (``documents``: a sequence's index in its row; the padding at a row's
    end is one more document)."""

    rows: list[list[int]]
    lengths: list[int]
    length: int

    @staticmethod
    def of(rows: list[list[int]], lengths: Sequence[int], capacity: int) -> PackedRows:
        """``rows`` of sequences of ``lengths``, each row ``length`` long: the longest row's tokens rounded up to a
        multiple of ``capacity`` / 64 (at least 8), so that the steps of a run see a bounded number of shapes (a
        pipeline stage's buffers are kept per shape) and pad little (1/32 of the budget, at least 16, padded the
        SmolLM2 GRPO recipe's rows by up to 6%)."""
        longest = max(sum(lengths[i] for i in row) for row in rows)
        return PackedRows(rows, list(lengths), round_up(longest, evenly_spaced(capacity, count=64, minimum=8)))

    def pack(self, per_token: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """``per_token`` ``[B, S]`` (right-padded) as ``[rows, length]``: each row's sequences back to back, then
        ``fill``."""
        out = per_token.new_full((len(self.rows), self.length), fill)
        for r, row in enumerate(self.rows):
            start = 0
            for i in row:
                n = self.lengths[i]
                out[r, start : start + n] = per_token[i, :n]
                start += n
        return out

    @property
    def documents(self) -> torch.Tensor:
        """``[rows, length]`` document ids: a sequence's index in its row, then the row's padding as the next
        indices, in pieces no longer than the longest sequence (attention pads every document to the longest one:
        a long padding document would make it compute and keep more than the rows hold)."""
        out = torch.empty(len(self.rows), self.length, dtype=torch.long)
        piece = max(self.lengths[i] for row in self.rows for i in row)
        for r, row in enumerate(self.rows):
            start = 0
            for d, i in enumerate(row):
                out[r, start : start + self.lengths[i]] = d
                start += self.lengths[i]
            out[r, start:] = len(row) + torch.arange(self.length - start) // piece
        return out

    @property
    def positions(self) -> int:
        """Positions computed per pass over the rows (padding included)."""
        return len(self.rows) * self.length
