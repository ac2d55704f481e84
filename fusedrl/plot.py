"""A run's curves as one picture, from its ``metrics.jsonl``.

    python -m fusedrl.plot RUN_DIR [--out FILE.png] [--smooth N]

Six panels over the iterations: the scores (``reward_mean``, the reward function's, the task's evaluation when
logged: ``true_score``, ``[eval]``'s ``eval/accuracy``, ``eval/score`` and ``eval/pass@n`` as points), response lengths
(mean, p50, p90, max, and the evaluation's mean), the KL to the Reference and the
entropy, the clip fraction, the phases of each iteration stacked (:data:`STACKED_PHASES`) and samples/s.
A figure the run did not log leaves its line out (a panel with none says so). ``--smooth N`` adds a moving mean over
N iterations beside the noisy score curves. Needs matplotlib (``pip install 'fusedrl[viz]'``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusedrl.components.metrics import read_jsonl

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STACKED_PHASES = (
    "weight_sync",
    "generation",
    "scoring_exposed",
    "reference",
    "advantages",
    "recompute",
    "training",
    "eval",
    "outside",
)
"""The parts of ``time_step`` (of scoring only what generation did not hide), then the task's evaluation and the time
between iterations (metrics and checkpoints): what an iteration costs."""
PANELS: dict[str, tuple[str, ...]] = {
    "score": ("reward_mean", "reward_fn_mean", "true_score"),
    "response length (tokens)": (
        "response_len_mean",
        "response_len_p50",
        "response_len_p90",
        "response_len_max",
        "eval/response_len_mean",
    ),
    "KL and entropy": ("kl", "kl_loss", "entropy"),
    "clip fraction": ("clip_frac", "vf_clip_frac"),
    "phase seconds per iteration": tuple(f"time_{p}" for p in STACKED_PHASES),
    "samples/s": ("samples_per_s",),
}


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def _moving_mean(values: list[float], n: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def figure(records: Sequence[dict], title: str, smooth: int = 5) -> Figure:
    """The six panels of ``records`` (metrics.jsonl's iteration records) as a matplotlib figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'fusedrl[viz]'") from err
    # [eval]'s grades (accuracy, score, pass@n) join the scores
    grades = sorted(
        {
            k
            for r in records
            for k in r
            if k.startswith("eval/") and k not in ("eval/response_len_mean", "eval/finished", "eval/turns_mean")
        }
    )
    panels = dict(PANELS, score=PANELS["score"] + tuple(grades))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (name, keys) in zip(axes.flat, panels.items()):
        drawn = 0
        if name.startswith("phase"):
            bottom: dict[int, float] = {}
            for key in keys:
                steps, values = _series(records, key)
                if steps and any(values):
                    base = [bottom.get(s, 0.0) for s in steps]
                    ax.bar(steps, values, bottom=base, width=1.0, label=key.removeprefix("time_"))
                    bottom.update({s: b + v for s, b, v in zip(steps, base, values)})
                    drawn += 1
        else:
            for key in keys:
                steps, values = _series(records, key)
                if not steps:
                    continue
                noisy = name == "score" and smooth > 1 and len(values) > smooth and not key.startswith("eval/")
                marker = "o" if key.startswith("eval/") else None  # every eval.interval iterations: points
                line = ax.plot(steps, values, label=key, alpha=0.35 if noisy else 1.0, linewidth=1, marker=marker, markersize=3)[
                    0
                ]
                if noisy:
                    ax.plot(steps, _moving_mean(values, smooth), color=line.get_color(), label=f"{key} ({smooth}-it. mean)")
                drawn += 1
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_xlabel("iteration")
        if drawn:
            ax.legend(fontsize=7, frameon=False)
        else:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes, color="gray")
    iterations = sum(1 for r in records if r["step"] > 0)  # step 0: the evaluation before the first
    fig.suptitle(f"{title}: {iterations} iterations", fontsize=11)
    fig.tight_layout()
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None, smooth: int = 5) -> Path:
    """Draw ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/metrics.png``); returns the picture's path."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist: give the run's output folder (job.output_dir) holding metrics.jsonl")
    records = [r for r in read_jsonl(metrics) if "step" in r]
    if not records:
        raise ValueError(f"{metrics} holds no iteration records yet: plot after the first iteration is logged")
    fig = figure(records, run_dir.name, smooth)
    path = Path(out) if out is not None else run_dir / "metrics.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fusedrl.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's output folder (job.output_dir), holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="the picture (default RUN_DIR/metrics.png)")
    parser.add_argument("--smooth", type=int, default=5, help="moving mean over N iterations beside the scores (1: none)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: must be at least 1")
    try:
        path = plot_run(args.run_dir, args.out, args.smooth)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
