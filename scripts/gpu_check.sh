#!/usr/bin/env bash
# One-command GPU regression check (docs/gpu.md): GPU tests, the trainer on one GPU (pp = 1, bf16, compiled
# decode with CUDA graphs), and the decode benchmark against the memory-bandwidth roofline. The last stdout line
# is a JSON summary; the exit status is non-zero when any step failed.
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#   bash scripts/gpu_check.sh --dry-run  # every step on the CPU with tiny shapes (CI runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
  # A machine without network: torchtune, torchao (and what else is missing) arrive as wheels (docs/gpu.md).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fusedrl-site .whl/*.whl
  export PYTHONPATH="/tmp/fusedrl-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
