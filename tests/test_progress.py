"""Progress of long phases: plain lines off a terminal (none for short phases), a bar on one, nothing when off."""

import io

from fusedrl.components import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_carry_counts_rate_figures_and_the_changed_total():
    out = io.StringIO()
    with Progress("step 3 rollout", 4, "req", interval=0.0, stream=out) as progress:
        progress.update(1, tok_s=250.0)
        progress.set_total(6)  # requests migrated in
        progress.update(2)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # one per update at interval 0, and the final one
    assert lines[0].startswith("step 3 rollout: 1/4 req, ") and "tok_s 250," in lines[0]
    assert lines[1].startswith("step 3 rollout: 3/6 req, ") and "tok_s 250," in lines[1]
    assert lines[2].startswith("step 3 rollout: 3/6 req, ") and lines[2].endswith("(done)")


def test_a_short_phase_or_a_disabled_one_prints_nothing():
    out = io.StringIO()
    with Progress("update", 2, "minibatch", interval=60.0, stream=out) as progress:
        progress.update(2)
    with Progress("update", 2, "minibatch", enabled=False, interval=0.0, stream=out) as progress:
        progress.update(2)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar():
    out = _Terminal()
    with Progress("step 1 update", 3, "minibatch", interval=0.0, stream=out) as progress:
        progress.update(2)
        progress.set_total(4)
        progress.update(1)
    text = out.getvalue()
    assert "step 1 update:" in text and "0/3" in text and "2/4" in text and "(done)" not in text  # tqdm redraws at its own pace


def _trainer_progress(out: str, progress: bool) -> tuple[list[tuple[str, int, int, bool]], list[int]]:
    """A 2-rank debug run (pp = 2, the tail migrating at half the batch): the trainer's progress objects (description,
    done, final total, shown) and the requests each rollout migrated."""
    from fusedrl.config import load_config
    from fusedrl.train import run
    from fusedrl.trainer import Trainer

    made: list[Progress] = []
    real = Trainer.progress

    def recorded(self, desc: str, total: int, unit: str) -> Progress:
        made.append(real(self, desc, total, unit))
        return made[-1]

    Trainer.progress = recorded  # type: ignore[method-assign]
    overrides = [
        "--job.config_file=train_configs/debug_ppo.toml",
        "--parallelism.dp_shard=1",
        "--ppo.batch_size=16",
        "--ppo.minibatch_size=8",
        "--ppo.microbatch_size=2",
        "--ppo.epochs=1",
        "--generation.max_new_tokens=24",
        "--generation.max_slots=8",
        "--generation.stop_token_ids=" + ",".join(map(str, range(0, 512, 16))),  # lengths that spread
        "--fusion.migration_threshold=0.5",
        "--fusion.migration_check_interval=1",
        "--fusion.schedule_search_budget_s=0.2",
        "--training.steps=2",
        "--checkpoint.interval=2",
        "--checkpoint.export_hf=true",
        "--metrics.trace=[]",
        f"--metrics.progress={str(progress).lower()}",
        f"--job.output_dir={out}",
    ]
    try:
        history = run(load_config(overrides))
    finally:  # the rank lives on in the session's pool
        Trainer.progress = real  # type: ignore[method-assign]
    moved = [r["migration_moved"] for r in history]
    return [(p.desc, p.done, p.total, p.enabled) for p in made], moved


def test_the_trainer_reports_each_long_phase_on_rank_0_only(tmp_path, two_ranks):
    (rank0, moved), (rank1, _) = two_ranks.run(_trainer_progress, str(tmp_path / "on"), True, timeout_s=300.0)
    assert any(moved), "requests migrated: the rollout's total must follow them"
    phases = [desc for desc, *_ in rank0]
    assert phases == [
        "step 1 rollout (rank 0's engine)",
        "step 1 update",
        "step 2 rollout (rank 0's engine)",
        "step 2 update",
        "step 2 checkpoint",
        "export of the Actor",
    ]
    assert all(enabled and done == total > 0 for _, done, total, enabled in rank0)  # each ran to its (final) total
    assert [total for desc, _, total, _ in rank0 if desc.endswith("update")] == [2, 2]  # minibatches of 8 of 16 samples
    assert all(not enabled for *_, enabled in rank1)
    off = two_ranks.run(_trainer_progress, str(tmp_path / "off"), False, timeout_s=300.0)
    assert all(not enabled for made, _ in off for *_, enabled in made)
