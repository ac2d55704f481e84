"""The rollout of one PPO iteration: requests from a prompt batch, the scorer and migration controller of this
rank's generation instance, generation + scoring of the batch, and its inter-stage fusion figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fusedrl.components import Progress, PromptBatch, Tokenizer
from fusedrl.config import InputError, JobConfig
from fusedrl.config.loader import source_of
from fusedrl.envs import EnvRunner, load_env_factory
from fusedrl.generation import GenerationEngine, Request, RequestState, SamplingParams
from fusedrl.layouts import RolloutLayout
from fusedrl.rlhf.episodes import Episodes, observation_ids
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.reward_fn import RewardFn, RuleReward, load_reward_fn
from fusedrl.rlhf.scoring import Scorer, ScoringModels
from fusedrl.rollout_fusion import GroupTarget, MigrationController, RolloutResult


def build_requests(cfg: JobConfig, batch: PromptBatch, step: int, stop_ids: tuple[int, ...]) -> list[Request]:
    """``generation.n`` requests per prompt (its group), with ids ``prompt sample id x n + k`` (global, unique over the
    run: prompt sample ids are positions in the prompt stream), sampling seeded by (job.seed, step, id): each sample
    from its own seed, wherever it is decoded."""
    g = cfg.generation
    params = SamplingParams(
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        max_new_tokens=g.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys((*stop_ids, *g.stop_token_ids))),
    )
    seed = cfg.job.seed * 1_000_003 + step
    n = g.n
    return [Request(sid * n + k, ids, params, seed=seed) for sid, ids in zip(batch.sample_ids, batch.token_ids) for k in range(n)]


def build_scorer(cfg: JobConfig, rollout: RolloutLayout, tokenizer: Tokenizer, task_reward: RewardFn | None = None) -> Scorer:
    """Reference log-probs, Reward scores and Critic values of finished samples (of the models the rollout layout
    holds), on this rank's instance.

    Log-probs are those of the sampling distribution, ``log_softmax(logits / generation.temperature)``, as the
    engine reports the sampled tokens' and the policy loss computes them. ``model.reward_fn`` adds its weighted value to
    each score (or scores alone without a Reward model); it runs on each instance's first rank, texts decoded
    with ``tokenizer``, and its failures follow ``training.nan_policy``. ``task_reward``: the function that
    ``model.reward_fn = "task"`` names (the job's task's; ``fusedrl.tasks.task_reward_fn``).
    """
    m = cfg.model
    rule = None
    if m.reward_fn is not None:
        if m.reward_fn != "task":
            fn = load_reward_fn(m.reward_fn)
        elif task_reward is None:
            raise ValueError('model.reward_fn = "task": pass the task\'s reward function as task_reward')
        else:
            fn = task_reward
        rule = RuleReward(
            fn,
            tokenizer,
            weight=m.reward_fn_weight,
            on_failure=cfg.training.nan_policy,
            name="" if m.reward_fn == "task" else m.reward_fn,  # "": named after the function
            group=rollout.instance_group,
        )
    return Scorer(
        ScoringModels(rollout.reference, rollout.reward, rollout.critic),
        pad_id=tokenizer.pad_id,
        temperature=cfg.generation.temperature,
        max_tokens=cfg.generation.scoring_max_tokens,
        reward_fn=rule,
        env_rewards=bool(cfg.env.env),
    )


def build_episodes(cfg: JobConfig, engine: GenerationEngine, tokenizer: Tokenizer) -> Episodes | None:
    """The multi-turn episodes of ``engine`` with ``[env]``'s environment (None without one). Raises InputError when
    the tokenizer's chat template cannot write an ``env.observation_role`` message after the model's turn."""
    e = cfg.env
    if not e.env:
        return None
    try:
        observation_ids(tokenizer, e.observation_role, "42", tokenizer.stop_token_ids)
    except Exception as err:  # noqa: BLE001 - a template's own error, of any type: said in one line
        problem = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        raise InputError(
            f"env.observation_role = {e.observation_role!r} ({source_of(cfg, 'env.observation_role')}): the tokenizer's "
            f"chat template cannot write such a message after the model's turn ({problem}); set a role it takes, e.g. "
            "--env.observation_role=user"
        ) from None
    runner = EnvRunner(
        load_env_factory(e.env),
        workers=e.workers,
        step_timeout_s=e.step_timeout_s,
        max_turns=e.max_turns,
        error_reward=e.error_reward,
    )
    return Episodes(engine, runner, tokenizer, max_tokens=e.max_tokens, role=e.observation_role)


def build_controller(
    cfg: JobConfig, engine: GenerationEngine, scorer: Scorer, rollout: RolloutLayout, episodes: Episodes | None = None
) -> MigrationController[Experience]:
    """Generation + scoring of this instance's requests; ``fusion.inter_stage`` switches tail migration on/off.

    Scoring micro-batches hold at most ``generation.max_slots`` samples. Request states travel over the rollout
    layout's default-backend group, statistics and finished samples over its gloo groups. ``episodes``
    (:func:`build_episodes`): multi-turn requests whose environments answer between turns."""
    return MigrationController.from_config(
        engine,
        scorer.score,
        cfg.fusion,
        micro_batch_size=cfg.generation.max_slots,
        group=rollout.group,
        control_group=rollout.control_group,
        instance_group=rollout.instance_group,
        episodes=episodes,
    )


def generate_and_score(
    controller: MigrationController[Experience],
    requests: list[Request],
    pad_id: int,
    progress: Progress | None = None,
    *,
    resume: Sequence[RequestState] = (),
    target: GroupTarget | None = None,
    rows: Sequence[Mapping[str, Any]] = (),
) -> tuple[RolloutResult[Experience], Experience]:
    """Generate and score this rank's requests (collective); every rank receives the whole scored batch
    in sample-id order. ``progress``, ``resume`` and ``target``: see :meth:`MigrationController.run`. With episodes
    (a controller built with them) ``rows[i]`` is request ``i``'s prompt row, which its environment starts from."""
    episodes = controller.episodes
    if isinstance(episodes, Episodes):
        requests = episodes.begin(requests, rows)
    result = controller.run(requests, resume=resume, target=target, gather=True, progress=progress)
    exp = Experience.concat(result.scored, pad_token_id=pad_id)
    assert exp.sample_ids is not None  # Scorer.score sets sample_ids on every scored batch
    return result, exp.select(exp.sample_ids.argsort())


def migration_metrics(result: RolloutResult) -> dict[str, float]:
    """Inter-stage fusion figures of one rollout (zeros when nothing migrated; identical on every rank): whether it ran
    fused (``inter_stage_fused``) and, with ``inter_stage = "auto"``, the previous rollout simulated fused and unfused
    and calibrated, which it chose from (``fusion_predicted_fused_s``, ``fusion_predicted_unfused_s``; 0 while it
    measures each way first); where the "auto" threshold simulated the rollout, its last choice
    (``auto_threshold``: 0 = never migrate), when it chose (``auto_at_s``) and the simulated rollout's length with
    that choice and without migrating (``rollout_predicted_s``, ``rollout_predicted_never_s``, beside the measured
    ``rollout_s``) and its last decode step's end with that choice (``decode_end_predicted_s``, beside the measured
    ``decode_end_s``)."""
    auto: dict[str, float] = {"inter_stage_fused": float(result.fused)}
    if result.fusion_choice is not None:
        c = result.fusion_choice
        auto |= {
            "fusion_predicted_fused_s": c.fused_s,
            "fusion_predicted_unfused_s": c.unfused_s,
        }
    if result.auto is not None:
        a = result.auto
        auto |= {
            "auto_threshold": a.threshold,
            "auto_min_kept": a.min_kept,
            "auto_at_s": a.at_s,
            "rollout_predicted_s": a.predicted_s,
            "rollout_predicted_never_s": a.never_s,
            "rollout_s": result.rollout_s,
            "decode_end_predicted_s": a.predicted_decode_end_s,
            "decode_end_s": result.decode_end_s,
        }
    return _migration_figures(result) | auto


def _migration_figures(result: RolloutResult) -> dict[str, float]:
    m = result.migration
    if m is None:
        return {
            "migration_moved": 0,
            "migration_bytes": 0,
            "migration_kept": 0,
            "migration_at_unfinished": 0,
            "migration_at_s": 0.0,
            "migration_s": 0.0,
        }
    return {
        "migration_moved": m.moved,
        "migration_bytes": m.moved_bytes + m.sample_bytes,
        "migration_kept": len(m.kept),
        "migration_at_unfinished": m.unfinished,
        "migration_at_s": m.time_s,
        "migration_s": m.duration_s,
    }


def speculation_metrics(parts: Sequence[Mapping[str, int]]) -> dict[str, float]:
    """One rollout's speculative decoding from every instance's ``Speculator.take_figures()``: verify steps,
    drafted and accepted tokens (in all and per source), the accepted share, and the tokens a verify step produced on
    average (its accepted drafts and one sampled token per request)."""
    keys = sorted({k for p in parts for k in p})
    total = {k: float(sum(p.get(k, 0) for p in parts)) for k in keys}
    out = {f"spec_{k}": v for k, v in total.items() if k != "produced"}
    out["spec_accept_rate"] = total.get("accepted", 0.0) / max(total.get("drafted", 0.0), 1.0)
    out["spec_tokens_per_verify"] = total.get("produced", 0.0) / max(total.get("verify_steps", 0.0), 1.0)
    return out
