"""RequestState, a request detached from its engine, and its one wire format.

A state is in flight (``finish_reason`` None: the unit of migration, with its KV slice) or finished
(a sample on its way to be scored). Both travel between ranks the same way: :func:`pack_states` turns a
batch of states into a few flat tensors (one header of fixed size first), :func:`send_states` /
:func:`recv_states` move them point to point; a batch of zero states is an
end-of-stream marker.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from fusedrl.generation.request import FinishReason, Request, RequestId, RequestResult, SamplingParams

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def sampled_count(generated: Sequence[int], observations: Sequence[tuple[int, int]]) -> int:
    """Tokens of ``generated`` a request sampled, those in the ``observations`` spans left out: the position of its
    random stream."""
    return len(generated) - sum(end - start for start, end in observations)


@dataclass
class RequestState:
    """Everything needed to continue a request on another engine with identical output, or to score it.

    ``generated`` holds the tokens after the prompt so far; while in flight the last one is *pending* (not yet in
    the KV cache). ``k``/``v`` are the request's cache rows, shape [num_layers, n, kv_heads, head_dim] with ``n <=
    cache_len == len(prompt) + len(generated) - 1`` (a multi-turn request continued after an observation holds the
    rows it had: the importing engine computes the rest); they are ``None`` for a re-prefill export (the importing
    engine recomputes them from the tokens), for a request that has not started, and for a finished one. The
    request's random stream is a function of its seed, id and the count of tokens it sampled (see :mod:`.sampling`):
    there is no RNG state to carry. Multi-turn: ``observations`` are the ``[start, end)`` spans of ``generated`` that
    environments appended, ``turn_start`` where the current turn began (its token budget counts from there), and
    ``awaiting`` marks a request whose turn ended and that waits for an observation.
    """

    request: Request
    generated: list[int]
    logprobs: list[float]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    finish_reason: FinishReason | None = None
    observations: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    turn_start: int = 0
    awaiting: bool = False

    @property
    def sampled(self) -> int:
        """Tokens of ``generated`` the request sampled (:func:`sampled_count`)."""
        return sampled_count(self.generated, self.observations)

    @property
    def id(self) -> RequestId:
        return self.request.id

    @property
    def cache_len(self) -> int:
        """Tokens whose keys/values are (or would be) cached."""
        extra = len(self.generated) - 1 if self.generated else 0
        return len(self.request.prompt) + extra

    @property
    def has_kv(self) -> bool:
        return self.k is not None

    def without_kv(self) -> RequestState:
        return dataclasses.replace(self, k=None, v=None)

    def observe(self, observation: Sequence[int], max_len: int, vocab_size: int) -> None:
        """Append an environment's ``observation`` (token ids, not sampled: log-prob 0, a span of ``observations``) to
        this request whose turn ended, and start its next turn. Raises ValueError, the state unchanged, where the
        observation is empty, holds an id outside ``[0, vocab_size)``, or leaves no position of ``max_len`` or token of
        the request's ``max_tokens`` for a next turn."""
        ids = [int(t) for t in observation]
        if not ids:
            raise ValueError(f"request {self.id!r}: an empty observation; end the request instead (end_request)")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {self.id!r}: observation token id {bad[0]} is outside [0, {vocab_size})")
        total = len(self.request.prompt) + len(self.generated) + len(ids)
        if total >= max_len:
            raise ValueError(
                f"request {self.id!r}: the observation of {len(ids)} tokens takes it to {total} tokens, past the "
                f"engine's max_len {max_len} less one for its next turn: end the episode (end_request), shorten the "
                "observation or raise max_len"
            )
        if self.request.turn_budget(len(self.generated) + len(ids)) == 0:
            raise ValueError(
                f"request {self.id!r}: the observation of {len(ids)} tokens takes it to its max_tokens "
                f"{self.request.max_tokens}, leaving no token for its next turn: end the episode (end_request)"
            )
        start = len(self.generated)
        self.generated += ids
        self.logprobs += [0.0] * len(ids)
        self.observations.append((start, start + len(ids)))
        self.turn_start, self.awaiting, self.finish_reason = len(self.generated), False, None

    @classmethod
    def of_result(cls, result: RequestResult) -> RequestState:
        """The finished state of an engine's result (to send it to the rank that scores it)."""
        return cls(
            result.request,
            list(result.tokens),
            list(result.logprobs),
            finish_reason=result.finish_reason,
            observations=list(result.observations),
        )

    def to_result(self) -> RequestResult:
        if self.finish_reason is None:
            raise ValueError(f"request {self.id!r} has not finished; only a finished state becomes a result")
        return RequestResult(
            self.request, self.generated, self.logprobs, self.finish_reason, observations=list(self.observations)
        )

    @property
    def nbytes(self) -> int:
        """Bytes this state adds to a packed batch (what a point-to-point transfer moves, header aside)."""
        return sum(t.numel() * t.element_size() for t in pack_states([self])[1:])


# ---------------------------------------------------------------------------------------------- wire format
# Message 1, int64 [HEADER]: count, then the element counts of messages 3-5 (meta bytes, tokens, log-probs),
# KV rows, and the KV layout (layers, kv_heads, head_dim, dtype index; zeros/-1 without KV).
# Message 2, int64 [count, len(_FIELDS)]: per state, _FIELDS. Then meta (uint8 JSON), tokens (prompt then
# generated, int64), log-probs (float32) and K, V (concatenated along the token axis).
_HEADER = ("count", "meta", "tokens", "logprobs", "kv_rows", "layers", "kv_heads", "head_dim", "kv_dtype")
_FIELDS = ("meta", "prompt", "generated", "kv_rows")


def pack_states(states: Sequence[RequestState]) -> list[torch.Tensor]:
    """The tensors of one message batch: header, per-state sizes, then the payloads present."""
    if not states:
        return [torch.tensor([0] * (len(_HEADER) - 1) + [-1], dtype=torch.int64)]
    metas = [
        json.dumps(
            {
                "id": s.id,
                "seed": s.request.seed,
                "sampling": dataclasses.asdict(s.request.sampling),
                "finish_reason": s.finish_reason,
                "multi_turn": s.request.multi_turn,
                "max_tokens": s.request.max_tokens,
                "observations": s.observations,
                "turn_start": s.turn_start,
                "awaiting": s.awaiting,
            }
        ).encode()
        for s in states
    ]
    with_kv = [s for s in states if s.has_kv]
    keys = cast(list[torch.Tensor], [s.k for s in with_kv])  # has_kv: k is set
    values = cast(list[torch.Tensor], [s.v for s in with_kv])  # v is set together with k
    layout = _kv_layout(keys)
    sizes = torch.tensor(
        [
            [len(m), len(s.request.prompt), len(s.generated), s.k.shape[1] if s.k is not None else 0]
            for m, s in zip(metas, states)
        ],
        dtype=torch.int64,
    )
    for s in states:
        if len(s.logprobs) != len(s.generated):
            raise ValueError(f"request {s.id!r} has {len(s.logprobs)} log-probs for {len(s.generated)} generated tokens")
    payload = [
        torch.frombuffer(bytearray(b"".join(metas)), dtype=torch.uint8),
        torch.tensor([t for s in states for t in (*s.request.prompt, *s.generated)], dtype=torch.int64),
        torch.tensor([lp for s in states for lp in s.logprobs], dtype=torch.float32),
    ]
    if with_kv:
        payload += [torch.cat(keys, dim=1), torch.cat(values, dim=1)]
    header = [len(states), *(p.numel() for p in payload[:3]), int(sizes[:, 3].sum()), *layout]
    return [torch.tensor(header, dtype=torch.int64), sizes, *payload]


def _kv_layout(keys: list[torch.Tensor]) -> list[int]:
    if not keys:
        return [0, 0, 0, -1]
    shapes = {(k.shape[0], *k.shape[2:], k.dtype) for k in keys}
    if len(shapes) != 1:
        raise ValueError(f"states of one batch must share the KV layout (layers, kv_heads, head_dim, dtype), got {shapes}")
    layers, kv_heads, head_dim, dtype = shapes.pop()
    return [layers, kv_heads, head_dim, _DTYPES.index(dtype)]


def unpack_states(tensors: Sequence[torch.Tensor]) -> list[RequestState]:
    """The states of a batch from the tensors that followed its header (inverse of :func:`pack_states`)."""
    sizes, meta, tokens, logprobs, *kv = tensors
    k, v = kv if kv else (None, None)
    meta_bytes, token_ids, logprob_values = bytes(meta.cpu().tolist()), tokens.tolist(), logprobs.tolist()
    out, pos = [], dict.fromkeys(("meta", "tokens", "logprobs", "kv"), 0)
    for n_meta, n_prompt, n_gen, n_kv in sizes.tolist():
        info = json.loads(meta_bytes[pos["meta"] : pos["meta"] + n_meta])
        sampling = {**info["sampling"], "stop_token_ids": tuple(info["sampling"]["stop_token_ids"])}
        seq = token_ids[pos["tokens"] : pos["tokens"] + n_prompt + n_gen]
        state = RequestState(
            Request(
                info["id"], seq[:n_prompt], SamplingParams(**sampling), info["seed"], info["multi_turn"], info.get("max_tokens")
            ),
            seq[n_prompt:],
            logprob_values[pos["logprobs"] : pos["logprobs"] + n_gen],
            finish_reason=info["finish_reason"],
            observations=[(int(a), int(b)) for a, b in info["observations"]],
            turn_start=info["turn_start"],
            awaiting=info["awaiting"],
        )
        if n_kv:
            assert k is not None and v is not None  # a batch with KV rows carries K and V
            state.k, state.v = k[:, pos["kv"] : pos["kv"] + n_kv], v[:, pos["kv"] : pos["kv"] + n_kv]
        out.append(state)
        for key, n in (("meta", n_meta), ("tokens", n_prompt + n_gen), ("logprobs", n_gen), ("kv", n_kv)):
            pos[key] += n
    return out


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class PendingSend:
    """Handles of non-blocking sends; keeps their tensors alive until :meth:`wait`."""

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor]) -> None:
        self._works, self._tensors = works, tensors

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._tensors = []


def send_states(
    states: Sequence[RequestState],
    dst: int,
    *,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    device: torch.device | str = "cpu",
) -> int:
    """Send a batch of states to rank ``dst`` of ``group`` (blocking); returns the bytes sent.

    ``device`` is where the transfer buffers live (``cuda`` for NCCL). Pair with :func:`recv_states`.
    """
    sent = 0
    for t in _nonempty(pack_states(states)):
        t = t.contiguous().to(device)
        dist.send(t, _global(dst, group), group=group, tag=tag)
        sent += t.numel() * t.element_size()
    return sent


def recv_states(
    src: int | None, *, group: dist.ProcessGroup | None = None, tag: int = 0, device: torch.device | str = "cpu"
) -> tuple[int, list[RequestState]]:
    """Receive a batch sent by :func:`send_states`: ``(sender, states)``.

    ``src`` is a rank of ``group``, or None for whichever sender's batch comes first (gloo only); the
    returned sender is a rank of ``group``. An empty list is the sender's end-of-stream marker.
    """
    header = torch.empty(len(_HEADER), dtype=torch.int64, device=device)
    sender = dist.recv(header, None if src is None else _global(src, group), group=group, tag=tag)
    h = dict(zip(_HEADER, header.tolist()))
    if h["count"] == 0:
        return _local(sender, group), []

    def recv(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        if x.numel():  # empty tensors are not sent (see _nonempty)
            dist.recv(x, sender, group=group, tag=tag)
        return x

    tensors = [
        recv([h["count"], len(_FIELDS)], torch.int64),
        recv([h["meta"]], torch.uint8),
        recv([h["tokens"]], torch.int64),
        recv([h["logprobs"]], torch.float32),
    ]
    if h["kv_dtype"] >= 0:
        shape = [h["layers"], h["kv_rows"], h["kv_heads"], h["head_dim"]]
        tensors += [recv(shape, _DTYPES[h["kv_dtype"]]), recv(shape, _DTYPES[h["kv_dtype"]])]
    return _local(sender, group), unpack_states(tensors)


def _nonempty(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Empty payloads (no log-probs yet) are not sent: the header tells the receiver so."""
    return [t for t in tensors if t.numel()]


def _local(global_rank: int, group: dist.ProcessGroup | None) -> int:
    return global_rank if group is None else dist.get_group_rank(group, global_rank)
