"""Prompt datasets (JSONL, Parquet, on-disk HF dataset, or a task's generated prompts) and a resumable, rank-sharded loader.

A prompt field holds a plain string or a chat: a list of ``{"role", "content"}`` messages, which the
tokenizer's chat template renders (with the assistant's generation prompt appended).

Loading validates every row: malformed JSON, invalid UTF-8, a missing / null / non-string / empty
prompt, a malformed message list, a conversation the template rejects, and token ids outside the
model's vocabulary are *bad rows*; they are counted, reported with their line (JSONL) or row
(Parquet, HF) numbers, and skipped. Prompts longer than ``max_prompt_len`` tokens are dropped or
truncated (``overlong``) and counted. If no prompt is left, loading fails with an error that lists
the problems.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from fusedrl.components.tokenizer import CHAT_TEMPLATE_FIX
from fusedrl.config import ConfigError, DataSection, InputError, Startup
from fusedrl.config.checks import built_later
from fusedrl.config.loader import format_value, source_of

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet", "hf_disk", "synthetic")
OVERLONG = ("drop", "truncate")


class PromptTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@runtime_checkable
class _ChatTokenizer(Protocol):  # what chat prompts need; HFTokenizer is one
    chat_template: str | None

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...


@dataclass
class BadRow:
    where: str  # "line 7" or "row 7" (1-based)
    reason: str


@dataclass
class DataReport:
    """What loading found: rows read, prompts kept, bad rows (with positions) and over-long prompts."""

    source: str
    rows: int = 0
    kept: int = 0
    bad: list[BadRow] = field(default_factory=list)
    overlong_dropped: int = 0
    overlong_truncated: int = 0

    def summary(self, max_listed: int = 10) -> str:
        s = f"{self.source}: {self.rows} rows, {self.kept} prompts kept, {len(self.bad)} bad rows"
        s += f", {self.overlong_dropped} over-long dropped, {self.overlong_truncated} over-long truncated"
        if self.bad and max_listed > 0:
            listed = "; ".join(f"{b.where}: {b.reason}" for b in self.bad[:max_listed])
            more = f"; ... and {len(self.bad) - max_listed} more" if len(self.bad) > max_listed else ""
            s += f" ({listed}{more})"
        return s


@dataclass
class PromptDataset:
    """Tokenised prompts; ``prompts[i]`` is the text that was tokenised (a chat as its template rendered it),
    ``source_rows[i]`` is where prompt ``i`` came from (1-based line / row), ``rows[i]`` that row's fields (what an
    environment of multi-turn rollouts is built from: every column with ``whole_rows``, else the prompt's alone
    from Parquet and HF datasets; ``{prompt_key: value}`` for synthetic prompts)."""

    prompts: list[str]
    token_ids: list[list[int]]
    source_rows: list[int]
    report: DataReport
    rows: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


Prompt = str | list[dict[str, str]]
"""A prompt: text, or chat messages (``{"role", "content"}``) that the tokenizer's chat template renders."""
_Row = tuple[int, Any, str | None, dict[str, Any]]  # (line / row number, prompt value, problem, the row's fields)


def _jsonl_rows(path: Path, prompt_key: str) -> Iterator[_Row]:
    """Yield ``(line number, prompt value, problem, fields)`` per non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, f"invalid UTF-8 at byte {e.start}", {}
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                yield lineno, None, f"malformed JSON ({e.msg} at column {e.colno})", {}
                continue
            if not isinstance(row, dict):
                yield lineno, None, f"row is a JSON {type(row).__name__}, not an object", {}
                continue
            if prompt_key not in row:
                yield lineno, None, f"missing prompt field {prompt_key!r} (keys: {sorted(row)[:5]})", {}
                continue
            yield lineno, row[prompt_key], None, row


def _column_rows(values: Iterable[Any], prompt_key: str) -> Iterator[_Row]:
    for i, v in enumerate(values, start=1):
        yield i, v, None, {prompt_key: v}


def _table_rows(rows: Iterable[dict[str, Any]], prompt_key: str) -> Iterator[_Row]:
    for i, row in enumerate(rows, start=1):
        yield i, row[prompt_key], None, row


def _parquet_rows(path: Path, prompt_key: str, whole_rows: bool) -> Iterator[_Row]:
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if prompt_key not in schema.names:
        raise InputError(f"Parquet file {path} has no column {prompt_key!r} (columns: {schema.names}); set data.prompt_key")
    return _table_rows(pq.read_table(path, columns=None if whole_rows else [prompt_key]).to_pylist(), prompt_key)


def _hf_disk_rows(path: Path, prompt_key: str, split: str, whole_rows: bool) -> Iterator[_Row]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise InputError(f"HF dataset {path} has splits {list(ds)}, not {split!r}; pass split=")
        ds = ds[split]
    if prompt_key not in ds.column_names:
        raise InputError(f"HF dataset {path} has no column {prompt_key!r} (columns: {ds.column_names}); set data.prompt_key")
    return _table_rows(iter(ds if whole_rows else ds.select_columns([prompt_key])), prompt_key)


def load_prompts(
    path: str | os.PathLike | None,
    tokenizer: PromptTokenizer,
    *,
    format: str = "jsonl",
    prompt_key: str = "prompt",
    max_prompt_len: int | None = None,
    overlong: str = "drop",
    chat_template: bool = False,
    vocab_size: int | None = None,
    split: str = "train",
    texts: Sequence[Prompt] | None = None,
    whole_rows: bool = False,
) -> PromptDataset:
    """Read, validate and tokenise prompts (``whole_rows``: keep every column of a row in ``rows``).

    A chat prompt (a list of ``{"role", "content"}`` messages) is rendered by ``tokenizer.render_chat``
    and encoded without an added BOS: the template writes the special tokens itself. ``chat_template=True``
    renders plain-string prompts too, each as one user message. Either needs a tokenizer with a chat
    template (else ValueError). ``overlong="truncate"`` keeps the *last* ``max_prompt_len`` tokens, so the
    end of the prompt (the question and the template's assistant marker) survives. ``format="synthetic"``
    takes the prompts from ``texts`` (a task's own generator, e.g. ``fusedrl.tasks.debug.sample_prompts``;
    ``path`` is ignored).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown data.format {format!r}; valid: {', '.join(FORMATS)}")
    if overlong not in OVERLONG:
        raise ValueError(f"unknown overlong policy {overlong!r}; valid: {', '.join(OVERLONG)}")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"data.max_prompt_len must be >= 1, got {max_prompt_len}")
    chat = tokenizer if isinstance(tokenizer, _ChatTokenizer) and tokenizer.chat_template is not None else None
    if chat_template and chat is None:
        raise _no_chat_template(tokenizer, "data.chat_template = true", "or set data.chat_template = false")

    if format == "synthetic":
        if texts is None:
            raise ValueError(
                "data.format synthetic takes its prompts from texts=; pass a task's prompts "
                "(e.g. fusedrl.tasks.debug.sample_prompts(n, seed))"
            )
        source = f"synthetic prompts ({len(texts)})"
        rows = _column_rows(texts, prompt_key)
    else:
        if path is None:
            raise ValueError(f"data.path is required for format {format!r}")
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"prompt dataset {path} does not exist; fix data.path")
        source = str(path)
        if format == "jsonl":
            rows = _jsonl_rows(path, prompt_key)
        elif format == "parquet":
            rows = _parquet_rows(path, prompt_key, whole_rows)
        else:
            rows = _hf_disk_rows(path, prompt_key, split, whole_rows)

    unit = "line" if format == "jsonl" else "row"
    report = DataReport(source)
    prompts, token_ids, source_rows, fields = [], [], [], []
    for row, value, problem, values in rows:
        report.rows += 1
        is_chat = isinstance(value, list)
        if problem is None:
            problem = _check_messages(value, prompt_key) if is_chat else _check_prompt(value, prompt_key)
        if problem is None and is_chat and chat is None:
            raise _no_chat_template(tokenizer, f"{source} {unit} {row} holds chat messages", "or store plain-string prompts")
        if problem is None:
            if chat is not None and (is_chat or chat_template):
                text, ids, problem = _render_chat(chat, value if is_chat else [{"role": "user", "content": value}])
            else:
                text, ids = value, list(tokenizer.encode(value))
        if problem is None:
            bad_ids = [i for i in ids if not 0 <= i < (vocab_size if vocab_size is not None else float("inf"))]
            if bad_ids:
                problem = f"token id {bad_ids[0]} out of range for vocab size {vocab_size} (tokenizer does not match the model)"
        if problem is not None:
            report.bad.append(BadRow(f"{unit} {row}", problem))
            continue
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            if overlong == "drop":
                report.overlong_dropped += 1
                continue
            ids = ids[-max_prompt_len:]
            report.overlong_truncated += 1
        prompts.append(text)
        token_ids.append(ids)
        source_rows.append(row)
        fields.append(values)
    report.kept = len(token_ids)
    if not token_ids:
        raise InputError(f"no usable prompts left: {report.summary()}; fix the dataset, data.prompt_key or data.max_prompt_len")
    if report.bad or report.overlong_dropped or report.overlong_truncated:
        log.warning("prompt dataset %s", report.summary())
    else:
        log.info("prompt dataset %s", report.summary())
    return PromptDataset(prompts, token_ids, source_rows, report, fields)


def load_prompts_from_config(
    section: DataSection,
    tokenizer: PromptTokenizer,
    *,
    vocab_size: int,
    texts: Sequence[Prompt] | None = None,
    whole_rows: bool = False,
) -> PromptDataset:
    """The ``[data]`` section's prompts; ``chat_template = true`` renders plain prompts through the tokenizer's
    chat template, and format ``synthetic`` takes ``texts`` (the embedded task's prompts). ``whole_rows``: every
    column of a row kept (an environment reads them)."""
    return load_prompts(
        section.path,
        tokenizer,
        format=section.format,
        prompt_key=section.prompt_key,
        max_prompt_len=section.max_prompt_len,
        overlong=section.on_long_prompt,
        chat_template=section.chat_template,
        vocab_size=vocab_size,
        texts=texts,
        whole_rows=whole_rows,
    )


def check_data(startup: Startup) -> None:
    """Startup check: ``data.path`` exists (unless the format is synthetic or a task builds it later)."""
    cfg = startup.cfg
    path = cfg.data.path
    if cfg.data.format == "synthetic" or path is None or built_later(startup.assets, path) is not None:
        return
    if not Path(path).exists():
        raise ConfigError(
            f"data.path = {format_value(path)} ({source_of(cfg, 'data.path')}): not found; "
            f"give an existing {cfg.data.format} dataset"
        )


def _no_chat_template(tokenizer: PromptTokenizer, why: str, alternative: str) -> InputError:
    name = getattr(tokenizer, "path", None) or type(tokenizer).__name__
    return InputError(f"{why}, but the tokenizer {name} has no chat template; {CHAT_TEMPLATE_FIX}, {alternative}")


def _render_chat(tokenizer: _ChatTokenizer, messages: list[dict[str, Any]]) -> tuple[str, list[int], str | None]:
    """``(text, ids, problem)`` of a chat; the ids carry exactly the special tokens the template wrote."""
    try:
        text = tokenizer.render_chat(messages)
    except ValueError as e:
        return "", [], str(e)
    ids = list(tokenizer.encode(text, add_bos=False))
    return text, ids, None if ids else "the chat template rendered an empty prompt"


def _check_messages(messages: list[Any], prompt_key: str) -> str | None:
    if not messages:
        return f"prompt field {prompt_key!r} is an empty list of messages"
    for n, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            return f"message {n} is a {type(message).__name__}, not a {{role, content}} object"
        for key in ("role", "content"):
            if message.get(key) is None:
                return f"message {n} has no {key!r}" if key not in message else f"message {n} {key} is null"
            if not isinstance(message[key], str):
                return f"message {n} {key} is a {type(message[key]).__name__}, not a string (text-only chats)"
    if not any(m["content"].strip() for m in messages):
        return "every message is empty"
    return None


def _check_prompt(value: Any, prompt_key: str) -> str | None:
    if value is None:
        return f"prompt field {prompt_key!r} is null"
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"invalid UTF-8 at byte {e.start}"
        return f"prompt field {prompt_key!r} is binary, not a string (store it as a UTF-8 string column)"
    if not isinstance(value, str):
        return f"prompt field {prompt_key!r} is a {type(value).__name__}, not a string or a list of messages"
    if not value.strip():
        return "empty prompt"
    return None


@dataclass
class PromptBatch:
    """This rank's prompts of one global batch."""

    token_ids: list[list[int]]
    dataset_indices: list[int]
    sample_ids: list[int]  # unique over the whole run: position in the endless shuffled stream


class PromptLoader:
    """Deterministic, resumable, rank-sharded batches over a :class:`PromptDataset`.

    The stream is the concatenation of epochs, each a permutation of the dataset seeded by
    ``(seed, epoch)``. A global batch is the next ``batch_size * world_size`` entries of the stream
    (crossing into the next epoch when needed, so no prompt is skipped); rank ``r`` gets the ``r``-th
    slice of ``batch_size``. ``state_dict`` holds the epoch and the position in it.
    """

    def __init__(
        self, dataset: PromptDataset, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.dataset = dataset
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=g).tolist()

    def next_batch(self) -> PromptBatch:
        n = len(self.dataset)
        global_size = self.batch_size * self.world_size
        indices, sample_ids = [], []
        for _ in range(global_size):
            if self.position == n:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            indices.append(self._order[self.position])
            sample_ids.append(self.epoch * n + self.position)
            self.position += 1
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        return PromptBatch([self.dataset.token_ids[i] for i in indices[lo:hi]], indices[lo:hi], sample_ids[lo:hi])

    def __iter__(self) -> Iterator[PromptBatch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_prompts"] != len(self.dataset) or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for {state['num_prompts']} prompts with seed {state['seed']}, but this dataset has "
                f"{len(self.dataset)} prompts and seed {self.seed}; resume with the same data and job.seed"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
