"""Startup checks of a job's config (before any process group or model is built): each refusal is one line that
names the key and the fix."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from fusedrl.components import CheckpointManager, check_vocab, load_tokenizer
from fusedrl.components.tokenizer import CHAT_TEMPLATE_FIX
from fusedrl.config import ConfigError, InputError, JobConfig, validate_paths, validate_world_size
from fusedrl.config.loader import source_of
from fusedrl.distributed import select_device
from fusedrl.layouts import MODEL_ROLES, RANDOM_INIT_MAX_PARAMS, model_flavor
from fusedrl.models import ModelFlavor, read_flavor, resolve_flavor
from fusedrl.rlhf import load_reward_fn, recompute_enabled, schedule_memory_limit
from fusedrl.tasks import Task, load_task, synthetic_prompts, task_reward_fn


def check_config(cfg: JobConfig, world_size: int, local_world_size: int | None = None) -> None:
    """Everything about the config that can be refused before a process group exists (raises ConfigError).
    ``local_world_size``: ranks per node (torchrun's LOCAL_WORLD_SIZE); None skips the node checks."""
    validate_world_size(cfg, world_size)
    if local_world_size is not None:
        check_nodes(cfg, world_size, local_world_size)
    if cfg.checkpoint.resume is True:
        ckpt = CheckpointManager.from_config(cfg.checkpoint, cfg.job.output_dir, {})
        resume_step(cfg, ckpt.latest_step(), ckpt.folder)
    task = load_task(cfg.job.task)
    check_reward(cfg, task)
    check_sampling(cfg)
    par, gen = cfg.parallelism, cfg.generation
    instances = world_size // par.gen_tp
    if cfg.ppo.batch_size % instances:
        raise ConfigError(
            f"ppo.batch_size = {cfg.ppo.batch_size}: must be a multiple of the number of generation instances "
            f"{instances} (world size {world_size} / parallelism.gen_tp {par.gen_tp}; each instance generates an "
            "equal share of the prompts)"
        )
    synthetic_prompts(cfg, task, count=1)  # the task gives the prompts of format synthetic
    assets = task.assets if task is not None else None
    pending = assets.missing(cfg) if assets is not None else None  # built by prepare() after these checks
    validate_paths(cfg, pending)
    flavors = model_flavors(cfg, (pending, assets.flavor) if assets is not None and pending is not None else None)
    for key, f in flavors.items():
        what = f"model.{key} = {getattr(cfg.model, key)!r}" if getattr(cfg.model, key) else f"model.{key}_path's {f.family} model"
        own = key == "critic" and par.pp_critic is not None
        stages, name = (par.critic_stages, "pp_critic") if own else (par.pp, "pp")
        if key != "reward" and f.num_layers < stages:
            smaller = " (or give the Critic fewer stages: parallelism.pp_critic)" if key == "critic" and not own else ""
            raise ConfigError(
                f"{what} has {f.num_layers} layers, fewer than parallelism.{name} = {stages} stages; "
                f"lower {name}{smaller} or use a deeper model"
            )
        sharded = "gen_tp" if key == "reward" else "tp and gen_tp"
        for option, degree in (("parallelism.tp", par.tp), ("parallelism.gen_tp", par.gen_tp)):
            if option.endswith(".tp") and key == "reward":
                continue
            for part, value in (
                ("attention heads", f.num_heads),
                ("KV heads", f.num_kv_heads),
                ("MLP width", f.intermediate_dim),
            ):
                if value % degree:
                    raise ConfigError(
                        f"{option} = {degree}: does not divide the {part} of {what} ({value}); tensor parallelism "
                        f"({sharded}) splits them evenly: choose a degree dividing it"
                    )
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
    longest = cfg.sequence_budget
    key, shortest = min(flavors.items(), key=lambda kv: kv[1].max_seq_len)
    if longest > shortest.max_seq_len:
        raise ConfigError(
            f"data.max_prompt_len + generation.max_new_tokens = {cfg.data.max_prompt_len} + {gen.max_new_tokens} "
            f"= {longest}: exceeds the max_seq_len {shortest.max_seq_len} of model.{key} (its max_position_embeddings, "
            "or a sliding window, within which attention is exact); lower one of them"
        )
    schedule_memory_limit(cfg, longest)
    try:
        device = select_device(cfg.training.device)
    except RuntimeError:
        raise ConfigError('training.device = "cuda": no CUDA device is available; use --training.device=cpu (or auto)') from None
    if cfg.training.float8 and device.type != "cuda":
        raise ConfigError("training.float8 = true: float8 training needs CUDA; set --training.float8=false on CPU")
    if cfg.training.float8 and cfg.parallelism.tp > 1:
        raise ConfigError(
            "training.float8 = true with parallelism.tp > 1: float8 tensor-parallel plans are not built; "
            "use tp = 1 (FSDP2 and pipeline stages work with float8) or --training.float8=false"
        )
    if pending is None or cfg.model.tokenizer_path == "byte" or not Path(cfg.model.tokenizer_path).is_relative_to(pending):
        check_tokenizer(cfg)


def check_nodes(cfg: JobConfig, world_size: int, local_world_size: int) -> None:
    """Node boundaries: torchrun gives node n the global ranks n * local_world_size onwards, and a generation
    instance (gen_tp consecutive ranks) or a training TP group (tp consecutive ranks: the innermost mesh dim) must
    not span two nodes (raises ConfigError). Pipeline stages and FSDP shards may."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE = {local_world_size} (ranks per node): must divide the world size {world_size}; "
            "launch the same number of processes on every node"
        )
    for key, what in (
        ("gen_tp", "a generation instance (gen_tp consecutive ranks)"),
        ("tp", "a tensor-parallel group (tp consecutive ranks)"),
    ):
        degree = getattr(cfg.parallelism, key)
        if local_world_size % degree:
            raise ConfigError(
                f"parallelism.{key} = {degree} ({source_of(cfg, f'parallelism.{key}')}): {what} would span "
                f"nodes (LOCAL_WORLD_SIZE = {local_world_size}: ranks per node); choose a {key} dividing "
                f"{local_world_size}, or launch a multiple of {degree} processes per node"
            )


def resume_step(cfg: JobConfig, latest: int | None, folder: Path) -> int | None:
    """The step a run continues from, given ``latest``, the latest complete checkpoint in ``folder``: that one when
    checkpoint.resume is true or "auto", None for a fresh start (false, or "auto" without one). Raises ConfigError
    for true without one."""
    if cfg.checkpoint.resume is False:
        return None
    if latest is None and cfg.checkpoint.resume is True:
        raise ConfigError(
            f"checkpoint.resume = true ({source_of(cfg, 'checkpoint.resume')}): no complete checkpoint in "
            f"{folder}; check job.output_dir and checkpoint.folder, or set --checkpoint.resume=auto "
            "to start fresh when there is none"
        )
    return latest


def check_tokenizer(cfg: JobConfig) -> None:
    """The tokenizer loads, its ids fit the Actor's vocabulary, and it has a chat template where the config
    asks for one (raises ConfigError)."""
    where = f"model.tokenizer_path = {cfg.model.tokenizer_path!r}"
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        check_vocab(tokenizer, model_flavor(cfg, "actor").vocab_size)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if cfg.data.chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"data.chat_template = true, but the tokenizer ({where}) has no chat template; {CHAT_TEMPLATE_FIX}, "
            "or set --data.chat_template=false"
        )


def model_flavors(cfg: JobConfig, pending: tuple[Path, str] | None = None) -> dict[str, ModelFlavor]:
    """The architecture of each built model (:func:`neural_models`) by [model] key; ConfigError naming the key when
    a flavor is unknown or a checkpoint's config.json describes what fusedrl cannot build. A path into ``pending``'s
    folder (a task's assets, not built yet) has ``pending``'s flavor, the one they are built with. A ``model.reference_path`` with a
    config.json must describe the Actor's architecture (the Reference is built as the Actor)."""
    out = {}
    for key in neural_models(cfg):
        path = getattr(cfg.model, f"{key}_path")
        try:
            if pending is not None and path and not getattr(cfg.model, key) and Path(path).is_relative_to(pending[0]):
                out[key] = resolve_flavor(pending[1])
            else:
                out[key] = model_flavor(cfg, key)
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


def neural_models(cfg: JobConfig) -> tuple[str, ...]:
    """The [model] flavor keys whose models are built: actor, critic and reward (unless ``model.reward = "none"``)."""
    return ("actor", "critic", "reward") if cfg.model.uses_reward_model else ("actor", "critic")


def check_sampling(cfg: JobConfig) -> None:
    """PPO needs the log-probs of the distribution that sampled (raises ConfigError): a temperature > 0 (greedy
    decoding has none) and no top-k / top-p filter (the training forward's log-probs would be of the unfiltered
    distribution, whose support differs). A quantized engine's log-probs are not the policy's: it needs
    ``ppo.recompute_logprobs``, as truncated importance sampling does (its weight is trainer / engine)."""
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
    if g.temperature <= 0:
        raise ConfigError(
            f"generation.temperature = {g.temperature} ({source_of(cfg, 'generation.temperature')}): PPO samples from the "
            "policy, and greedy decoding has no sampling distribution; use a temperature > 0 (1.0: the model's own)"
        )
    for key, value, off in (("top_k", g.top_k, 0), ("top_p", g.top_p, 1.0)):
        if value != off:
            raise ConfigError(
                f"generation.{key} = {value} ({source_of(cfg, f'generation.{key}')}): the PPO ratio and KL need the "
                f"log-probs of the distribution that sampled, and a filtered one's support moves with the policy; set "
                f"--generation.{key}={off} (lower generation.temperature to sharpen sampling)"
            )


def check_reward(cfg: JobConfig, task: Task | None) -> None:
    """The rule-based reward (raises ConfigError): ``model.reward_fn`` imports and is callable (``"task"``: the task
    has one); ``model.reward = "none"`` needs it and no ``model.reward_path``; ``model.reward_fn_weight`` needs it."""
    m = cfg.model
    if m.reward_fn == "task":
        task_reward_fn(cfg, task)
    elif m.reward_fn is not None:
        try:
            load_reward_fn(m.reward_fn)
        except ValueError as e:
            raise ConfigError(f"model.reward_fn = {m.reward_fn!r}: {e}") from None
    elif not m.uses_reward_model:
        raise ConfigError(
            'model.reward = "none" and model.reward_fn is unset: nothing would score the samples; set '
            "--model.reward_fn=package.module:function or give a Reward model (model.reward_path)"
        )
    elif m.reward_fn_weight != 1.0:
        raise ConfigError(
            f"model.reward_fn_weight = {m.reward_fn_weight} weighs no function: model.reward_fn is unset; set "
            "--model.reward_fn=package.module:function or drop the weight"
        )
    if not m.uses_reward_model and m.reward_path is not None:
        raise ConfigError(
            f'model.reward_path = {m.reward_path!r} is set but model.reward = "none" builds no Reward model; '
            'unset it (--model.reward_path=) or build a Reward model (model.reward = "" reads its config.json)'
        )
