"""The estimate as a table (``format_table``: categories x phases, maxima over ranks, then one line per rank) and as
the ``--json`` object (``to_json``); ``docs/memory.md`` tells how to read them."""

from __future__ import annotations

from fusedrl.memory.estimate import Estimate
from fusedrl.memory.formulas import GIB, H2D_GB_PER_S, PHASES, offload_seconds
from fusedrl.pipelining import ACTOR, CRITIC


def _gib(n: float) -> float:
    return n / GIB


def categories(est: Estimate) -> list[str]:
    """Every category that appears at some phase peak, persistent ones first."""
    seen: dict[str, None] = {}
    for r in est.ranks:
        for name in r.persistent:
            seen.setdefault(name)
    for phase in PHASES:
        for r in est.ranks:
            for name in r.phases[phase]:
                seen.setdefault(name)
    return [n for n in seen if any(est.max_over_ranks(p, n)[0] for p in PHASES)]


def format_table(est: Estimate, device_gib: float) -> str:
    """Per category and phase: the largest bytes over ranks (GiB) and the rank holding them; then per rank."""
    width = 14
    lines = [f"memory per rank: {est.config}, {est.world} ranks (GiB at each phase's peak, max over ranks, rank)"]
    lines.append(f"{'category':<22}" + "".join(f"{p:>{width}}" for p in PHASES))
    for name in categories(est):
        cells = []
        for phase in PHASES:
            value, rank = est.max_over_ranks(phase, name)
            cells.append(f"{_gib(value):>8.3f} r{rank:<4}" if value else f"{'-':>8}      ")
        lines.append(f"{name:<22}" + "".join(f"{c:>{width}}" for c in cells))
    peaks = []
    for phase in PHASES:
        value, rank = max((r.phase_peak(phase), r.rank) for r in est.ranks)
        peaks.append(f"{_gib(value):>8.3f} r{rank:<4}")
    lines.append(f"{'phase peak':<22}" + "".join(f"{c:>{width}}" for c in peaks))
    lines.append("")
    lines.append(
        f"{'rank':>5} {'pp':>3} {'dp':>3} {'tp':>3} {'persistent':>11} {'peak':>8}  {'phase':<12} in flight (actor, critic)"
    )
    for r in est.ranks:
        value, phase = r.peak
        flight = r.details["in_flight_max"]
        lines.append(
            f"{r.rank:>5} {r.coords['pp']:>3} {r.coords['dp_shard']:>3} {r.coords['tp']:>3} "
            f"{_gib(r.persistent_total):>11.2f} {_gib(value):>8.2f}  {phase:<12} "
            f"{flight[ACTOR]}, {flight.get(CRITIC, '-')}"  # '-': no Critic (critic-free)
        )
    persistent = max(r.persistent_total for r in est.ranks)
    peak, worst = max((r.peak[0], r.rank) for r in est.ranks)
    lines.append("")
    lines.extend(f"note: {n}" for n in est.notes)
    verdict = "fits" if _gib(peak) <= device_gib else "does NOT fit"
    host = max(r.host_total for r in est.ranks)
    if host:
        lines.append(
            f"host memory per rank {_gib(host):.2f} GiB (Reference and Reward, training.offload_frozen): "
            f"copying them in adds {offload_seconds(host):.2f} s per iteration at an assumed "
            f"{H2D_GB_PER_S:g} GB/s"
        )
    lines.append(
        f"per-rank persistent {_gib(persistent):.2f} GiB, per-rank peak {_gib(peak):.2f} GiB (rank {worst}, "
        f"{est.ranks[[r.rank for r in est.ranks].index(worst)].peak[1]}): {verdict} in {device_gib:g} GiB"
    )
    return "\n".join(lines)


def to_json(est: Estimate, device_gib: float) -> dict:
    """The ``--json`` object: maxima over ranks in GiB, and every rank's figures."""
    phases = {}
    for phase in PHASES:
        value, rank = max((r.phase_peak(phase), r.rank) for r in est.ranks)
        phases[phase] = {
            "peak_gib": round(_gib(value), 3),
            "rank": rank,
            "categories_gib": {
                n: round(_gib(est.max_over_ranks(phase, n)[0]), 3) for n in categories(est) if est.max_over_ranks(phase, n)[0]
            },
        }
    peak = max(r.peak[0] for r in est.ranks)
    ranks = {
        str(r.rank): {
            "coords": r.coords,
            "persistent_gib": round(_gib(r.persistent_total), 3),
            "peak_gib": round(_gib(r.peak[0]), 3),
            "peak_phase": r.peak[1],
            "persistent": r.persistent,
            "transients": r.transients,
            "phase_peaks_gib": {p: round(_gib(r.phase_peak(p)), 3) for p in PHASES},
            "in_flight_max": r.details["in_flight_max"],
            "host_gib": round(_gib(r.host_total), 3),
        }
        for r in est.ranks
    }
    host = max(r.host_total for r in est.ranks)
    return {
        "config": est.config,
        "world": est.world,
        "device_gib": device_gib,
        "per_rank_persistent_gib": round(_gib(max(r.persistent_total for r in est.ranks)), 3),
        "per_rank_peak_gib": round(_gib(peak), 3),
        "fits": _gib(peak) <= device_gib,
        "phases": phases,
        "per_rank_host_gib": round(_gib(host), 3),
        "offload_s_per_iteration": round(offload_seconds(host), 3),
        "ranks": ranks,
    }
