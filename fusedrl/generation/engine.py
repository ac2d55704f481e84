"""GenerationEngine: requests, slots of a KV cache, continuous batching, prefill and the (compiled) decode step over a
torchtune decoder. The model's forward over the cache is :mod:`.slot_forward`, its CPU projections :mod:`.cpu_kernels`;
a request in a slot and the host's read of a step's tokens :mod:`.slots`."""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, TypeVar, get_args

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtune.modules import TransformerDecoder
from tqdm.auto import tqdm

from fusedrl.buckets import doubling, round_up
from fusedrl.config import ConfigError, GenerationSection, Startup
from fusedrl.config.loader import source_of
from fusedrl.distributed import compat
from fusedrl.generation import cpu_kernels, freshness, quantized
from fusedrl.generation.quantized import QUANTIZE_MODES, Quantize
from fusedrl.generation.request import FinishReason, Request, RequestId, RequestResult, request_error, request_seed
from fusedrl.generation.slot_forward import SlotForward, SlotState, layer_region, sample_rows
from fusedrl.generation.slots import Launched, Slot, copy_out, reads_lag_a_step, sampling_flags
from fusedrl.generation.speculation import Speculator, VerifyRow
from fusedrl.generation.state import RequestState
from fusedrl.generation.stats import CompileStats, EngineStats, PrefillStats, RequestProgress

_T = TypeVar("_T")
Speculative = Literal["off", "history"]
SPECULATIVE_MODES: tuple[str, ...] = get_args(Speculative)
CompileScope = Literal["step", "layer"]
COMPILE_SCOPES: tuple[str, ...] = get_args(CompileScope)
BACKENDS: tuple[str, ...] = ("inductor", "tensorrt", "eager", "aot_eager")


def _tensor_parallel(model: TransformerDecoder) -> bool:
    """Whether ``model``'s weights are DTensors (``fusedrl.distributed.apply_tp`` over a generation instance)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def check_compile(startup: Startup) -> None:
    """Startup check (raises ConfigError): CUDA graphs (``compile_mode = "reduce-overhead"``) record the whole decode
    step, so they need ``compile_scope = "step"``; the compiled decode takes no tensor-parallel weights."""
    g = startup.cfg.generation
    gen_tp = startup.cfg.parallelism.gen_tp
    if g.compile and gen_tp > 1:
        raise ConfigError(
            f"generation.compile = true ({source_of(startup.cfg, 'generation.compile')}) with parallelism.gen_tp = "
            f"{gen_tp}: the compiled decode does not take tensor-parallel (DTensor) weights in this torch; set "
            "--generation.compile=false or parallelism.gen_tp = 1"
        )
    if g.compile and g.compile_scope == "layer" and g.compile_mode == "reduce-overhead":
        raise ConfigError(
            f"generation.compile_mode = reduce-overhead ({source_of(startup.cfg, 'generation.compile_mode')}) records CUDA "
            "graphs of the whole decode step, but generation.compile_scope = layer compiles one layer: set "
            "--generation.compile_scope=step, or compile_mode = default"
        )


class GenerationEngine:
    """Continuous-batching generation over a torchtune ``TransformerDecoder``'s own modules.

    Args:
        model: the decoder. Its weights are used in place (``quantize``: through a quantized copy), so the engine may
            share the model a loop trains: it samples from the current weights after any ``torch.optim`` step (fused
            kernels included), ``load_state_dict`` or in-place edit through autograd (:mod:`.freshness`); after writes
            through ``.data`` or kernels of your own, call :meth:`weights_updated`. Decoding runs in eval mode and
            gives the model its own modes back after each step. A model sharded by ``fully_shard`` (FSDP2) cannot be
            shared: give the engine an unsharded copy and :class:`~fusedrl.generation.WeightSync`.
        max_slots: requests decoded at once; each slot owns ``max_len`` KV positions per layer.
        max_len: longest sequence (prompt + generated) the job needs, at most the model's ``max_seq_len``; it
            sizes the KV cache (required: a 128k-context model's whole context would be ~137 GB of bf16 cache
            for an 8B model with 64 slots).
        seed: default seed; each request's random stream is keyed by (request.seed or seed, request.id) and the
            number of tokens it has sampled (see :mod:`.sampling`).
        compile: compile as ``compile_scope`` says.
        compile_scope: ``"layer"`` (default): the decode step with its sampling as one graph in which each decoder
            layer is one nested compile region (compiled once, its code reused by every layer), with symbolic batch
            and length (one graph for 2 or more rows, another for a single row, whose CPU products are fused loops
            streaming the weights), so that compiling costs about the same whatever the model's depth and the buckets
            visited; the prefill stays eager.
            ``"step"``: the whole decode step with its sampling (batch padded to ``batch_buckets``,
            attended length to ``len_buckets`` but symbolic: one graph per batch bucket; with
            ``mode="reduce-overhead"`` a CUDA graph per (batch, length) bucket pair that occurs) and the prefill (one
            graph with symbolic rows and prompt length, another for a single row).
        backend / mode: passed to ``torch.compile`` (``mode="reduce-overhead"`` uses CUDA graphs on GPU);
            ``backend="tensorrt"`` needs ``pip install fusedrl[tensorrt]``.
        quantize: ``"int8_weight_only"`` decodes with a torchao int8 weight-only copy of the model.
        kv_dtype: dtype of the KV cache (default: the model's weight dtype).
        speculative: ``"history"`` drafts up to ``max_draft`` next tokens of a request from what the rollout has
            (its group siblings' tokens, earlier responses to its prompt, its own prompt and response:
            :class:`~fusedrl.generation.drafts.HistoryDrafter`) while at most ``speculative_rows`` requests decode, and
            verifies them in one forward over the pending token and the drafts: each position is sampled as decoding
            samples it (the request's seeded stream at that token count, its temperature and filters, the accepted
            drafts as context), drafts are accepted while they equal the sampled tokens, and the first sampled token
            that differs is kept. The tokens are those of decoding without it; log-probs are the verify forward's.
            Without ``lagged_reads`` or tensor-parallel weights the steps are timed, and verify steps run only at the
            numbers of rows where they produced more tokens per second than decode steps
            (:class:`~fusedrl.generation.speculation.SpeculationGate`).

        lagged_reads: read each decode step's tokens while the next step runs (None: on CUDA devices,
            :func:`.slots.reads_lag_a_step`). A request that finished is then found one step later (its row decodes once
            more, discarded); every request's tokens and log-probs are the same.

    The model may be tensor-parallel over a generation instance (``fusedrl.distributed.apply_tp``): every rank
    of the instance runs the same requests in lockstep, holds its share of the KV heads, and samples the same
    tokens (the logits are replicated).
    """

    def __init__(
        self,
        model: TransformerDecoder,
        *,
        max_slots: int = 8,
        max_len: int,
        seed: int = 0,
        compile: bool = False,
        compile_scope: CompileScope = "layer",
        backend: str = "inductor",
        mode: str | None = None,
        quantize: Quantize | None = None,
        batch_buckets: Iterable[int] | None = None,
        len_buckets: Iterable[int] | None = None,
        kv_dtype: torch.dtype | None = None,
        speculative: Speculative = "off",
        max_draft: int = 8,
        speculative_rows: int = 4,
        lagged_reads: bool | None = None,
    ) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if quantize is not None and quantize not in QUANTIZE_MODES:
            raise ValueError(f"unknown quantize mode {quantize!r}; valid: {', '.join(QUANTIZE_MODES)} or None")
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"unknown compile scope {compile_scope!r}; valid: {', '.join(COMPILE_SCOPES)}")
        if compile and compile_scope == "layer" and mode == "reduce-overhead":
            raise ValueError(
                "mode='reduce-overhead' records CUDA graphs of the whole decode step: use compile_scope='step' with it"
            )
        if backend not in BACKENDS:
            raise ValueError(f"unknown compile backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if speculative not in SPECULATIVE_MODES:
            raise ValueError(f"unknown speculative mode {speculative!r}; valid: {', '.join(SPECULATIVE_MODES)}")
        if max_draft < 1 or speculative_rows < 1:
            raise ValueError(f"max_draft and speculative_rows must be >= 1, got {max_draft} and {speculative_rows}")
        if compile and backend == "tensorrt":
            try:
                import torch_tensorrt  # noqa: F401
            except ImportError as e:
                raise ImportError("backend='tensorrt' needs torch-tensorrt: pip install fusedrl[tensorrt]") from e
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(
                "GenerationEngine got a model sharded by fully_shard (FSDP2), whose weights it cannot decode with: give "
                "it an unsharded copy (copy.deepcopy before fully_shard, or build_model) and WeightSync(trained, engine)"
            )
        if compile and _tensor_parallel(model):
            raise ValueError("compile=True with tensor-parallel (DTensor) weights: the compiled decode does not take them")
        model_max = model.max_seq_len
        if not 2 <= max_len <= model_max:
            raise ValueError(f"max_len must be in [2, {model_max}] (the model's max_seq_len), got {max_len}")
        self.source_model = model
        self.max_slots, self.max_len, self.seed = max_slots, max_len, seed
        self.quantize, self.compile, self.backend, self.mode = quantize, compile, backend, mode
        self.compile_scope = compile_scope
        self.kv_dtype = kv_dtype
        self.batch_buckets = tuple(sorted(set(batch_buckets or doubling(1, max_slots))))
        self.len_buckets = tuple(sorted(set(len_buckets or doubling(64, max_len))))
        if self.batch_buckets[0] < 1 or self.batch_buckets[-1] != max_slots:
            raise ValueError(f"batch_buckets {self.batch_buckets} must lie in [1, max_slots] and include max_slots={max_slots}")
        if self.len_buckets[0] < 1 or self.len_buckets[-1] != max_len:
            raise ValueError(f"len_buckets {self.len_buckets} must lie in [1, max_len] and include max_len={max_len}")
        self.vocab_size = model.tok_embeddings.num_embeddings
        self.device = model.tok_embeddings.weight.device
        self.lagged_reads = reads_lag_a_step(self.device) if lagged_reads is None else lagged_reads
        # a decode step whose tokens the host has not read (lagged_reads); only while some slot is active: a read that
        # leaves none drops it (its rows all finished before it)
        self._in_flight: Launched | None = None
        self._build()
        self._state = SlotState(max_slots, self.device)
        self._active: list[Slot] = []
        self._waiting: deque[RequestState] = deque()
        self._ready: list[RequestResult] = []
        self._parked: dict[RequestId, RequestState] = {}  # multi-turn requests between turns (their KV kept here)
        self._ids: set[RequestId] = set()
        self.speculator = (
            # an instance's TP ranks must take the same kind of step: only timings of their own could part them
            Speculator(max_draft=max_draft, rows=speculative_rows, measured=not self.lagged_reads and not _tensor_parallel(model))
            if speculative == "history"
            else None
        )  # :mod:`.speculation`

    @classmethod
    def from_config(
        cls,
        model: TransformerDecoder,
        section: GenerationSection,
        *,
        max_len: int,
        seed: int,
        kv_dtype: torch.dtype | None = None,
    ) -> GenerationEngine:
        """An engine as the ``[generation]`` section says (``compile_mode = "default"`` and ``quantize = "none"``
        are torch.compile's default mode and no quantization)."""
        if section.compile and section.compile_cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = section.compile_cache_dir  # read by inductor at each cache access
        return cls(
            model,
            max_slots=section.max_slots,
            max_len=max_len,
            seed=seed,
            compile=section.compile,
            compile_scope=section.compile_scope,
            backend=section.backend,
            mode=None if section.compile_mode == "default" else section.compile_mode,
            quantize=None if section.quantize == "none" else section.quantize,
            kv_dtype=kv_dtype,
            speculative=section.speculative,
            max_draft=section.max_draft,
            speculative_rows=section.speculative_rows,
        )

    @property
    def kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's slot cache buffers (k, v), each ``[max_slots, max_len + 1, kv_heads, head_dim]``."""
        return [self._forward.cache(i) for i in range(len(self.model.layers))]

    # ---------------------------------------------------------------- model / weights
    def _build(self) -> None:
        self.model = self.source_model if self.quantize is None else quantized.quantized_copy(self.source_model)
        model = self.model
        # decoding runs in eval mode (no dropout); a shared model gets its own modes back after each step
        self._modules = list(model.modules())
        freshness.watch(self.source_model)
        self._source_stamp = self._stamp_of_source()
        cpu_layouts = self.quantize is None and cpu_kernels.layouts_supported(self.model, _tensor_parallel(self.model))
        # torchao's quantized weights (tensor subclasses) do not enter a nested compile region (torch 2.13): a quantized
        # engine's step graph traces every layer inline
        regions = self.compile and self.compile_scope == "layer" and self.quantize is None
        self._forward = SlotForward(
            self.model, self.max_slots, self.max_len, cpu_layouts, self.kv_dtype, stack_projections=not regions
        )
        self._decode: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._forward.sample_step
        self._prefill_fn: Callable[..., torch.Tensor] = self._forward.prefill
        self.compile_stats = CompileStats()
        self.prefill_stats = PrefillStats()
        if regions:
            # The decode step with its sampling is one graph (one dispatch and one set of guards per step) in which
            # every layer is the same nested compile region: compiled once, its code reused by every layer. The batch
            # and the attended length are symbolic (marked per call): one graph per pair of sampling flags, and one
            # for a single row. The prefill stays eager.
            self._forward.decode_layer = layer_region(self._forward)
            compat.allow_recompiles(2 * 4)  # many rows and one row, for each of the 4 pairs of sampling flags
        elif self.compile and self.compile_scope == "step":
            compat.allow_recompiles(4 * len(self.batch_buckets))  # a graph per batch bucket and sampling flags
            # prefill: one graph over symbolic rows and prompt length (padding a prompt to a length bucket would
            # cost up to twice its compute); no CUDA graphs: one prefill runs long enough that launch overhead
            # does not matter, and graph pools would hold its large activations
            self._prefill_fn = torch.compile(self._forward.prefill, backend=self.backend, dynamic=True)
        if self.compile:
            self._decode = torch.compile(self._forward.sample_step, backend=self.backend, mode=self.mode, dynamic=False)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy full (unsharded) weights into the model; a quantized engine re-quantizes them in place."""
        if self._active:
            raise RuntimeError("load_weights with requests in flight; finish or export them first")
        self.source_model.load_state_dict(state_dict, strict=True)
        self.weights_updated()

    def weights_updated(self) -> None:
        """Take the source model's current weights: a quantized engine quantizes them into its copy's existing tensors
        (a compiled decode keeps its graphs), and the CPU layouts are rebuilt from them. The engine does this by itself
        before it admits requests into an idle batch if a weight changed since (:mod:`.freshness`); call it after writes
        that bypass autograd's version counter (through ``.data``, or kernels of your own)."""
        if self._active:
            raise RuntimeError("weights changed with requests in flight; finish or export them first")
        cpu_kernels.forget(self.model)
        if self.quantize is not None:
            quantized.requantize(self.source_model, self.model)
        self._source_stamp = self._stamp_of_source()

    def _stamp_of_source(self) -> freshness.Stamp:
        return freshness.weights_stamp(self.source_model.parameters())

    # ---------------------------------------------------------------- requests in
    def add_request(self, request: Request) -> None:
        """Queue a request. A malformed request becomes an error result (returned by the next step()).

        A request without a seed takes the engine's, so that its random stream stays the same when it is exported
        to another engine."""
        if request.seed is None:
            request = dataclasses.replace(request, seed=self.seed)
        if request.id in self._ids:
            raise ValueError(f"request id {request.id!r} is already in this engine; ids must be unique")
        error = request_error(request, self.max_len, self.vocab_size)
        if error is not None:
            self._ready.append(RequestResult(request, [], [], "error", error))
            return
        self._ids.add(request.id)
        self._waiting.append(RequestState(request, [], []))

    def import_request(self, state: RequestState) -> None:
        """Continue a request exported by another engine (with its KV, or re-prefilled from its tokens)."""
        if state.id in self._ids:
            raise ValueError(f"request id {state.id!r} is already in this engine; ids must be unique")
        error = request_error(state.request, self.max_len, self.vocab_size)
        if error is not None:
            raise ValueError(f"cannot import request {state.id!r}: {error}")
        if state.k is not None:
            layout = (len(self.model.layers), self._forward.num_kv_heads, self._forward.head_dim)
            k = state.k
            if (k.shape[0], *k.shape[2:]) != layout or k.shape[1] > state.cache_len or k.dtype != self._forward.dtype:
                raise ValueError(
                    f"request {state.id!r} KV has shape {tuple(k.shape)} {k.dtype}, this engine needs "
                    f"({layout[0]}, <= {state.cache_len}, {layout[1]}, {layout[2]}) {self._forward.dtype}: export it "
                    "with mode='reprefill' instead"
                )
        self._ids.add(state.id)
        if state.awaiting:
            self._parked[state.id] = state
        else:
            self._waiting.append(state)

    # ---------------------------------------------------------------- requests out
    def export_request(self, request_id: RequestId, mode: Literal["kv", "reprefill"] = "kv") -> RequestState:
        """Remove an unfinished request and return its state (KV included when ``mode="kv"``)."""
        if mode not in ("kv", "reprefill"):
            raise ValueError(f"export mode must be 'kv' or 'reprefill', got {mode!r}")
        self._read_in_flight()
        for i, slot in enumerate(self._active):
            if slot.request.id == request_id:
                state = slot.state()
                if mode == "kv":
                    state.k, state.v = self._forward.read_slot(i, slot.cache_len)
                self._remove_slot(i)
                self._ended(request_id, keep=False)
                return state
        for state in self._waiting:
            if state.id == request_id:
                self._waiting.remove(state)
                self._ended(request_id, keep=False)
                return state if mode == "kv" else state.without_kv()
        if request_id in self._parked:
            self._ended(request_id, keep=False)
            state = self._parked.pop(request_id)
            return state if mode == "kv" else state.without_kv()
        raise KeyError(f"request {request_id!r} is not unfinished in this engine (finished, exported or never added)")

    def unfinished_ids(self) -> list[RequestId]:
        """Requests decoding, queued, or (multi-turn) waiting between turns."""
        self._read_in_flight()
        return [s.request.id for s in self._active] + [s.id for s in self._waiting] + list(self._parked)

    # ---------------------------------------------------------------- multi-turn requests
    def continue_request(self, request_id: RequestId, observation: Sequence[int]) -> None:
        """Append an environment's ``observation`` (token ids, not sampled: log-prob 0, in ``observations``) to a
        multi-turn request whose turn ended (``awaiting``), and queue its next turn: its earlier KV is kept and only
        the observation (with the stop token before it) is computed when it takes a slot again."""
        state = self._awaiting(request_id)
        state.observe(observation, self.max_len, self.vocab_size)
        del self._parked[request_id]
        if self.speculator is not None:
            self.speculator.extend(request_id, state.generated[state.observations[-1][0] :])
        self._waiting.appendleft(state)  # an episode under way goes before fresh requests

    def end_request(self, request_id: RequestId) -> RequestResult:
        """End a multi-turn request whose turn ended: its result (every turn and observation); its KV is freed."""
        state = self._awaiting(request_id)
        del self._parked[request_id]
        self._ended(request_id)
        assert state.finish_reason is not None  # set when its turn ended
        return RequestResult(state.request, state.generated, state.logprobs, state.finish_reason, observations=state.observations)

    def _awaiting(self, request_id: RequestId) -> RequestState:
        state = self._parked.get(request_id)
        if state is None:
            raise KeyError(
                f"request {request_id!r} is not waiting between turns here (a multi_turn request whose result had "
                "awaiting=True, not yet continued or ended)"
            )
        return state

    @property
    def num_awaiting(self) -> int:
        """Multi-turn requests waiting between turns (they hold KV but no slot)."""
        return len(self._parked)

    def progress(self) -> list[RequestProgress]:
        """Every unfinished request's progress (``generated``: its current turn's tokens): active slots first, then the
        waiting queue in order (multi-turn requests between turns left out)."""
        self._read_in_flight()
        entries = [(s.request, len(s.generated), s.turn_start, True) for s in self._active]
        entries += [(s.request, len(s.generated), s.turn_start, False) for s in self._waiting]
        return [
            RequestProgress(r.id, len(r.prompt), n - t, r.turn_budget(t), r.sampling.target_len is not None, active)
            for r, n, t, active in entries
        ]

    @property
    def num_unfinished(self) -> int:
        """Requests decoding, queued, or waiting between turns."""
        self._read_in_flight()
        return len(self._active) + len(self._waiting) + len(self._parked)

    def has_work(self) -> bool:
        """Whether :meth:`step` has something to do (multi-turn requests between turns wait for their caller)."""
        return bool(self._active or self._waiting or self._ready)

    def stats(self) -> EngineStats:
        remaining = sum(p.budget - p.generated for p in self.progress())  # what the current turns may still sample
        return EngineStats(
            active=len(self._active),
            waiting=len(self._waiting),
            free_slots=self.max_slots - len(self._active),
            remaining_tokens=remaining,
            cached_tokens=sum(s.cache_len for s in self._active),
        )

    # ---------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self) -> list[RequestResult]:
        """Admit waiting requests into free slots (prefill), then decode one token for every active slot.

        Returns the requests that finished (or were rejected) since the last call.
        """
        if self.quantize is not None and not self._active and self._waiting and self._stamp_of_source() != self._source_stamp:
            self.weights_updated()  # a shared model was trained since the copy was made
        training = [m for m in self._modules if m.training]
        for m in training:
            m.training = False
        try:
            self._admit()
            if self._active:
                self._decode_step()
        finally:
            for m in training:
                m.training = True
        done, self._ready = self._ready, []
        return done

    def generate(self, requests: Iterable[Request], *, progress: bool | None = None) -> list[RequestResult]:
        """Run ``requests`` to completion; results in input order.

        ``progress``: a tqdm bar on rank 0 (None: only when stderr is a terminal; False: never).
        """
        requests = list(requests)
        turns = [r.id for r in requests if r.multi_turn]
        if turns:
            raise ValueError(
                f"generate got multi_turn requests ({turns[:3]}); their turns wait for observations: drive them with "
                "step(), continue_request() and end_request() (fusedrl.envs runs environments that way)"
            )
        for r in requests:
            self.add_request(r)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        bar = tqdm(
            total=len(requests),
            unit="req",
            desc="generate",
            disable=(None if progress is None else not progress) if rank0 else True,
        )
        results: dict[RequestId, RequestResult] = {}
        with bar:
            while self.has_work():
                for res in self.step():
                    results[res.id] = res
                    bar.update(1)
        return [results[r.id] for r in requests]

    def _admit(self) -> None:
        free = self.max_slots - len(self._active)
        if not free or not self._waiting:
            return
        taken = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        to_prefill: list[Slot] = []
        to_extend: list[tuple[int, int]] = []  # (row, cached positions) of requests whose KV ends before cache_len
        for state in taken:
            seed = self.seed if state.request.seed is None else state.request.seed  # imported without one
            slot = Slot(
                state.request,
                request_seed(seed, state.id),
                list(state.generated),
                list(state.logprobs),
                list(state.observations),
                state.turn_start,
            )
            i = len(self._active)
            self._active.append(slot)
            if self.speculator is not None:
                self.speculator.start(state.id, state.request.prompt, state.generated)
            pending = slot.generated[-1] if slot.generated else 0  # a fresh slot's first token comes from its prefill
            self._state.write(i, pending, slot.cache_len, slot.seed, slot.sampled, slot.request.sampling)
            if state.k is not None:
                assert state.v is not None  # a state's K and V are set together
                self._forward.write_slot(i, state.k.to(self.device), state.v.to(self.device))
                if state.k.shape[1] < slot.cache_len:  # continued after an observation: compute what follows
                    to_extend.append((i, state.k.shape[1]))
            else:
                to_prefill.append(slot)
        if to_prefill:
            self._prefill(to_prefill)
        if to_extend:
            self._extend(to_extend)

    def _prefill(self, slots: list[Slot]) -> None:
        """Prefill ``slots`` (fresh or resumed from tokens). Slots whose tokens are identical (a GRPO group's samples
        of one prompt) share one prefill: it runs once, into the first one's cache row, whose filled positions are
        then copied to the others', and they sample from the same logits, each with its own random stream."""
        start, graphs = time.perf_counter(), self.compile_stats.graphs
        seqs = [s.request.prompt + s.generated[:-1] for s in slots]
        index = [self._active.index(s) for s in slots]
        first: dict[tuple[int, ...], int] = {}  # each distinct token sequence -> its row among the prefilled ones
        shared = [first.setdefault(tuple(seq), len(first)) for seq in seqs]
        unique = [seqs[shared.index(u)] for u in range(len(first))]
        owners = [index[shared.index(u)] for u in range(len(first))]
        width = max(len(x) for x in unique)
        lengths = [len(x) for x in unique]
        tokens = torch.zeros(len(unique), width, dtype=torch.int64)
        for row, seq in enumerate(unique):
            tokens[row, : len(seq)] = torch.tensor(seq)
        logits = self._call(
            self._prefill_fn,
            tokens.to(self.device),
            torch.tensor(owners, device=self.device),
            torch.tensor(lengths, device=self.device),
        )[: len(unique)]
        for i, u in zip(index, shared):
            if i != owners[u]:
                self._forward.move_slot(owners[u], i, lengths[u])
        logits = logits[torch.tensor(shared, device=self.device)]
        # Requests resumed from tokens already have their pending token; only fresh ones sample here.
        fresh = [row for row, s in enumerate(slots) if not s.generated]
        if fresh:
            rows = torch.tensor([index[r] for r in fresh], device=self.device)
            sampled_slots = [slots[r] for r in fresh]
            ints, floats = self._state.ints[rows], self._state.floats[rows]
            flags = sampling_flags(sampled_slots)
            tokens, logprobs = sample_rows(logits[fresh], ints, floats, *flags)
            self._state.ints[rows] = SlotState.advanced(ints, tokens)
            self._record(sampled_slots, tokens, logprobs)
        if self.compile_stats.graphs == graphs:
            self.prefill_stats.tokens += sum(lengths)
            self.prefill_stats.seconds += time.perf_counter() - start

    def _extend(self, rows: list[tuple[int, int]]) -> None:
        """Compute the KV of each ``(row, cached)`` slot's positions from ``cached`` to its cache length (a multi-turn
        request's stop token and observation; its pending token, the observation's last, decodes next)."""
        seqs = [self._active[i].request.prompt + self._active[i].generated for i, _ in rows]
        parts = [seq[cached : self._active[i].cache_len] for seq, (i, cached) in zip(seqs, rows)]
        tokens = torch.zeros(len(parts), max(len(p) for p in parts), dtype=torch.int64)
        for r, part in enumerate(parts):
            tokens[r, : len(part)] = torch.tensor(part)
        self._forward.extend(
            tokens.to(self.device),
            torch.tensor([i for i, _ in rows], device=self.device),
            torch.tensor([cached for _, cached in rows], device=self.device),
            torch.tensor([len(p) for p in parts], device=self.device),
        )

    def _decode_step(self) -> None:
        spec = self.speculator
        if spec is not None and spec.wants(len(self._active)):
            self._read_in_flight()  # drafts extend every request's latest tokens
            if not self._active:
                return
            rows, start = len(self._active), time.perf_counter()
            produced = self._verify_step()
            if produced:
                spec.observe(True, rows, produced, time.perf_counter() - start)
                return
        n, start, graphs = len(self._active), time.perf_counter(), self.compile_stats.graphs
        b = round_up(n, self.batch_buckets)
        # the host knows every cache length (a step still in flight moved each row one position on): the length bucket
        # needs no device read
        lag = int(self._in_flight is not None)
        length = round_up(max(s.cache_len for s in self._active) + lag, self.len_buckets, strictly_above=True)
        columns, ints, floats = self._forward.columns[:length], self._state.ints[:b], self._state.floats[:b]
        if self.compile:
            # the attended length is symbolic: one graph for every length bucket (compiled per step, the buckets bound
            # the CUDA graphs recorded, one per length); per layer, the batch too where it varies (2 <= b <= max_slots;
            # a single row has a graph of its own, a size of 1 is never symbolic, and its CPU products stream weights)
            compat.mark_dim_dynamic(columns, 0)
            if self.compile_scope == "layer" and self.max_slots > 2 and b > 1:
                compat.mark_dim_dynamic(ints, 0)
                compat.mark_dim_dynamic(floats, 0)
        # rows past n: free slots (token 0 at position 0, cleared when their request left)
        tokens, logprobs, ints = self._call(self._decode, ints, floats, columns, *sampling_flags(self._active))
        self._state.ints[:b] = ints  # copied at once: a CUDA graph's outputs are overwritten by its next replay
        launched = copy_out(list(self._active), tokens[:n], logprobs[:n])
        if not self.lagged_reads:
            self._read(launched)
            if spec is not None and self.compile_stats.graphs == graphs:  # a step that compiled says nothing of speed
                spec.observe(False, n, n, time.perf_counter() - start)
            return
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._read(previous)  # while this step runs
            if not self._active:
                self._in_flight = None  # every row of this step finished before it: nothing of it to read

    def _verify_step(self) -> int:
        """A speculative step (:mod:`.speculation`) over every active slot: the tokens it produced (0: nothing done,
        no slot had a draft)."""
        assert self.speculator is not None  # called when speculating
        slots = list(self._active)
        rows = []
        for i, slot in enumerate(slots):
            budget = slot.request.turn_budget(slot.turn_start) - (len(slot.generated) - slot.turn_start)
            room = self.max_len - 1 - slot.cache_len
            # a verify step produces one token after its accepted drafts
            rows.append(VerifyRow(slot.request.id, i, slot.generated[-1], slot.cache_len, min(budget - 1, room)))
        produced = self.speculator.verify(self._forward, self._state, rows, *sampling_flags(slots))
        if produced is None:
            return 0
        tokens, logprobs = [t for t, _ in produced], [lp for _, lp in produced]
        before = sum(len(slot.generated) for slot in slots)
        for slot in self._append(slots, tokens, logprobs):  # those still decoding: their new state
            i = self._active.index(slot)
            self._state.write(i, slot.generated[-1], slot.cache_len, slot.seed, slot.sampled, slot.request.sampling)
        return sum(len(slot.generated) for slot in slots) - before  # none past a token that ended its request

    def _call(self, fn: Callable[..., _T], *args) -> _T:
        """``fn(*args)``, counting the graphs it compiled into ``compile_stats``."""
        if not self.compile:
            return fn(*args)
        graphs, start = compat.compiled_graph_count(), time.perf_counter()
        out = fn(*args)
        new = compat.compiled_graph_count() - graphs
        if new:
            self.compile_stats.graphs += new
            self.compile_stats.seconds += time.perf_counter() - start
        return out

    def _record(self, slots: list[Slot], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append each slot's sampled token and log-prob (one device-to-host copy) and retire finished slots."""
        self._read(copy_out(slots, tokens, logprobs))

    def _read(self, launched: Launched) -> None:
        """Append a step's tokens to its slots that are still active (a row that finished in the step before a lagged
        read decoded once more: its token is dropped) and retire the slots that finished."""
        tokens, logprobs = launched.read()
        live = {id(s) for s in self._active}
        rows = [r for r, s in enumerate(launched.slots) if id(s) in live]
        self._append([launched.slots[r] for r in rows], [[tokens[r]] for r in rows], [[logprobs[r]] for r in rows])

    def _read_in_flight(self) -> None:
        """Read the decode step still in flight (``lagged_reads``): every slot's tokens on the host are then current."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._read(launched)

    def _append(self, slots: list[Slot], tokens: list[list[int]], logprobs: list[list[float]]) -> list[Slot]:
        """Append each slot's sampled tokens in order, up to the one that ends it (a verify step produces several),
        and retire the slots that ended: a multi-turn request whose turn ended leaves its slot with its KV and waits
        (``continue_request``). Returns the slots that go on decoding."""
        finished: list[tuple[int, FinishReason]] = []
        for slot, toks, lps in zip(slots, tokens, logprobs):
            for tok, lp in zip(toks, lps):
                slot.generated.append(tok)
                slot.logprobs.append(lp)
                if self.speculator is not None:
                    self.speculator.extend(slot.request.id, [tok])
                reason = slot.finish_reason(tok, self.max_len)
                if reason is not None:
                    finished.append((self._active.index(slot), reason))
                    break
        gone = {id(self._active[i]) for i, _ in finished}
        for i, reason in sorted(finished, reverse=True):
            slot = self._active[i]
            result = RequestResult(slot.request, slot.generated, slot.logprobs, reason, observations=slot.observations)
            if slot.request.multi_turn and reason != "max_len":
                state = slot.state(reason)
                state.k, state.v = self._forward.read_slot(i, slot.cache_len)
                state.awaiting = result.awaiting = True
                self._parked[slot.request.id] = state
            else:
                self._ended(slot.request.id)
            self._ready.append(result)
            self._remove_slot(i)
        return [slot for slot in slots if id(slot) not in gone]

    def _ended(self, request_id: RequestId, keep: bool = True) -> None:
        """A request leaves this engine (``keep``: it ended here, its tokens join its prompt's draft history)."""
        self._ids.discard(request_id)
        if self.speculator is not None:
            self.speculator.finish(request_id, keep=keep)

    def _remove_slot(self, i: int) -> None:
        """Free slot i, keeping active slots contiguous: the last active slot moves into i (with the position a step
        still in flight writes)."""
        last = len(self._active) - 1
        if i != last:
            self._forward.move_slot(last, i, self._active[last].cache_len + int(self._in_flight is not None))
            self._state.move(last, i)
            self._active[i] = self._active[last]
        self._state.ints[last] = 0  # a free row decodes at position 0 (padding rows of a batch bucket)
        self._active.pop()
