"""Cost model for the pipeline planner: per model and stage, forward/backward time and activation memory.

Times and memory are in arbitrary but consistent units (the planner only compares them). Activation
memory is the amount one micro-batch holds on a stage between its forward and its backward (its weight
backward W when the backward is split into an input backward I and W).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusedrl.pipelining.ir import ACTOR, CRITIC, MODELS, Placement

if TYPE_CHECKING:
    from fusedrl.models import ModelFlavor

# Share of a backward spent on weight gradients (W) when no measurement says otherwise. Each weight matmul of the
# forward costs two matmuls of the same size in the backward, one for the input gradient (I) and one for the weight
# gradient (W), so W is about half of B; the zero-bubble pipeline paper (Qi et al., ICLR 2024) likewise models W
# as costing about as much as I for transformer layers. Attention's score/value products have no weights and only
# add to I, so a long-sequence stage has W a little below half.
WEIGHT_GRAD_SHARE = 0.5


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs of one model; every tuple has one entry per stage.

    ``w`` is the weight-gradient part of each backward ``b`` (the input-gradient part is ``b - w``); empty means
    ``WEIGHT_GRAD_SHARE x b``. Only split-backward schedules use it."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    mem: tuple[float, ...]
    w: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.w:
            object.__setattr__(self, "w", tuple(WEIGHT_GRAD_SHARE * v for v in self.b))
        if not (len(self.f) == len(self.b) == len(self.mem) == len(self.w)) or not self.f:
            raise ValueError(
                f"stage costs need one f, b, mem (and optionally w) value per stage, got {len(self.f)}, {len(self.b)}, "
                f"{len(self.mem)}, {len(self.w)}"
            )
        for name, values in (("f", self.f), ("b", self.b), ("mem", self.mem), ("w", self.w)):
            if any(v < 0 for v in values):
                raise ValueError(f"stage cost {name} must be >= 0, got {list(values)}")
        if any(v <= 0 for v in self.f + self.b):
            raise ValueError("forward and backward times must be > 0; profile the stage or pass a small positive time")
        if any(w >= b for w, b in zip(self.w, self.b)):
            raise ValueError(
                f"weight-gradient times w={list(self.w)} must be below the backward times b={list(self.b)} "
                "(the input-gradient part b - w must be > 0)"
            )

    @property
    def i(self) -> tuple[float, ...]:
        """Input-gradient part of each backward (``b - w``)."""
        return tuple(b - w for b, w in zip(self.b, self.w))


@dataclass(frozen=True)
class CostModel:
    """Costs of both models plus the point-to-point latency between neighbouring stages on different ranks."""

    actor: StageCosts
    critic: StageCosts
    p2p_latency: float = 0.0

    def __post_init__(self) -> None:
        if self.p2p_latency < 0:
            raise ValueError(f"p2p_latency must be >= 0, got {self.p2p_latency}")

    def of(self, model: str) -> StageCosts:
        if model == ACTOR:
            return self.actor
        if model == CRITIC:
            return self.critic
        raise ValueError(f"unknown model {model!r}; valid models: {', '.join(MODELS)}")

    def check(self, placement: Placement) -> None:
        """Raise ValueError if the stage counts do not match ``placement``."""
        for model in MODELS:
            n = placement.num_stages(model)
            got = len(self.of(model).f)
            if got != n:
                raise ValueError(f"cost model has {got} {model} stages but the placement has {n}; build it for this placement")

    @classmethod
    def uniform(
        cls,
        placement: Placement,
        f_actor: float,
        f_critic: float,
        *,
        b_actor: float | None = None,
        b_critic: float | None = None,
        mem_actor: float = 1.0,
        mem_critic: float = 1.0,
        p2p_latency: float = 0.0,
    ) -> CostModel:
        """Every stage of a model costs the same; backward defaults to 2 x forward."""

        def stages(n: int, f: float, b: float | None, mem: float) -> StageCosts:
            return StageCosts((f,) * n, ((2 * f) if b is None else b,) * n, (mem,) * n)

        return cls(
            stages(placement.num_stages(ACTOR), f_actor, b_actor, mem_actor),
            stages(placement.num_stages(CRITIC), f_critic, b_critic, mem_critic),
            p2p_latency,
        )

    @classmethod
    def from_profile(cls, profile: Mapping[str, Mapping[str, Sequence[float]]], p2p_latency: float = 0.0) -> CostModel:
        """From measured per-stage numbers: ``{"actor": {"f": [...], "b": [...], "mem": [...], "w": [...]}, "critic": {...}}``.

        ``b`` defaults to 2 x ``f``, ``mem`` to 1.0 per stage and ``w`` (the weight-gradient part of ``b``) to
        ``WEIGHT_GRAD_SHARE x b`` when missing.
        """

        def stages(model: str) -> StageCosts:
            if model not in profile or "f" not in profile[model]:
                raise ValueError(f"profile needs per-stage forward times under profile[{model!r}]['f']")
            p = profile[model]
            f = tuple(float(v) for v in p["f"])
            b = tuple(float(v) for v in p.get("b", [2 * v for v in f]))
            mem = tuple(float(v) for v in p.get("mem", [1.0] * len(f)))
            return StageCosts(f, b, mem, tuple(float(v) for v in p.get("w", ())))

        return cls(stages(ACTOR), stages(CRITIC), p2p_latency)

    @classmethod
    def from_flavors(
        cls,
        placement: Placement,
        actor_flavor: str | ModelFlavor,
        critic_flavor: str | ModelFlavor,
        *,
        tokens_per_microbatch: int,
        seq_len: int | None = None,
        flops_per_second: float = 1e14,
        bytes_per_activation: int = 2,
        tp: int = 1,
        recompute: bool = False,
        p2p_latency: float = 0.0,
    ) -> CostModel:
        """Estimate costs from the two architectures (:class:`fusedrl.models.ModelFlavor`, or names of
        ``fusedrl.models.FLAVORS``).

        Forward time = forward FLOPs (:func:`fusedrl.models.figures.stage_forward_flops`, sequences of ``seq_len``
        tokens) / ``flops_per_second`` (seconds), backward = 2 x forward, of which the weight gradients ``w`` are one
        matmul per weight matmul of the forward (attention's score and value products have no weights: their
        backward is all input gradient); memory is the stored activations per micro-batch in GiB
        (:func:`fusedrl.models.figures.stage_activation_bytes` in a compute dtype of ``bytes_per_activation`` bytes,
        attention and MLP split over ``tp``, with ``recompute``: activation checkpointing). Layers are split evenly
        over stages (earlier stages get the remainder); the LM/value head is charged to the last stage.
        """
        from fusedrl.models import figures, resolve_flavor  # here: the planner alone imports no model code

        def stages(flavor: str | ModelFlavor, n: int, role: str) -> StageCosts:
            cfg = resolve_flavor(flavor)
            if cfg.num_layers < n:
                raise ValueError(f"{cfg.describe()} has {cfg.num_layers} layers, fewer than its {n} pipeline stages")
            seq = seq_len or min(tokens_per_microbatch, cfg.max_seq_len)
            flops = figures.stage_forward_flops(cfg, role, n, tokens_per_microbatch, tokens_per_microbatch * seq)
            layers = figures.stage_layer_counts(cfg.num_layers, n)
            mem = tuple(
                figures.stage_activation_bytes(
                    cfg,
                    k,
                    first=s == 0,
                    last=s == n - 1,
                    role=role,
                    tokens=tokens_per_microbatch,
                    itemsize=bytes_per_activation,
                    tp=tp,
                    recompute=recompute,
                )
                / 2**30
                for s, k in enumerate(layers)
            )
            f = tuple(total / flops_per_second for total, _ in flops)
            w = tuple(matmul / flops_per_second for _, matmul in flops)
            return StageCosts(f, tuple(2 * v for v in f), mem, w)

        return cls(
            stages(actor_flavor, placement.num_stages(ACTOR), "policy"),
            stages(critic_flavor, placement.num_stages(CRITIC), "value"),
            p2p_latency,
        )
