"""fusedrl.bench"""

NO_OUTPUT_OVERRIDES: tuple[str, ...] = (
    "--checkpoint.interval=0",
    "--checkpoint.resume=false",
    "--checkpoint.export_hf=false",
    "--metrics.trace=[]",
    "--metrics.jsonl=false",
    "--metrics.tensorboard=false",
    "--eval.interval=0",
)
"""Config overrides for a benchmark's trainer runs: no checkpoints, exports, traces, metrics files or held-out evaluations
(and no resume)."""
