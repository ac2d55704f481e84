"""How far an iteration's training and scoring run from the machine's matmul peak: model FLOPs of the real
architecture over the real (unpadded) tokens, the head over response tokens only, divided by the phase's time on every
rank and one rank's measured (or configured) peak in the dtype the phase computes in."""

from __future__ import annotations

from fusedrl.config import JobConfig
from fusedrl.hardware import Peak
from fusedrl.models import model_flavor, scoring_flavors
from fusedrl.models.figures import forward_flops


def compute_figures(
    cfg: JobConfig,
    lengths: list[int],
    response_tokens: int,
    trained_positions: int,
    times: dict[str, float],
    peak_flops: dict[str, float],
    world: int,
) -> dict[str, float]:
    """``train_tokens_per_s`` (real tokens trained, every epoch), ``train_mfu``, ``pad_frac`` (the share of the
    trained positions that are padding) and ``score_mfu`` of one iteration whose trained (and scored) sequences have
    ``lengths`` and ``response_tokens`` response tokens, trained over ``trained_positions`` token positions per epoch
    (padding included);
    ``times`` holds ``time_training`` and ``time_scoring``; ``peak_flops`` one rank's matmul FLOP/s by dtype name."""
    epochs, t = cfg.ppo.epochs, cfg.training
    policy = forward_flops(model_flavor(cfg, "actor"), "policy", lengths, response_tokens)
    critic = 0.0 if cfg.ppo.critic_free else forward_flops(model_flavor(cfg, "critic"), "value", lengths, 0)
    reference, values = scoring_flavors(cfg)  # the Critic (when trained) among the scoring value models
    trained = policy + critic
    scored = (policy if reference is not None else 0.0) + sum(forward_flops(f, "value", lengths, 0) for f in values)
    out = {"pad_frac": 1.0 - sum(lengths) / max(1, trained_positions)}
    train_s, score_s = times.get("time_training", 0.0), times.get("time_scoring", 0.0)
    if train_s > 0:
        out["train_tokens_per_s"] = epochs * sum(lengths) / train_s
        out["train_mfu"] = 3 * epochs * trained / (train_s * world * peak_flops[t.mixed_precision_param])
    if score_s > 0 and scored > 0:
        out["score_mfu"] = scored / (score_s * world * peak_flops[t.frozen_dtype])
    return out


def peak_flops_per_s(cfg: JobConfig, peak: Peak | None) -> dict[str, float]:
    """One rank's matmul FLOP/s by dtype name (float32 and bfloat16): ``training.peak_tflops`` for both when set, else
    ``peak``'s (a device that measured no bf16 peak gets its float32 one for both)."""
    if cfg.training.peak_tflops > 0:
        return dict.fromkeys(("float32", "bfloat16"), cfg.training.peak_tflops * 1e12)
    assert peak is not None, "measure the peak when training.peak_tflops is 0"
    measured = peak.matmul_flops_per_s
    return {name: measured.get(name, measured["float32"]) for name in ("float32", "bfloat16")}
