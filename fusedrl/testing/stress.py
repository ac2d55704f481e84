"""Stress run: PPO iterations of the debug config with random migration settings in every iteration and
random bad rows mixed into the prompt file; every sample and every data row is reconciled.

    python -m fusedrl.testing.stress [--steps 50] [--nproc 4] [--seed 0] [--out DIR] [--section.key=value ...]

Each iteration draws the inter-stage fusion settings (threshold: a fraction of the batch or ``auto``;
``kv`` or ``reprefill``; check interval 1-4), the same on every rank. The prompt file holds the debug
task's prompts with about 20% bad rows (malformed JSON, invalid UTF-8, empty or missing prompt, a
non-string prompt, a row that is not an object, over-long prompts) at random lines. The run fails unless
the data report counts exactly the injected rows at their line numbers, and every iteration scores each
requested sample exactly once (over the run: sample ids 0 .. steps * batch - 1, each once).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fusedrl.testing.multirank import MultiRankPool, run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "train_configs" / "debug_ppo.toml"
# Small enough for CI (about 1 s per iteration on 4 CPU ranks sharing 2 cores); the debug config otherwise.
SMALL = [
    "--ppo.batch_size=16",
    "--ppo.minibatch_size=16",
    "--ppo.microbatch_size=4",
    "--ppo.epochs=1",
    "--generation.max_new_tokens=24",
    "--generation.max_slots=4",
    "--fusion.schedule_search_budget_s=0.2",
    "--fusion.inter_stage=true",  # every rollout fused: it migrates as each iteration's drawn settings say
    "--checkpoint.interval=10",
    "--checkpoint.keep=1",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
]
FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.95)
BAD_ROWS: dict[str, bytes | None] = {  # kind -> line written (None: an over-long prompt, built from max_prompt_len)
    "malformed JSON": b'{"prompt": "2 + 2 =',
    "invalid UTF-8": b'{"prompt": "\xff\xfe"}',
    "empty prompt": b'{"prompt": "   "}',
    "missing prompt field": b'{"question": "2 + 2 ="}',
    "non-string prompt": b'{"prompt": 42}',
    "row not an object": b'["2 + 2 ="]',
    "over-long prompt": None,
}


def write_prompt_file(
    path: Path, prompts: list[str], max_prompt_len: int, seed: int, bad_fraction: float = 0.2
) -> dict[int, str]:
    """The prompts as JSONL with bad rows at random lines; returns {line number: kind} of the bad rows."""
    rng = random.Random(seed)
    lines: list[bytes] = [json.dumps({"prompt": p}).encode() for p in prompts]
    bad: list[tuple[int, str]] = []
    for _ in range(round(bad_fraction * len(prompts))):
        kind = rng.choice(sorted(BAD_ROWS))
        line = BAD_ROWS[kind] or json.dumps({"prompt": "9" * (max_prompt_len + 1 + rng.randrange(50))}).encode()
        pos = rng.randrange(len(lines) + 1)
        lines.insert(pos, line)
        bad = [(i + 1 if i >= pos else i, k) for i, k in bad] + [(pos, kind)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {i + 1: k for i, k in sorted(bad)}


def _stress_rank(argv: list[str], steps: int, seed: int, injected: dict[int, str]) -> dict[str, Any]:
    from collections.abc import Sequence

    from fusedrl.config import load_config
    from fusedrl.generation import Request
    from fusedrl.rlhf import Experience
    from fusedrl.rollout_fusion import RolloutResult
    from fusedrl.trainer import Trainer

    cfg = load_config(argv)
    trainer = Trainer(cfg)
    report = trainer.dataset.report
    overlong = sorted(i for i, k in injected.items() if k == "over-long prompt")
    bad_lines = sorted(int(b.where.split()[-1]) for b in report.bad)
    if bad_lines != sorted(set(injected) - set(overlong)) or report.overlong_dropped != len(overlong):
        raise AssertionError(f"data report does not match the injected rows: {report.summary()}; injected {injected}")

    ctl, rng = trainer.controller, random.Random(seed)  # same draws on every rank
    settings: list[tuple[Any, str, int]] = []
    ledger: list[dict[str, Any]] = []
    train_step, run_rollout = trainer.train_step, ctl.run

    def randomized_step(step: int) -> dict[str, float]:
        ctl.threshold = rng.choice([*FRACTIONS, "auto"])
        ctl.mode = rng.choice(["kv", "reprefill"])
        ctl.check_interval = rng.randint(1, 4)
        settings.append((ctl.threshold, ctl.mode, ctl.check_interval))
        return train_step(step)

    def audited_rollout(requests: Sequence[Request], **options: Any) -> RolloutResult[Experience]:
        result = run_rollout(requests, **options)
        asked: list[list[int]] = [[] for _ in range(dist.get_world_size())]  # every slot is overwritten
        dist.all_gather_object(asked, [int(r.id) for r in requests])
        scored_ids: list[int] = []
        for e in result.scored:
            assert e.sample_ids is not None  # scoring sets sample_ids on every batch it returns
            scored_ids += e.sample_ids.tolist()
        m = result.migration
        ledger.append(
            {
                "requested": sorted(i for ids in asked for i in ids),
                "scored": scored_ids,
                "moved": m.moved if m else 0,
                "kept": len(m.kept) if m else 0,
            }
        )
        return result

    trainer.train_step, ctl.run = randomized_step, audited_rollout  # type: ignore[method-assign]
    history = trainer.train()
    scored = [i for e in ledger for i in e["scored"]]
    per_step_bad = [s for s, e in enumerate(ledger, 1) if sorted(e["scored"]) != e["requested"]]
    return {
        "steps": len(history),
        "settings": settings,
        "migrations": sum(1 for e in ledger if e["kept"]),
        "kept_counts": sorted({e["kept"] for e in ledger if e["kept"]}),
        "moved": sum(e["moved"] for e in ledger),
        "requested": sum(len(e["requested"]) for e in ledger),
        "scored": len(scored),
        "lost": len(set(range(steps * cfg.ppo.batch_size)) - set(scored)),
        "duplicated": len(scored) - len(set(scored)),
        "steps_not_reconciled": per_step_bad,
        "skipped_updates": sum(h.get("skipped_updates", 0) for h in history),
        "data": report.summary(max_listed=0),
    }


def stress(
    out: Path,
    *,
    steps: int = 50,
    nproc: int = 4,
    seed: int = 0,
    overrides: list[str] | tuple[str, ...] = (),
    timeout_s: float = 1800.0,
    pool: MultiRankPool | None = None,
) -> dict[str, Any]:
    """Run the stress test on ``nproc`` gloo ranks (``pool``'s if given); returns rank 0's figures (raises if anything is lost)."""
    from fusedrl.config import load_config
    from fusedrl.tasks.debug import sample_prompts
    from fusedrl.train import prepare

    out.mkdir(parents=True, exist_ok=True)
    base = ["--job.config_file", str(CONFIG), *SMALL, *overrides]
    cfg = load_config(base)
    prompts = sample_prompts(256, seed)
    data = out / "prompts.jsonl"
    injected = write_prompt_file(data, prompts, cfg.data.max_prompt_len, seed)
    argv = [*base, "--data.format=jsonl", f"--data.path={data}", f"--job.output_dir={out}", f"--training.steps={steps}"]
    argv += [f"--model.{k}={ROOT / v}" for k in ("actor_path", "critic_path", "reward_path") if (v := getattr(cfg.model, k))]
    prepare(argv, world_size=nproc)  # the config and path checks of `python -m fusedrl.train`, before any process starts
    start = time.perf_counter()
    result = run_on_ranks(pool, _stress_rank, nproc, argv, steps, seed, injected, timeout_s=timeout_s)[0]
    result["wall_s"] = time.perf_counter() - start
    result["bad_rows_injected"] = {k: sum(1 for v in injected.values() if v == k) for k in BAD_ROWS}
    if result["lost"] or result["duplicated"] or result["steps_not_reconciled"] or result["scored"] != steps * cfg.ppo.batch_size:
        raise AssertionError(f"stress run lost or duplicated samples: {result}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("outputs/stress"))
    args, overrides = ap.parse_known_args(argv)
    r = stress(args.out, steps=args.steps, nproc=args.nproc, seed=args.seed, overrides=overrides)
    thresholds = sorted({str(t) for t, _, _ in r["settings"]})
    print(
        f"stress: {r['steps']} iterations on {args.nproc} ranks in {r['wall_s']:.0f} s; thresholds tried {thresholds}, "
        f"modes {sorted({m for _, m, _ in r['settings']})}, check intervals {sorted({k for _, _, k in r['settings']})}"
    )
    print(f"  data: {r['data']}; injected {r['bad_rows_injected']}")
    print(
        f"  migrations {r['migrations']} of {r['steps']} iterations (kept instances: {r['kept_counts']}), "
        f"{r['moved']} requests moved"
    )
    print(
        f"  samples requested {r['requested']}, scored {r['scored']}, lost {r['lost']}, duplicated {r['duplicated']}; "
        f"skipped updates {r['skipped_updates']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
