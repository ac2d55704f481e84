"""Rehearse the GPU check on this machine as a lent GPU machine receives and runs it (docs/gpu.md).

    python scripts/gpu_rehearsal.py [--work DIR] [--real-model models/SmolLM2-135M-Instruct] [--no-run]

1. Builds the carried paths: ``.whl/`` (``scripts/gpu_wheels.txt``'s pins for CPython 3.12, downloaded from the
   package index when a wheel is missing) and ``models/smollm2-no-weights/`` (the SmolLM2 folder's config and
   tokenizer files: the check draws random weights of that architecture).
2. Lists what travels: tracked files, untracked files git does not ignore, and the carried paths; fails when they pass
   the device tool's 64 MiB.
3. Copies exactly that into a fresh folder, with this interpreter's wheels of the same pins in place of ``.whl/`` (the
   3.12 wheels do not install on another Python; everything else is what travels).
4. Runs ``bash scripts/gpu_check.sh --dry-run`` there in a new network namespace (``unshare -rn``: no network, the
   loopback up) with only the GPU image's distributions importable in every process (an import blocker installed by a
   ``sitecustomize``, :class:`fusedrl.testing.image.ImageSite`), so that the check must install the wheels with
   ``pip --no-index`` and import what it needs from them, as on the GPU machine.

Prints what travels and the dry run's summary, then the command to run on the GPU machine; exits non-zero when
anything failed. Needs ``git``, ``unshare`` and ``ip`` (util-linux, iproute2) and user namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_wheels import GPU_PYTHON, download, read_pins  # noqa: E402 - after the path above

from fusedrl.testing.image import normalize  # noqa: E402

LIMIT_BYTES = 64 * 2**20
"""What travels to a lent GPU machine with the working tree: 64 MiB in all (the device tool's README)."""
WHEELS = Path(".whl")
MODEL = Path("models/smollm2-no-weights")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
IMAGE = Path("scripts/gpu_image_packages.txt")
CHECK_LIMIT_S = 540
"""The limit to give the check's command on the GPU machine: its steps' 480 s, the preflight and the install."""


def carried_wheels(pins: list[str]) -> None:
    """``.whl/`` holds a 3.12 wheel of every pin (downloaded when missing) and nothing else."""
    folder = ROOT / WHEELS
    wanted = {normalize(p.split("==")[0]): p.split("==")[1] for p in pins}
    have = {normalize(w.name.split("-")[0]): w for w in folder.glob("*.whl")} if folder.is_dir() else {}
    stale = [w.name for name, w in have.items() if wanted.get(name) != w.name.split("-")[1]]
    if stale:
        raise SystemExit(f"error: {WHEELS}/ holds wheels scripts/gpu_wheels.txt does not pin: {', '.join(stale)}; remove them")
    missing = [p for p in pins if normalize(p.split("==")[0]) not in have]
    if missing:
        print(f"rehearsal: downloading {', '.join(missing)} for CPython {GPU_PYTHON} into {WHEELS}/", flush=True)
        download(missing, folder, GPU_PYTHON)


def carried_model(real_model: Path) -> None:
    """``models/smollm2-no-weights/``: the config and tokenizer files of ``real_model``."""
    missing = [f for f in MODEL_FILES if not (real_model / f).is_file()]
    if missing:
        raise SystemExit(
            f"error: {real_model} lacks {', '.join(missing)}; build it with python scripts/smollm2_from_gguf.py "
            f"--out {real_model} (README) or pass --real-model"
        )
    (ROOT / MODEL).mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy2(real_model / name, ROOT / MODEL / name)


def travelling_files() -> list[Path]:
    """The working tree as the device tool sends it (tracked, and untracked files git does not ignore) plus the
    carried paths, relative to the repository."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    listed = os.fsdecode(out)
    tree = [Path(p) for p in listed.split("\0") if p and (ROOT / p).is_file()]
    carried = [p.relative_to(ROOT) for folder in (WHEELS, MODEL) for p in sorted((ROOT / folder).rglob("*")) if p.is_file()]
    return tree + carried


def size_report(files: list[Path]) -> int:
    sizes = {"working tree": 0, str(WHEELS): 0, str(MODEL): 0}
    for f in files:
        key = next((str(c) for c in (WHEELS, MODEL) if f.is_relative_to(c)), "working tree")
        sizes[key] += (ROOT / f).stat().st_size
    total = sum(sizes.values())
    parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
    print(f"rehearsal: {len(files)} files travel, {total / 2**20:.1f} MiB of {LIMIT_BYTES / 2**20:.0f} ({parts})", flush=True)
    return total


def copy_tree(files: list[Path], dst: Path, pins: list[str]) -> None:
    for f in files:
        if f.is_relative_to(WHEELS):
            continue
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(f"rehearsal: the same pins for CPython {here} (this interpreter) in the copy's {WHEELS}/", flush=True)
    download(pins, dst / WHEELS, here)


def image_site(folder: Path, tree: Path, roots: list[Path]) -> Path:
    """A folder whose ``sitecustomize`` hides every distribution the GPU image lacks unless it comes from ``roots``
    (put the folder first on PYTHONPATH); it then runs the ``sitecustomize`` it shadows, if the interpreter has one."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "# written by scripts/gpu_rehearsal.py: this process sees the GPU image's distributions only\n"
        "import importlib.machinery\n"
        "import importlib.util\n"
        "import sys\n"
        "from pathlib import Path\n\n"
        f"_spec = importlib.util.spec_from_file_location('_fusedrl_image', {str(tree / 'fusedrl/testing/image.py')!r})\n"
        "_image = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_image)\n"
        f"_image.install_image_site(Path({str(tree / IMAGE)!r}), [Path(r) for r in {[str(r) for r in roots]!r}])\n"
        f"_next = importlib.machinery.PathFinder.find_spec('sitecustomize', [p for p in sys.path if p != {str(folder)!r}])\n"
        "if _next is not None and _next.loader is not None:\n"
        "    _next.loader.exec_module(importlib.util.module_from_spec(_next))\n"
    )
    return folder


def dry_run(tree: Path, work: Path) -> int:
    """The check's dry run in ``tree``, offline and with the image's distributions only; its exit status."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(
        PYTHONPATH=str(image_site(work / "image", tree, [work / "site"])),
        PYTHON=sys.executable,
        FUSEDRL_SITE=str(work / "site"),
        PIP_NO_INDEX="1",
    )
    check = ["bash", "scripts/gpu_check.sh", "--dry-run", "--real-model", str(MODEL), "--out", str(work / "out")]
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *check]
    print(f"rehearsal: {' '.join(check)} in {tree}, offline, the image's distributions only", flush=True)
    return subprocess.run(cmd, cwd=tree, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_rehearsal.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work", type=Path, default=None, help="where the copy goes, kept (default: a temporary folder, removed if all passed)"
    )
    parser.add_argument("--real-model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--no-run", action="store_true", help="build, measure and copy only; no dry run")
    args = parser.parse_args(argv)
    for tool in ("git", "unshare", "ip"):
        if shutil.which(tool) is None:
            raise SystemExit(f"error: the rehearsal needs {tool} on PATH (git, util-linux, iproute2)")
    pins = read_pins()
    carried_wheels(pins)
    carried_model(args.real_model)
    files = travelling_files()
    if size_report(files) > LIMIT_BYTES:
        raise SystemExit(f"error: what travels passes {LIMIT_BYTES / 2**20:.0f} MiB; carry less (docs/gpu.md)")
    work = Path(tempfile.mkdtemp(prefix="fusedrl-rehearsal-")) if args.work is None else args.work.resolve()
    if work.is_relative_to(ROOT):
        raise SystemExit(f"error: --work {work} is inside the repository, whose files it copies; give a folder outside it")
    tree, status = work / "tree", 1
    try:
        if tree.exists():
            shutil.rmtree(tree)
        copy_tree(files, tree, pins)
        status = 0 if args.no_run else dry_run(tree, work)
    finally:
        if args.work is None and status == 0 and not args.no_run:
            shutil.rmtree(work)
        else:
            print(f"rehearsal: the copy, the installed wheels and the check's files are in {work}", flush=True)
    carry = json.dumps([str(WHEELS), str(MODEL)])
    print(
        f"rehearsal: {'passed' if status == 0 else f'FAILED (exit status {status})'}; on the GPU machine, carrying "
        f"{carry}, with a limit of {CHECK_LIMIT_S} s: bash scripts/gpu_check.sh --real-model {MODEL}",
        flush=True,
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
