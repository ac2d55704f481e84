"""Every collective of a trainer run passes tensors its group's backend serves (fusedrl.testing.collectives)."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fusedrl.testing import free_port
from fusedrl.testing.collectives import CollectiveDeviceError, checked_collectives

ROOT = Path(__file__).resolve().parents[1]


def test_a_tensor_on_a_device_the_backend_does_not_serve_is_refused():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    original = dist.all_reduce
    try:
        with checked_collectives():
            dist.all_reduce(torch.ones(2))  # CPU on gloo: fine
            with pytest.raises(CollectiveDeviceError, match=r"all_reduce: a meta tensor \(2,\) .* serves \['cpu'\]"):
                dist.all_reduce(torch.ones(2, device="meta"))
            with pytest.raises(CollectiveDeviceError, match="batch_isend_irecv"):
                dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1, device="meta"), 0)])
        assert dist.all_reduce is original  # restored
    finally:
        dist.destroy_process_group()


def _checked_trainer_run(out: str) -> int:
    from fusedrl.config import load_config
    from fusedrl.trainer import Trainer

    tiny = [
        "--model.actor_path=",
        "--model.critic_path=",
        "--model.reward_path=",
        "--ppo.batch_size=8",
        "--ppo.minibatch_size=8",
        "--ppo.microbatch_size=2",
        "--ppo.epochs=1",
        "--generation.max_new_tokens=8",
        "--generation.max_slots=4",
        "--generation.stop_token_ids=" + ",".join(map(str, range(0, 512, 4))),
        "--fusion.migration_threshold=0.5",
        "--fusion.migration_check_interval=1",
        "--fusion.schedule_search_budget_s=0",
        "--training.steps=2",
        "--checkpoint.interval=1",
        "--checkpoint.export_hf=true",
        "--metrics.trace=[2]",
        "--parallelism.gen_tp=2",
        f"--job.output_dir={out}",
    ]
    with checked_collectives():
        history = Trainer(load_config(["--job.config_file", str(ROOT / "train_configs" / "debug_ppo.toml"), *tiny])).train()
    return len(history)


@pytest.mark.slow
def test_a_trainer_run_passes_every_collective_a_served_device(tmp_path, four_ranks):
    # pp=2 x dp_shard=2 training, instances of gen_tp=2: weight sync, migration, checkpoint, export and a trace
    assert four_ranks.run(_checked_trainer_run, str(tmp_path), timeout_s=300) == [2] * 4
