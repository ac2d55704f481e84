"""The GPU regression check behind ``bash scripts/gpu_check.sh`` (see docs/gpu.md).

Steps, each a fresh process so that one failure cannot hide another:

1. ``pytest -m gpu tests``: the GPU-marked tests (those needing 2+ GPUs skip with that reason);
2. the trainer on one device: pp = 1, bf16 compute / frozen / rollout / KV cache, compiled decode with CUDA
   graphs, a few PPO iterations of the debug task on a ~0.5B flavor (random weights built locally);
3. ``python -m fusedrl.bench.generation`` on a ~1B bf16 flavor: decode tokens/s at batch 1, 8, 32, 128 next to
   torchtune's ``generate``, and each as a fraction of the memory-bandwidth roofline.

``--dry-run`` runs the same steps on the CPU with tiny shapes (CI runs it). The last stdout line is one JSON
object: per step its exit status, seconds and figures, and ``ok``; the exit status is non-zero when any step
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(name: str, cmd: list[str], timeout_s: float, env: dict[str, str]) -> dict:
    print(f"gpu_check: {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = 124, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout_s:.0f}s"
    seconds = time.perf_counter() - start
    tail = "\n".join(out.strip().splitlines()[-15:])
    print(f"gpu_check: {name}: exit {code} in {seconds:.0f}s\n{tail}", flush=True)
    return {"exit": code, "seconds": round(seconds, 1), "output": out}


def _pytest_counts(output: str) -> dict[str, int]:
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output)}


def _last_json(output: str) -> dict | None:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    args = parser.parse_args(argv)
    py = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = Path(tempfile.mkdtemp(prefix="gpu_check."))
    if args.dry_run:
        trainer_model, bench = (
            "debug",
            ["--flavor", "debug", "--batch-sizes", "1,2", "--new-tokens", "8", "--no-compile", "--repeats", "1"],
        )
        device = ["--training.device=cpu", "--generation.compile=false"]
    else:
        trainer_model = "qwen2_5_0_5b"
        bench = [
            "--device",
            "cuda",
            "--flavor",
            "llama3_2_1b",
            "--dtype",
            "bfloat16",
            "--compile-mode",
            "reduce-overhead",
            "--batch-sizes",
            "1,8,32,128",
            "--new-tokens",
            "128",
            "--prompt-len",
            "128",
            "--repeats",
            "2",
        ]
        device = ["--training.device=cuda", "--generation.compile=true", "--generation.compile_mode=reduce-overhead"]
    bf16 = [f"--training.{k}=bfloat16" for k in ("mixed_precision_param", "frozen_dtype", "rollout_dtype", "kv_cache_dtype")]
    steps = {
        "pytest_gpu": _run(
            "pytest -m gpu", [py, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider", "-rs"], 300, env
        ),
        "trainer": _run(
            "trainer, pp = 1, bf16",
            [
                py,
                "-m",
                "fusedrl.train",
                "--job.config_file",
                "train_configs/debug_ppo_single.toml",
                *(f"--model.{k}={trainer_model}" for k in ("actor", "critic", "reward")),
                *(f"--model.{k}_path=" for k in ("actor", "critic", "reward", "reference")),
                *device,
                *bf16,
                "--training.steps=3",
                "--checkpoint.interval=0",
                "--checkpoint.export_hf=false",
                "--metrics.trace=[]",
                "--ppo.batch_size=32",
                "--ppo.minibatch_size=16",
                f"--job.output_dir={out / 'trainer'}",
            ],
            300,
            env,
        ),
        "generation_bench": _run("bench.generation", [py, "-m", "fusedrl.bench.generation", *bench, "--json"], 300, env),
    }
    summary: dict = {"dry_run": args.dry_run}
    for name, result in steps.items():
        entry = {"exit": result["exit"], "seconds": result["seconds"]}
        if name == "pytest_gpu":
            entry["tests"] = _pytest_counts(result["output"])
            if result["exit"] == 5:  # pytest: no tests collected (a CPU run deselects every GPU test)
                entry["exit"] = 0
        elif name == "trainer":
            metrics = out / "trainer" / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
            keys = (
                "samples_per_s",
                "time_step",
                "time_weight_sync",
                "time_generation",
                "time_scoring",
                "time_training",
                "peak_memory_gib",
                "reward_mean",
            )
            entry["iterations"] = [{k: r[k] for k in keys if k in r} for r in records]
            if result["exit"] == 0 and len(records) != 3:
                entry["exit"] = 1
        else:
            figures = _last_json(result["output"]) or {}
            entry.update({k: figures.get(k) for k in ("speedup_vs_torchtune", "modes", "roofline_fraction")})
        summary[name] = entry
    summary["ok"] = all(summary[name]["exit"] == 0 for name in steps)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
