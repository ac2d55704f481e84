"""Create a virtual environment that sees the packages of the interpreter running this script, for checks that install
one package into a fresh environment (scripts/check_package.sh, .ci/run; docs/ci.md).

``python -m venv --system-site-packages`` is not that: run from inside a virtual environment it sees the base
interpreter's packages, not the environment's (torch installed in the environment would be missing). This writes the
running interpreter's import path (its ``sys.path``, .pth entries included, less the standard library, the script's
folder and the ``--exclude`` folders) into a ``.pth`` file of the new environment: its own site-packages come first,
so what is installed there wins, and the parent's editable installs (import hooks) do not carry over.

    python scripts/venv_seeing_packages.py DIR [--with-pip] [--exclude FOLDER ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the new environment's folder (must not exist)")
    parser.add_argument("--with-pip", action="store_true", help="install pip into it (ensurepip: no network)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="a folder to leave out (repeatable)")
    args = parser.parse_args()
    if args.dir.exists():
        sys.exit(f"venv_seeing_packages: {args.dir} exists; give a new folder")
    venv.EnvBuilder(with_pip=args.with_pip).create(args.dir)
    python = args.dir / "bin" / "python"
    purelib = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True)
    # the standard library is the new interpreter's own (pip's isolated builds drop repeated entries of it altogether)
    stdlib = subprocess.check_output([python, "-I", "-S", "-c", "import sys; print(*sys.path, sep=chr(10))"], text=True)
    left_out = {Path(sys.path[0]).resolve(), *(p.resolve() for p in args.exclude)}
    left_out |= {Path(p).resolve() for p in stdlib.splitlines() if p}
    paths = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() not in left_out]
    (Path(purelib.strip()) / "_parent_packages.pth").write_text("".join(f"{p}\n" for p in paths))
    print(f"venv_seeing_packages: {args.dir} sees {len(paths)} folders of {sys.executable}'s import path")


if __name__ == "__main__":
    main()
