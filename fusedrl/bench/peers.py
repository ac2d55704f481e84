"""fusedrl against TRL's ``GRPOTrainer`` on one GRPO workload: samples/s of each, in one run.

The workload (both trainers): SmolLM2-135M-Instruct (``--model FOLDER``, an HF folder with its tokenizer) learns
512 chat prompts "What is a + b? Answer with the number only." (a, b from 1 to 9, a fixed list: :func:`prompt_rows`),
rendered by the tokenizer's chat template; the reward is :func:`fusedrl.tasks.arithmetic.score` (1 when the response
ended with the stop token and its last integer is a + b, else 0): fusedrl calls it through the task's ``reward_fn``,
TRL through :func:`score_completions`. GRPO with P prompts x G samples per step (``--variants``, ``PxG``; 4x4 = 16
samples), at most 48 new tokens at temperature 1 (top_p 1, top_k 0), one optimizer step per generated batch, the
k3 KL to the Reference in the loss with coefficient 0.04, learning rate 1e-6, on the CPU with ``--threads``
threads (2), in float32 or bfloat16 (``--dtypes``).

- TRL: ``GRPOConfig(use_cpu=True, per_device_train_batch_size=P*G, gradient_accumulation_steps=1,
  num_generations=G, num_iterations=1, beta=0.04, ...)``, ``bf16=True`` for bfloat16 (the weights stay float32,
  as TRL loads them by default: bf16 autocast); no vLLM.
- fusedrl: ``python -m fusedrl.train --job.config_file train_configs/smollm2_135m_grpo.toml --parallelism.pp=1
  --parallelism.dp_shard=1`` with the workload's overrides (``ppo.batch_size = minibatch_size = P*G``, ``epochs = 1``, ``kl_loss_coef = 0.04``,
  ``kl_coef = 0``, both fusions off, no checkpoints, the batch packed in one row: ``ppo.microbatch_tokens``); bfloat16 sets the parameter, frozen, rollout and KV-cache
  dtypes to bfloat16, float32 all four to float32. ``--fusedrl-args "..."`` appends overrides to every fusedrl run
  and ``--fusedrl-nproc N`` runs it on N ranks (torchrun; ``--threads`` are shared among them).

Every run is its own process (no threads or memory shared), the trainers alternating: for each variant and dtype
TRL, then fusedrl. A step's time is the same for both: wall seconds from the end of one optimizer step to the end of
the next (generation, scoring, training and the trainer's logging in between): TRL's ``on_step_end`` callback
times, fusedrl's ``time_step + time_outside`` of its metrics. Steps 2..``--steps`` are timed (the first warms up);
samples/s = samples per step / mean seconds per timed step. Reports per run seconds per step, samples/s, mean
reward and response length (the two trainers sample the same model, so these should agree), for fusedrl the mean
``time_generation / time_scoring / time_recompute / time_training`` and ``train_mfu`` / ``score_mfu`` (the shares of
this machine's matmul peak), and each fusedrl run's samples/s over TRL's
(the same variant and dtype, and TRL's best dtype of the variant).

TRL is a benchmark-only extra (``pip install -e ".[peers]"``); it runs in a child process
(``--worker trl``), so nothing of it is imported here.

Run: ``python -m fusedrl.bench.peers --model FOLDER [--steps 5] [--dtypes float32,bfloat16] [--variants 4x4,4x8]
[--only trl|fusedrl] [--fusedrl-args "..."] [--fusedrl-nproc 1] [--threads 2] [--out DIR] [--json]`` (``--out``
keeps every run's log and output there); with ``--json`` the last stdout line is ``{"runs": [...], "ratios": {"4x4/bfloat16": {"vs_same_dtype": .., "vs_best": ..}, ...}, ...}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from fusedrl.tasks import arithmetic

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "train_configs" / "smollm2_135m_grpo.toml"
PROMPTS = 512
MAX_NEW_TOKENS = 48
MAX_PROMPT_LEN = 64  # the recipe's data.max_prompt_len, stated: it sizes the packed micro-batch
KL_COEF = 0.04
LR = 1e-6
DTYPES = ("float32", "bfloat16")
TRAINERS = ("trl", "fusedrl")
PHASES = ("generation", "scoring", "recompute", "training", "compile")
"""fusedrl's phases reported per run (the means of its ``time_<phase>`` metrics over the timed steps; ``compile``: the
torch.compile time inside the others, so a recompile in the steady state shows apart)."""
FRACTIONS = ("train_mfu", "score_mfu")
"""fusedrl's shares of the machine's matmul peak reported per run (means over the timed steps, where it logs them)."""
INSTALL = 'TRL is not installed: pip install -e ".[peers]"'


def _trl_installed() -> bool:
    return importlib.util.find_spec("trl") is not None


RUN_TIMEOUT_S = 3600


# ---------------------------------------------------------------------------------------------- the workload
def prompt_rows(count: int = PROMPTS, seed: int = 0) -> list[dict[str, Any]]:
    """The workload's prompts: ``count`` rows ``{"messages": [user turn], "answer": a + b}`` with the question
    ``arithmetic.SUM`` of a, b drawn from 1..9 by ``random.Random(seed)`` (the same list for both trainers)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"messages": [{"role": "user", "content": arithmetic.SUM.format(a=a, b=b)}], "answer": a + b})
    return rows


def write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """``rows`` as a jsonl file, fusedrl's ``data.format = "jsonl"`` with ``data.prompt_key = "messages"``."""
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def _text(x: Any) -> str:
    """A prompt or completion as TRL hands it to a reward function: plain text, or chat turns (the last one's
    content: the user's question of a prompt, the assistant's reply of a completion)."""
    return x if isinstance(x, str) else x[-1]["content"]


def score_completions(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]], stop_ids: Collection[int]
) -> list[float]:
    """The workload's reward for TRL's samples: :func:`fusedrl.tasks.arithmetic.score` of each, a sample being
    finished when its last token is a stop token (TRL cuts a completion after its first EOS, keeping it; its text is
    decoded without special tokens), as fusedrl's rule-based reward sees ``finished``."""
    return [
        arithmetic.score(_text(p), _text(c), bool(ids) and ids[-1] in stop_ids)
        for p, c, ids in zip(prompts, completions, completion_ids, strict=True)
    ]


def parse_variant(text: str) -> tuple[int, int]:
    """``"4x8"`` -> (4 prompts, 8 samples per prompt); ValueError unless both are positive integers, samples >= 2
    (GRPO's groups need two)."""
    prompts, sep, samples = text.partition("x")
    if not sep or not prompts.isdigit() or not samples.isdigit() or int(prompts) < 1 or int(samples) < 2:
        raise ValueError(f"variant {text!r}: expected PROMPTSxSAMPLES with PROMPTS >= 1 and SAMPLES >= 2, e.g. 4x4")
    return int(prompts), int(samples)


# ---------------------------------------------------------------------------------------------- fusedrl's run
def fusedrl_argv(
    model: Path, data: Path, out: Path, prompts: int, samples: int, dtype: str, steps: int, extra: Sequence[str] = ()
) -> list[str]:
    """The ``fusedrl.train`` arguments of one run of the workload (``extra`` last: they win)."""
    batch = prompts * samples
    return [
        "--job.config_file",
        str(CONFIG),
        "--parallelism.pp=1",
        "--parallelism.dp_shard=1",  # one process; --fusedrl-nproc runs pass their layout in --fusedrl-args
        f"--job.output_dir={out}",
        f"--model.actor_path={model}",
        f"--model.tokenizer_path={model}",
        f"--data.path={data}",
        f"--generation.max_new_tokens={MAX_NEW_TOKENS}",
        f"--generation.n={samples}",
        "--generation.temperature=1.0",
        "--generation.top_p=1.0",
        "--generation.top_k=0",
        f"--ppo.batch_size={batch}",
        f"--ppo.minibatch_size={batch}",
        f"--ppo.microbatch_size={batch}",  # one process: the batch in one micro-batch and one decode batch, as TRL does
        f"--data.max_prompt_len={MAX_PROMPT_LEN}",
        f"--ppo.microbatch_tokens={batch * (MAX_PROMPT_LEN + MAX_NEW_TOKENS)}",  # that micro-batch packed in one row
        f"--generation.max_slots={batch}",
        "--ppo.epochs=1",
        "--ppo.kl_coef=0.0",
        f"--ppo.kl_loss_coef={KL_COEF}",
        "--ppo.kl_estimator=k3",
        f"--optimizer.actor_lr={LR}",
        "--lr_scheduler.warmup_steps=0",
        "--lr_scheduler.decay=constant",
        f"--training.steps={steps}",
        "--training.device=cpu",
        *(f"--training.{key}={dtype}" for key in ("mixed_precision_param", "frozen_dtype", "rollout_dtype", "kv_cache_dtype")),
        "--fusion.inter_stage=false",
        "--fusion.intra_stage=false",
        "--checkpoint.export_hf=false",
        "--eval.interval=0",
        "--checkpoint.interval=0",
        "--checkpoint.resume=false",
        "--metrics.jsonl=true",
        "--metrics.tensorboard=false",
        "--metrics.trace=[]",
        *extra,
    ]


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list[str], env: dict[str, str], log: Path, what: str) -> None:
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    if proc.returncode:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"the {what} run failed (exit status {proc.returncode}):\n{tail}")


def run_fusedrl(args: argparse.Namespace, data: Path, tmp: Path, variant: tuple[int, int], dtype: str) -> dict[str, Any]:
    """One fusedrl training job (its own process, or ``--fusedrl-nproc`` torchrun ranks sharing ``--threads``) of
    ``variant`` in ``dtype``; its timed steps."""
    prompts, samples = variant
    out = tmp / f"fusedrl_{prompts}x{samples}_{dtype}"
    shutil.rmtree(out, ignore_errors=True)  # a kept --out folder's earlier run: no resume, no old metrics
    argv = fusedrl_argv(args.model, data, out, prompts, samples, dtype, args.steps, args.fusedrl_args)
    launch = ["-m", "fusedrl.train"]
    if args.fusedrl_nproc > 1:
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.fusedrl_nproc}", *launch]
    cmd = [sys.executable, *launch, *argv]
    _run(cmd, _env(args.threads), tmp / f"{out.name}.log", f"fusedrl {prompts}x{samples} {dtype}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] >= 2]
    if len(timed) != args.steps - 1:
        raise RuntimeError(f"fusedrl wrote metrics of steps {[r['step'] for r in records]}, expected 1..{args.steps}")
    return {
        "step_s": [r["time_step"] + r["time_outside"] for r in timed],
        "phases": {p: statistics.fmean(r[f"time_{p}"] for r in timed) for p in PHASES},
        "fractions": {k: statistics.fmean(r[k] for r in timed) for k in FRACTIONS if all(k in r for r in timed)},
        "reward": statistics.fmean(r["reward_fn_mean"] for r in records),
        "response_len": statistics.fmean(r["response_len_mean"] for r in records),
    }


# ---------------------------------------------------------------------------------------------- TRL's run
def run_trl(args: argparse.Namespace, tmp: Path, variant: tuple[int, int], dtype: str) -> dict[str, Any]:
    """One TRL training job of ``variant`` in ``dtype``, in a child process of this module (``--worker trl``); its
    timed steps."""
    prompts, samples = variant
    name = f"trl_{prompts}x{samples}_{dtype}"
    spec = {
        "model": str(args.model),
        "out": str(tmp / name),
        "prompts": prompts,
        "samples": samples,
        "dtype": dtype,
        "steps": args.steps,
        "threads": args.threads,
    }
    result = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "fusedrl.bench.peers", "--worker", "trl", "--spec", json.dumps(spec), "--result", str(result)]
    _run(cmd, _env(args.threads), tmp / f"{name}.log", f"TRL {prompts}x{samples} {dtype}")
    done = json.loads(result.read_text())
    ends = done["step_ends"]
    if len(ends) != args.steps:
        raise RuntimeError(f"TRL ended {len(ends)} optimizer steps, expected {args.steps}")
    logs = [log for log in done["logs"] if "reward" in log]
    return {
        "step_s": [b - a for a, b in zip(ends, ends[1:])],
        "reward": statistics.fmean(log["reward"] for log in logs) if logs else float("nan"),
        "response_len": statistics.fmean(log["completions/mean_length"] for log in logs) if logs else float("nan"),
    }


def trl_worker(spec: dict[str, Any], result: Path) -> None:
    """The TRL side, run in its own process: ``GRPOTrainer`` on the workload for ``spec["steps"]`` optimizer steps,
    writing the ``time.perf_counter()`` of every ``on_step_end`` and TRL's logs to ``result`` (JSON)."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    stop_ids = {tokenizer.eos_token_id}

    def arithmetic_exact(prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float | None]:
        scores: list[float | None] = [*score_completions(prompts, completions, completion_ids, stop_ids)]
        return scores  # TRL's reward functions may return None for a sample they cannot score (ours scores every one)

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, int | float)})

    rows = [{"prompt": r["messages"], "answer": r["answer"]} for r in prompt_rows()]
    batch = spec["prompts"] * spec["samples"]
    config = GRPOConfig(
        output_dir=spec["out"],
        use_cpu=True,
        bf16=spec["dtype"] == "bfloat16",
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=spec["samples"],
        num_iterations=1,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=KL_COEF,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=arithmetic_exact,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    result.write_text(json.dumps({"step_ends": timer.ends, "logs": timer.logs, "threads": torch.get_num_threads()}))


# ---------------------------------------------------------------------------------------------- the bench
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``parser.error``: exit status 2 with one line)."""
    parser = argparse.ArgumentParser(prog="python -m fusedrl.bench.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="HF folder of SmolLM2-135M-Instruct (weights and tokenizer)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; steps 2..N are timed")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="float32, bfloat16 or both, comma-separated")
    parser.add_argument("--variants", default="4x4", help="PROMPTSxSAMPLES per step, comma-separated (e.g. 4x4,4x8)")
    parser.add_argument("--only", choices=TRAINERS, help="run one trainer only")
    parser.add_argument("--fusedrl-args", default="", help="overrides appended to every fusedrl run (one string)")
    parser.add_argument("--fusedrl-nproc", type=int, default=1, help="ranks of each fusedrl run (torchrun when > 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run (fusedrl: of all its ranks)")
    parser.add_argument("--out", type=Path, help="keep each run's log and output in this folder (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        if args.spec is None or args.result is None:
            parser.error("--worker needs --spec and --result")
        return args
    if args.model is None:
        parser.error("--model FOLDER is required (an HF folder of SmolLM2-135M-Instruct with its tokenizer)")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; expected an HF model folder")
    args.model = args.model.resolve()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: must be at least 2 (the first step is not timed)")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        parser.error(f"--dtypes {','.join(args.dtypes)}: choose from {', '.join(DTYPES)}")
    try:
        args.variants = [parse_variant(v) for v in args.variants.split(",")]
    except ValueError as e:
        parser.error(f"--variants: {e}")
    if args.fusedrl_nproc < 1 or args.threads < 1:
        parser.error("--fusedrl-nproc and --threads must be at least 1")
    try:
        args.fusedrl_args = shlex.split(args.fusedrl_args)
    except ValueError as e:
        parser.error(f"--fusedrl-args: {e}")
    return args


def _check_fusedrl(args: argparse.Namespace, data: Path, out: Path) -> str | None:
    """The first fusedrl config's startup checks, before any run; the problem in one line, or None."""
    from fusedrl.config import ConfigError
    from fusedrl.train import prepare

    for prompts, samples in args.variants:
        for dtype in args.dtypes:
            argv = fusedrl_argv(args.model, data, out, prompts, samples, dtype, args.steps, args.fusedrl_args)
            try:
                prepare(argv, args.fusedrl_nproc)
            except ConfigError as e:
                return f"fusedrl {prompts}x{samples} {dtype}: {e}"
    return None


def _summary(trainer: str, variant: tuple[int, int], dtype: str, run: dict[str, Any]) -> dict[str, Any]:
    step_s = statistics.fmean(run["step_s"])
    samples = variant[0] * variant[1]
    return {
        "trainer": trainer,
        "variant": f"{variant[0]}x{variant[1]}",
        "dtype": dtype,
        "samples_per_step": samples,
        "step_s": step_s,
        "samples_per_s": samples / step_s,
        "timed_step_s": run["step_s"],
        "reward_mean": run["reward"],
        "response_len_mean": run["response_len"],
        **({"phases_s": run["phases"]} if "phases" in run else {}),
        **({"peak_fractions": run["fractions"]} if run.get("fractions") else {}),
    }


HEADER = (
    f"{'trainer':<8}{'PxG':<6}{'dtype':<10}{'s/step':>8}{'samples/s':>11}{'reward':>8}{'resp_len':>9}   fusedrl phases (s/step)"
)


def _line(s: dict[str, Any]) -> str:
    phases = s.get("phases_s")
    where = ", ".join(f"{p} {phases[p]:.2f}" for p in PHASES) if phases else ""
    where += "".join(f", {k} {v:.3f}" for k, v in s.get("peak_fractions", {}).items())
    return (
        f"{s['trainer']:<8}{s['variant']:<6}{s['dtype']:<10}{s['step_s']:>8.2f}{s['samples_per_s']:>11.3f}"
        f"{s['reward_mean']:>8.2f}{s['response_len_mean']:>9.1f}   {where}"
    )


def ratios(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per fusedrl run (``"4x4/bfloat16"``): its samples/s over TRL's of the same variant and dtype, and over TRL's
    best dtype of the variant (None without a TRL run to compare)."""
    trl = {(s["variant"], s["dtype"]): s["samples_per_s"] for s in runs if s["trainer"] == "trl"}
    out: dict[str, dict[str, float | None]] = {}
    for s in runs:
        if s["trainer"] != "fusedrl":
            continue
        same = trl.get((s["variant"], s["dtype"]))
        best = max((v for (variant, _), v in trl.items() if variant == s["variant"]), default=None)
        out[f"{s['variant']}/{s['dtype']}"] = {
            "vs_same_dtype": s["samples_per_s"] / same if same else None,
            "vs_best": s["samples_per_s"] / best if best else None,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "trl":
        trl_worker(json.loads(args.spec), args.result)
        return 0
    trainers = [t for t in TRAINERS if args.only in (None, t)]
    if "trl" in trainers and not _trl_installed():
        print(INSTALL, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fusedrl_peers_") as tmp_name:
        tmp = Path(tmp_name) if args.out is None else args.out.resolve()
        tmp.mkdir(parents=True, exist_ok=True)
        data = write_rows(tmp / "prompts.jsonl", prompt_rows())
        if "fusedrl" in trainers and (problem := _check_fusedrl(args, data, tmp / "check")) is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        print(
            f"GRPO on {args.model.name}: {PROMPTS} prompts 'What is a + b?', {MAX_NEW_TOKENS} new tokens max, "
            f"KL k3 x {KL_COEF}, lr {LR}, {args.threads} threads on the CPU; {args.steps} steps per run, steps 2..{args.steps} "
            f"timed (wall s from one optimizer step's end to the next)"
            + (f"; fusedrl on {args.fusedrl_nproc} ranks" if args.fusedrl_nproc > 1 else "")
            + (f"; fusedrl overrides {' '.join(args.fusedrl_args)}" if args.fusedrl_args else ""),
            flush=True,
        )
        print(HEADER)
        runs = []
        for variant in args.variants:
            for dtype in args.dtypes:
                for trainer in trainers:
                    try:
                        if trainer == "trl":
                            run = run_trl(args, tmp, variant, dtype)
                        else:
                            run = run_fusedrl(args, data, tmp, variant, dtype)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"error: {e}", file=sys.stderr)
                        return 1
                    runs.append(_summary(trainer, variant, dtype, run))
                    print(_line(runs[-1]), flush=True)
    figures = ratios(runs)
    for key, r in figures.items():
        named = (("vs TRL same dtype", r["vs_same_dtype"]), ("vs TRL best", r["vs_best"]))
        if parts := [f"{name} {v:.3f}x" for name, v in named if v]:
            print(f"fusedrl {key} samples/s: " + ", ".join(parts))
    if args.json:
        result = {"model": str(args.model), "steps": args.steps, "threads": args.threads, "runs": runs, "ratios": figures}
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
