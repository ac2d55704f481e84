"""scripts/gpu_check.sh --dry-run: every step of the GPU check on the CPU with tiny shapes, and its summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_and_summarizes_every_step():
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["dry_run"]
    assert summary["pytest_gpu"]["tests"].get("failed", 0) == 0
    assert len(summary["trainer"]["iterations"]) == 3 and all(r["samples_per_s"] > 0 for r in summary["trainer"]["iterations"])
    assert set(summary["generation_bench"]["modes"]) == {"torchtune", "eager"}
    assert set(summary["generation_bench"]["speedup_vs_torchtune"]) == {"1", "2"}
    recipe = summary["smollm2_recipe"]  # skipped without the SmolLM2 folder (.ci/run builds it)
    if (ROOT / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file():
        assert len(recipe["iterations"]) == 3 and all(r["samples_per_s"] > 0 for r in recipe["iterations"])
    else:
        assert "scripts/smollm2_from_gguf.py" in recipe["skipped"]
