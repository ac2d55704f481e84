"""Startup checks of the PPO settings that depend on other sections: when the old log-probs must be recomputed
with the training layout, the fused schedule's activation-memory cap, packed micro-batches, and over-provisioned
rollouts, and multi-turn environments."""

from __future__ import annotations

from fusedrl.config import ConfigError, Startup
from fusedrl.config.loader import source_of
from fusedrl.envs import EnvError, load_env_factory
from fusedrl.rlhf.program import recompute_enabled, schedule_memory_limit


def check_recompute(startup: Startup) -> None:
    """A quantized engine's log-probs are not the policy's: it needs ``ppo.recompute_logprobs``, as truncated
    importance sampling does (its weight is trainer / engine); raises ConfigError."""
    cfg = startup.cfg
    g, ppo = cfg.generation, cfg.ppo
    if g.quantize != "none" and not recompute_enabled(cfg):
        raise ConfigError(
            f"generation.quantize = {g.quantize!r} with ppo.recompute_logprobs = false: the quantized engine's "
            "log-probs would become PPO's old log-probs; set --ppo.recompute_logprobs=true (or auto)"
        )
    if ppo.tis_cap > 0 and not recompute_enabled(cfg):
        raise ConfigError(
            f"ppo.tis_cap = {ppo.tis_cap} ({source_of(cfg, 'ppo.tis_cap')}): truncated importance sampling weighs the "
            "trainer's old log-probs against the engine's, which needs ppo.recompute_logprobs on; set "
            "--ppo.recompute_logprobs=true or --ppo.tis_cap=0"
        )


def check_schedule_memory(startup: Startup) -> None:
    """``fusion.schedule_memory_gib`` is not below sequential 1F1B's peak (:func:`schedule_memory_limit`)."""
    schedule_memory_limit(startup.cfg, startup.cfg.sequence_budget)


def check_packing(startup: Startup) -> None:
    """``ppo.microbatch_tokens`` (packed rows) holds the longest sequence, and at pp >= 2 (where a packed minibatch
    keeps the program's micro-batch count) any minibatch's rows; raises ConfigError."""
    cfg = startup.cfg
    tokens = cfg.packing_tokens
    if tokens == 0:
        return
    where = source_of(cfg, "ppo.microbatch_tokens")
    if tokens < cfg.sequence_budget:
        raise ConfigError(
            f"ppo.microbatch_tokens = {tokens} ({where}) is smaller than the longest sequence, "
            f"{cfg.sequence_budget_terms} = {cfg.sequence_budget}; raise it to at least {cfg.sequence_budget}, or set 0 "
            "(no packing)"
        )
    need = (cfg.ppo.microbatch_size + 1) * cfg.sequence_budget
    if cfg.parallelism.pp > 1 and tokens < need:
        raise ConfigError(
            f"ppo.microbatch_tokens = {tokens} ({where}): with parallelism.pp = {cfg.parallelism.pp} a packed minibatch "
            f"keeps the pipeline program's micro-batch count, and a row then takes up to (ppo.microbatch_size + 1) x "
            f"the longest sequence = {need} tokens; raise it to at least {need}, or set 0 (no packing)"
        )


def check_partial_rollouts(startup: Startup) -> None:
    """``rollout.over_provision`` with ``unfinished = "carry"`` trains tokens sampled by earlier policies: it needs
    ``ppo.tis_cap``, their importance correction; raises ConfigError."""
    cfg = startup.cfg
    if cfg.rollout.over_provision > 0 and cfg.rollout.unfinished == "carry" and cfg.ppo.tis_cap <= 0:
        raise ConfigError(
            f"rollout.over_provision = {cfg.rollout.over_provision} ({source_of(cfg, 'rollout.over_provision')}) with "
            "rollout.unfinished = carry trains tokens that earlier policies sampled, which needs their importance "
            "correction: set --ppo.tis_cap (e.g. 2.0, with ppo.recompute_logprobs on), or --rollout.unfinished=defer "
            "(tail batching: on-policy), or --rollout.over_provision=0"
        )


def check_env(startup: Startup) -> None:
    """``[env]``'s environment imports and fits the job: episodes stay on their generation instance (no over-provisioned
    rollouts that carry or defer them, one rank per instance), and a turn fits an episode; raises ConfigError."""
    cfg = startup.cfg
    e = cfg.env
    if not e.env:
        return
    where = f"env.env = {e.env!r} ({source_of(cfg, 'env.env')})"
    try:
        load_env_factory(e.env)
    except (ValueError, EnvError) as err:
        raise ConfigError(f"{where}: {err}") from None
    if cfg.rollout.over_provision > 0:
        raise ConfigError(
            f"{where} with rollout.over_provision = {cfg.rollout.over_provision}: episodes are not carried or deferred "
            "between iterations (their environments live in one rollout); set --rollout.over_provision=0"
        )
    if cfg.parallelism.gen_tp > 1:
        raise ConfigError(
            f"{where} with parallelism.gen_tp = {cfg.parallelism.gen_tp}: environments run on single-rank generation "
            "instances; set --parallelism.gen_tp=1"
        )
    if cfg.generation.max_new_tokens > e.max_tokens:
        raise ConfigError(
            f"{where}: a turn may take generation.max_new_tokens = {cfg.generation.max_new_tokens} tokens, more than an "
            f"episode's env.max_tokens = {e.max_tokens}; raise env.max_tokens or lower generation.max_new_tokens"
        )
