"""Gather the wheels the GPU check needs beyond the GPU image's packages (docs/gpu.md), from an import test.

    python scripts/gpu_wheels.py [--out .whl] [--no-download]

1. Runs the import check (``fusedrl/testing/image.py``: every fusedrl module, every test module and the check
   itself, with only the image's distributions of ``scripts/gpu_image_packages.txt`` importable) and adds each
   distribution whose absence made an import fail, until every import passes.
2. Writes them to ``scripts/gpu_wheels.txt``, one ``name==version`` a line (the version installed here).
3. Downloads each for CPython 3.12 on manylinux x86_64 into ``--out`` (a wheel built here from the source
   distribution where the index has none), ready to carry: ``bash scripts/gpu_check.sh`` installs ``.whl/*.whl``.

Run it on a machine with the project's dependencies installed (``pip install -e ".[dev]"``) and a package index.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fusedrl.testing.image import normalize, run_check  # noqa: E402 - after the path above

IMAGE = ROOT / "scripts" / "gpu_image_packages.txt"
WHEELS = ROOT / "scripts" / "gpu_wheels.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def needed_distributions(max_rounds: int = 20) -> list[str]:
    """The distributions beyond the image that the import check needs, found one round of failures at a time."""
    wheels: set[str] = set()
    for round_ in range(1, max_rounds + 1):
        report = run_check(IMAGE, sorted(wheels))
        if not report["failed"]:
            return sorted(wheels)
        if not report["missing"]:
            name, error = next(iter(report["failed"].items()))
            raise SystemExit(f"error: importing {name} fails for another reason than a missing distribution: {error}")
        print(f"round {round_}: {len(report['failed'])} imports fail for want of {', '.join(report['missing'])}", flush=True)
        wheels |= set(report["missing"])
    raise SystemExit(f"error: the import check still fails after {max_rounds} rounds")


GPU_PYTHON = "3.12"
"""The GPU image's Python (docs/gpu.md)."""


def read_pins(path: Path = WHEELS) -> list[str]:
    """The ``name==version`` lines of a wheel list (``scripts/gpu_wheels.txt``)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def download(pins: list[str], out: Path, python_version: str = GPU_PYTHON) -> None:
    """Wheels of ``pins`` for CPython ``python_version`` on manylinux x86_64 into ``out`` (a wheel built here from
    the source distribution where the index has none: pure-Python packages, which fit any version)."""
    out.mkdir(parents=True, exist_ok=True)
    for pin in pins:
        platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
        binary = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        binary += ["--python-version", python_version, "--implementation", "cp", *platform_args]
        if subprocess.run([*binary, "-d", str(out), pin]).returncode == 0:
            continue
        print(f"{pin}: no wheel on the index for CPython {python_version}; building one from its source distribution", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), pin], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_wheels.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".whl", help="where the wheels go")
    parser.add_argument("--no-download", action="store_true", help="only find the distributions and write the list")
    args = parser.parse_args(argv)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in needed_distributions()]
    WHEELS.write_text(
        "# Distributions the GPU check needs beyond scripts/gpu_image_packages.txt, found by scripts/gpu_wheels.py\n"
        + "".join(f"{pin}\n" for pin in pins)
    )
    print(f"{WHEELS.relative_to(ROOT)}: {', '.join(pins)}", flush=True)
    if not args.no_download:
        download(pins, args.out)
        wheels = sorted(args.out.glob("*.whl"))
        missing = [p for p in pins if not any(normalize(w.name.split("-")[0]) == normalize(p.split("==")[0]) for w in wheels)]
        if missing:
            raise SystemExit(f"error: no wheel in {args.out} for {', '.join(missing)}")
        size = sum(w.stat().st_size for w in wheels) / 2**20
        print(f"{args.out}: {len(wheels)} wheels, {size:.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
