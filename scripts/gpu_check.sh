#!/usr/bin/env bash
# One-command GPU regression check (docs/gpu.md), 8 minutes at most: GPU tests, one PPO iteration of the SmolLM2
# recipe on one GPU (pp = 1, bf16, compiled decode with CUDA graphs), and the decode benchmark against the
# memory-bandwidth roofline. Each step's JSON goes to $OUT (or --out); the last stdout line is a JSON summary; the
# exit status is non-zero when any step failed.
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#   bash scripts/gpu_check.sh --dry-run  # every step on the CPU with tiny shapes (CI runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null && ! "$PY" -c "import torchtune" 2> /dev/null; then
  # A machine without network: what the image lacks arrives as wheels (scripts/gpu_wheels.py, docs/gpu.md).
  SITE="${FUSEDRL_SITE:-/tmp/fusedrl-site}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import sys; from importlib.metadata import entry_points as e; sys.exit(not e(group='fusedrl.config_checks'))"; then
  # A checkout that is not pip-installed (the GPU image): the trainer finds its startup checks through fusedrl's
  # entry points (docs/config.md), so record pyproject.toml's in a metadata folder on the path, as an install would.
  "$PY" - /tmp/fusedrl-meta <<'EOF'
import sys, tomllib
from pathlib import Path

project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"fusedrl-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fusedrl\nVersion: {project['version']}\n")
groups = project["entry-points"].items()
(info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for g, eps in groups))
EOF
  export PYTHONPATH="$PYTHONPATH:/tmp/fusedrl-meta"
fi
exec "$PY" scripts/gpu_check.py "$@"
