"""Benchmark the fused pipeline planner over a grid of problems.

    python -m fusedrl.bench.schedule [--budget-s 2] [--seed 0] [--json]

Grid: pp_actor in {4, 8, 16}; pp_critic in {pp_actor, pp_actor/2}; M_actor in {pp, 2pp, 4pp} with
M_critic = M_actor / (pp_actor/pp_critic) per Critic replica (same global batch); critic/actor cost ratio r in
{0.4, 0.8, 1.0, 1.25}: per-stage f_actor = 1, f_critic = r, b = 2f, activation memory per micro-batch 1 (Actor)
and r (Critic). Per problem: makespan / lower bound, speedup over sequential 1F1B (simulated in the same run),
peak activation memory / single-model 1F1B peak, search seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from fusedrl.pipelining import CostModel, Placement, fused_schedule
from fusedrl.pipelining.search import single_model_1f1b_peak
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
            f"{'pp_a':>4} {'pp_c':>4} {'M_a':>4} {'M_c':>4} {'ratio':>5} {'ms/LB':>7} {'vs 1F1B':>8} "
            f"{'mem/1F1B':>8} {'search_s':>8}  method"
        )
    for pp, pp_critic, mb_actor, mb_critic, ratio in grid():
        placement = Placement(pp, pp_critic)
        costs = CostModel.uniform(placement, 1.0, ratio, mem_actor=1.0, mem_critic=ratio)
        plan = fused_schedule(placement, costs, mb_actor, mb_critic, budget_s=budget_s, seed=seed)
        single_peak = single_model_1f1b_peak(Problem(placement, costs, mb_actor, mb_critic))
        row = {
            "pp_actor": pp,
            "pp_critic": pp_critic,
            "mb_actor": mb_actor,
            "mb_critic": mb_critic,
            "cost_ratio": ratio,
            "makespan_over_lower_bound": plan.makespan / plan.lower_bound,
            "speedup_vs_sequential": plan.sequential_1f1b_makespan / plan.makespan,
            "peak_memory_over_1f1b_single": plan.result.max_peak_memory / single_peak,
            "search_seconds": plan.search_seconds,
            "method": plan.method,
        }
        rows.append(row)
        if verbose:
            print(
                f"{pp:>4} {pp_critic:>4} {mb_actor:>4} {mb_critic:>4} {ratio:>5.2f} "
                f"{row['makespan_over_lower_bound']:>7.4f} {row['speedup_vs_sequential']:>7.3f}x "
                f"{row['peak_memory_over_1f1b_single']:>8.3f} {row['search_seconds']:>8.2f}  {plan.method}",
                flush=True,
            )
    ratios = [r["makespan_over_lower_bound"] for r in rows]
    summary = {
        "problems": len(rows),
        "budget_s": budget_s,
        "mean_makespan_over_lower_bound": statistics.mean(ratios),
        "max_makespan_over_lower_bound": max(ratios),
        "problems_within_1.01_of_bound": sum(r <= 1.01 + 1e-9 for r in ratios),
        "min_speedup_vs_sequential": min(r["speedup_vs_sequential"] for r in rows),
        "mean_speedup_vs_sequential": statistics.mean(r["speedup_vs_sequential"] for r in rows),
        "max_peak_memory_over_1f1b_single": max(r["peak_memory_over_1f1b_single"] for r in rows),
        "max_search_seconds": max(r["search_seconds"] for r in rows),
        "total_search_seconds": sum(r["search_seconds"] for r in rows),
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
    print(f"max peak memory / single-model 1F1B peak: {s['max_peak_memory_over_1f1b_single']:.3f} (target <= 1.5)")
    print(
        f"search seconds: max {s['max_search_seconds']:.2f} per problem (target <= 30), "
        f"total {s['total_search_seconds']:.1f} (budget {args.budget_s:g} s/problem)"
    )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
