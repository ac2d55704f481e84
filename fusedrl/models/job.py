"""The job's models: the architecture each [model] key builds, and the startup check of checkpoints and flavors."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from fusedrl.config import ConfigError, InputError, JobConfig, Startup
from fusedrl.config.checks import built_later
from fusedrl.config.loader import format_value, source_of
from fusedrl.models.hf import check_hf_checkpoint
from fusedrl.models.hf_config import CheckpointError, read_flavor
from fusedrl.models.lora import LoRASpec, add_lora, trainable_counts
from fusedrl.models.registry import ModelFlavor, Role, build_model, resolve_flavor

RANDOM_INIT_MAX_PARAMS = 2e9  # random initialisation builds the whole model in host memory: small flavors only
MODEL_ROLES: dict[str, Role] = {"actor": "policy", "critic": "value", "reward": "value"}
DEFAULT_FLAVOR = "debug"  # the Actor's, with an empty name and no checkpoint path


def model_flavor(cfg: JobConfig, key: str) -> ModelFlavor:
    """The architecture of ``model.<key>`` (actor, critic or reward): the named flavor; with an empty name the one
    ``config.json`` of ``model.<key>_path`` describes (raises :class:`CheckpointError` if it cannot be built), or
    without a path the Actor's (for the Actor itself the tiny ``debug`` flavor), randomly initialised. The
    Reference is built as the Actor."""
    name, path = getattr(cfg.model, key), getattr(cfg.model, f"{key}_path")
    if name:
        return resolve_flavor(name)
    if path:
        return read_flavor(path, MODEL_ROLES[key])
    return resolve_flavor(DEFAULT_FLAVOR) if key == "actor" else model_flavor(cfg, "actor")


def lora_spec(cfg: JobConfig, key: str) -> LoRASpec | None:
    """The adapters ``[lora]`` puts on trained model ``key`` (actor or critic); None: it trains every parameter."""
    lora = cfg.lora
    if key not in lora.models:
        return None
    return LoRASpec(lora.rank, lora.alpha, lora.dropout, tuple(dict.fromkeys(lora.targets)))


def trained_parameters(cfg: JobConfig) -> str:
    """What each trained model trains, for the startup line: e.g. ``actor 1.8M of 136M (1.35%, LoRA rank 16 on
    q_proj, v_proj); critic all 136M`` (counted on the meta device)."""
    parts = []
    for key in ("actor",) if cfg.ppo.critic_free else ("actor", "critic"):
        model = build_model(model_flavor(cfg, key), MODEL_ROLES[key], device="meta")
        spec = lora_spec(cfg, key)
        if spec is None:
            parts.append(f"{key} all {_millions(sum(p.numel() for p in model.parameters()))}")
            continue
        trained, total = trainable_counts([add_lora(model, spec)])
        on = ", ".join(spec.targets)
        parts.append(
            f"{key} {_millions(trained)} of {_millions(total)} ({100 * trained / total:.2f}%, LoRA rank {spec.rank} on {on})"
        )
    return "; ".join(parts)


def _millions(n: int) -> str:
    return f"{n / 1e6:.3g}M"


def check_lora(startup: Startup) -> None:
    """``[lora]`` fits the job: its models are built and trained, it has targets, and no float8 training (which
    would swap the adapted projections for its own)."""
    cfg = startup.cfg
    lora = cfg.lora
    if not lora.enabled:
        return
    where = f"lora.models = {format_value(lora.models)} ({source_of(cfg, 'lora.models')})"
    if "critic" in lora.models and cfg.ppo.critic_free:
        raise ConfigError(
            f"{where}: ppo.advantage_estimator = {cfg.ppo.advantage_estimator} builds no Critic; remove critic from lora.models"
        )
    if not lora.targets:
        raise ConfigError(
            f'lora.targets ({source_of(cfg, "lora.targets")}) is empty; name projections, e.g. ["q_proj", "v_proj"]'
        )
    if lora.export == "adapter" and "actor" not in lora.models:
        raise ConfigError(
            f"lora.export = adapter ({source_of(cfg, 'lora.export')}) writes the Actor's adapters, but {where} gives it "
            "none; add actor to lora.models or set --lora.export=merged"
        )
    if reference_from_base(cfg) and cfg.model.reference_path and cfg.model.reference_path != cfg.model.actor_path:
        raise ConfigError(
            f"lora.reference = base ({source_of(cfg, 'lora.reference')}) takes the Reference from the Actor's base, but "
            f"model.reference_path names another checkpoint ({cfg.model.reference_path}); set --lora.reference=copy or "
            "drop model.reference_path"
        )
    if lora.rollout_weights == "adapters" and "actor" in lora.models and cfg.generation.quantize != "none":
        raise ConfigError(
            f"lora.rollout_weights = adapters ({source_of(cfg, 'lora.rollout_weights')}) with generation.quantize = "
            f"{cfg.generation.quantize}: the quantized engine decodes plain projections; set --lora.rollout_weights=merged "
            "or --generation.quantize=none"
        )
    if cfg.training.float8:
        raise ConfigError(f"{where} with training.float8: float8 training replaces the adapted projections; turn one off")


def neural_models(cfg: JobConfig) -> tuple[str, ...]:
    """The [model] flavor keys whose models are built: actor, critic (unless the advantage estimator is critic-free)
    and reward (unless ``model.reward = "none"``)."""
    critic = () if cfg.ppo.critic_free else ("critic",)
    return ("actor", *critic, *(("reward",) if cfg.model.uses_reward_model else ()))


def reference_from_base(cfg: JobConfig) -> bool:
    """Whether the Reference log-probs come from the LoRA Actor's training stages with the adapters off
    (``lora.reference = "base"``), so that no rollout copy of the Reference is built or scored."""
    return cfg.ppo.uses_reference and "actor" in cfg.lora.models and cfg.lora.reference == "base"


def scoring_flavors(cfg: JobConfig) -> tuple[ModelFlavor | None, tuple[ModelFlavor, ...]]:
    """The models a job scores with: the Reference (policy head; None without a KL term or when it is the LoRA Actor's
    base, :func:`reference_from_base`) and the value-head models
    whose bodies run too (the Critic unless the estimator is critic-free, the Reward model unless a rule scores
    alone)."""
    reference = model_flavor(cfg, "actor") if cfg.ppo.uses_reference and not reference_from_base(cfg) else None
    others = () if cfg.ppo.critic_free else (model_flavor(cfg, "critic"),)
    if cfg.model.uses_reward_model:
        others = (*others, model_flavor(cfg, "reward"))
    return reference, others


def _check_checkpoint_files(cfg: JobConfig, flavors: dict[str, ModelFlavor], assets: dict[Path, str]) -> None:
    """Each checkpoint folder against its model, from the files' headers (no tensor read): truncated or missing
    files, tensor names, shapes and dtypes, config.json; a value model may start from an LM checkpoint (a fresh
    head), as the trainer loads it. ConfigError naming the key, the folder, every problem and its fix."""
    folders = [(key, getattr(cfg.model, f"{key}_path"), f, MODEL_ROLES[key]) for key, f in flavors.items()]
    if cfg.ppo.uses_reference and cfg.model.reference_path:
        folders.append(("reference", cfg.model.reference_path, flavors["actor"], "policy"))
    for key, path, flavor, role in folders:
        if not path or built_later(assets, path) is not None:
            continue
        try:
            check_hf_checkpoint(path, flavor, role)
        except CheckpointError as error:
            try:
                if role != "value":
                    raise
                check_hf_checkpoint(path, flavor, role, init_value_head_from_lm=True)
            except CheckpointError:
                raise ConfigError(f"model.{key}_path: {error}") from None


def model_flavors(cfg: JobConfig, assets: dict[Path, str] | None = None) -> dict[str, ModelFlavor]:
    """The architecture of each built model (:func:`neural_models`) by [model] key; ConfigError naming the key when
    a flavor is unknown or a checkpoint's config.json describes what fusedrl cannot build. A path into one of
    ``assets`` (folders built after the startup checks -> the flavor of their models, :class:`Startup`) has that
    flavor. A ``model.reference_path`` with a config.json must describe the Actor's architecture (the Reference is
    built as the Actor)."""
    out = {}
    for key in neural_models(cfg):
        path = getattr(cfg.model, f"{key}_path")
        later = built_later(assets or {}, path) if path and not getattr(cfg.model, key) else None
        try:
            out[key] = resolve_flavor(later) if later is not None else model_flavor(cfg, key)
        except InputError as e:
            raise ConfigError(f"model.{key}: {e}") from None
        except ValueError as e:  # an unknown flavor name
            raise ConfigError(f"model.{key} = {getattr(cfg.model, key)!r}: {e}") from None
    reference = cfg.model.reference_path
    if reference and (Path(reference) / "config.json").is_file():
        try:
            ref = read_flavor(reference)
        except InputError as e:
            raise ConfigError(f"model.reference_path: {e}") from None
        actor = out["actor"]
        differ = [
            f.name
            for f in fields(ModelFlavor)
            if f.name not in ("name", "max_seq_len") and getattr(ref, f.name) != getattr(actor, f.name)
        ]
        if differ:
            raise ConfigError(
                f"model.reference_path = {reference!r}: its config.json describes another architecture than the Actor's "
                f"(it differs in {', '.join(differ)}); the Reference is built as the Actor: give a checkpoint of the "
                "Actor's architecture"
            )
    return out


def check_models(startup: Startup) -> None:
    """Startup check of the four models (raises ConfigError): their checkpoint folders exist (unless built later),
    their flavors resolve (:func:`model_flavors`), a model without a checkpoint is small enough to initialise
    randomly in host memory, all share the Actor's vocabulary, and a prompt plus its response fits each one's
    ``max_seq_len``."""
    cfg = startup.cfg
    for key in ("actor_path", "critic_path", "reward_path", "reference_path"):
        path = getattr(cfg.model, key)
        if path is not None and built_later(startup.assets, path) is None and not Path(path).is_dir():
            raise ConfigError(
                f"model.{key} = {format_value(path)} ({source_of(cfg, f'model.{key}')}): folder not found; "
                "give an HF-format safetensors folder, or leave it unset for random initialisation"
            )
    flavors = model_flavors(cfg, startup.assets)
    for key, f in flavors.items():
        if not getattr(cfg.model, f"{key}_path") and f.num_params(MODEL_ROLES[key]) > RANDOM_INIT_MAX_PARAMS:
            raise ConfigError(
                f"model.{key}_path is unset: a random initialisation builds the whole {f.name!r} model in host memory "
                f"(allowed up to {RANDOM_INIT_MAX_PARAMS / 1e9:.0f}B parameters); give an HF checkpoint folder"
            )
    actor = flavors["actor"]
    if any(f.vocab_size != actor.vocab_size for f in flavors.values()):
        sizes = ", ".join(f"{key} {f.vocab_size}" for key, f in flavors.items())
        raise ConfigError(
            f"model.critic / model.reward: vocabulary sizes differ from the Actor's ({sizes}); "
            "all four models must share the tokenizer"
        )
    _check_checkpoint_files(cfg, flavors, startup.assets)
    longest = cfg.sequence_budget
    key, shortest = min(flavors.items(), key=lambda kv: kv[1].max_seq_len)
    if longest > shortest.max_seq_len:
        raise ConfigError(
            f"{cfg.sequence_budget_terms} = {longest}: exceeds the max_seq_len {shortest.max_seq_len} of model.{key} (its max_position_embeddings, "
            "or a sliding window, within which attention is exact); lower one of them"
        )
