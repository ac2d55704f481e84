"""Benchmark the fused pipeline planner over a grid of problems, with F/B schedules and with split backwards.

    python -m fusedrl.bench.schedule [--budget-s 2] [--seed 0] [--json]

Grid: pp_actor in {4, 8, 16}; pp_critic in {pp_actor, pp_actor/2}; M_actor in {pp, 2pp, 4pp} with
M_critic = M_actor / (pp_actor/pp_critic) per Critic replica (same global batch); critic/actor cost ratio r in
{0.4, 0.8, 1.0, 1.25}: per-stage f_actor = 1, f_critic = r, b = 2f (half of it weight gradients W when split),
activation memory per micro-batch 1 (Actor) and r (Critic). Per problem, each search run twice (F/B schedule;
``split_backward=True``): makespan / F/B lower bound, makespan / split lower bound, speedup over sequential 1F1B
(simulated in the same run), peak activation memory / single-model 1F1B peak, search seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from fusedrl.pipelining import CostModel, Placement, fused_schedule
from fusedrl.pipelining.bounds import rank_work_bound
from fusedrl.pipelining.local_search import single_model_1f1b_peak
from fusedrl.pipelining.simulator import Problem

PP = (4, 8, 16)
MB_FACTORS = (1, 2, 4)
COST_RATIOS = (0.4, 0.8, 1.0, 1.25)


def grid() -> list[tuple[int, int, int, int, float]]:
    problems = []
    for pp in PP:
        for pp_critic in (pp, pp // 2):
            for factor in MB_FACTORS:
                mb_actor = factor * pp
                for ratio in COST_RATIOS:
                    problems.append((pp, pp_critic, mb_actor, mb_actor // (pp // pp_critic), ratio))
    return problems


def run(budget_s: float, seed: int, verbose: bool = True) -> dict:
    rows: list[dict[str, Any]] = []
    if verbose:
        print(
            f"{'pp_a':>4} {'pp_c':>4} {'M_a':>4} {'M_c':>4} {'ratio':>5} | F/B: {'ms/LB':>6} {'vs 1F1B':>7} {'mem':>5} "
            f"{'s':>5} | split: {'ms/LB':>6} {'ms/sLB':>6} {'vs 1F1B':>7} {'mem':>5} {'s':>5} | methods (F/B; split)"
        )
    for pp, pp_critic, mb_actor, mb_critic, ratio in grid():
        placement = Placement(pp, pp_critic)
        costs = CostModel.uniform(placement, 1.0, ratio, mem_actor=1.0, mem_critic=ratio)
        problem = Problem(placement, costs, mb_actor, mb_critic)
        single_peak = single_model_1f1b_peak(problem)
        row: dict[str, Any] = {
            "pp_actor": pp,
            "pp_critic": pp_critic,
            "mb_actor": mb_actor,
            "mb_critic": mb_critic,
            "cost_ratio": ratio,
            "rank_work_bound": rank_work_bound(problem),
        }
        for prefix, split in (("", False), ("split_", True)):
            plan = fused_schedule(placement, costs, mb_actor, mb_critic, budget_s=budget_s, seed=seed, split_backward=split)
            row["lower_bound"], row["split_lower_bound"] = plan.lower_bound, plan.split_lower_bound
            row[prefix + "makespan"] = plan.makespan
            row[prefix + "makespan_over_lower_bound"] = plan.makespan / plan.lower_bound
            row[prefix + "makespan_over_split_lower_bound"] = plan.makespan / plan.split_lower_bound
            row[prefix + "speedup_vs_sequential"] = plan.sequential_1f1b_makespan / plan.makespan
            row[prefix + "peak_memory_over_1f1b_single"] = plan.result.max_peak_memory / single_peak
            row[prefix + "search_seconds"] = plan.search_seconds
            row[prefix + "method"] = plan.method
        rows.append(row)
        if verbose:
            print(
                f"{pp:>4} {pp_critic:>4} {mb_actor:>4} {mb_critic:>4} {ratio:>5.2f} | "
                f"{row['makespan_over_lower_bound']:>11.4f} {row['speedup_vs_sequential']:>6.3f}x "
                f"{row['peak_memory_over_1f1b_single']:>5.3f} {row['search_seconds']:>5.2f} | "
                f"{row['split_makespan_over_lower_bound']:>13.4f} {row['split_makespan_over_split_lower_bound']:>6.4f} "
                f"{row['split_speedup_vs_sequential']:>6.3f}x {row['split_peak_memory_over_1f1b_single']:>5.3f} "
                f"{row['split_search_seconds']:>5.2f} | {row['method']}; {row['split_method']}",
                flush=True,
            )
    ratios = [r["makespan_over_lower_bound"] for r in rows]
    # Problems with idle time that no F/B schedule can remove: the F/B bound lies above every rank's own work.
    forced = [r for r in rows if r["lower_bound"] > r["rank_work_bound"] * (1 + 1e-9)]
    split_ratios = [r["split_makespan_over_lower_bound"] for r in forced]
    summary = {
        "problems": len(rows),
        "budget_s": budget_s,
        "mean_makespan_over_lower_bound": statistics.mean(ratios),
        "max_makespan_over_lower_bound": max(ratios),
        "problems_within_1.01_of_bound": sum(r <= 1.01 + 1e-9 for r in ratios),
        "min_speedup_vs_sequential": min(r["speedup_vs_sequential"] for r in rows),
        "mean_speedup_vs_sequential": statistics.mean(r["speedup_vs_sequential"] for r in rows),
        "max_peak_memory_over_1f1b_single": max(r["peak_memory_over_1f1b_single"] for r in rows),
        "mean_peak_memory_over_1f1b_single": statistics.mean(r["peak_memory_over_1f1b_single"] for r in rows),
        "problems_peak_memory_within_1.25": sum(r["peak_memory_over_1f1b_single"] <= 1.25 + 1e-9 for r in rows),
        "max_search_seconds": max(r["search_seconds"] for r in rows),
        "total_search_seconds": sum(r["search_seconds"] for r in rows),
        "split_problems_with_forced_idle": len(forced),
        "split_problems_below_lower_bound": sum(x < 1 - 1e-9 for x in split_ratios),
        "split_mean_makespan_over_lower_bound": statistics.mean(split_ratios) if forced else None,
        "split_max_makespan_over_lower_bound": max(split_ratios) if forced else None,
        "split_mean_makespan_over_split_lower_bound": statistics.mean(r["split_makespan_over_split_lower_bound"] for r in rows),
        "split_max_makespan_over_split_lower_bound": max(r["split_makespan_over_split_lower_bound"] for r in rows),
        "split_mean_speedup_vs_fused": statistics.mean(r["makespan"] / r["split_makespan"] for r in rows),
        "split_min_speedup_vs_fused": min(r["makespan"] / r["split_makespan"] for r in rows),
        "split_max_peak_memory_over_1f1b_single": max(r["split_peak_memory_over_1f1b_single"] for r in rows),
        "split_mean_peak_memory_over_1f1b_single": statistics.mean(r["split_peak_memory_over_1f1b_single"] for r in rows),
        "split_problems_peak_memory_within_1.25": sum(r["split_peak_memory_over_1f1b_single"] <= 1.25 + 1e-9 for r in rows),
        "split_max_search_seconds": max(r["split_search_seconds"] for r in rows),
        "split_total_search_seconds": sum(r["split_search_seconds"] for r in rows),
    }
    return {"summary": summary, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fusedrl.bench.schedule", description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=2.0, help="search budget per problem (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object with summary and rows")
    args = p.parse_args(argv)
    out = run(args.budget_s, args.seed)
    s = out["summary"]
    print(f"mean makespan / lower bound: {s['mean_makespan_over_lower_bound']:.4f} (target <= 1.01)")
    print(f"max makespan / lower bound:  {s['max_makespan_over_lower_bound']:.4f} (target <= 1.03)")
    print(f"problems within 1.01 x bound: {s['problems_within_1.01_of_bound']}/{s['problems']}")
    print(
        f"speedup vs sequential 1F1B: min {s['min_speedup_vs_sequential']:.3f}x, "
        f"mean {s['mean_speedup_vs_sequential']:.3f}x (target: min >= 1)"
    )
    print(
        f"peak memory / single-model 1F1B peak: max {s['max_peak_memory_over_1f1b_single']:.3f} (target <= 1.25), mean "
        f"{s['mean_peak_memory_over_1f1b_single']:.3f}, within 1.25 on {s['problems_peak_memory_within_1.25']}/{s['problems']}"
    )
    print(
        f"search seconds: max {s['max_search_seconds']:.2f} per problem (target <= 30), "
        f"total {s['total_search_seconds']:.1f} (budget {args.budget_s:g} s/problem)"
    )
    print(
        f"split backward, problems whose F/B bound exceeds the per-rank work bound: {s['split_problems_with_forced_idle']}"
        f"/{s['problems']}; split makespan below the F/B bound on {s['split_problems_below_lower_bound']} of them "
        "(target: all)"
    )
    if s["split_problems_with_forced_idle"]:
        print(
            f"split makespan / F/B lower bound on those: mean {s['split_mean_makespan_over_lower_bound']:.4f}, "
            f"max {s['split_max_makespan_over_lower_bound']:.4f} (target < 1)"
        )
    print(
        f"split makespan / split lower bound: mean {s['split_mean_makespan_over_split_lower_bound']:.4f}, "
        f"max {s['split_max_makespan_over_split_lower_bound']:.4f}"
    )
    print(
        f"split speedup vs the F/B fused schedule: min {s['split_min_speedup_vs_fused']:.3f}x, "
        f"mean {s['split_mean_speedup_vs_fused']:.3f}x (target: min >= 1)"
    )
    print(
        f"split peak memory / single-model 1F1B peak: max {s['split_max_peak_memory_over_1f1b_single']:.3f} (target <= 1.25), "
        f"mean {s['split_mean_peak_memory_over_1f1b_single']:.3f}, within 1.25 on "
        f"{s['split_problems_peak_memory_within_1.25']}/{s['problems']}"
    )
    print(
        f"split search seconds: max {s['split_max_search_seconds']:.2f} per problem (target <= 30), "
        f"total {s['split_total_search_seconds']:.1f}"
    )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
