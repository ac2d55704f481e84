"""Per-step metrics: phase timers, length percentiles, peak memory, and a logger writing a stdout
line, a JSONL file and (when installed) TensorBoard, on rank 0 only. Also the one Chrome/Perfetto trace
writer every trace producer uses (load the JSON in chrome://tracing or ui.perfetto.dev), the one Gantt
chart of such a trace, and the logging set-up of a run (rank 0 speaks; other ranks only warn)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from fusedrl.config import MetricsSection
from fusedrl.hardware import host_heap_bytes

log = logging.getLogger(__name__)


class _RankZero(logging.Filter):
    """Passes every record on rank 0 and only warnings and errors on other ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def init_logging(rank: int | None = None) -> None:
    """Log fusedrl's progress to stdout as ``fusedrl: message`` on rank 0 (``$RANK`` when not given); other
    ranks print only warnings and errors, prefixed with their rank. Idempotent."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    root = logging.getLogger("fusedrl")
    for handler in list(root.handlers):
        if getattr(handler, "_fusedrl", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler._fusedrl = True  # type: ignore[attr-defined]
    prefix = "fusedrl" if rank == 0 else f"fusedrl [rank {rank}]"
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    handler.addFilter(_RankZero(rank))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


class ChromeTrace:
    """A list of Chrome trace events; ``save`` writes ``{"traceEvents": [...]}``.

    Times are in seconds (converted to the format's microseconds); ``pid`` groups rows (e.g. a rank),
    ``tid`` is a row within it (e.g. a phase or a model).
    """

    def __init__(self) -> None:
        self.events: list[dict] = []

    def complete(
        self, name: str, start_s: float, dur_s: float, pid: int | str = 0, tid: int | str = 0, cat: str = "", **args
    ) -> None:
        """A span (``ph: X``); ``cat`` is its category (what :func:`save_gantt_png` colours it by)."""
        ev = {"name": name, "ph": "X", "ts": start_s * 1e6, "dur": max(dur_s, 0.0) * 1e6, "pid": pid, "tid": tid}
        if cat:
            ev["cat"] = cat
        if args:
            ev["args"] = args
        self.events.append(ev)

    def instant(self, name: str, ts_s: float, pid: int | str = 0, tid: int | str = 0, **args) -> None:
        """A point in time (``ph: i``), e.g. a migration decision."""
        ev = {"name": name, "ph": "i", "s": "t", "ts": ts_s * 1e6, "pid": pid, "tid": tid}
        if args:
            ev["args"] = args
        self.events.append(ev)

    def counter(self, name: str, ts_s: float, values: Mapping[str, float], pid: int | str = 0) -> None:
        """A counter sample (``ph: C``), e.g. the number of unfinished requests."""
        self.events.append({"name": name, "ph": "C", "ts": ts_s * 1e6, "pid": pid, "args": dict(values)})

    def name_process(self, pid: int | str, name: str) -> None:
        self.events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})

    def name_thread(self, pid: int | str, tid: int | str, name: str) -> None:
        self.events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})

    def extend(self, other: ChromeTrace | Sequence[dict]) -> None:
        """Append another trace's events (e.g. gathered from other ranks)."""
        self.events.extend(other.events if isinstance(other, ChromeTrace) else other)

    def to_json(self) -> str:
        return json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"})

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path


def save_gantt_png(
    trace: ChromeTrace,
    path: str | os.PathLike,
    colors: Mapping[str, str],
    *,
    title: str = "",
    label: Callable[[dict], str] | None = None,
    xlabel: str = "ms",
) -> Path:
    """A Gantt chart of ``trace``'s spans: one row per (pid, tid), grouped by process, in order of first mention, named
    by the trace's thread (else process) names; x in ms from the trace's zero. A span's colour is ``colors`` of its ``cat`` (of its
    name when it has none; gray when absent), the legend lists ``colors``; ``label(span)`` is written inside spans
    wide enough for it (up to 16 rows). Needs matplotlib (``pip install 'fusedrl[viz]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import to_rgb
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("a Gantt chart needs matplotlib: pip install 'fusedrl[viz]'") from err
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace.events if e["ph"] == "M"}
    spans = [e for e in trace.events if e["ph"] == "X"]
    first: dict[tuple, int] = {}  # a process's rows stay together, both in order of first mention
    for i, e in enumerate(trace.events):
        first.setdefault(("process", e["pid"]), i)
        first.setdefault((e["pid"], e.get("tid")), i)
    rows = sorted({(e["pid"], e["tid"]) for e in spans}, key=lambda key: (first[("process", key[0])], first[key]))
    row_of = {key: i for i, key in enumerate(rows)}
    end = max((e["ts"] + e["dur"] for e in spans), default=0.0) / 1e3
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.4))
    for e in spans:
        y, start, width = row_of[(e["pid"], e["tid"])], e["ts"] / 1e3, e["dur"] / 1e3
        color = colors.get(e.get("cat", e["name"]), "gray")
        ax.barh(y, width, left=start, height=0.8, color=color, edgecolor="white", linewidth=0.4)
        if label is not None and len(rows) <= 16 and width > 0.012 * end:
            dark = sum(to_rgb(color)) < 1.5
            ax.text(start + width / 2, y, label(e), ha="center", va="center", fontsize=6, color="white" if dark else "black")
    ax.set_yticks(range(len(rows)), [names.get(key, names.get((key[0], None), str(key[0]))) for key in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel(xlabel)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in colors.items()],
        ncol=len(colors),
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        frameon=False,
    )
    ax.set_title(title, loc="left", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


class PhaseTimers:
    """Accumulating wall-clock timers of an iteration's phases: ``with timers("generation"): ...``; ``pop()``
    returns and resets.

    With ``sync_cuda`` the timer synchronises the device at both ends so asynchronous kernels are
    counted in the phase that launched them. With ``trace`` every span is also recorded there.
    """

    def __init__(self, sync_cuda: bool = False, trace: ChromeTrace | None = None, pid: int | str = 0) -> None:
        self.sync_cuda = sync_cuda and torch.cuda.is_available()
        self.trace = trace
        self.pid = pid
        self._totals: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.sync_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync_cuda:
                torch.cuda.synchronize()
            dur = time.perf_counter() - start
            self._totals[phase] += dur
            if self.trace is not None:
                self.trace.complete(phase, start, dur, pid=self.pid, tid="phases")

    def add(self, phase: str, seconds: float) -> None:
        """Add a duration measured elsewhere (e.g. exposed scoring time reported by the rollout)."""
        self._totals[phase] += seconds

    def totals(self) -> dict[str, float]:
        return dict(self._totals)

    def pop(self) -> dict[str, float]:
        out = dict(self._totals)
        self._totals.clear()
        return out


def length_stats(lengths: Sequence[int] | torch.Tensor, prefix: str = "response_len") -> dict[str, float]:
    """Mean, p50, p90, p99 and max of ``lengths`` (nearest-rank percentiles) as ``{prefix}_mean`` etc."""
    x = torch.as_tensor(lengths, dtype=torch.float64).flatten()
    if x.numel() == 0:
        raise ValueError("length_stats needs at least one length")
    xs = x.sort().values
    return {
        f"{prefix}_mean": xs.mean().item(),
        f"{prefix}_p50": percentile(xs, 50),
        f"{prefix}_p90": percentile(xs, 90),
        f"{prefix}_p99": percentile(xs, 99),
        f"{prefix}_max": xs[-1].item(),
    }


def percentile(values: Sequence[float] | torch.Tensor, q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] (an observed value, no interpolation)."""
    xs = torch.as_tensor(values, dtype=torch.float64).flatten().sort().values
    if xs.numel() == 0:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    rank = max(1, math.ceil(q / 100 * xs.numel()))
    return xs[rank - 1].item()


def peak_memory_gib(device: torch.device | str | None = None) -> float:
    """Peak memory: CUDA ``max_memory_allocated`` on a CUDA device, else the process's peak RSS."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)


def resident_memory_gib(device: torch.device | str | None = None) -> float:
    """Memory held now: CUDA ``memory_allocated`` on a CUDA device, else the process's resident set (Linux's
    ``/proc/self/statm``; elsewhere the peak RSS, :func:`peak_memory_gib`). A leak shows as a slope over iterations,
    which the peak (a high-water mark) hides once reached."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return peak_memory_gib(device)
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def memory_figures(device: torch.device | str | None = None) -> dict[str, float]:
    """An iteration's memory figures: ``peak_memory_gib`` and ``resident_memory_gib`` and, for CPU work under glibc,
    the C allocator's ``host_heap_in_use_gib`` and ``host_heap_free_gib`` (free but kept by the process: reuse or
    fragmentation, not a leak)."""
    figures = {"peak_memory_gib": peak_memory_gib(device), "resident_memory_gib": resident_memory_gib(device)}
    if torch.device(device or "cpu").type == "cpu" and (heap := host_heap_bytes()) is not None:
        figures["host_heap_in_use_gib"], figures["host_heap_free_gib"] = (b / 2**30 for b in heap)
    return figures


class MetricsLogger:
    """Writes one record per step to stdout, ``<folder>/metrics.jsonl`` and TensorBoard (rank 0 only).

    ``log(step, metrics)`` writes when ``step % log_freq == 0``. Values must be numbers (tensors are
    converted with ``.item()``). A jsonl record also carries ``wall_time``, the Unix time it was written
    (TensorBoard keeps its own per event). TensorBoard is used when ``tensorboard=True`` and the package is
    installed (a warning otherwise).
    """

    def __init__(
        self,
        folder: str | os.PathLike | None,
        *,
        rank: int = 0,
        log_freq: int = 1,
        jsonl: bool = True,
        tensorboard: bool = False,
        stdout: bool = True,
        stdout_keys: Sequence[str] | None = None,
    ) -> None:
        if log_freq < 1:
            raise ValueError(f"metrics.log_freq must be >= 1, got {log_freq}")
        self.enabled = rank == 0
        self.log_freq = log_freq
        self.stdout = stdout
        self.stdout_keys = tuple(stdout_keys) if stdout_keys is not None else None
        self.jsonl_path: Path | None = None
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        if not (jsonl or tensorboard):
            return
        if folder is None:
            raise ValueError("MetricsLogger needs a folder for jsonl/tensorboard output; pass folder= or disable them")
        if jsonl:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.jsonl_path = Path(folder) / "metrics.jsonl"
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("metrics.tensorboard=true but tensorboard is not installed (pip install tensorboard); skipping it")
            else:
                self._tb = SummaryWriter(log_dir=str(Path(folder) / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float | int | torch.Tensor]) -> None:
        if not self.enabled or step % self.log_freq:
            return
        record = {"step": step, **{k: _number(k, v) for k, v in metrics.items()}}
        if self.stdout:
            keys = self.stdout_keys if self.stdout_keys is not None else [k for k in record if k != "step"]
            parts = [f"{k}={_fmt(record[k])}" for k in keys if k in record]
            print(f"step {step}: " + " ".join(parts), flush=True)
        if self._jsonl is not None:
            stamped = {"step": step, "wall_time": round(time.time(), 3), **record}
            self._jsonl.write(json.dumps(stamped, allow_nan=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    @classmethod
    def from_config(
        cls, section: MetricsSection, folder: str | os.PathLike, *, rank: int, stdout_keys: Sequence[str] | None = None
    ) -> MetricsLogger:
        """A logger as the ``[metrics]`` section says (``log_freq``, ``jsonl``, ``tensorboard``)."""
        return cls(
            folder,
            rank=rank,
            log_freq=section.log_freq,
            jsonl=section.jsonl,
            tensorboard=section.tensorboard,
            stdout_keys=stdout_keys,
        )

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics JSONL file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def drop_steps_after(path: str | os.PathLike, step: int) -> int:
    """Rewrite a metrics JSONL file without the records of steps after ``step`` (a resumed run logs them
    again); atomic: a crash leaves the old file. Returns how many records were dropped."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _number(key: str, v) -> float | int:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(v.shape)}; log a scalar")
        v = v.item()
    if isinstance(v, bool):
        return int(v)
    if not isinstance(v, (int, float)):
        raise ValueError(f"metric {key!r} has type {type(v).__name__}; log an int or float")
    return v


def _fmt(v: float | int) -> str:
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}"
