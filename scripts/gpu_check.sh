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
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fusedrl-site .whl/*.whl
  export PYTHONPATH="/tmp/fusedrl-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check.py "$@"
