"""Training plumbing reusable by any loop: tokenizers, prompt data, optimizers, LR schedules,
metrics, progress and checkpoints."""

from fusedrl.components.checkpoint import CheckpointManager, check_resume, export_hf, resume_step
from fusedrl.components.data import (
    DataReport,
    PromptBatch,
    PromptDataset,
    PromptLoader,
    check_data,
    load_prompts,
    load_prompts_from_config,
)
from fusedrl.components.lr_schedule import build_lr_scheduler, lr_factor
from fusedrl.components.metrics import (
    ChromeTrace,
    MetricsLogger,
    PhaseTimers,
    drop_steps_after,
    init_logging,
    length_stats,
    memory_figures,
    peak_memory_gib,
    percentile,
    read_jsonl,
    resident_memory_gib,
    save_gantt_png,
)
from fusedrl.components.optimizer import build_optimizer, clip_grad_norm, grad_norm
from fusedrl.components.progress import Progress
from fusedrl.components.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TorchtuneTokenizer,
    check_tokenizer,
    check_vocab,
    load_tokenizer,
)

__all__ = [
    "ChromeTrace",
    "CheckpointManager",
    "DataReport",
    "MetricsLogger",
    "PromptBatch",
    "PromptDataset",
    "PromptLoader",
    "PhaseTimers",
    "Progress",
    "build_lr_scheduler",
    "build_optimizer",
    "check_data",
    "check_resume",
    "check_tokenizer",
    "clip_grad_norm",
    "export_hf",
    "grad_norm",
    "length_stats",
    "load_prompts",
    "load_prompts_from_config",
    "lr_factor",
    "memory_figures",
    "peak_memory_gib",
    "resident_memory_gib",
    "percentile",
    "drop_steps_after",
    "init_logging",
    "read_jsonl",
    "resume_step",
    "save_gantt_png",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TorchtuneTokenizer",
    "check_vocab",
    "load_tokenizer",
]
