#!/usr/bin/env bash
# Packaging check (docs/ci.md): `python -m build` makes the sdist and, from it, the wheel; the wheel must hold every
# file of fusedrl/; each of the two installs (--no-deps) into a fresh venv that sees this interpreter's packages
# (torch, torchtune, ...; scripts/venv_seeing_packages.py, also from inside a virtual environment), and from a folder outside the repository `python -m fusedrl.config --help` runs and
# train_configs/debug_ppo.toml validates with fusedrl imported from the venv's site-packages, not from this tree.
#   bash scripts/check_package.sh     # needs the `build` package (dev extra) and network for the isolated builds
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/fusedrl-*.tar.gz)
wheel=$(ls "$work"/dist/fusedrl-*.whl)

# Every file under fusedrl/ (Python or package data) must be in the wheel.
"$python" - "$wheel" <<'EOF'
import sys, zipfile
from pathlib import Path

in_wheel = set(zipfile.ZipFile(sys.argv[1]).namelist())
in_tree = {p.as_posix() for p in Path("fusedrl").rglob("*")
           if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}
missing = sorted(in_tree - in_wheel)
if missing:
    sys.exit(f"check_package: the wheel lacks {len(missing)} file(s) of fusedrl/: {', '.join(missing[:10])}; "
             "list package data in MANIFEST.in")
print(f"check_package: wheel holds all {len(in_tree)} files of fusedrl/")
EOF

for kind in wheel sdist; do
  artifact=${!kind}
  name=$(basename "$artifact")
  venv="$work/venv-$kind"
  # a venv that sees this interpreter's packages (torch, torchtune, ...), virtual environment or not
  "$python" scripts/venv_seeing_packages.py "$venv" --with-pip --exclude "$root" > /dev/null
  "$venv/bin/python" -m pip install --quiet --no-deps "$artifact" > "$work/install.log" 2>&1 \
    || { tail -n 40 "$work/install.log"; echo "check_package: installing $name failed" >&2; exit 1; }
  (
    cd "$work"  # outside the repository: its fusedrl/ must not be importable from here
    "$venv/bin/python" - <<'EOF'
import sys, sysconfig
from pathlib import Path

import fusedrl

site = Path(sysconfig.get_paths()["purelib"]).resolve()
where = Path(fusedrl.__file__).resolve()
if site not in where.parents:
    sys.exit(f"check_package: fusedrl imported from {where}, not from the venv's {site}")
EOF
    "$venv/bin/python" -m fusedrl.config --help > "$work/help.txt"
    grep -q "usage: python -m fusedrl.config" "$work/help.txt"
    "$venv/bin/python" -m fusedrl.config --job.config_file "$root/train_configs/debug_ppo.toml" --world_size 4
  ) || { echo "check_package: $name installs but does not run" >&2; exit 1; }
  echo "check_package: $name installs and runs python -m fusedrl.config from site-packages"
done
