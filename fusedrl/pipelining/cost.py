"""Cost model for the pipeline planner: per model and stage, forward/backward time and activation memory.

Times and memory are in arbitrary but consistent units (the planner only compares them). Activation
memory is the amount one micro-batch holds on a stage between its forward and its backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fusedrl.pipelining.ir import ACTOR, CRITIC, MODELS, Placement


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs of one model; every tuple has one entry per stage."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    mem: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (len(self.f) == len(self.b) == len(self.mem)) or not self.f:
            raise ValueError(
                f"stage costs need one f, b and mem value per stage, got {len(self.f)}, {len(self.b)}, {len(self.mem)}"
            )
        for name, values in (("f", self.f), ("b", self.b), ("mem", self.mem)):
            if any(v < 0 for v in values):
                raise ValueError(f"stage cost {name} must be >= 0, got {list(values)}")
        if any(v <= 0 for v in self.f + self.b):
            raise ValueError("forward and backward times must be > 0; profile the stage or pass a small positive time")


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
        """From measured per-stage numbers: ``{"actor": {"f": [...], "b": [...], "mem": [...]}, "critic": {...}}``.

        ``b`` defaults to 2 x ``f`` and ``mem`` to 1.0 per stage when missing.
        """

        def stages(model: str) -> StageCosts:
            if model not in profile or "f" not in profile[model]:
                raise ValueError(f"profile needs per-stage forward times under profile[{model!r}]['f']")
            p = profile[model]
            f = tuple(float(v) for v in p["f"])
            b = tuple(float(v) for v in p.get("b", [2 * v for v in f]))
            mem = tuple(float(v) for v in p.get("mem", [1.0] * len(f)))
            return StageCosts(f, b, mem)

        return cls(stages(ACTOR), stages(CRITIC), p2p_latency)

    @classmethod
    def from_flavors(
        cls,
        placement: Placement,
        actor_flavor: str,
        critic_flavor: str,
        *,
        tokens_per_microbatch: int,
        seq_len: int | None = None,
        flops_per_second: float = 1e14,
        bytes_per_activation: int = 2,
        p2p_latency: float = 0.0,
    ) -> CostModel:
        """Estimate costs from the architectures in ``fusedrl.models.FLAVORS``.

        Forward time = forward FLOPs / ``flops_per_second`` (seconds), backward = 2 x forward; memory is the
        stored activations per micro-batch in GiB. Layers are split evenly over stages (earlier stages get the
        remainder); the LM/value head is charged to the last stage.
        """
        from fusedrl.models import FLAVORS

        def stages(flavor: str, n: int, vocab_out: bool) -> StageCosts:
            if flavor not in FLAVORS:
                raise ValueError(f"unknown model flavor {flavor!r}; valid flavors: {', '.join(sorted(FLAVORS))}")
            cfg = FLAVORS[flavor]
            if cfg.num_layers < n:
                raise ValueError(f"flavor {flavor!r} has {cfg.num_layers} layers, fewer than its {n} pipeline stages")
            tokens = tokens_per_microbatch
            seq = seq_len or min(tokens, cfg.max_seq_len)
            head_dim = cfg.embed_dim // cfg.num_heads
            attn_params = cfg.embed_dim * head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
            mlp_params = 3 * cfg.embed_dim * cfg.intermediate_dim
            # 2 FLOPs per parameter per token, plus causal attention scores and values (QK^T and PV, halved).
            layer_flops = 2 * tokens * (attn_params + mlp_params) + 2 * tokens * seq * cfg.embed_dim
            # Stored activations per layer without recomputation: ~16 x dim + 2 x intermediate values per token.
            layer_bytes = tokens * (16 * cfg.embed_dim + 2 * cfg.intermediate_dim) * bytes_per_activation
            head_out = cfg.vocab_size if vocab_out else 1
            layers = [cfg.num_layers // n + (1 if s < cfg.num_layers % n else 0) for s in range(n)]
            f, mem = [], []
            for s, k in enumerate(layers):
                flops = k * layer_flops + (2 * tokens * cfg.embed_dim * head_out if s == n - 1 else 0)
                f.append(flops / flops_per_second)
                mem.append(k * layer_bytes / 2**30)
            return StageCosts(tuple(f), tuple(2 * v for v in f), tuple(mem))

        return cls(
            stages(actor_flavor, placement.num_stages(ACTOR), True),
            stages(critic_flavor, placement.num_stages(CRITIC), False),
            p2p_latency,
        )
