"""Job config: one dataclass per TOML section, one typed field per key.

Each field carries its documentation in ``metadata["help"]`` (printed by ``--help`` and used for
docs/config.md) and, where a value can be impossible, a ``metadata["check"]`` function that returns
a problem description or None. Cross-key rules live in :mod:`fusedrl.config.loader`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Check = Callable[[Any], "str | None"]


def _key(default: Any, help: str, check: Check | None = None, **kwargs: Any) -> Any:
    """A config key: its default, its one-line documentation and an optional value check."""
    metadata = {"help": help, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


def at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be >= {low}"


def positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def finite(v: float) -> str | None:
    return None if math.isfinite(v) else "must be a finite number"


def unit_interval(v: float) -> str | None:
    return None if 0.0 <= v <= 1.0 else "must be in [0, 1]"


def each(check: Check) -> Check:
    """Apply ``check`` to every element of a list."""

    def run(values: list) -> str | None:
        for v in values:
            problem = check(v)
            if problem:
                return f"element {v!r} {problem}"
        return None

    return run


def non_empty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def _import_path(v: str | None) -> str | None:
    if v is None or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", v):
        return None
    return 'must be an import path "package.module:attribute", e.g. "fusedrl.tasks.debug:TASK"'


def _reward_fn_path(v: str | None) -> str | None:
    if v == "task":
        return None
    if _import_path(v) is None:
        return None
    return 'must be an import path "package.module:function", e.g. "fusedrl.tasks.debug:reward_fn", or "task" (the task\'s)'


def _top_p(v: float) -> str | None:
    return None if 0.0 < v <= 1.0 else "must be in (0, 1]; 1.0 disables top-p filtering"


def _threshold(v: float | str) -> str | None:
    if v == "auto" or (isinstance(v, float) and 0.0 < v < 1.0 and math.isfinite(v)):
        return None
    return 'must be a fraction in (0, 1) of the batch, or "auto"'


@dataclass
class JobSection:
    """[job]: run identity and reproducibility."""

    name: str = _key("fusedrl", "Run name, shown in logs and metrics.", non_empty)
    output_dir: str = _key("outputs", "Folder for metrics, traces, checkpoints and exports of this run.", non_empty)
    seed: int = _key(
        0,
        "Seed of model initialisation, data order and sampling (each request's RNG comes from (seed, iteration, request id)).",
        at_least(0),
    )
    task: str | None = _key(
        "fusedrl.tasks.debug:TASK",
        'The task, "package.module:attribute" naming a fusedrl.tasks.Task: the prompts of data.format synthetic, the '
        'reward function of model.reward_fn = "task", an evaluation logged each iteration, models it builds first. '
        "Unset: none.",
        _import_path,
    )
    # Where the config came from: set by the loader, never inside a file, not part of equality.
    config_file: str | None = _key(
        None, "TOML file to load; given on the command line only (--job.config_file FILE).", compare=False
    )


@dataclass
class ModelSection:
    """[model]: flavors and initial weights of the four PPO models."""

    actor: str = _key(
        "",
        "Actor (policy) flavor from fusedrl.models.FLAVORS; empty: the architecture of actor_path's config.json (any "
        "Llama, Mistral, Qwen2 or Qwen3 checkpoint), or the tiny debug flavor without actor_path. The Reference is "
        "built as the Actor.",
    )
    critic: str = _key(
        "",
        "Critic (value model) flavor from fusedrl.models.FLAVORS; empty: the architecture of critic_path's config.json, "
        "or the Actor's without critic_path.",
    )
    reward: str = _key(
        "",
        "Reward model (value head) flavor from fusedrl.models.FLAVORS; empty: the architecture of reward_path's "
        'config.json, or the Actor\'s without reward_path; "none": no Reward model (reward_fn alone scores).',
    )
    actor_path: str | None = _key(
        None, "HF-format safetensors folder with the Actor's initial weights; unset: random initialisation."
    )
    critic_path: str | None = _key(
        None,
        "HF-format safetensors folder for the Critic (an LM checkpoint gets a fresh value head); unset: random initialisation.",
    )
    reward_path: str | None = _key(
        None, "HF-format safetensors folder of the trained Reward model; unset: random initialisation."
    )
    reference_path: str | None = _key(
        None, "HF-format safetensors folder of the Reference policy; unset: the Actor's initial weights."
    )
    tokenizer_path: str = _key(
        "byte",
        '"byte" (the built-in byte tokenizer for debug flavors), a tokenizer.json file, or a folder with '
        "tokenizer.json, tokenizer.model, or vocab.json + merges.txt.",
        non_empty,
    )
    reward_fn: str | None = _key(
        None,
        'Rule-based reward "package.module:function" scoring each sample from its texts and token ids (docs/ppo.md, '
        'Reward functions), or "task": the job.task\'s reward function; its value times reward_fn_weight is added to '
        "the Reward model's score. Unset: none.",
        _reward_fn_path,
    )
    reward_fn_weight: float = _key(1.0, "Weight of reward_fn's value in a sample's score (also when it scores alone).")

    @property
    def uses_reward_model(self) -> bool:
        """Whether a neural Reward model is built (``reward`` is a flavor, not ``"none"``)."""
        return self.reward != "none"


@dataclass
class DataSection:
    """[data]: the prompt dataset."""

    path: str | None = _key(None, "Prompt dataset file or folder; unused (and may stay unset) for format synthetic.")
    format: Literal["jsonl", "parquet", "hf_disk", "synthetic"] = _key(
        "synthetic",
        "jsonl (one JSON object per line), parquet, hf_disk (datasets.save_to_disk folder), or synthetic (job.task's prompts).",
    )
    prompt_key: str = _key(
        "prompt",
        "Field of each record that holds the prompt: a string, or a chat (a list of {role, content} messages, e.g. "
        'field "messages"), which the tokenizer\'s chat template renders with the generation prompt appended.',
        non_empty,
    )
    max_prompt_len: int = _key(256, "Longest prompt in tokens; longer prompts are handled by on_long_prompt.", at_least(1))
    on_long_prompt: Literal["drop", "truncate"] = _key(
        "drop",
        "What to do with prompts longer than max_prompt_len: drop them or truncate them to max_prompt_len tokens (counted and logged either way).",
    )
    chat_template: bool = _key(
        False,
        "Render plain-string prompts through the tokenizer's chat template too, each as one user message (chats always "
        "are); needs a tokenizer with a chat template.",
    )
    shuffle: bool = _key(True, "Shuffle the prompt order (seeded by job.seed).")


@dataclass
class GenerationSection:
    """[generation]: rollout sampling and the decode engine."""

    max_new_tokens: int = _key(256, "Most tokens generated per response.", at_least(1))
    n: int = _key(
        1,
        "Samples per prompt (a group; grpo and rloo need >= 2); each sampled from its own seed, so fusion and migration "
        "change no sample.",
        at_least(1),
    )
    temperature: float = _key(1.0, "Sampling temperature; 0 is greedy decoding.", at_least(0.0))
    top_p: float = _key(
        1.0,
        "Nucleus sampling mass in (0, 1]; 1.0 disables it. The engine samples with it, but PPO training refuses it (its "
        "log-probs would not be the policy's): for generation-only uses of the engine.",
        _top_p,
    )
    top_k: int = _key(
        0,
        "Keep only the k most likely tokens; 0 disables it. Like top_p, for generation-only uses: PPO training refuses it.",
        at_least(0),
    )
    stop_token_ids: list[int] = _key(
        [], "Extra token ids that end a response, besides the tokenizer's end-of-sequence ids.", each(at_least(0))
    )
    max_slots: int = _key(64, "Requests decoded at once per generation instance (KV-cache slots).", at_least(1))
    scoring_max_tokens: int = _key(
        16384,
        "Most padded tokens (rows x longest sample) per scoring forward; longer scoring micro-batches are cut.",
        at_least(1),
    )
    compile: bool = _key(False, "Compile the engine's decode with torch.compile, as compile_scope says.")
    compile_scope: Literal["layer", "step"] = _key(
        "layer",
        "What compile = true compiles: layer (the decode step with its sampling as one graph, each decoder layer a "
        "region compiled once and reused by every layer; batch and length symbolic: one graph, ~17-21 s cold and ~4 s "
        "with a warm cache on a 2-core CPU for SmolLM2-135M, and one more for a single row, whose CPU products stream "
        "the weights as fused loops; the prefill eager) or step (the whole decode step with "
        "its sampling, one graph per batch bucket, and the prefill; needed for compile_mode = reduce-overhead's CUDA "
        "graphs).",
    )
    backend: Literal["inductor", "eager", "aot_eager", "tensorrt"] = _key(
        "inductor",
        "torch.compile backend when compile = true: inductor, eager / aot_eager (debugging), or tensorrt (GPU, needs fusedrl[tensorrt]).",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = _key(
        "default", "torch.compile mode when compile = true; reduce-overhead uses CUDA graphs on GPU."
    )
    compile_cache_dir: str = _key(
        "",
        "Inductor's on-disk cache of compiled graphs when compile = true (sets TORCHINDUCTOR_CACHE_DIR); a path on a "
        "shared filesystem lets every node and restart reuse them. Empty: TORCHINDUCTOR_CACHE_DIR if set, else "
        "torch's default (/tmp/torchinductor_<user>).",
    )
    quantize: Literal["none", "int8_weight_only"] = _key(
        "none", "Decode with a quantized copy of the Actor: none or int8_weight_only (torchao)."
    )
    speculative: Literal["off", "history"] = _key(
        "off",
        "Speculative decoding without a draft model: history drafts a request's next tokens from its group siblings' "
        "tokens, earlier responses to its prompt and its own prompt and response, and the engine verifies them with its "
        "own seeded sampler (the samples are those of decoding without it); off: one token per step.",
    )
    max_draft: int = _key(8, "Most drafted tokens per request and verify step (each request adapts its own).", at_least(1))
    speculative_rows: int = _key(
        4,
        "Speculate only while at most this many requests decode: a verify step's cost grows with rows x drafted "
        "positions (on the CPU decode is compute-bound past a few rows; on a GPU it stays memory-bound much longer). "
        "An engine that reads each step's tokens at once (by default every CPU engine without tensor parallelism) also "
        "times both kinds of step per number of rows and verifies only where that produced more tokens per second.",
        at_least(1),
    )


@dataclass
class FusionSection:
    """[fusion]: the two fusions (both change when work runs, never what is computed)."""

    inter_stage: bool | Literal["auto"] = _key(
        "auto",
        "Inter-stage fusion: migrate the long generation tail onto few instances and score on the freed ones, and score "
        'on an instance whose own requests are done while others decode. "auto": each rollout is fused only where the '
        "rollout simulator, replaying the previous rollout both ways and calibrated by measured / simulated times of "
        "earlier rollouts run each way, finds the fused one at least 5% shorter (the first rollout runs unfused and the "
        "next fused, to measure; multi-turn rollouts are always fused); a fused rollout then migrates, with "
        'migration_threshold "auto", only where the simulator predicts it ends at least 5% sooner than without '
        "migrating and sooner by more than its last prediction was off (each decision logged; what it learned is "
        "checkpointed); true: every rollout fused, migrating at migration_threshold (a fixed one whatever the gain); "
        "false: every instance decodes to the end, then all score.",
    )
    migration_threshold: float | Literal["auto"] = _key(
        "auto",
        'Migrate when unfinished requests fall to this fraction of the batch, in (0, 1); "auto" picks it from the observed length distribution.',
        _threshold,
    )
    migration_mode: Literal["kv", "reprefill"] = _key(
        "kv", "kv sends KV caches with the requests; reprefill sends tokens only and recomputes the KV (less bandwidth)."
    )
    migration_check_interval: int = _key(8, "Decode steps between checks of the global unfinished count.", at_least(1))
    intra_stage: bool | Literal["auto"] = _key(
        "auto",
        'Intra-stage fusion: train Actor and Critic with one fused bidirectional pipeline schedule. "auto": the fused '
        "schedule where the planner's simulation of it is at least 2% shorter than sequential 1F1B's, which it is not "
        "without a Critic unless split_backward (the decision logged with its predicted gain); true: the search's "
        "schedule whatever the gain.",
    )
    schedule_search_budget_s: float = _key(
        5.0,
        "Seconds the fused schedule search may spend; 0 runs the greedy fused scheduler alone (no local search).",
        at_least(0.0),
    )
    schedule_memory_gib: float | None = _key(
        None,
        "Cap on the stored activations per pipeline rank (GiB, as the memory estimate counts them: "
        "`fusedrl.models.figures`) that the "
        "fused schedule search may use; unset: 1.5 x one model's 1F1B peak. Refused below what sequential 1F1B needs.",
        positive,
    )
    split_backward: bool = _key(
        False,
        "Let the fused schedule split each backward into an input-gradient and a weight-gradient half and run weight "
        "gradients in pipeline bubbles: worth it when fill and drain idle the ranks (few micro-batches per stage); "
        "activations stay until the weight gradient (peak within the search's memory limit). Needs intra_stage; "
        "not with activation checkpointing.",
    )


@dataclass
class RolloutSection:
    """[rollout]: over-provisioned rollouts, with the unfinished groups carried between iterations or deferred to
    long rounds (opt-in)."""

    over_provision: float = _key(
        0.0,
        "Start this fraction more prompt groups than ppo.batch_size needs on each generation instance and stop "
        "decoding once enough whole groups have finished; the unfinished groups go on as rollout.unfinished says. "
        "0: off (every iteration decodes its batch to the end).",
        at_least(0.0),
    )
    unfinished: Literal["carry", "defer"] = _key(
        "carry",
        "What becomes of the groups unfinished when an over-provisioned rollout stops: carry (partial rollouts: their "
        "requests continue in the next iteration, re-prefilled under the new weights, each token tagged with the "
        "iteration that sampled it; needs ppo.tis_cap, the stale tokens' importance correction) or defer (tail "
        "batching: their tokens are dropped and their prompts wait in a long queue; once it holds a batch's worth, an "
        "iteration decodes those prompts alone, to the end: every trained token is on-policy).",
    )
    max_staleness: int = _key(
        1,
        "Most iterations a trained token may lag the policy it trains (unfinished = carry): a carried group that "
        "would exceed it is discarded (its tokens counted as wasted) and its prompt starts again.",
        at_least(1),
    )


@dataclass
class ParallelismSection:
    """[parallelism]: training mesh (pp x dp_shard x tp = world size) and generation TP."""

    pp: int = _key(1, "Pipeline-parallel stages (Actor in rank order, Critic in reverse order).", at_least(1))
    pp_critic: int | None = _key(
        None,
        "Pipeline stages of the Critic; unset: pp. Fewer stages (a divisor of pp) run as pp / pp_critic Critic replicas on "
        "consecutive rank blocks, each training its share of the micro-batches (gradients averaged like data parallelism).",
        at_least(1),
    )
    dp_shard: int = _key(1, "FSDP2 data-parallel shards.", at_least(1))
    tp: int = _key(1, "Tensor-parallel degree for training.", at_least(1))
    gen_tp: int = _key(1, "Tensor-parallel degree of each generation instance; must divide the world size.", at_least(1))

    @property
    def critic_stages(self) -> int:
        """The Critic's pipeline stages (``pp_critic``, or ``pp`` when unset)."""
        return self.pp if self.pp_critic is None else self.pp_critic

    @property
    def critic_replicas(self) -> int:
        return self.pp // self.critic_stages


@dataclass
class PPOSection:
    """[ppo]: batch sizes, the advantage estimator and the clipped policy loss (PPO's, which GRPO, RLOO, REINFORCE++
    and DAPO share; docs/algorithms.md)."""

    batch_size: int = _key(
        64,
        "Samples per iteration, across all ranks: batch_size / generation.n prompts, each sampled generation.n times.",
        at_least(1),
    )
    minibatch_size: int = _key(32, "Samples per optimizer step, across all ranks; must divide batch_size.", at_least(1))
    microbatch_size: int = _key(
        4,
        "Samples per pipeline micro-batch on each data-parallel shard; minibatch_size / dp_shard must be a multiple of it.",
        at_least(1),
    )
    microbatch_tokens: int | Literal["auto"] = _key(
        0,
        "Packed training micro-batches: > 0 puts the sequences of each data-parallel shard's minibatch back to back in "
        "rows of at most this many tokens (one row per micro-batch, attention within each sequence), so no padding "
        "between sequences is computed: at pp = 1 the fewest rows, at least the longest sequence (data.max_prompt_len + "
        "generation.max_new_tokens, or + env.max_tokens); at pp >= 2 the program's micro-batch count, at least "
        '(microbatch_size + 1) x that. "auto": (microbatch_size + 1) x the longest sequence, recomputed whenever those '
        "keys change. 0: micro-batches of microbatch_size right-padded rows.",
        lambda v: None if v == "auto" else at_least(0)(v),
    )
    epochs: int = _key(1, "Passes over each iteration's experience.", at_least(1))
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = _key(
        "gae",
        "gae: PPO with a Critic (GAE on its values); critic-free, no Critic built: grpo (score minus its group's mean, "
        "divided by the group's std with grpo_std_norm), rloo (score minus the mean of the other samples of its group), "
        "reinforce_pp (KL-shaped return, normalised over the batch).",
    )
    grpo_std_norm: bool = _key(True, "grpo: divide by the group's score std (false: Dr.GRPO's unnormalised group-mean baseline).")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = _key(
        "token-mean",
        "How per-token policy losses make one minibatch loss: token-mean (over all its response tokens), "
        "seq-mean-token-mean (each sequence's token mean, averaged over sequences) or seq-mean-token-sum-norm "
        "(each sequence's token sum / generation.max_new_tokens, averaged: Dr.GRPO).",
    )
    clip_eps: float = _key(0.2, "Policy ratio clip range: ratios are clipped to [1 - clip_eps, 1 + clip_eps].", positive)
    clip_eps_low: float | None = _key(
        None, "Lower clip range (ratios >= 1 - clip_eps_low); unset: clip_eps. DAPO's asymmetric clipping.", positive
    )
    clip_eps_high: float | None = _key(
        None, "Upper clip range (ratios <= 1 + clip_eps_high); unset: clip_eps. DAPO uses 0.28 with clip_eps_low 0.2.", positive
    )
    value_clip_eps: float = _key(0.2, "Value clip range around the old values; 0 disables value clipping.", at_least(0.0))
    kl_coef: float = _key(0.05, "Weight of the per-token KL penalty against the Reference in the reward; 0: none.", at_least(0.0))
    kl_loss_coef: float = _key(
        0.0,
        "Weight of the KL to the Reference as a policy-loss term (GRPO's); 0: none. With kl_coef = kl_loss_coef = 0 no "
        "Reference is built.",
        at_least(0.0),
    )
    kl_estimator: Literal["k1", "k2", "k3"] = _key(
        "k1",
        "Per-token KL estimator of both KL terms: k1 (log-ratio), k2 (half its square) or k3 (unbiased, non-negative).",
    )
    gamma: float = _key(1.0, "Discount factor of GAE and of reinforce_pp's returns, in [0, 1].", unit_interval)
    lam: float = _key(0.95, "GAE lambda, in [0, 1].", unit_interval)
    whiten_advantages: bool = _key(
        True, "gae: normalise advantages to zero mean and unit variance over the whole batch (reinforce_pp always does)."
    )
    dynamic_sampling: bool = _key(
        False,
        "DAPO's dynamic sampling (grpo / rloo): drop groups whose scores are all equal and generate more prompts until "
        "the batch is full or dynamic_sampling_max_rounds rounds ran (then the dropped groups fill it, counted).",
    )
    dynamic_sampling_max_rounds: int = _key(
        4, "Most generation rounds per iteration with dynamic_sampling (the first included).", at_least(1)
    )
    entropy_coef: float = _key(0.0, "Weight of the entropy bonus in the policy loss.", at_least(0.0))
    recompute_logprobs: bool | Literal["auto"] = _key(
        "auto",
        "Recompute the old Actor log-probs with a forward-only pass through the training layout before the first "
        "epoch (the engine's stay in the KL reward); \"auto\": when the engine's weights or dtype differ from the "
        "training forward's (a bf16 rollout or compute dtype, or generation.quantize). With one update per iteration "
        "(epochs 1, minibatch_size = batch_size, no tis_cap) the update's own forward gives them (no pass of their own).",
    )
    tis_cap: float = _key(
        0.0,
        "Truncated importance sampling: weight each token's policy loss by min(pi_train_old / pi_engine, tis_cap); "
        "needs recompute_logprobs; 0 disables it.",
        at_least(0.0),
    )
    truncated: Literal["score", "mask", "penalty"] = _key(
        "score",
        "Responses that hit max_new_tokens (with an environment: episodes that env.max_tokens or env.max_turns cut): "
        "score (as if finished), mask (no loss on them) or penalty (their score minus truncation_penalty).",
    )
    truncation_penalty: float = _key(
        1.0, 'Subtracted from a truncated response\'s score with truncated = "penalty".', at_least(0.0)
    )
    overlong_buffer: int = _key(
        0,
        "DAPO's soft overlong punishment: a response longer than max_new_tokens (env.max_tokens of sampled tokens with an "
        "environment) - overlong_buffer loses overlong_penalty x (its excess / overlong_buffer) from its score; 0 disables it.",
        at_least(0),
    )
    overlong_penalty: float = _key(1.0, "Largest soft overlong punishment (at max_new_tokens).", at_least(0.0))

    @property
    def critic_free(self) -> bool:
        """Whether the advantage estimator needs no Critic (every one but gae)."""
        return self.advantage_estimator != "gae"

    @property
    def uses_reference(self) -> bool:
        """Whether a KL term (in the reward or in the loss) needs the Reference."""
        return self.kl_coef > 0 or self.kl_loss_coef > 0

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(low, high)``: ratios are clipped to ``[1 - low, 1 + high]``."""
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        return low, self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@dataclass
class OptimizerSection:
    """[optimizer]: AdamW for Actor and Critic."""

    actor_lr: float = _key(1e-6, "Actor peak learning rate.", at_least(0.0))
    critic_lr: float = _key(5e-6, "Critic peak learning rate.", at_least(0.0))
    weight_decay: float = _key(0.0, "AdamW weight decay of weight matrices (norms and biases get none).", at_least(0.0))
    grad_clip: float = _key(1.0, "Clip each model's global gradient norm to this; 0 disables clipping.", at_least(0.0))


@dataclass
class LRSchedulerSection:
    """[lr_scheduler]: warmup then decay, the same shape for Actor and Critic."""

    warmup_steps: int = _key(0, "Steps of linear warmup from 0 to the peak learning rate.", at_least(0))
    decay: Literal["linear", "cosine", "constant"] = _key(
        "constant", "Decay after warmup until training.steps: linear, cosine or constant."
    )
    min_ratio: float = _key(0.0, "Final learning rate as a fraction of the peak (linear and cosine decay).", unit_interval)


@dataclass
class TrainingSection:
    """[training]: run length, device and numerics."""

    steps: int = _key(100, "PPO iterations to run.", at_least(1))
    device: Literal["auto", "cpu", "cuda"] = _key("auto", "Device: cuda (NCCL), cpu (gloo) or auto (cuda when available).")
    float8: bool = _key(False, "Train Actor and Critic linears in float8 with torchao (CUDA only).")
    compile: bool = _key(
        False,
        "Compile the decoder layers of the trained and scoring models with torch.compile: one layer forward shared "
        "by every layer and model of an architecture, rows and lengths symbolic (a few graphs; 10-30 s in the first "
        "iterations on a 2-core CPU for SmolLM2-135M, seconds from inductor's disk cache; time_compile in the "
        "metrics); packed-document attention stays eager. Needs tp = gen_tp = 1.",
    )
    mixed_precision_param: Literal["bfloat16", "float32"] = _key(
        "bfloat16",
        "Compute dtype of Actor and Critic training (FSDP2 param_dtype); master weights and optimizer state stay float32.",
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = _key(
        "float32", "Dtype of gradient reduction across data-parallel shards (FSDP2 reduce_dtype)."
    )
    frozen_dtype: Literal["bfloat16", "float32"] = _key(
        "bfloat16", "Dtype of the frozen models' weights (Reference and Reward) on the generation instances."
    )
    rollout_dtype: Literal["bfloat16", "float32"] = _key(
        "bfloat16",
        "Dtype of the rollout copies of the trained models (the engine's Actor and the scoring Critic), which weight "
        "sync refreshes; also the dtype weight sync sends.",
    )
    kv_cache_dtype: Literal["bfloat16", "float32"] = _key(
        "bfloat16", "Dtype of the generation engine's KV cache (attention runs in this dtype)."
    )
    activation_checkpointing: Literal["none", "full"] = _key(
        "none",
        "full: each transformer layer of Actor and Critic keeps only its input per micro-batch in flight and recomputes "
        "its activations in the backward (about a third more training compute); none: autograd keeps them all.",
    )
    peak_tflops: float = _key(
        0.0,
        "Peak matmul TFLOP/s of one rank in the compute dtype, the denominator of train_mfu and score_mfu; 0: measured "
        "(fusedrl.hardware.measure_peak) once per machine, thread count and torch version, and cached (~2 s once).",
        at_least(0.0),
    )
    reuse_host_memory: bool = _key(
        True,
        "On CPU ranks, keep freed host memory in the process for reuse (glibc malloc: no mmap-ed blocks, no trimming, one "
        "heap for every thread): CPU tensors "
        "then cost no page faults after the first iteration (~1.5 s of system time per SmolLM2 GRPO iteration); resident "
        "memory stays at its peak. false: the C allocator's defaults.",
    )
    offload_frozen: bool = _key(
        False,
        "Keep the Reference and Reward weights in host memory outside the rollout: copied to the device before "
        "each rollout (timed with weight_sync) and freed after it, so training and weight sync have their memory.",
    )
    nan_policy: Literal["skip", "stop"] = _key(
        "skip", "On NaN/inf in rewards, losses or gradients: skip the update with a logged reason, or stop the run."
    )
    logprob_gap_check: Literal["warn", "stop", "off"] = _key(
        "warn",
        "When the engine's log-probs of samples drawn with the current weights differ from the training forward's by "
        "more than logprob_gap_limit on average (most likely stale rollout weights): log a one-line warning, stop the "
        "run, or check nothing.",
    )
    logprob_gap_limit: float = _key(
        0.0,
        "Mean absolute log-prob gap (engine vs training forward) above which logprob_gap_check acts; 0: by the dtypes "
        "in play, 1e-3 when the engine and training both compute in float32, else 0.5 (bf16, an int8 engine).",
        at_least(0),
    )
    collective_timeout_s: float = _key(
        1800.0, "Seconds a collective waits for a peer before the run fails (a hung rank; a dead one fails at once).", positive
    )


@dataclass
class CheckpointSection:
    """[checkpoint]: DCP training state and HF export."""

    folder: str = _key("checkpoints", "Checkpoint folder; a relative path is inside job.output_dir.", non_empty)
    interval: int = _key(0, "Save the full training state every this many steps; 0 disables periodic saves.", at_least(0))
    keep: int = _key(0, "Keep only the newest this many checkpoints; 0 keeps all.", at_least(0))
    resume: bool | Literal["auto"] = _key(
        False,
        'Continue from the latest complete checkpoint in folder: true requires one, "auto" starts fresh when there is '
        "none (for automatic restarts: docs/multinode.md); false starts fresh.",
    )
    export_hf: bool = _key(True, "At the end of training, export the Actor as an HF-format safetensors folder.")


@dataclass
class MetricsSection:
    """[metrics]: logging and traces."""

    log_freq: int = _key(1, "Log metrics every this many steps.", at_least(1))
    jsonl: bool = _key(True, "Write metrics to <output_dir>/metrics.jsonl.")
    tensorboard: bool = _key(False, "Also write TensorBoard events (needs the tensorboard package).")
    trace: list[int] = _key([], "Steps to record a Chrome/Perfetto trace of, e.g. [2, 10]; empty: none.", each(at_least(0)))
    timeline_interval: int = _key(
        0,
        "Record pipeline timelines (and log bubble_ratio) every this many steps, besides traced steps; 0: traced steps "
        "only. A recorded step adds a barrier and per-action timing to training.",
        at_least(0),
    )
    progress: bool = _key(
        True,
        "Show the progress of long phases on rank 0 (the rollout's requests and tokens/s, the update's minibatches, "
        "checkpoint saves, the export): a bar where stderr is a terminal, else a line every 10 s. Nothing goes to the "
        "metrics.",
    )


@dataclass
class EvalSection:
    """[eval]: the Actor's accuracy on held-out prompts during training, generated by the rollout engine."""

    interval: int = _key(
        0,
        "Evaluate after every this many iterations' updates and after the last (the engine first takes the updated "
        "weights); 0: no evaluation. Needs a job.task with held-out prompts and a checker (fusedrl.tasks.HeldOut).",
        at_least(0),
    )
    at_start: bool = _key(True, "Also evaluate the starting Actor before the first iteration of a fresh run (logged as step 0).")
    count: int = _key(128, "Held-out prompts per evaluation.", at_least(1))
    n: int = _key(
        1, "Samples per prompt; eval/pass@n (a prompt counts when one of its samples is right) is logged when n > 1.", at_least(1)
    )
    temperature: float = _key(0.0, "Sampling temperature of the evaluation; 0 is greedy (then n must be 1).", at_least(0.0))
    seed: int = _key(
        1,
        "Seed of the task's held-out prompts (other than the training prompts' seed) and of the evaluation's sampling; "
        "every evaluation of a run uses the same prompts and random streams.",
    )
    path: str = _key(
        "",
        "A prompt file to evaluate on instead of the task's generated prompts, in [data]'s format and keys (format, "
        "prompt_key, chat_template), each prompt graded by the task's checker; empty: the task's held-out prompts.",
    )


@dataclass
class EnvSection:
    """[env]: multi-turn rollouts: an environment answers each model turn (docs/agents.md)."""

    env: str = _key(
        "",
        'The environment: "package.module:attribute", an fusedrl.envs.Environment class or a factory called with each '
        "sample's prompt row (e.g. fusedrl.tasks.word_problems_tools:word_problems_calc); empty: one turn, no "
        "environment.",
        lambda v: _import_path(v or None),
    )
    max_turns: int = _key(4, "Model turns per episode; the last one ends it (after its step ran).", at_least(1))
    max_tokens: int = _key(
        512,
        "Tokens of an episode after its prompt (every turn and observation; generation.max_new_tokens is per turn): the "
        "KV cache and training buckets hold data.max_prompt_len + this; a turn cut at it or an observation that would "
        "pass it ends the episode, unfinished (counted in env_limit_tokens).",
        at_least(2),
    )
    step_timeout_s: float = _key(
        10.0, "Seconds an environment step may take; a slower one ends its episode with error_reward.", positive
    )
    workers: int = _key(4, "Threads that run environment steps beside the decode loop, per generation instance.", at_least(1))
    error_reward: float = _key(
        0.0,
        "Reward of an episode a step ended by raising, timing out or returning something invalid (in place of what "
        "its earlier steps gave).",
        finite,
    )
    observation_role: str = _key(
        "user",
        "Chat role of text observations: each is appended as the tokenizer's chat template renders a message of this "
        "role after the model's turn (e.g. user, tool); one the template refuses stops the job at startup.",
        non_empty,
    )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_model(v: str) -> str | None:
    if v in ("actor", "critic"):
        return None
    if v in ("reward", "reference"):
        return "is frozen (nothing of it trains): adapters go on the trained models only, actor and critic"
    return "must be actor or critic"


def _lora_target(v: str) -> str | None:
    return None if v in LORA_TARGETS else f"is not a projection LoRA adapts; valid: {', '.join(LORA_TARGETS)}"


@dataclass
class LoRASection:
    """[lora]: low-rank adapters on the trained models' projections; their base weights stay frozen."""

    models: list[str] = _key(
        [],
        "The trained models that get adapters: actor and/or critic (a Critic's scalar head trains too); empty: no LoRA, "
        "every parameter trains.",
        each(_lora_model),
    )
    rank: int = _key(16, "Rank of each adapter.", at_least(1))
    alpha: float = _key(32.0, "Adapter scale numerator: the update is (alpha / rank) B A.", positive)
    dropout: float = _key(
        0.0,
        "Dropout on the adapters' input in training forwards (0: none; above 0 the training forward is random, so "
        "recomputed log-probs and fused / unfused schedules differ by their masks).",
        lambda v: None if 0.0 <= v < 1.0 else "must be in [0, 1)",
    )
    targets: list[str] = _key(list(LORA_TARGETS), "Projections (HF / PEFT names) that get adapters.", each(_lora_target))
    reference: Literal["base", "copy"] = _key(
        "base",
        "The Reference of a LoRA Actor when a KL term needs one: base, the Actor's training stages with the adapters "
        "off, run after the rollout (no second copy of the weights); copy, a frozen rollout copy scored during "
        "generation as without LoRA (one more copy of the weights; inter-stage fusion can hide its scoring).",
    )
    rollout_weights: Literal["merged", "adapters"] = _key(
        "merged",
        "How the rollout copies of the LoRA models get the adapters: merged, each weight sync sends every weight with "
        "the adapters folded in (W + scale B A, rounded to the rollout dtype); adapters, the rollout copies carry the "
        "adapters unmerged (the engine adds each projection's low-rank update): the first sync sends every weight, "
        "later ones only what trains (the adapters and a value head).",
    )
    export: Literal["merged", "adapter"] = _key(
        "merged",
        "What checkpoint.export_hf writes for a LoRA Actor: merged, an HF model with the adapters folded into its "
        "weights; adapter, the adapters alone in PEFT's format (adapter_config.json, adapter_model.safetensors).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.models)


def microbatch_count(minibatch: int, dp: int, microbatch: int) -> int:
    """Micro-batches of ``microbatch`` samples that one data-parallel replica of ``dp`` runs per minibatch: the one rule
    the planner, the executors and the benchmarks count by (the config check makes the sizes divide)."""
    return minibatch // dp // microbatch


@dataclass
class JobConfig:
    """The whole job config; attribute names are the TOML section names."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    fusion: FusionSection = field(default_factory=FusionSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    eval: EvalSection = field(default_factory=EvalSection)
    lora: LoRASection = field(default_factory=LoRASection)
    env: EnvSection = field(default_factory=EnvSection)
    # "section.key" -> where its value came from (a file path or "command line"); absent: default.
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def sequence_budget(self) -> int:
        """The longest sample: ``data.max_prompt_len + generation.max_new_tokens``, or with an environment
        ``data.max_prompt_len + env.max_tokens`` (the engine's KV cache length and the base of the training buckets)."""
        return self.data.max_prompt_len + (self.env.max_tokens if self.env.env else self.generation.max_new_tokens)

    @property
    def packing_tokens(self) -> int:
        """``ppo.microbatch_tokens`` with ``"auto"`` resolved: ``(ppo.microbatch_size + 1) x`` :attr:`sequence_budget`,
        the least a pipeline's packed rows need (0: no packing)."""
        tokens = self.ppo.microbatch_tokens
        return (self.ppo.microbatch_size + 1) * self.sequence_budget if tokens == "auto" else tokens

    @property
    def response_budget(self) -> int:
        """The most tokens after a prompt: ``generation.max_new_tokens``, or ``env.max_tokens`` (every turn and
        observation of an episode) with an environment."""
        return self.sequence_budget - self.data.max_prompt_len

    @property
    def sequence_budget_terms(self) -> str:
        """:attr:`sequence_budget` as its keys and values, for messages: ``"data.max_prompt_len + ... = 64 + 32"``."""
        key, value = (
            ("env.max_tokens", self.env.max_tokens)
            if self.env.env
            else ("generation.max_new_tokens", self.generation.max_new_tokens)
        )
        return f"data.max_prompt_len + {key} = {self.data.max_prompt_len} + {value}"

    @property
    def microbatches(self) -> int:
        """Actor micro-batches of one minibatch on each data-parallel shard (each Critic replica takes an equal share):
        :func:`microbatch_count` of the ``ppo`` sizes."""
        return microbatch_count(self.ppo.minibatch_size, self.parallelism.dp_shard, self.ppo.microbatch_size)
