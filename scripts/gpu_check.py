"""The GPU regression check behind ``bash scripts/gpu_check.sh`` (see docs/gpu.md).

Steps, each a fresh process so that one failure cannot hide another:

1. ``pytest -m gpu tests``: the GPU-marked tests (those needing 2+ GPUs skip with that reason);
2. the trainer on one device: pp = 1, bf16 compute / frozen / rollout / KV cache, compiled decode with CUDA
   graphs, a few PPO iterations of the debug task on a ~0.5B flavor (random weights built locally);
3. ``python -m fusedrl.bench.generation`` on a ~1B bf16 flavor: decode tokens/s at batch 1, 8, 32, 128 next to
   torchtune's ``generate``, and each as a fraction of the memory-bandwidth roofline;
4. the SmolLM2-135M recipe (``train_configs/smollm2_135m_ppo.toml``) on one device: the architecture and tokenizer
   of ``--real-model`` (default ``models/SmolLM2-135M-Instruct``, from ``scripts/smollm2_from_gguf.py``) at full
   size, with its weights when the folder has them, else random weights drawn here from its config.json (only the
   config and tokenizer files need to travel to a GPU machine; the dry run shrinks it to 2 layers of width 64);
   skipped, with the reason, without that folder.

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
REAL_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


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


def prepare_real_model(src: Path, dst: Path, tiny: bool) -> None:
    """``dst``: a checkpoint folder with ``src``'s config.json and tokenizer, and its weights, or random bf16 weights
    of its architecture when ``src`` has none or ``tiny`` (the dry run: 2 layers of width 64, the same family,
    vocabulary and tokenizer); ``dst/arithmetic.jsonl``: the recipe's prompts."""
    import dataclasses
    import shutil

    import torch

    from fusedrl.models import build_model, read_flavor, save_hf_checkpoint
    from fusedrl.tasks import arithmetic

    has_weights = (src / "model.safetensors").is_file() or (src / "model.safetensors.index.json").is_file()
    if has_weights and not tiny:
        shutil.copytree(src, dst)
    else:
        torch.manual_seed(0)
        flavor = read_flavor(src)
        if tiny:
            shape = dict(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_dim=128)
            flavor = dataclasses.replace(flavor, **shape)
        save_hf_checkpoint(build_model(flavor).to(torch.bfloat16).state_dict(), dst, flavor)
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (src / name).is_file():
                shutil.copyfile(src / name, dst / name)
    arithmetic.write_prompts(dst / "arithmetic.jsonl", 1024)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    parser.add_argument("--real-model", type=Path, default=REAL_MODEL, help="SmolLM2 folder (weights optional)")
    parser.add_argument("--prepare-real-model", nargs=2, type=Path, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare_real_model:
        prepare_real_model(*args.prepare_real_model, tiny=args.dry_run)
        return 0
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
    real = out / "smollm2"
    if not (args.real_model / "config.json").is_file():
        skipped = f"no {args.real_model / 'config.json'}: build it with scripts/smollm2_from_gguf.py"
        steps["smollm2_recipe"] = {"exit": 0, "seconds": 0.0, "output": "", "skipped": skipped}
        print(f"gpu_check: smollm2_recipe: skipped ({skipped})", flush=True)
    else:
        prepare = [
            py,
            __file__,
            "--prepare-real-model",
            str(args.real_model),
            str(real),
            *(["--dry-run"] if args.dry_run else []),
        ]
        prepared = _run("SmolLM2 folder", prepare, 300, env)
        small = ["--ppo.batch_size=2", "--ppo.minibatch_size=2", "--ppo.microbatch_size=1", "--generation.max_new_tokens=4"]
        steps["smollm2_recipe"] = (
            prepared
            if prepared["exit"]
            else _run(
                "SmolLM2 recipe, one device",
                [
                    py,
                    "-m",
                    "fusedrl.train",
                    "--job.config_file",
                    "train_configs/smollm2_135m_ppo.toml",
                    *(f"--model.{k}_path={real}" for k in ("actor", "critic", "tokenizer")),
                    f"--data.path={real / 'arithmetic.jsonl'}",
                    "--parallelism.pp=1",
                    *device,
                    *([] if args.dry_run else bf16),
                    *(small if args.dry_run else []),
                    "--training.steps=3",
                    "--checkpoint.export_hf=false",
                    f"--job.output_dir={out / 'smollm2_run'}",
                ],
                600,
                env,
            )
        )
    summary: dict = {"dry_run": args.dry_run}
    for name, result in steps.items():
        entry = {"exit": result["exit"], "seconds": result["seconds"]}
        if name == "pytest_gpu":
            entry["tests"] = _pytest_counts(result["output"])
            if result["exit"] == 5:  # pytest: no tests collected (a CPU run deselects every GPU test)
                entry["exit"] = 0
        elif name in ("trainer", "smollm2_recipe"):
            if "skipped" in result:
                entry["skipped"] = result["skipped"]
                summary[name] = entry
                continue
            metrics = out / ("trainer" if name == "trainer" else "smollm2_run") / "metrics.jsonl"
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
                "response_len_mean",
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
