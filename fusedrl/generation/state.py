"""RequestState: an in-flight request, detached from its engine (the unit of migration)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedrl.generation.request import Request, SamplingParams

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@dataclass
class RequestState:
    """Everything needed to continue a request on another engine with identical output.

    ``generated`` holds the tokens sampled so far; the last one is *pending* (not yet in the KV cache).
    ``k``/``v`` are the request's cache rows, shape [num_layers, cache_len, kv_heads, head_dim], where
    ``cache_len == len(prompt) + len(generated) - 1``; they are ``None`` for a re-prefill export (the
    importing engine recomputes them from the tokens) and for a request that has not started.
    ``rng_state`` is the request's generator state (None until the request is admitted).

    The object pickles as is; :meth:`to_tensors` / :meth:`from_tensors` give a tensor-only form for
    ``torch.distributed`` point-to-point (see :func:`send_request_state`).
    """

    request: Request
    generated: list[int]
    logprobs: list[float]
    rng_state: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def id(self):
        return self.request.id

    @property
    def cache_len(self) -> int:
        """Tokens whose keys/values are (or would be) cached."""
        extra = len(self.generated) - 1 if self.generated else 0
        return len(self.request.prompt) + extra

    @property
    def has_kv(self) -> bool:
        return self.k is not None

    def without_kv(self) -> "RequestState":
        return dataclasses.replace(self, k=None, v=None)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor form (what a point-to-point transfer moves)."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Tensor-only form: ``meta`` (uint8 JSON), ``tokens``, ``logprobs``, optional ``rng``, ``k``, ``v``."""
        req = self.request
        meta = {
            "id": req.id,
            "prompt_len": len(req.prompt),
            "seed": req.seed,
            "sampling": dataclasses.asdict(req.sampling),
        }
        out = {
            "meta": torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8),
            "tokens": torch.tensor(req.prompt + self.generated, dtype=torch.int64),
            "logprobs": torch.tensor(self.logprobs, dtype=torch.float32),
        }
        if self.rng_state is not None:
            out["rng"] = self.rng_state
        if self.k is not None:
            out["k"], out["v"] = self.k, self.v
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "RequestState":
        meta = json.loads(bytes(tensors["meta"].cpu().tolist()).decode())
        tokens = tensors["tokens"].tolist()
        sampling = meta["sampling"]
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
        request = Request(meta["id"], tokens[: meta["prompt_len"]], SamplingParams(**sampling), meta["seed"])
        return cls(
            request=request,
            generated=tokens[meta["prompt_len"] :],
            logprobs=tensors["logprobs"].tolist(),
            rng_state=tensors["rng"].cpu() if "rng" in tensors else None,
            k=tensors.get("k"),
            v=tensors.get("v"),
        )


# Header layout for point-to-point transfer: sizes of each tensor of the tensor form.
_HEADER = ["meta", "tokens", "logprobs", "rng", "layers", "cache_len", "kv_heads", "head_dim", "kv_dtype"]


def send_request_state(state: RequestState, dst: int, *, group=None, device: torch.device | str = "cpu") -> int:
    """Send ``state`` to rank ``dst`` with blocking point-to-point ops; returns the bytes sent.

    ``device`` is where the transfer buffers live (``cuda`` for NCCL). Pair with :func:`recv_request_state`.
    """
    t = state.to_tensors()
    k = t.get("k")
    header = [
        t["meta"].numel(),
        t["tokens"].numel(),
        t["logprobs"].numel(),
        t["rng"].numel() if "rng" in t else -1,
        *(list(k.shape) if k is not None else [0, 0, 0, 0]),
        _DTYPES.index(k.dtype) if k is not None else -1,
    ]
    payload = [torch.tensor(header, dtype=torch.int64)] + [t[n] for n in ("meta", "tokens", "logprobs", "rng", "k", "v") if n in t]
    sent = 0
    for x in payload:
        x = x.contiguous().to(device)
        dist.send(x, dst, group=group)
        sent += x.numel() * x.element_size()
    return sent


def recv_request_state(src: int, *, group=None, device: torch.device | str = "cpu") -> RequestState:
    """Receive a :class:`RequestState` sent by :func:`send_request_state` from rank ``src``."""

    def recv(shape, dtype):
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src, group=group)
        return x

    h = dict(zip(_HEADER, recv([len(_HEADER)], torch.int64).tolist()))
    t = {
        "meta": recv([h["meta"]], torch.uint8),
        "tokens": recv([h["tokens"]], torch.int64),
        "logprobs": recv([h["logprobs"]], torch.float32),
    }
    if h["rng"] >= 0:
        t["rng"] = recv([h["rng"]], torch.uint8)
    if h["kv_dtype"] >= 0:
        shape = [h["layers"], h["cache_len"], h["kv_heads"], h["head_dim"]]
        t["k"] = recv(shape, _DTYPES[h["kv_dtype"]])
        t["v"] = recv(shape, _DTYPES[h["kv_dtype"]])
    return RequestState.from_tensors(t)
