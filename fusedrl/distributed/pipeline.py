"""Split a torchtune TransformerDecoder into pipeline-stage modules (``PipelineStage`` submodules)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchtune.modules import TransformerDecoder
from torchtune.modules.tied_linear import TiedLinear

from fusedrl.distributed.parallel_dims import mesh_lines
from fusedrl.models.documents import DocumentSpans
from fusedrl.models.figures import stage_layer_counts


def stage_layer_ranges(num_layers: int, num_stages: int, boundaries: Sequence[int] | None = None) -> list[range]:
    """The decoder layers each stage runs.

    Without ``boundaries`` the layers are split as the cost model splits them,
    :func:`fusedrl.models.figures.stage_layer_counts` (the last stage also runs the output head). ``boundaries`` are the ``num_stages - 1``
    layer indices where stages 1.. start: strictly increasing, within ``[0, num_layers]``; only the
    first and the last stage may be left without layers (they still hold the embedding / the head).
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if boundaries is None:
        sizes = stage_layer_counts(num_layers, num_stages)
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        return [range(start, start + size) for start, size in zip(starts, sizes)]
    bounds = list(boundaries)
    if len(bounds) != num_stages - 1:
        raise ValueError(
            f"boundaries {bounds} must hold num_stages - 1 = {num_stages - 1} layer indices "
            "(the first layer of stages 1..num_stages-1)"
        )
    edges = [0, *bounds, num_layers]
    if any(not isinstance(b, int) or b < 0 or b > num_layers for b in bounds):
        raise ValueError(f"boundaries {bounds} must be integers in [0, {num_layers}] (the model has {num_layers} layers)")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"boundaries {bounds} must be strictly increasing so that every middle stage has a layer")
    return [range(edges[s], edges[s + 1]) for s in range(num_stages)]


class DecoderStage(nn.Module):
    """One pipeline stage of a TransformerDecoder: ``forward(x)`` only.

    Stage 0 takes token ids ``[B, S]``; other stages take hidden states ``[B, S, D]``; the last stage
    returns the model output (``float32``, like TransformerDecoder), or with ``apply_head=False`` the final
    normed hidden states (``float32``; the head, still held by the stage, is then applied by the loss).
    Attention is plain causal with positions ``0..S-1`` (right-padded training batches), or causal within each
    document of packed rows (``forward(x, documents)``); no KV cache.

    ``layers`` is keyed by the layer's index in the full model, so parameter names match the full
    model's state dict (``layers.5.attn.q_proj.weight``). ``hidden_dim`` is the model's embedding width: the last
    dim of the activations between stages.
    """

    def __init__(
        self,
        layers: dict[str, nn.Module],
        tok_embeddings: nn.Module | None,
        norm: nn.Module | None,
        output: nn.Module | None,
        max_seq_len: int,
        hidden_dim: int,
        apply_head: bool = True,
    ) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.tok_embeddings = tok_embeddings
        self.layers = nn.ModuleDict(layers)
        self.norm = norm
        self.output = output
        self.max_seq_len = max_seq_len
        self.apply_head = apply_head

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents``: ``[B, S]`` document ids of packed rows (:class:`~fusedrl.models.documents.DocumentSpans`):
        attention causal within each document, positions from 0 in each; None: plain causal rows."""
        spans = None if documents is None else DocumentSpans.from_ids(documents)
        longest = x.shape[1] if spans is None else max(max(row) for row in spans.lengths)
        if longest > self.max_seq_len:
            raise ValueError(f"sequence length {longest} exceeds the model's max_seq_len {self.max_seq_len}")
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if spans is None:
            for layer in self.layers.values():
                h = layer(h)
        else:
            positions = spans.positions(h.device)
            for layer in self.layers.values():
                h = layer(h, mask=spans, input_pos=positions)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h).float() if self.apply_head else h.float()
        return h

    @property
    def output_dim(self) -> int:
        """The last dim of this stage's output: the head's width on a last stage that applies it (the vocabulary of an
        LM head, 1 for a value head), the hidden width on any other stage."""
        if self.output is None or not self.apply_head:
            return self.hidden_dim
        return cast(nn.Linear, self.output).out_features


def _output_module(model: TransformerDecoder) -> nn.Module:
    if isinstance(model.output, nn.Module):
        return model.output
    if isinstance(model.output, TiedLinear):
        # Tied LM head: a Linear whose weight *is* the embedding's Parameter, so a single process
        # chaining the stages accumulates both uses into one gradient as the unsplit model does.
        weight = model.output.tied_module.weight
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = weight
        return head
    raise TypeError(f"unsupported decoder output head {type(model.output).__name__}; expected nn.Module or TiedLinear")


def split_decoder(
    model: TransformerDecoder, num_stages: int, boundaries: Sequence[int] | None = None, *, apply_head: bool = True
) -> list[DecoderStage]:
    """Split ``model`` into ``num_stages`` stage modules (see ``stage_layer_ranges`` for the layout).

    ``apply_head=False``: the last stage returns its final hidden states and leaves the head to the loss (a
    chunked LM-head loss, ``fusedrl.rlhf.PolicyLoss(head=stage.output)``).

    The stages reference the model's own submodules (no copies): build the full model, keep your
    stage, drop the rest. For a tied-embedding model split over several ranks, the embedding weight
    lives on the first and the last stage; its gradient is the sum of both stages' gradients
    (:class:`TiedEmbeddings` adds them).
    """
    if not isinstance(model, TransformerDecoder):
        raise TypeError(f"split_decoder needs a torchtune TransformerDecoder, got {type(model).__name__}")
    if model.caches_are_enabled() or model.num_output_chunks or model.output_hidden_states:
        raise ValueError(
            "split_decoder supports plain training forwards only: disable KV caches, chunked output "
            "and output_hidden_states first"
        )
    ranges = stage_layer_ranges(len(model.layers), num_stages, boundaries)
    last = num_stages - 1
    return [
        DecoderStage(
            layers={str(i): model.layers[i] for i in layer_range},
            tok_embeddings=model.tok_embeddings if s == 0 else None,
            norm=model.norm if s == last else None,
            output=_output_module(model) if s == last else None,
            max_seq_len=model.max_seq_len,
            hidden_dim=cast(nn.Embedding, model.tok_embeddings).embedding_dim,
            apply_head=apply_head,
        )
        for s, layer_range in enumerate(ranges)
    ]


class TiedEmbeddings:
    """A tied embedding / LM head split over pipeline stages: the first stage holds the embedding, the last its
    copy as the head. Each rank's backward gives only its use's gradient; :meth:`sum_gradients` adds the two
    (one all-reduce between the first and the last pipeline rank of each data-parallel / TP coordinate), so both
    copies get the full gradient, as the unsplit model's one parameter does, and stay equal under the same
    optimizer. Collective at construction: every rank of ``mesh`` builds it. Nothing to do unless the stage
    model ties its embeddings and pp >= 2 (then ``param`` is None on every rank). ``uncounted`` holds the last
    stage's copy: a global gradient norm leaves it out (``clip_grad_norm(..., uncounted=)``), so that the shared
    weight counts once, as the first stage's embedding.
    """

    def __init__(self, mesh: DeviceMesh, stage: DecoderStage, tied: bool) -> None:
        self.param: nn.Parameter | None = None
        self.group: dist.ProcessGroup | None = None
        self.uncounted: list[nn.Parameter] = []
        if not tied or mesh["pp"].size() < 2:
            return
        for row in mesh_lines(mesh, "pp"):  # every rank creates every pair's group, in the same order
            group = dist.new_group([row[0], row[-1]])
            if dist.get_rank() in (row[0], row[-1]):
                self.group = group
        # a module's weight is a registered Parameter (mypy sees Module.__getattr__'s Tensor | Module)
        if stage.tok_embeddings is not None:
            self.param = cast(nn.Parameter, stage.tok_embeddings.weight)
        elif stage.output is not None:
            self.param = cast(nn.Parameter, stage.output.weight)
            self.uncounted = [self.param]

    def sum_gradients(self) -> None:
        """Add the first and the last stage's gradients of the shared weight (call after backward, before clipping)."""
        if self.param is None or self.param.grad is None:
            return
        grad = self.param.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)
