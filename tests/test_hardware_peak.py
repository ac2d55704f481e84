"""fusedrl.hardware.measure_peak and ``python -m fusedrl.bench.peak``: the figures' shape, not their speed; and
``reuse_host_memory``: freed host memory reused without page faults."""

import json
import math
import subprocess
import sys

import pytest
import torch

from fusedrl.bench import peak as peak_bench
from fusedrl.hardware import Peak, accelerator_named, measure_peak

HAND = Peak("cpu", 2, {"float32": 4e11, "bfloat16": 2e12}, 3e10)


def test_measure_peak_figures_and_threads_restored():
    before = torch.get_num_threads()
    threads = 1 if before > 1 else 2
    peak = measure_peak("cpu", threads=threads, seconds=0.0)
    assert torch.get_num_threads() == before
    assert peak.device == "cpu" and peak.threads == threads
    assert set(peak.matmul_flops_per_s) == {"float32", "bfloat16"}
    for figure in [*peak.matmul_flops_per_s.values(), peak.memory_read_bytes_per_s]:
        assert math.isfinite(figure) and figure > 0
    assert json.loads(json.dumps(peak.as_dict())) == peak.as_dict()


def test_fraction_on_hand_given_figures():
    assert HAND.fraction(1e12, torch.bfloat16) == 0.5
    assert HAND.fraction(1e11, "float32") == 0.25
    assert HAND.memory_fraction(1.5e10) == 0.5
    with pytest.raises(ValueError, match="no float16 matmul peak"):
        HAND.fraction(1e12, torch.float16)


def test_bad_arguments():
    with pytest.raises(ValueError, match="threads=0"):
        measure_peak(threads=0)
    with pytest.raises(ValueError, match="seconds=-1"):
        measure_peak(seconds=-1)


def test_cli_json_last_line(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(peak_bench, "measure_peak", lambda *args: calls.append(args) or HAND)
    assert peak_bench.main(["--device", "cpu", "--threads", "2", "--seconds", "0.5", "--json"]) == 0
    assert calls == [("cpu", 2, 0.5)]
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["matmul_flops_per_s"] == HAND.matmul_flops_per_s
    assert out["memory_read_bytes_per_s"] == 3e10 and out["bf16_fp32_ratio"] == 5.0
    assert any("TFLOP/s" in line for line in lines[:-1])


def _took_and_faults(script: str, mode: str) -> tuple[str, int]:
    """What ``script`` printed last, run in a fresh interpreter: whether reuse_host_memory took effect, page faults."""
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()[-2:]
    return took, int(faults)


_FAULTS_SCRIPT = """
import resource, sys, torch
from fusedrl.hardware import reuse_host_memory
took = reuse_host_memory() if sys.argv[1] == "reuse" else None
def faults_of_a_fresh_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 << 20)  # 64 MiB: above glibc's mmap threshold
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
# the heap grows for the first few (up to ~10 seen); later tensors reuse its faulted pages
print(took, sum([faults_of_a_fresh_tensor() for _ in range(24)][-8:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and page-fault counts are Linux's")
def test_reuse_host_memory_ends_the_page_faults_of_fresh_tensors():
    """Freed 64 MiB tensors' pages are reused by the next ones (no page faults once the heap has grown) after
    reuse_host_memory(); without it every fresh tensor faults in all of its pages (8 tensors: 8 x 16384)."""

    took, reused = _took_and_faults(_FAULTS_SCRIPT, "reuse")
    _, system = _took_and_faults(_FAULTS_SCRIPT, "system")
    # transparent huge pages (THP "always") fault a 64 MiB tensor in 32 pages of 2 MiB instead of 16384
    assert took == "True" and system >= 8 * 32 and reused * 10 < system, (took, reused, system)


_THREAD_FAULTS_SCRIPT = """
import ctypes, resource, sys, threading, torch
from fusedrl.hardware import reuse_host_memory
took = reuse_host_memory()
if sys.argv[1] == "arenas":  # glibc's default again: a thread allocates from an arena of its own
    ctypes.CDLL("libc.so.6").mallopt(-8, 64)  # M_ARENA_MAX
def held_tensors(count):
    xs = [torch.ones(4 << 20) for _ in range(count)]  # count x 16 MiB held together, then freed
    del xs
def faults(work):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
worker = threading.Thread(target=held_tensors, args=(16,))  # e.g. the fused rollout's scoring while its instance idles
worker.start()
worker.join()
print(took, faults(lambda: held_tensors(12)))  # less than the worker freed: it fits whatever the small blocks between
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and page-fault counts are Linux's")
def test_memory_a_thread_freed_is_reused_by_the_main_thread_without_page_faults():
    """After reuse_host_memory() every thread allocates from one heap: the 256 MiB a worker thread held and freed
    serve the main thread's next 192 MiB of tensors; with an arena per thread (glibc's default) the worker's arena
    keeps them and the main thread faults its pages in again."""

    took, one_heap = _took_and_faults(_THREAD_FAULTS_SCRIPT, "one_heap")
    _, arenas = _took_and_faults(_THREAD_FAULTS_SCRIPT, "arenas")
    # transparent huge pages (THP "always") fault 192 MiB in 96 pages of 2 MiB instead of 49152; with one heap, a run
    # now and then puts one of the 12 tensors in fresh pages (4105 faults in 1 of 16 runs here), never most of them
    assert took == "True" and arenas >= 96 and one_heap * 3 < arenas, (took, one_heap, arenas)


@pytest.mark.parametrize(
    ("device_name", "sheet"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("NVIDIA A10G", None),
        ("NVIDIA GH200 480GB", None),
    ],
)
def test_a_gpu_is_read_as_its_own_data_sheet(device_name, sheet):
    found = accelerator_named(device_name)
    assert (found.name if found else None) == sheet
