"""Whole-training-state checkpoints with ``torch.distributed.checkpoint`` (DCP), and HF export.

A checkpoint is a folder ``<folder>/step-<N>`` holding DCP files and a ``COMPLETE`` marker. It is
written atomically: every rank writes into ``.step-<N>.tmp``; after a barrier rank 0 writes the
marker and renames the folder into place. A folder without its marker (a crash before the rename
completed) is ignored on resume with a warning, so a crash while writing never damages the
previous checkpoint. Model and optimizer states go through ``get_state_dict``/``set_state_dict``,
so FSDP2 (DTensor) shards are saved and loaded per rank without gathering.

State saved: each model (``nn.Module`` on this rank: the whole model or this rank's pipeline stage,
FQNs as in the full model), its optimizer, LR schedulers, any object with
``state_dict``/``load_state_dict`` (``extra``, e.g. the prompt dataloader; its state must be equal
on all ranks), the step, and per-rank RNG states (torch CPU/CUDA and ``random``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from fusedrl.components.tokenizer import Tokenizer
from fusedrl.config import CheckpointSection, ConfigError, JobConfig, Startup
from fusedrl.config.loader import source_of
from fusedrl.distributed import gather_full_state_dict
from fusedrl.models import LoRASpec, ModelFlavor, merge_adapters, save_hf_checkpoint, save_peft_adapter

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class _ModelState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            out["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])


class _RNGState(Stateful):
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Saves every ``interval`` steps into ``folder`` and resumes from the latest complete checkpoint.

    ``models`` maps a name to this rank's module; ``optimizers``/``schedulers`` use the same names
    (a missing name has none). ``keep_last`` keeps only the newest k complete checkpoints (None: all).
    Name pipeline stages per stage (``actor_stage0``, ``actor_stage1``, ...): DCP keeps one copy of
    every non-tensor entry per name, so two ranks holding different stages under one name would
    share one optimizer ``param_groups`` entry and fail to resume.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        models: Mapping[str, nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
        schedulers: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        *,
        interval: int = 0,
        keep_last: int | None = None,
    ) -> None:
        if interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0 (0 disables periodic saves), got {interval}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        optimizers, schedulers, extra = dict(optimizers or {}), dict(schedulers or {}), dict(extra or {})
        unknown = sorted((set(optimizers) | set(schedulers)) - set(models))
        if unknown:
            raise ValueError(f"optimizers/schedulers {unknown} have no model of the same name; models: {sorted(models)}")
        for name, obj in {**schedulers, **extra}.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"checkpoint entry {name!r} ({type(obj).__name__}) needs state_dict() and load_state_dict()")
        self.folder = Path(folder)
        self.interval = interval
        self.keep_last = keep_last
        self._models = {n: _ModelState(m, optimizers.get(n)) for n, m in models.items()}
        self._schedulers = schedulers
        self._extra = extra

    @classmethod
    def from_config(
        cls,
        section: CheckpointSection,
        output_dir: str | os.PathLike,
        models: Mapping[str, nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
        schedulers: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> CheckpointManager:
        """A manager as the ``[checkpoint]`` section says: ``folder`` relative to ``output_dir`` unless
        absolute, ``interval``, ``keep`` (0: keep all)."""
        folder = Path(section.folder)
        return cls(
            folder if folder.is_absolute() else Path(output_dir) / folder,
            models,
            optimizers,
            schedulers,
            extra,
            interval=section.interval,
            keep_last=section.keep or None,
        )

    # -------------------------------------------------------------------- paths
    def path(self, step: int) -> Path:
        return self.folder / f"step-{step:08d}"

    def _tmp_path(self, step: int) -> Path:
        return self.folder / f".step-{step:08d}.tmp"

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending; folders without the marker are skipped with a warning."""
        if not self.folder.is_dir():
            return []
        steps = []
        for p in self.folder.iterdir():
            m = _STEP_DIR.match(p.name)
            if not (m and p.is_dir()):
                continue
            if (p / COMPLETE_MARKER).is_file():
                steps.append(int(m.group(1)))
            else:
                log.warning("ignoring incomplete checkpoint %s (no %s marker; the writer likely crashed)", p, COMPLETE_MARKER)
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    # -------------------------------------------------------------------- save / load
    def should_save(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def _app_state(self, step: int) -> dict[str, Any]:
        # DCP calls state_dict()/load_state_dict() only on top-level Stateful values
        state: dict[str, Any] = {"step": step, f"rng_rank{_rank()}": _RNGState()}
        state.update({f"model.{n}": m for n, m in self._models.items()})
        state["schedulers"] = {n: s.state_dict() for n, s in self._schedulers.items()}
        state["extra"] = {n: e.state_dict() for n, e in self._extra.items()}
        return state

    def save(self, step: int, force: bool = False) -> Path | None:
        """Save if ``step`` is on the interval (or ``force``); collective over all ranks."""
        if not (force or self.should_save(step)):
            return None
        final, tmp = self.path(step), self._tmp_path(step)
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed writer
            tmp.mkdir(parents=True)
        _barrier()
        with _single_process_quiet():
            dcp.save(self._app_state(step), checkpoint_id=tmp)
        _barrier()
        if _rank() == 0:
            self._commit(tmp, final, step)
            self._prune()
        _barrier()
        return final

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        marker = tmp / COMPLETE_MARKER
        with open(marker, "w") as f:
            json.dump({"step": step, "world_size": _world()}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # an older checkpoint of the same step (e.g. a rerun); replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.folder)

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for step in self.complete_steps()[: -self.keep_last]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def load(self, step: int | None = None) -> int | None:
        """Restore the state of ``step`` (default: the latest complete one); returns it, or None if none exists."""
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        path = self.path(step)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"no complete checkpoint at {path}; complete steps: {self.complete_steps()}")
        meta = json.loads((path / COMPLETE_MARKER).read_text())
        if meta.get("world_size") != _world():
            raise ValueError(
                f"checkpoint {path} was written by {meta.get('world_size')} ranks but this run has {_world()}; "
                "resume with the same number of ranks"
            )
        state = self._app_state(step)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        absent = [n for n in self._extra if not any(k.startswith(f"extra.{n}.") for k in saved)]
        for n in absent:  # written before that component kept state: it starts fresh
            log.warning("checkpoint %s holds no %r state (written by an earlier version): %r starts fresh", path, n, n)
            del state["extra"][n]
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path)
        for n, s in self._schedulers.items():
            s.load_state_dict(state["schedulers"][n])
        for n, e in self._extra.items():
            if n not in absent:
                e.load_state_dict(state["extra"][n])
        return int(state["step"])


def resume_step(cfg: JobConfig, latest: int | None, folder: Path) -> int | None:
    """The step a run continues from, given ``latest``, the latest complete checkpoint in ``folder``: that one when
    checkpoint.resume is true or "auto", None for a fresh start (false, or "auto" without one). Raises ConfigError
    for true without one."""
    if cfg.checkpoint.resume is False:
        return None
    if latest is None and cfg.checkpoint.resume is True:
        raise ConfigError(
            f"checkpoint.resume = true ({source_of(cfg, 'checkpoint.resume')}): no complete checkpoint in "
            f"{folder}; check job.output_dir and checkpoint.folder, or set --checkpoint.resume=auto "
            "to start fresh when there is none"
        )
    return latest


def check_resume(startup: Startup) -> None:
    """Startup check: ``checkpoint.resume = true`` finds a complete checkpoint (:func:`resume_step`)."""
    cfg = startup.cfg
    if cfg.checkpoint.resume is True:
        ckpt = CheckpointManager.from_config(cfg.checkpoint, cfg.job.output_dir, {})
        resume_step(cfg, ckpt.latest_step(), ckpt.folder)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning when no group exists."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_hf(
    stages: nn.Module | list[nn.Module],
    folder: str | os.PathLike,
    flavor: str | ModelFlavor,
    role: str = "policy",
    pp_group: dist.ProcessGroup | None = None,
    tokenizer: Tokenizer | None = None,
    *,
    lora: LoRASpec | None = None,
    adapter_of: str | None = None,
) -> Path | None:
    """Write a model (pipeline stages and/or FSDP2 / TP shards over ranks) as an HF safetensors folder.

    Collective: every rank passes its own stage(s) (see ``fusedrl.distributed.gather_full_state_dict``).
    Returns the folder on global rank 0, which writes it, and None elsewhere. With the ``tokenizer`` the
    model was trained with, its bos / eos / pad ids go into ``config.json`` and ``generation_config.json``
    (eos: all the tokenizer's stop ids, so that transformers' ``generate()`` stops on them), and a
    tokenizer that can ``save`` itself (``ByteTokenizer``) writes its files into the folder.

    A LoRA model (``lora``: its adapters' spec) is written with its adapters merged into float32 weights, or with
    ``adapter_of`` (the base model's HF folder) as its adapters alone in PEFT's format.
    """
    state = gather_full_state_dict(stages, pp_group)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    if lora is not None and adapter_of is not None:
        return save_peft_adapter(state, folder, flavor, lora, adapter_of)
    if lora is not None:
        state = merge_adapters(state, lora.scale)
    bos: int | None = None
    eos: int | list[int] | None = None
    pad: int | None = None
    if tokenizer is not None:
        stop = list(dict.fromkeys([tokenizer.eos_id, *tokenizer.stop_token_ids]))
        bos, eos, pad = tokenizer.bos_id, stop[0] if len(stop) == 1 else stop, tokenizer.pad_id
    path = save_hf_checkpoint(
        {k: v.cpu() for k, v in state.items()}, folder, flavor, role, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad
    )
    save = getattr(tokenizer, "save", None)
    if callable(save):
        save(path)
    return path
