"""The GPU regression check behind ``bash scripts/gpu_check.sh`` (see docs/gpu.md).

Steps, each a fresh process (its process group killed at its limit) so that one failure cannot hide another; the
limits sum to 8 minutes, within one command of a lent GPU machine:

1. ``pytest_gpu`` (2 min): ``pytest -m gpu tests``, the GPU-marked tests (those needing 2+ GPUs skip with that
   reason);
2. ``smollm2_recipe`` (3.5 min): two PPO iterations (the second reported as ``steady_state``: the first compiles) of ``train_configs/smollm2_135m_ppo.toml`` on one device (pp = 1,
   bf16, compiled decode with CUDA graphs) with the architecture and tokenizer of ``--real-model`` (default
   ``models/SmolLM2-135M-Instruct``, from ``scripts/smollm2_from_gguf.py``) at full size: its weights when the folder
   has them, else random weights drawn here from its config.json (only the config and tokenizer files need to travel
   to a GPU machine; the dry run shrinks it to 2 layers of width 64); without that folder the step is skipped with
   the reason and counts as failed;
3. ``generation_bench`` (2.5 min): ``python -m fusedrl.bench.generation`` on a ~1B bf16 flavor, decode tokens/s at
   batch 1 and 32 next to torchtune's ``generate``, and each as a fraction of the memory-bandwidth roofline.

Before the steps, a preflight (a second, not counted in the limits) writes ``preflight.json``: the Python version, the
GPU, driver and CUDA version (``nvidia-smi``), the versions of the distributions the figures depend on
(:data:`REPORTED`), and the carried wheels; it refuses to start (exit 1, nothing else run) when a distribution of
``scripts/gpu_wheels.txt`` is not installed (the wheels were not carried) or a carried wheel does not fit this
Python (a wheel tagged for another minor version, as multiprocess is). A dry run lists such wheels without refusing:
``.whl/`` holds the GPU machine's (CPython 3.12) wheels once the rehearsal built them, and a dry run here runs on this
interpreter's own packages.

Each step's result is written to ``--out`` (default ``$OUT``, the folder whose files come back from a lent GPU
machine, else a new temporary folder) as ``<step>.json`` when it ends, so a run killed from outside still returns the
finished steps. ``--only STEP`` (repeatable) runs some steps. ``--dry-run`` runs the same steps on the CPU with tiny
shapes (CI runs it). The last stdout line is one JSON object, printed also when a step timed out: per step its exit
status, limit, seconds and figures, and ``ok``; the exit status is non-zero when any step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


WHEELS_LIST = ROOT / "scripts" / "gpu_wheels.txt"
CARRIED_WHEELS = ROOT / ".whl"
REPORTED = ("torch", "triton", "transformers", "datasets", "pyarrow", "huggingface-hub", "torchtune", "torchao")
"""Distributions whose versions the preflight records."""

STEP_LIMITS_S = {"pytest_gpu": 120, "smollm2_recipe": 210, "generation_bench": 150}
"""Each step's wall-clock limit: 480 s together, 8 of the 10 minutes one command may run on a lent GPU machine."""
DRY_RUN_GUARD = 4
"""The CPU dry run checks that every step works, not how fast: its steps are killed at this many times their GPU
limit, a hang guard that a loaded CI machine does not reach (at 1x, two busy cores made every step overrun)."""
METRIC_KEYS = (
    "samples_per_s",
    "time_step",
    "time_weight_sync",
    "time_generation",
    "time_scoring",
    "time_recompute",
    "time_training",
    "peak_memory_gib",
    "reward_mean",
    "response_len_mean",
    "logprob_diff_mean",
)


def _run(name: str, cmd: list[str], timeout_s: float, env: dict[str, str]) -> dict:
    """``cmd`` in its own process group, killed whole (pytest's and the trainer's workers too) at ``timeout_s``."""
    print(f"gpu_check: {name}: {' '.join(cmd)} (limit {timeout_s:.0f}s)", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code, out = 124, f"{out}\ntimed out after {timeout_s:.0f}s"
    seconds = time.perf_counter() - start
    tail = "\n".join(out.strip().splitlines()[-15:])
    print(f"gpu_check: {name}: exit {code} in {seconds:.0f}s\n{tail}", flush=True)
    return {"exit": code, "seconds": round(seconds, 1), "output": out}


def _pytest_counts(output: str) -> dict[str, int]:
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output)}


def _last_json(output: str) -> dict | None:
    """The last whole JSON object line of ``output`` (a line cut off by a kill is passed over)."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
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


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu() -> dict[str, str]:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return {}
    if not lines:
        return {}
    name, driver, memory = (field.strip() for field in lines[0].split(","))
    return {"gpu": name, "driver": driver, "memory": memory, "count": str(len(lines))}


def _misfit_wheel(wheel: Path) -> str | None:
    """Why ``wheel`` does not install on this interpreter, or None. A tag packaging accepts can still name another
    minor version (``py311`` is compatible on 3.12 by packaging's rules, yet multiprocess's py311 wheel is a copy of
    3.11's multiprocessing): a minor-specific Python tag must name this one."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    tags = parse_wheel_filename(wheel.name)[3]
    if not tags & set(sys_tags()):
        return "no tag this interpreter supports"
    this = f"{sys.version_info.major}{sys.version_info.minor}"
    fitting = [t for t in tags if t.abi == "abi3" or t.interpreter in ("py3", "py2") or t.interpreter.endswith(this)]
    return None if fitting else f"tagged for {', '.join(sorted({t.interpreter for t in tags}))}, not Python {this}"


def preflight(out: Path, dry_run: bool = False) -> dict:
    """The machine and versions (written to ``out/preflight.json``); ``exit`` 1 with ``error`` when the carried
    wheels are missing or (unless ``dry_run``: listed as ``wheels_for_another_python``) do not fit this Python."""
    pins = [line.split("==")[0] for line in WHEELS_LIST.read_text().splitlines() if line and not line.startswith("#")]
    wheels = sorted(CARRIED_WHEELS.glob("*.whl"))
    misfits = {w.name: why for w in wheels if (why := _misfit_wheel(w)) is not None}
    missing = [name for name in pins if _version(name) is None]
    entry: dict = {
        "python": sys.version.split()[0],
        **_gpu(),
        "versions": {name: _version(name) for name in REPORTED},
        "carried_wheels": [w.name for w in wheels],
    }
    errors = []
    if missing:
        errors.append(
            f"{', '.join(missing)} not installed: build the wheels with `python scripts/gpu_wheels.py` on a machine with an "
            f"index and carry {CARRIED_WHEELS.name}/ with the checkout (docs/gpu.md)"
        )
    if misfits and dry_run:
        entry["wheels_for_another_python"] = misfits
    elif misfits:
        errors.append(
            "carried wheels that do not fit this Python: "
            + "; ".join(f"{name} ({why})" for name, why in misfits.items())
            + ": rebuild them with `python scripts/gpu_wheels.py` (it downloads for CPython 3.12)"
        )
    entry |= {"exit": 1 if errors else 0, **({"error": "; ".join(errors)} if errors else {})}
    (out / "preflight.json").write_text(json.dumps(entry, indent=1))
    print(f"gpu_check: preflight: {json.dumps(entry)}", flush=True)
    return entry


def _iterations(folder: Path) -> list[dict]:
    metrics = folder / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [{k: r[k] for k in METRIC_KEYS if k in r} for r in records]


def _pytest_step(py: str, env: dict[str, str], limit: float) -> dict:
    result = _run("pytest -m gpu", [py, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider", "-rs"], limit, env)
    entry = {"exit": result["exit"], "tests": _pytest_counts(result["output"])}
    if result["exit"] == 5:  # pytest: no tests collected (a CPU run deselects every GPU test)
        entry["exit"] = 0
    return entry | {"output_tail": result["output"][-3000:]}


def _recipe_step(py: str, env: dict[str, str], limit: float, args: argparse.Namespace, out: Path, device: list[str]) -> dict:
    if not (args.real_model / "config.json").is_file():
        skipped = f"no {args.real_model / 'config.json'}: build it with scripts/smollm2_from_gguf.py"
        print(f"gpu_check: smollm2_recipe: skipped ({skipped})", flush=True)
        return {"exit": 1, "skipped": skipped}  # a check without the recipe's figures does not read ok
    start = time.perf_counter()
    real = out / "smollm2"
    prepare = [py, __file__, "--prepare-real-model", str(args.real_model), str(real), *(["--dry-run"] if args.dry_run else [])]
    prepared = _run("SmolLM2 folder", prepare, limit, env)
    if prepared["exit"]:
        return {"exit": prepared["exit"], "output_tail": prepared["output"][-3000:]}
    bf16 = [f"--training.{k}=bfloat16" for k in ("mixed_precision_param", "frozen_dtype", "rollout_dtype", "kv_cache_dtype")]
    small = ["--ppo.batch_size=2", "--ppo.minibatch_size=2", "--ppo.microbatch_size=1", "--generation.max_new_tokens=4"]
    cmd = [
        py,
        "-m",
        "fusedrl.train",
        "--job.config_file",
        "train_configs/smollm2_135m_ppo.toml",
        *(f"--model.{k}_path={real}" for k in ("actor", "critic", "tokenizer")),
        f"--data.path={real / 'arithmetic.jsonl'}",
        "--parallelism.pp=1",
        *device,
        *(small if args.dry_run else bf16),
        "--training.steps=2",  # the first iteration compiles; the second is the steady state
        "--checkpoint.interval=0",
        "--checkpoint.export_hf=false",
        "--eval.interval=0",
        f"--job.output_dir={out / 'smollm2_run'}",
    ]
    result = _run("SmolLM2 recipe, one device", cmd, limit - (time.perf_counter() - start), env)
    iterations = _iterations(out / "smollm2_run")
    code = result["exit"] or (0 if len(iterations) == 2 else 1)
    steady = iterations[1] if len(iterations) == 2 else None
    return {"exit": code, "iterations": iterations, "steady_state": steady, "output_tail": result["output"][-3000:]}


def _generation_step(py: str, env: dict[str, str], limit: float, dry_run: bool) -> dict:
    if dry_run:
        bench = ["--flavor", "debug", "--batch-sizes", "1,2", "--new-tokens", "8", "--no-compile", "--repeats", "1"]
    else:
        bench = [
            "--device",
            "cuda",
            "--flavor",
            "llama3_2_1b",
            "--dtype",
            "bfloat16",
            "--compile-scope",
            "step",
            "--compile-mode",
            "reduce-overhead",
        ]
        # no bucketed compile run: its graphs of a 1B model would not fit the step's limit
        bench += ["--batch-sizes", "1,32", "--new-tokens", "128", "--prompt-len", "128", "--repeats", "1", "--graphs-slots", "0"]
        # eager figures first; a compiled batch size starts only in the first half of the limit (CUDA graph capture
        # of a 1B model's step takes tens of seconds), so the step ends with figures rather than at its limit
        bench += ["--time-budget-s", f"{limit / 2:.0f}"]
    result = _run("bench.generation", [py, "-m", "fusedrl.bench.generation", *bench, "--json"], limit, env)
    figures = _last_json(result["output"]) or {}  # the bench prints its figures so far after each batch size
    keys = ("speedup_vs_torchtune", "modes", "roofline_fraction", "compile_overhead_s", "compiled_graphs", "compiled_skipped")
    entry = {"exit": result["exit"], "partial": figures.get("partial", not figures), **{k: figures.get(k) for k in keys}}
    return entry | {"output_tail": result["output"][-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    parser.add_argument("--real-model", type=Path, default=REAL_MODEL, help="SmolLM2 folder (weights optional)")
    parser.add_argument("--out", type=Path, default=None, help="where each step's JSON goes (default: $OUT, else a temp folder)")
    parser.add_argument("--only", action="append", choices=sorted(STEP_LIMITS_S), help="run this step only (repeatable)")
    parser.add_argument("--prepare-real-model", nargs=2, type=Path, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare_real_model:
        prepare_real_model(*args.prepare_real_model, tiny=args.dry_run)
        return 0
    py = sys.executable
    # inductor compiles with a worker per core (its default is fewer), the GPU machine's 16 included
    env = {"TORCHINDUCTOR_COMPILE_THREADS": str(os.cpu_count() or 1), **os.environ, "PYTHONUNBUFFERED": "1"}
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu_check.")))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_work."))  # checkpoints and folders stay off the folder that returns
    device = (
        ["--training.device=cpu", "--generation.compile=false"]
        if args.dry_run
        else [
            "--training.device=cuda",
            "--generation.compile=true",
            "--generation.compile_scope=step",
            "--generation.compile_mode=reduce-overhead",
        ]
    )
    steps = {
        "pytest_gpu": lambda limit: _pytest_step(py, env, limit),
        "smollm2_recipe": lambda limit: _recipe_step(py, env, limit, args, work, device),
        "generation_bench": lambda limit: _generation_step(py, env, limit, args.dry_run),
    }
    summary: dict = {"dry_run": args.dry_run, "out": str(out), "preflight": preflight(out, args.dry_run)}
    if summary["preflight"]["exit"]:
        summary["ok"] = False
        print(json.dumps(summary), flush=True)
        shutil.rmtree(work, ignore_errors=True)
        return 1
    try:
        for name, step in steps.items():
            if args.only and name not in args.only:
                continue
            limit, start = STEP_LIMITS_S[name], time.perf_counter()
            result = step(limit * (DRY_RUN_GUARD if args.dry_run else 1))
            entry = {"limit_s": limit, "seconds": round(time.perf_counter() - start, 1), **result}
            (out / f"{name}.json").write_text(json.dumps(entry, indent=1))
            summary[name] = {k: v for k, v in entry.items() if k != "output_tail"}
    finally:  # also when interrupted: what finished is reported, and the scratch folder goes
        shutil.rmtree(work, ignore_errors=True)
        ran = [name for name in steps if name in summary]
        summary["ok"] = bool(ran) and all(summary[name]["exit"] == 0 for name in ran)
        print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
