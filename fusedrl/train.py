"""The training command: ``torchrun --nproc_per_node 4 -m fusedrl.train --job.config_file train_configs/debug_ppo.toml``.

Loads and checks the config (bad configs are refused with a one-line ``error: ...`` and exit status 2 before any
process group starts), starts the process group and runs :class:`fusedrl.trainer.Trainer`.
"""

from __future__ import annotations

import os
import sys
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path


def _training_setting(argv: list[str], key: str) -> object:
    """``training.<key>`` as this command sets it, read before torch loads: from the command line (its text), else
    from the config file (its TOML value), else None. :func:`fusedrl.config.load_config` checks it later."""
    given: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in (f"--training.{key}", "--job.config_file"):
            given[name] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if f"--training.{key}" in given:
        return given[f"--training.{key}"]
    if "--job.config_file" in given:
        try:
            with open(given["--job.config_file"], "rb") as f:
                training = tomllib.load(f).get("training")
            return training.get(key) if isinstance(training, dict) else None
        except (OSError, ValueError):  # unreadable, not UTF-8, not TOML: load_config names the problem
            pass
    return None


def runs_on_cpu(argv: list[str], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this command's ranks compute on the CPU, told before torch loads: ``training.device`` from the command
    line, else from the config file, and for "auto" whether an NVIDIA GPU is visible (the driver lists one and
    CUDA_VISIBLE_DEVICES does not hide them). :func:`fusedrl.distributed.select_device` decides the device itself once
    torch is up; this only chooses settings that must precede torch's import."""
    device = _training_setting(argv, "device")
    if device in ("cpu", "cuda"):
        return device == "cpu"
    gpus = Path("/proc/driver/nvidia/gpus")
    return environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or not (gpus.is_dir() and any(gpus.iterdir()))


def reuses_host_memory(argv: list[str]) -> bool:
    """Whether ``training.reuse_host_memory`` is on (its default) for this command, told before any thread starts."""
    value = _training_setting(argv, "reuse_host_memory")
    return not (value is False or (isinstance(value, str) and value.lower() == "false"))


# Read once, when torch loads GNU OpenMP: so before the first torch import, and on CPU ranks only (a GPU rank's host
# threads should sleep, not spin beside inductor's compile workers). With the default policy, once gloo has run a large
# collective (it copies tensors on threads of its own), the main thread's OpenMP workers are woken for each parallel
# region (as we read it: more OpenMP threads than cores stop their spinning), which costs more than a small kernel: on
# 2 threads a bf16 [16, 576] x [576, 1536] linear took 47 us before the trainer's first large gloo collective and 92 us
# after, and the whole decode ran 1.9x slower (docs/ppo.md, "Threads"). "active" keeps them ready; an idle process
# still sleeps.
if runs_on_cpu(sys.argv[1:]):
    os.environ.setdefault("OMP_WAIT_POLICY", "active")
    if reuses_host_memory(sys.argv[1:]):
        # before any thread starts (gloo's, the trainer's), so that all of them allocate from the heap that the
        # trainer keeps for reuse (fusedrl.hardware.share_one_heap); imports torch, after the line above
        from fusedrl.hardware import share_one_heap

        share_one_heap()

import torch.distributed as dist  # noqa: E402

from fusedrl.components import init_logging  # noqa: E402
from fusedrl.config import InputError, JobConfig, load_config, run_checks  # noqa: E402
from fusedrl.distributed import Heartbeat, describe_failure, init_distributed  # noqa: E402
from fusedrl.tasks import load_task  # noqa: E402
from fusedrl.trainer import Trainer, use_device  # noqa: E402

USAGE = """\
usage: torchrun --nproc_per_node N -m fusedrl.train --job.config_file FILE [--section.key=VALUE ...]

Trains PPO as the config says (N = parallelism.pp * dp_shard * tp). Every config key follows; docs/ppo.md
explains how the trainer uses them.
"""


STARTUP_ERROR_WAIT_S = 30.0  # how long ranks other than 0 wait for rank 0 to report a bad config


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train with an already initialised default process group (what torchrun and tests call)."""
    use_device(cfg)
    return Trainer(cfg).train()


def prepare(argv: list[str], world_size: int | None = None) -> JobConfig:
    """Load the config and run the startup checks (:func:`fusedrl.config.run_checks`) for ``world_size`` ranks
    (default: $WORLD_SIZE, else 1; then the node checks use $LOCAL_WORLD_SIZE when set), and build the models the task
    trains first (``job.task``'s assets) when missing; raises ConfigError. Needs no process group."""
    cfg = load_config(argv)
    local_world_size = None
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    run_checks(cfg, world_size, local_world_size)  # before building anything
    assets = getattr(load_task(cfg.job.task), "assets", None)
    if assets is not None and assets.missing(cfg) is not None:
        assets.build(cfg)
        run_checks(cfg, world_size, local_world_size)  # now the built assets' paths and tokenizer too
    return cfg


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 when training finished, 2 on bad input (config, checkpoint, dataset: one line from one
    rank, no traceback); any other failure prints one line per rank and raises."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        from fusedrl.config.__main__ import USAGE as CONFIG_USAGE
        from fusedrl.config.__main__ import help_text

        print(USAGE + help_text().removeprefix(CONFIG_USAGE))
        return 0
    init_logging()
    try:
        cfg = prepare(argv)
    except InputError as e:  # every rank finds the same problem: rank 0 says it
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # a launcher stops every worker once one exits: leaving first could stop rank 0 before it says it
            time.sleep(STARTUP_ERROR_WAIT_S)
        return 2
    init_distributed(cfg.training.device, timeout_s=cfg.training.collective_timeout_s)
    heartbeat = Heartbeat.from_env()
    trainer = None
    try:
        use_device(cfg)
        trainer = Trainer(cfg)
        trainer.train()
        dist.barrier()
    except InputError as e:  # found while loading checkpoints or data, maybe by some ranks only: the first says it
        # one claim per launch attempt: the store of a torchrun agent outlives a restart of its workers
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if heartbeat is None or heartbeat.claim(f"input_error/{attempt}"):
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        advice = ""
        if trainer is not None and trainer.step > 0 and trainer.ckpt.latest_step() is not None:
            advice = (
                '; rerunning the same command (checkpoint.resume = "auto") continues from the last complete checkpoint'
                if cfg.checkpoint.resume == "auto"
                else "; restart with --checkpoint.resume=true to continue from the last complete checkpoint"
            )
        print(f"error: {describe_failure(e, dist.get_rank(), heartbeat)}{advice}", file=sys.stderr, flush=True)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
