"""scripts/gpu_check.sh --dry-run: every step of the GPU check on the CPU with tiny shapes, its per-step files and
its summary; and the library and the check import on the GPU image with only the wheels scripts/gpu_wheels.txt
lists."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from fusedrl.testing.image import read_names, run_check

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"pytest_gpu", "smollm2_recipe", "generation_bench"}


def _dry_run(out: Path, *args: str) -> tuple[int, str, str]:
    """``gpu_check.sh --dry-run``: its exit status, stdout and stderr."""
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2100,  # a hang guard past the dry run's own (4x the 480 s of step limits)
        env={**os.environ, "PYTHON": sys.executable},
    )
    return proc.returncode, proc.stdout, proc.stderr


def _summary(run: Future, ok: bool = True) -> dict:
    returncode, stdout, stderr = run.result()
    assert (returncode == 0) == ok, stdout[-3000:] + stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


IMAGE = ROOT / "scripts" / "gpu_image_packages.txt"
WHEELS = sorted(read_names(ROOT / "scripts" / "gpu_wheels.txt"))


@pytest.fixture(scope="module")
def started(request, tmp_path_factory) -> Iterator[dict[str, tuple[Path | None, Future]]]:
    """The module's long commands that the selected tests need, started together at the module's first test: two dry
    runs of the check and two import checks, each a process on one core, so they run side by side."""
    selected = {item.originalname for item in request.session.items}
    dry_runs = {
        "whole": (test_gpu_check_dry_run_passes_within_8_minutes_of_limits_and_writes_each_step, ()),
        "only": (test_gpu_check_only_runs_the_named_step, ("--only", "generation_bench")),
    }
    image_checks = {"image": WHEELS, "image_without_torchtune": [w for w in WHEELS if w != "torchtune"]}
    with ThreadPoolExecutor(len(dry_runs) + len(image_checks)) as pool:
        runs: dict[str, tuple[Path | None, Future]] = {}
        for name, (test, args) in dry_runs.items():
            if test.__name__ in selected:
                out = tmp_path_factory.mktemp(name)
                runs[name] = (out, pool.submit(_dry_run, out, *args))
        if test_library_and_check_import_with_only_the_gpu_image_and_the_listed_wheels.__name__ in selected:
            for name, wheels in image_checks.items():
                runs[name] = (None, pool.submit(run_check, IMAGE, wheels))
        yield runs


@pytest.mark.slow
@pytest.mark.timeout(2400)  # past _dry_run's own 2100 s, so that its TimeoutExpired names the command
def test_gpu_check_dry_run_passes_within_8_minutes_of_limits_and_writes_each_step(started):
    out, run = started["whole"]
    real_model = (ROOT / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file()  # .ci/run builds it
    summary = _summary(run, ok=real_model)  # a skipped step fails the check
    assert summary["ok"] == real_model and summary["dry_run"] and STEPS <= set(summary)
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight == summary["preflight"] and preflight["exit"] == 0 and preflight["versions"]["torch"]
    assert sum(summary[name]["limit_s"] for name in STEPS) <= 8 * 60
    for name in STEPS:  # each step's file, written as it ended, holds the summary's entry and the output's tail
        written = json.loads((out / f"{name}.json").read_text())
        assert {k: v for k, v in written.items() if k != "output_tail"} == summary[name]
    assert summary["pytest_gpu"]["tests"].get("failed", 0) == 0
    assert set(summary["generation_bench"]["modes"]) == {"torchtune", "eager"}
    assert set(summary["generation_bench"]["speedup_vs_torchtune"]) == {"1", "2"}
    recipe = summary["smollm2_recipe"]
    if real_model:
        assert len(recipe["iterations"]) == 2 and recipe["steady_state"] == recipe["iterations"][1]
        assert all(it["samples_per_s"] > 0 for it in recipe["iterations"])
    else:
        assert "scripts/smollm2_from_gguf.py" in recipe["skipped"] and recipe["exit"] != 0


@pytest.mark.timeout(2400)
def test_gpu_check_only_runs_the_named_step(started):
    out, run = started["only"]
    summary = _summary(run)
    assert summary["ok"] and set(summary) & STEPS == {"generation_bench"}
    assert sorted(p.name for p in out.iterdir()) == ["generation_bench.json", "preflight.json"]
    # the bench printed its figures after each batch size (what a step killed at its limit keeps), then all of them
    entry = json.loads((out / "generation_bench.json").read_text())
    partial = [
        json.loads(line) for line in entry["output_tail"].splitlines() if line.startswith('{"') and '"partial": true' in line
    ]
    assert [sorted(p["modes"]["eager"]) for p in partial] == [["1"], ["1", "2"]] and entry["partial"] is False


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_refuses_to_start_without_the_carried_wheels_or_with_wheels_for_another_python(tmp_path, monkeypatch, capsys):
    check = _gpu_check_module()
    listed = tmp_path / "gpu_wheels.txt"
    listed.write_text("# comment\nno-such-distribution-here==1.0\npytest==0\n")
    carried = tmp_path / "whl"
    carried.mkdir()
    other = f"py3{sys.version_info.minor - 1}"
    for name in (f"multiprocess-0.70.19-{other}-none-any.whl", "dill-0.4.1-py3-none-any.whl"):
        (carried / name).touch()
    monkeypatch.setattr(check, "WHEELS_LIST", listed)
    monkeypatch.setattr(check, "CARRIED_WHEELS", carried)
    out = tmp_path / "out"
    assert check.main(["--out", str(out)]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["preflight.json"]  # no step ran
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    error = summary["preflight"]["error"]
    assert not summary["ok"] and "no-such-distribution-here not installed" in error and "pytest" not in error.split(":")[0]
    assert f"multiprocess-0.70.19-{other}-none-any.whl" in error and "dill" not in error
    assert summary["preflight"]["versions"]["torch"] == importlib.metadata.version("torch")
    # a dry run (this interpreter's packages) lists the GPU machine's wheels and refuses only what is missing
    listed.write_text("pytest==0\n")
    dry = check.preflight(tmp_path, dry_run=True)
    assert dry["exit"] == 0 and list(dry["wheels_for_another_python"]) == [f"multiprocess-0.70.19-{other}-none-any.whl"]
    listed.write_text("no-such-distribution-here==1.0\n")
    assert check.preflight(tmp_path, dry_run=True)["exit"] == 1


@pytest.mark.slow
def test_library_and_check_import_with_only_the_gpu_image_and_the_listed_wheels(started):
    """Every fusedrl module, test module and the check itself import when only the GPU image's distributions (and,
    for the image packages' newer versions here, their dependencies) and scripts/gpu_wheels.txt's are importable."""
    report, without = started["image"][1].result(), started["image_without_torchtune"][1].result()
    assert report["failed"] == {} and report["missing"] == [], report
    assert "torchtune" in WHEELS and "torch" not in WHEELS  # what the image lacks, and not what it has
    assert without["missing"] == ["torchtune"] and "fusedrl.train" in without["failed"]  # the check can fail


def test_the_rehearsal_s_image_site_hides_what_the_image_lacks_unless_it_comes_from_the_wheels_root(tmp_path):
    """scripts/gpu_rehearsal.py runs the check with :class:`~fusedrl.testing.image.ImageSite` in every process (a
    ``sitecustomize``): torchtune, installed here but not on the GPU image, does not import, nor from another folder
    on the path; installed into the root the blocker names (the carried wheels' install target), it does."""
    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_rehearsal import image_site
    finally:
        sys.path[:] = saved  # the module puts scripts/ on the path too
    outside = tmp_path / "carried"
    site = image_site(tmp_path / "image", ROOT, [outside])
    elsewhere = tmp_path / "elsewhere"  # not a root: a package there is refused as the installed one is
    (elsewhere / "torchtune").mkdir(parents=True)
    (elsewhere / "torchtune" / "__init__.py").write_text("")
    probe = (
        "import importlib\n"
        "for name in ('torch', 'torchtune', 'torchtune.models'):\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        f"        print(name, 'carried' if module.__file__.startswith({str(outside)!r}) else 'installed')\n"
        "    except ModuleNotFoundError as e:\n"
        "        print(name, 'refused:', e)\n"
    )

    def run(*path: Path) -> list[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip().splitlines()

    refused = "torchtune refused: No module named 'torchtune' (torchtune is not on the image)"
    hidden = run(site)
    assert hidden[0] == "torch installed" and hidden[1] == refused, hidden  # torch is on the image
    assert run(site, elsewhere)[1] == refused
    (outside / "torchtune").mkdir(parents=True)  # the wheels installed into the root
    (outside / "torchtune" / "__init__.py").write_text("")
    (outside / "torchtune" / "models.py").write_text("")
    assert run(site) == ["torch installed", "torchtune carried", "torchtune.models carried"]
    empty = tmp_path / "carried" / "torchtune"  # a root holding a folder without __init__.py: no package, refused
    (empty / "__init__.py").unlink()
    assert run(site)[1] == refused
