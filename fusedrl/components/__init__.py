"""Training plumbing reusable by any loop: tokenizers, prompt data, optimizers, LR schedules,
metrics and checkpoints."""

from fusedrl.components.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TorchtuneTokenizer,
    check_vocab,
    load_tokenizer,
)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TorchtuneTokenizer",
    "check_vocab",
    "load_tokenizer",
]
