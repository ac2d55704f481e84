"""Packed rows: several sequences ("documents") back to back in one row, each attending only to itself, causally,
with positions restarting at 0 (``ppo.microbatch_tokens``). No padding is computed between them.

The linear layers run on the packed rows; attention alone runs on the documents gathered into a right-padded batch,
one causal SDPA over all of them (torch's fused CPU and CUDA kernels take no per-document mask). Measured on the 4 x 4
GRPO batch of SmolLM2-135M (docs/benchmarks.md): a dense document-causal mask over the whole packed row computes every
query against every key of the row (1120 positions: slower than padding the sequences); one SDPA call per document
was no faster than padding (a slow bf16 CPU backward per call, and a zero-filled gradient per slice); torchtune
refuses FlexAttention's block masks off CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import MultiHeadAttention


# Not frozen: torch 2.11's dynamo guards on a frozen dataclass's fields, so a compiled layer given new spans
# with another document count compiled again, until its graph limit (2.13 and 2.14 guard on the type only).
@dataclass(eq=False)
class DocumentSpans:
    """The documents of each row of a packed batch: ``lengths[r]`` are row ``r``'s document lengths in order, summing
    to the row's length (trailing padding is a document of its own). Passed as the ``mask`` of a fusedrl decoder's
    layers (:func:`accept_document_spans`)."""

    lengths: tuple[tuple[int, ...], ...]
    _indices: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_ids(documents: torch.Tensor) -> DocumentSpans:
        """From ``[rows, seq]`` document ids, equal within a document and different between neighbours (read on the
        host: the executors keep them there, so no device-to-host copy)."""
        if documents.dim() != 2:
            raise ValueError(f"document ids must be [rows, seq], got shape {tuple(documents.shape)}")
        rows = []
        for row in documents.cpu().tolist():
            lengths, run = [], 1
            for prev, cur in zip(row, row[1:]):
                if cur == prev:
                    run += 1
                else:
                    lengths.append(run)
                    run = 1
            rows.append((*lengths, run))
        return DocumentSpans(tuple(rows))

    def indices(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather`` ``[documents, longest]``: each document's positions in the flattened ``[rows * seq]`` batch,
        right-padded with its first position; ``scatter`` ``[rows * seq]``: each position's place in the flattened
        ``[documents * longest]`` layout. Computed once per spans and device."""
        key = str(device)
        if key not in self._indices:
            longest = max(max(row) for row in self.lengths)
            gather: list[list[int]] = []
            scatter: list[int] = []
            start = 0
            for lengths in self.lengths:
                for n in lengths:
                    scatter.extend(range(len(gather) * longest, len(gather) * longest + n))
                    gather.append([start + i if i < n else start for i in range(longest)])
                    start += n
            self._indices[key] = (torch.tensor(gather, device=device), torch.tensor(scatter, device=device))
        return self._indices[key]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """``[rows, seq]`` positions, from 0 at the start of each document (RoPE's ``input_pos``)."""
        rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in self.lengths]
        return torch.stack(rows).to(device)


def _document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: object,
    dropout_p: float,
    is_causal: bool,
    *,
    fallback: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """torchtune's attention call (``q, k, v`` are ``[b, heads, s, head_dim]``) with :class:`DocumentSpans` as a mask:
    the documents gathered into a right-padded ``[documents, heads, longest, head_dim]`` batch, one causal SDPA over
    it (a document's padding comes after it: no real query sees it), and the outputs gathered back. Any other mask goes
    to torchtune's own call (``fallback``)."""
    if not isinstance(mask, DocumentSpans):
        return fallback(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    return _attend_documents(q, k, v, mask, dropout_p)


@torch.compiler.disable  # the spans change every step: compiled layers (fusedrl.distributed.compile) run this eager
def _attend_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentSpans, dropout_p: float) -> torch.Tensor:
    b, heads, s, dim = q.shape
    if len(mask.lengths) != b or any(sum(row) != s for row in mask.lengths):
        raise ValueError(f"DocumentSpans of rows {[sum(r) for r in mask.lengths]} do not match the attention's [{b}, {s}] input")
    gather, scatter = mask.indices(q.device)
    documents, longest = gather.shape

    def to_documents(x: torch.Tensor) -> torch.Tensor:
        flat = x.transpose(1, 2).reshape(b * s, heads, dim)
        return flat.index_select(0, gather.flatten()).view(documents, longest, heads, dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(to_documents(q), to_documents(k), to_documents(v), dropout_p=dropout_p, is_causal=True)
    flat = out.transpose(1, 2).reshape(documents * longest, heads, dim).index_select(0, scatter)
    return flat.view(b, s, heads, dim).transpose(1, 2)


def accept_document_spans(model: nn.Module) -> None:
    """Let every torchtune attention of ``model`` take :class:`DocumentSpans` as its ``mask``; other masks (None,
    boolean tensors) keep torchtune's behaviour."""
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module._attention_call = functools.partial(_document_causal_attention, fallback=module._attention_call)
