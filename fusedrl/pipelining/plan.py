"""Plan a fused Actor+Critic pipeline schedule from the command line.

    python -m fusedrl.pipelining.plan --pp-actor 8 --pp-critic 4 --mb-actor 32 --mb-critic 16 \
        --f-actor 5 --f-critic 4 --mem-actor 1.95 --mem-critic 2 [--budget-s 30] [--seed 0] [--split-backward] \
        [--json] [--png out.png] [--trace out.json]
    python -m fusedrl.pipelining.plan --critic-free --split-backward --pp-actor 8 --mb-actor 32 --f-actor 5

``--mb-critic`` is per Critic replica (pp_actor / pp_critic replicas). Backward defaults to 2 x forward, half of it
weight gradients (W) when ``--split-backward`` splits it. ``--critic-free`` plans the Actor alone (GRPO-style
algorithms train no Critic); with ``--split-backward`` the weight gradients fill the pipeline bubbles.
"""

from __future__ import annotations

import argparse
import json
import sys

from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.ir import Placement
from fusedrl.pipelining.local_search import single_model_1f1b_peak
from fusedrl.pipelining.search import PlanResult, fused_schedule
from fusedrl.pipelining.simulator import Problem


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fusedrl.pipelining.plan", description=__doc__.split("\n")[0])
    p.add_argument("--pp-actor", type=int, required=True, help="pipeline ranks = Actor stages")
    p.add_argument("--pp-critic", type=int, default=None, help="Critic stages (divides --pp-actor; default: equal)")
    p.add_argument("--mb-actor", type=int, required=True, help="Actor micro-batches")
    p.add_argument("--mb-critic", type=int, default=None, help="micro-batches per Critic replica (required unless --critic-free)")
    p.add_argument("--f-actor", type=float, required=True, help="Actor forward time per stage")
    p.add_argument("--f-critic", type=float, default=None, help="Critic forward time per stage (required unless --critic-free)")
    p.add_argument("--b-actor", type=float, default=None, help="Actor backward time per stage (default 2 x forward)")
    p.add_argument("--b-critic", type=float, default=None, help="Critic backward time per stage (default 2 x forward)")
    p.add_argument("--mem-actor", type=float, default=1.0, help="Actor activation memory per micro-batch per stage")
    p.add_argument("--mem-critic", type=float, default=1.0, help="Critic activation memory per micro-batch per stage")
    p.add_argument("--p2p-latency", type=float, default=0.0, help="latency between stages on different ranks")
    p.add_argument(
        "--memory-limit", type=float, default=None, help="per-rank activation memory cap (default 1.5 x single-model 1F1B peak)"
    )
    p.add_argument("--budget-s", type=float, default=30.0, help="search budget in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split-backward", action="store_true", help="split backwards into input (I) and weight (W) gradients, W in bubbles"
    )
    p.add_argument(
        "--critic-free", action="store_true", help="the Actor alone, no Critic (GRPO-style); best with --split-backward"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--png", default=None, help="write a Gantt chart (needs matplotlib: pip install 'fusedrl[viz]')")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON")
    return p


def summary(plan: PlanResult, problem: Problem) -> dict:
    return {
        "critic_free": problem.mb_critic == 0,
        "split_backward": plan.split_backward,
        "makespan": plan.makespan,
        "lower_bound": plan.lower_bound,
        "makespan_over_lower_bound": plan.makespan / plan.lower_bound,
        "split_lower_bound": plan.split_lower_bound,
        "makespan_over_split_lower_bound": plan.makespan / plan.split_lower_bound,
        "sequential_1f1b_makespan": plan.sequential_1f1b_makespan,
        "speedup_vs_sequential": plan.sequential_1f1b_makespan / plan.makespan,
        "bubble_ratio": plan.result.bubble_ratio,
        "peak_memory": plan.result.max_peak_memory,
        "peak_memory_1f1b_single": single_model_1f1b_peak(problem),
        "memory_limit": plan.memory_limit,
        "search_seconds": plan.search_seconds,
        "evaluations": plan.evaluations,
        "method": plan.method,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        mb_critic, f_critic = _critic_args(args)
        placement = Placement(args.pp_actor, args.pp_critic)
        costs = CostModel.uniform(
            placement,
            args.f_actor,
            f_critic,
            b_actor=args.b_actor,
            b_critic=args.b_critic,
            mem_actor=args.mem_actor,
            mem_critic=args.mem_critic,
            p2p_latency=args.p2p_latency,
        )
        problem = Problem(placement, costs, args.mb_actor, mb_critic)
        plan = fused_schedule(
            placement,
            costs,
            args.mb_actor,
            mb_critic,
            budget_s=args.budget_s,
            seed=args.seed,
            memory_limit=args.memory_limit,
            split_backward=args.split_backward,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = summary(plan, problem)
    if args.png:
        from fusedrl.pipelining.viz import save_gantt

        models = (
            f"pp={args.pp_actor}, M={args.mb_actor}, Actor alone (critic-free)"
            if args.critic_free
            else f"pp_actor={args.pp_actor}, pp_critic={placement.num_stages('critic')}, "
            f"M_actor={args.mb_actor}, M_critic={mb_critic}/replica"
        )
        save_gantt(
            plan.result,
            args.png,
            title=(
                f"{'split-backward' if args.critic_free else 'fused'} schedule: {models}; makespan {plan.makespan:g} "
                f"(lower bound {plan.lower_bound:g}{f', split {plan.split_lower_bound:g}' if plan.split_backward else ''}, "
                f"sequential 1F1B {plan.sequential_1f1b_makespan:g})"
            ),
        )
    if args.trace:
        from fusedrl.pipelining.viz import write_chrome_trace

        write_chrome_trace(plan.result, args.trace)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")
    return 0


def _critic_args(args: argparse.Namespace) -> tuple[int, float]:
    """``(mb_critic, f_critic)``: the Critic's micro-batches and forward time, 0 micro-batches with ``--critic-free``
    (its forward time then only fills the unused Critic cost model)."""
    if args.critic_free:
        given = [f"--{n.replace('_', '-')}" for n in ("mb_critic", "f_critic", "b_critic") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--critic-free plans the Actor alone: drop {', '.join(given)}")
        return 0, args.f_actor
    missing = [f"--{n.replace('_', '-')}" for n in ("mb_critic", "f_critic") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} required (or --critic-free to plan the Actor alone)")
    return args.mb_critic, args.f_critic


if __name__ == "__main__":
    sys.exit(main())
