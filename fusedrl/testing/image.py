"""Import fusedrl as it would import on a machine that has only some Python distributions: the GPU image's packages
plus the wheels that travel with the check (``scripts/gpu_wheels.py`` finds which, ``tests/test_gpu_check.py``
checks the list). Everything else installed here is hidden behind an import blocker, so a module that the image
lacks fails to import exactly as it would there (and optional imports take their fallback).

    python fusedrl/testing/image.py --image scripts/gpu_image_packages.txt --wheels torchtune torchao ...

prints one JSON object: ``failed`` (module -> the error importing it raised), ``missing`` (the distributions whose
absence caused those errors) and ``blocked`` (every refused distribution -> its top-level modules that something
tried to import, optional imports that fell back included). Run as a file, not with ``-m``: the blocker must be in
place before anything, fusedrl included, is imported.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import pkgutil
import re
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED_FILES = ("scripts/gpu_check.py",)
"""Files imported besides every fusedrl module and every test module (pytest collects them all, GPU tests or not)."""


def normalize(distribution: str) -> str:
    """A distribution's name as pip compares names (PEP 503): ``PyYAML`` and ``pyyaml`` are one."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def read_names(path: Path) -> set[str]:
    """The distribution names of a list file: one a line (``name`` or ``name==version``), ``#`` comments and blank
    lines ignored."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(line.partition("==")[0].strip()) for line in lines if line}


def with_dependencies(names: set[str]) -> set[str]:
    """``names`` and, transitively, every installed distribution one of them requires here. The image's packages are
    consistent there at their own versions; here, newer versions of them may need more (huggingface-hub here needs
    httpx2, which the image's does not): those are allowed too, and are not wheels to carry."""
    from packaging.requirements import Requirement

    installed = {normalize(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    closure: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name in closure:
            continue
        closure.add(name)
        for line in installed[name].requires or [] if name in installed else []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                pending.append(normalize(req.name))
    return closure


class ImportBlocker(importlib.abc.MetaPathFinder):
    """Refuses top-level modules of installed distributions outside ``allowed`` and records each refusal. The
    standard library and modules owned by no distribution (this repository's) always import."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.owners = {
            module: {normalize(d) for d in dists} for module, dists in importlib.metadata.packages_distributions().items()
        }
        self.blocked: dict[str, set[str]] = {}

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        owners = self.owners.get(top, set())
        if top in sys.stdlib_module_names or not owners or owners & self.allowed:
            return None  # the normal finders take it
        for owner in owners:
            self.blocked.setdefault(owner, set()).add(top)
        error = ModuleNotFoundError(
            f"No module named {fullname!r} ({'/'.join(sorted(owners))} is not on the image)", name=fullname
        )
        error.distributions = owners  # type: ignore[attr-defined]  # read by check_imports
        raise error


class ImageSite(ImportBlocker):
    """An :class:`ImportBlocker` for whole programs run as on the image (``scripts/gpu_rehearsal.py``): a refused
    distribution imports after all from one of ``roots`` (the carried wheels' ``pip install --target`` folder), as it
    would on the image; nothing else it refuses is found anywhere."""

    def __init__(self, allowed: set[str], roots: Sequence[Path]) -> None:
        super().__init__(allowed)
        self.roots = [str(Path(r).resolve()) for r in roots]

    def _in_roots(self, location: str | None) -> bool:
        return location is not None and any(str(Path(location).resolve()).startswith(r + "/") for r in self.roots)

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        loaded = sys.modules.get(top)
        if loaded is not None and self._in_roots(getattr(loaded, "__file__", None)):
            return None  # its package came from a root: its __path__ finds its submodules there
        if fullname == top:
            spec = importlib.machinery.PathFinder.find_spec(top, self.roots)
            if spec is not None and spec.origin is not None:  # a module or a regular package in a root, not a namespace
                return spec
        return super().find_spec(fullname, path, target)


def install_image_site(image: Path, roots: Sequence[Path]) -> ImageSite:
    """Put an :class:`ImageSite` for the distributions listed in ``image`` (with their dependencies) and ``roots``
    first on ``sys.meta_path`` (a ``sitecustomize`` calls it, so that every process of a program has it)."""
    blocker = ImageSite(with_dependencies(read_names(image)) | {"fusedrl"}, roots)
    sys.meta_path.insert(0, blocker)
    return blocker


def _blocked_in(error: BaseException) -> set[str]:
    """The distributions whose refusal by an :class:`ImportBlocker` caused ``error`` (its chain searched)."""
    found: set[str] = set()
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found |= getattr(e, "distributions", set())
        pending += [e.__cause__, e.__context__]
    return found


def _module_names() -> list[str]:
    import fusedrl

    names = ["fusedrl"]
    for info in pkgutil.walk_packages(fusedrl.__path__, "fusedrl."):
        names.append(info.name)
    return names


def _import_file(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"_checked_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up
    spec.loader.exec_module(module)


def check_imports(allowed: set[str]) -> dict:
    """Import every fusedrl module, every test module and :data:`CHECKED_FILES` behind an :class:`ImportBlocker`
    (in this process: run it in a fresh one, :func:`run_check`)."""
    blocker = ImportBlocker(allowed)
    sys.meta_path.insert(0, blocker)
    failed: dict[str, str] = {}
    missing: set[str] = set()
    sys.path.insert(0, str(ROOT / "tests"))  # test modules import their conftest helpers as pytest makes them
    targets: list[tuple[str, Path | None]] = [(name, None) for name in _module_names()]
    targets += [(str(p.relative_to(ROOT)), p) for p in sorted((ROOT / "tests").glob("*.py"))]
    targets += [(name, ROOT / name) for name in CHECKED_FILES]
    for name, path in targets:
        try:
            if path is None:
                importlib.import_module(name)
            else:
                _import_file(path)
        except Exception as e:  # noqa: BLE001 - every failure is reported, with its cause
            frames = [
                f for f in traceback.extract_tb(e.__traceback__) if f.filename not in (__file__, "<frozen importlib._bootstrap>")
            ]
            where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
            failed[name] = f"{type(e).__name__}: {e}{where}".replace("\n", " ")
            missing |= _blocked_in(e)
    blocked = {d: sorted(m) for d, m in sorted(blocker.blocked.items())}
    return {"failed": failed, "missing": sorted(missing), "blocked": blocked}


def run_check(image: Path, wheels: Sequence[str], timeout_s: float = 600.0) -> dict:
    """:func:`check_imports` in a fresh Python process, allowing the distributions listed in the file ``image`` (with
    their dependencies, :func:`with_dependencies`) and the distributions ``wheels``; returns its report."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--image", str(image), "--wheels", *wheels]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"the import check exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python fusedrl/testing/image.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", type=Path, required=True, help="the file listing the image's distributions")
    parser.add_argument("--wheels", nargs="*", default=[], help="distributions that travel as wheels (name or name==version)")
    args = parser.parse_args(argv)
    allowed = with_dependencies(read_names(args.image)) | {normalize(w.partition("==")[0]) for w in args.wheels}
    allowed.add("fusedrl")  # an editable install of this repository
    print(json.dumps(check_imports(allowed)))
    return 0


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # the repository, not this file's folder
    sys.exit(main())
