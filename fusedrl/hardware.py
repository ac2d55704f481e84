"""Accelerator data-sheet figures and the utilisations the roofline estimates assume, one definition each: the
rollout simulator's costs (``RolloutCosts.for_models``) and the paper-scale benchmarks read them here; and the
limits of the machine at hand, measured (``measure_peak``), that a benchmark states its achieved figures against."""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch


@dataclass(frozen=True)
class Accelerator:
    """One GPU: HBM bandwidth and size, dense bf16 FLOP/s, and the bytes/s it gets on the network between nodes
    (half of one NIC per GPU: two GPUs share each NIC)."""

    name: str
    hbm_bytes_per_s: float
    flops_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float


# Vendor data sheets; the link is half of one 400 Gb/s (H100, H200) or 200 Gb/s (A100) NIC per GPU.
H100_SXM = Accelerator("H100 SXM", 3.35e12, 989e12, 80e9, 25e9)
H200_SXM = Accelerator("H200 SXM", 4.8e12, 989e12, 141e9, 25e9)
A100_SXM_80GB = Accelerator("A100 SXM 80GB", 2.039e12, 312e12, 80e9, 12.5e9)
H100_PCIE = Accelerator("H100 PCIe", 2.0e12, 756e12, 80e9, 25e9)
H100_NVL = Accelerator("H100 NVL", 3.9e12, 835e12, 94e9, 25e9)


def accelerator_named(device_name: str) -> Accelerator | None:
    """The data sheet of a GPU from its CUDA device name (``torch.cuda.get_device_name()``: "NVIDIA H100 80GB HBM3" is
    the SXM part, "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"); None for others (a GH200 among them)."""
    name = device_name.upper()
    if "GH200" in name:  # Grace Hopper: another HBM size and bandwidth per part; measure it
        return None
    if "H200" in name:
        return H200_SXM
    if "H100" in name:
        return H100_PCIE if "PCIE" in name else H100_NVL if "NVL" in name else H100_SXM
    if "A100" in name and "SXM" in name and "80GB" in name:
        return A100_SXM_80GB
    return None


MFU = 0.4  # share of peak FLOP/s that compute-bound work (prefill, scoring, training) reaches
DECODE_BW_UTIL = 0.6  # share of HBM bandwidth that memory-bound work (decode steps, the optimizer step) reaches


@dataclass(frozen=True)
class Peak:
    """A device's measured limits: the best matmul FLOP/s per dtype (keys ``"float32"``, and ``"bfloat16"`` where the
    device runs it) and the best memory read bytes/s, on ``threads`` host threads."""

    device: str
    threads: int
    matmul_flops_per_s: dict[str, float]
    memory_read_bytes_per_s: float

    def fraction(self, flops_per_s: float, dtype: torch.dtype | str) -> float:
        """``flops_per_s`` achieved in ``dtype`` (``torch.bfloat16`` or ``"bfloat16"``) as a share of its peak."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.matmul_flops_per_s:
            raise ValueError(
                f"no {name} matmul peak was measured on {self.device} (measured: {', '.join(self.matmul_flops_per_s)}); "
                "state the figure against one of those dtypes"
            )
        return flops_per_s / self.matmul_flops_per_s[name]

    def memory_fraction(self, bytes_per_s: float) -> float:
        """``bytes_per_s`` read as a share of the peak memory read bandwidth."""
        return bytes_per_s / self.memory_read_bytes_per_s

    def as_dict(self) -> dict[str, object]:
        """The figures as plain JSON-serialisable values."""
        return asdict(self)


def measure_peak(device: torch.device | str = "cpu", threads: int | None = None, seconds: float = 2.0) -> Peak:
    """Time ``device``'s matmul throughput (shapes of LLM linears, float32 and bfloat16; each shape through
    ``torch.matmul`` and through ``F.linear``, whose kernels differ: the best of all, so that no pass of a model through
    either runs above it) and memory read bandwidth (the sum of a tensor far larger than any cache), best of repeats
    after a warm-up each, on ``threads`` host threads
    (the current count when None; restored afterwards). ``seconds`` is the time the repeats share: each measurement
    runs a warm-up and at least two timed repeats, more while its share lasts; warm-ups and filling the tensors add
    1-2 s on a 2-core CPU. CUDA matmuls run under the current precision settings (TF32 off by default)."""
    device = torch.device(device)
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads}: give at least 1, or None for the current count")
    if seconds < 0:
        raise ValueError(f"seconds={seconds}: give a time budget of 0 or more")
    dtypes = [torch.float32]
    if device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False):
        dtypes.append(torch.bfloat16)
    on_host = device.type == "cpu"
    # (m, k, n): a square projection, a small model's MLP up- and down-projection over a token batch
    shapes = (
        ((2048, 2048, 2048), (4096, 576, 1536), (4096, 1536, 576))
        if on_host
        else ((8192, 8192, 8192), (16384, 4096, 14336), (16384, 14336, 4096))
    )
    budget = seconds / (2 * len(dtypes) * len(shapes) + 1)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        flops: dict[str, float] = {}
        for dtype in dtypes:
            for m, k, n in shapes:
                a = torch.randn(m, k, dtype=dtype, device=device)
                b = torch.randn(k, n, dtype=dtype, device=device)
                weight = b.t().contiguous()  # [out, in], as F.linear takes it
                out = torch.empty(m, n, dtype=dtype, device=device)
                for run in (partial(torch.matmul, a, b, out=out), partial(torch.nn.functional.linear, a, weight)):
                    rate = 2 * m * k * n / _best_seconds(run, device, budget)
                    name = str(dtype).removeprefix("torch.")
                    flops[name] = max(flops.get(name, 0.0), rate)
        x = torch.ones((256 if on_host else 4096) * 2**20 // 4, device=device)
        read = x.nbytes / _best_seconds(x.sum, device, budget)
        return Peak(str(device), torch.get_num_threads(), flops, read)
    finally:
        torch.set_num_threads(previous)


def _best_seconds(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """The shortest of timed calls of ``fn`` after a warm-up call: at least two, more while ``budget_s`` lasts."""

    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        return time.perf_counter() - start

    timed()
    best, start, repeats = math.inf, time.perf_counter(), 0
    while repeats < 2 or time.perf_counter() - start < budget_s:
        best = min(best, timed())
        repeats += 1
    return best


PEAK_METHOD = "matmul+linear, 3 shapes"  # part of the cache key: a change of measure_peak measures again


def cached_peak(device: torch.device | str = "cpu", threads: int | None = None, cache_dir: str | Path | None = None) -> Peak:
    """:func:`measure_peak` once per device model, thread count and torch version, kept in ``cache_dir`` (default
    ``$FUSEDRL_CACHE_DIR`` or ``~/.cache/fusedrl``) as ``peak.json``, so that a job's startup does not measure again.
    Processes that find no entry at the same time each measure and write theirs (the file is replaced atomically).
    ``python -m fusedrl.bench.peak`` always measures afresh."""
    device = torch.device(device)
    threads = threads or torch.get_num_threads()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    key = f"{device.type}|{name}|{threads} threads|torch {torch.__version__}|{PEAK_METHOD}"
    folder = Path(cache_dir or os.environ.get("FUSEDRL_CACHE_DIR") or Path.home() / ".cache" / "fusedrl")
    path = folder / "peak.json"
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    if key in entries:
        return Peak(**entries[key])
    peak = measure_peak(device, threads)
    entries[key] = peak.as_dict()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
            json.dump(entries, f, indent=1)
        os.replace(f.name, path)
    except OSError:  # a read-only home: measured each time
        pass
    return peak


def _cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo) and core count."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.machine()
    return f"{model}, {os.cpu_count()} cores"


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8  # glibc's mallopt parameters (malloc.h)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc's allocator functions, or None where the C library is another (macOS, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    if hasattr(libc, "mallinfo2"):  # glibc 2.33+
        libc.mallinfo2.restype = _MallInfo2
    return libc


def share_one_heap() -> bool:
    """Make every thread allocate from the process's main heap (glibc's ``M_ARENA_MAX`` = 1) instead of an arena of
    its own. With :func:`reuse_host_memory`'s settings the main heap keeps freed memory for reuse, while another
    arena hands blocks larger than its 64 MiB heaps to ``mmap`` and back: the fused rollout's scoring thread
    faulted ~36 thousand pages in again at every rollout (SmolLM2 GRPO recipe, iteration 2: 0.4 s of system time,
    its scoring 1.4x the main thread's). Takes full effect before the process starts threads (``fusedrl.train`` calls
    it, with ``training.reuse_host_memory`` on, before gloo starts its threads); later, a thread that holds an arena
    keeps it. Returns whether it took effect (False off glibc)."""
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, 1) == 1


def reuse_host_memory() -> bool:
    """Make the C allocator keep freed memory for reuse instead of returning it to the system (glibc's ``mallopt``:
    no ``mmap``-ed blocks, no trimming of the heap; threads started from now on share the main heap,
    :func:`share_one_heap`). Each CPU tensor of an iteration (activations, gradients, logits chunks) is otherwise a
    fresh ``mmap`` whose every page faults on first touch: measured on SmolLM2-135M's GRPO update, ~450 thousand
    page faults and ~1.5 s of system time per iteration, none after this. The process's resident memory then stays
    at its peak. Returns whether it took effect (False off glibc, e.g. macOS)."""
    libc = _glibc()
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20))
    return libc is not None and all(libc.mallopt(param, value) == 1 for param, value in settings) and share_one_heap()


def host_heap_bytes() -> tuple[int, int] | None:
    """The C allocator's bytes (glibc's ``mallinfo2``, every arena): (in use, free but held by the process). Tells a
    leak (in use rising) from memory kept for reuse or lost to fragmentation (free rising). None off glibc 2.33+."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def release_host_memory() -> bool:
    """Give the C allocator's free memory back to the system (glibc's ``malloc_trim``); the settings of
    :func:`reuse_host_memory` stay. For a process that lives on, idle, after its work (a test session's pooled ranks).
    Returns whether any memory was released (False off glibc)."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1
