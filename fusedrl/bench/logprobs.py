"""The engine-vs-trainer log-prob gap: what PPO's ratio sees before any update, and what recomputing costs.

    python -m fusedrl.bench.logprobs [--json] [--flavor debug_large | --model FOLDER] [--samples 8] [--new-tokens 96]
        [--temperature 1.0] [--config CONFIG --steps N]

Part 1, the gap. One float32 model (``--flavor``, random weights, or an HF folder ``--model``); each engine copy
samples ``--samples`` responses to the same prompts with the same seeds, and the training forward (float32, or the
model's bf16 copy as FSDP2's mixed precision computes it: parameters cast, RoPE tables float32) scores the same
tokens at the same temperature. Engine copies: float32; bf16 parameters with float32 RoPE tables (what the rollout
layout builds); bf16 with the RoPE tables cast too (``module.to(bf16)``: how rollout copies were built before);
bf16 with a float32 LM head (on both sides: what a float32 head would buy); torchao int8 weight-only. Per pair: mean and largest |log pi_engine - log pi_train| over the sampled tokens and the
range of the ratio ``pi_train / pi_engine`` (1 everywhere: no gap).

Part 2 (``--config``): the config's trainer on its ranks for ``--steps`` iterations with ``ppo.recompute_logprobs``
on, the recomputation's share of the iteration time (``time_recompute / time_step``, mean over the steps after the
first) and the measured gap (``logprob_diff_mean``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from fusedrl.bench import NO_OUTPUT_OVERRIDES
from fusedrl.config import ConfigError, load_config
from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.generation.quantized import Quantize
from fusedrl.models import build_model, cast_parameters, from_pretrained, init_rope_buffers
from fusedrl.rlhf import logprob_gap
from fusedrl.rlhf.losses import token_logprobs


class Float32Head(nn.Module):
    """An LM head kept in float32 whatever the hidden state's dtype: the ``bf16_head_fp32`` copies, which show what
    a float32 head on both sides would buy (fusedrl does not build them: the extra copy costs vocab x hidden x 4
    bytes per engine, 2.1 GB for Llama-3.1-8B)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


def bf16_copy(model: nn.Module, *, float32_head: bool = False) -> nn.Module:
    """``model`` with bf16 parameters (RoPE tables float32, as rollout copies and FSDP2 training have them), and
    optionally a float32 copy of its LM head (tied or not)."""
    out = cast_parameters(copy.deepcopy(model), torch.bfloat16)
    if float32_head:
        head = model.output if isinstance(model.output, nn.Linear) else model.tok_embeddings  # tied: the embedding
        out.output = Float32Head(cast(nn.Linear | nn.Embedding, head).weight)
    return out


def engine_copies(model: nn.Module) -> dict[str, tuple[nn.Module, Quantize | None]]:
    """Name -> (model copy, quantize mode) of every engine the benchmark compares."""
    old_style = copy.deepcopy(model).to(torch.bfloat16)  # parameters and buffers (the RoPE tables) cast
    return {
        "fp32": (model, None),
        "bf16": (bf16_copy(model), None),
        "bf16_rope_cast": (old_style, None),
        "bf16_head_fp32": (bf16_copy(model, float32_head=True), None),
        "int8": (model, "int8_weight_only"),
    }


def trainer_copies(model: nn.Module) -> dict[str, nn.Module]:
    return {"fp32": model, "bf16": bf16_copy(model), "bf16_head_fp32": bf16_copy(model, float32_head=True)}


def measure_gap(model: nn.Module, samples: int, new_tokens: int, temperature: float, prompt_len: int = 16) -> dict:
    vocab = cast(nn.Embedding, model.tok_embeddings).num_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (prompt_len,), generator=g).tolist() for _ in range(samples)]
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens)
    trainers = trainer_copies(model)
    out: dict = {}
    for name, (copy_, quantize) in engine_copies(model).items():
        engine = GenerationEngine(copy_.eval(), max_slots=samples, max_len=prompt_len + new_tokens, seed=7, quantize=quantize)
        results = sorted(
            engine.generate([Request(i, p, params) for i, p in enumerate(prompts)], progress=False), key=lambda r: r.id
        )
        width = max(len(r.request.prompt) + len(r.tokens) for r in results)
        tokens = torch.zeros(samples, width, dtype=torch.long)
        mask = torch.zeros(samples, width, dtype=torch.bool)
        engine_lp = torch.zeros(samples, width)
        for row, r in enumerate(results):
            p, n = len(r.request.prompt), len(r.request.prompt) + len(r.tokens)
            tokens[row, :n] = torch.tensor(r.request.prompt + r.tokens)
            mask[row, p:n] = True
            engine_lp[row, p:n] = torch.tensor(r.logprobs)
        out[name] = {}
        with torch.no_grad():
            for trainer_name, trainer in trainers.items():
                train_lp = token_logprobs(trainer(tokens), tokens, temperature)
                out[name][trainer_name] = logprob_gap(engine_lp, train_lp, mask)
    return out


def _recompute_run(argv: list[str], steps: int, out_dir: str) -> list[dict]:
    from fusedrl.trainer import Trainer

    cfg = load_config([*argv, f"--training.steps={steps}", f"--job.output_dir={out_dir}", *NO_OUTPUT_OVERRIDES])
    trainer = Trainer(cfg)
    return [trainer.train_step(step) for step in range(1, steps + 1)]


def measure_recompute(config: str, overrides: list[str], steps: int) -> dict:
    from fusedrl.testing import run_multirank
    from fusedrl.train import prepare

    argv = ["--job.config_file", config, *overrides, "--ppo.recompute_logprobs=true"]
    par = load_config(argv).parallelism
    world = par.pp * par.dp_shard * par.tp
    prepare(argv, world)
    with tempfile.TemporaryDirectory() as out:
        records = run_multirank(_recompute_run, world, argv, steps, out, timeout_s=3600.0)[0]
    measured = records[1:] or records
    return {
        "config": config,
        "world": world,
        "recompute_share": statistics.fmean(r["time_recompute"] / r["time_step"] for r in measured),
        "recompute_s": statistics.fmean(r["time_recompute"] for r in measured),
        "step_s": statistics.fmean(r["time_step"] for r in measured),
        "logprob_diff_mean": statistics.fmean(r["logprob_diff_mean"] for r in measured),
        "logprob_diff_max": max(r["logprob_diff_max"] for r in measured),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.logprobs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--flavor", default="debug_large", help="random weights of this flavor (without --model)")
    parser.add_argument("--model", default=None, help="an HF checkpoint folder instead of --flavor")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", default=None, help="also measure recomputation's cost in this config's trainer")
    parser.add_argument("--steps", type=int, default=3, help="trainer iterations with --config (the first is not counted)")
    args, overrides = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        model = from_pretrained(args.model).model.eval()
    else:
        torch.manual_seed(0)
        model = build_model(args.flavor).eval()
        init_rope_buffers(model)
    label = args.model or args.flavor
    print(f"{label}: {args.samples} samples x {args.new_tokens} tokens at temperature {args.temperature}", flush=True)
    result: dict = {"model": label, "gap": measure_gap(model, args.samples, args.new_tokens, args.temperature)}
    print(f"{'engine':<16}{'trainer':<16}{'mean |diff|':>13}{'max |diff|':>12}{'ratio min':>11}{'ratio max':>11}")
    for engine, by_trainer in result["gap"].items():
        for trainer, g in by_trainer.items():
            print(
                f"{engine:<16}{trainer:<16}{g['logprob_diff_mean']:>13.2e}{g['logprob_diff_max']:>12.2e}"
                f"{g['importance_ratio_min']:>11.4f}{g['importance_ratio_max']:>11.4f}"
            )
    if args.config:
        try:
            result["recompute"] = r = measure_recompute(args.config, [*overrides, "--training.device=cpu"], args.steps)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(
            f"\nrecompute in {args.config} ({r['world']} ranks): {r['recompute_s']:.3f} s of {r['step_s']:.3f} s per "
            f"iteration ({100 * r['recompute_share']:.1f}%); gap mean {r['logprob_diff_mean']:.2e}, max {r['logprob_diff_max']:.2e}"
        )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
