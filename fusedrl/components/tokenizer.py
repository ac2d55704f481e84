"""Tokenizers behind one small protocol.

- :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` (``tokenizers`` library) and its Jinja chat template.
- :class:`TorchtuneTokenizer`: torchtune's Llama 3 (tiktoken ``tokenizer.model``) and Qwen 2.5
  (``vocab.json`` + ``merges.txt``) tokenizers.
- :class:`ByteTokenizer`: 256 byte ids plus three specials, for debug runs; ``save`` writes it as
  a ``tokenizer.json`` so the HF path can load it.

``vocab_size`` is always one more than the largest id the tokenizer can produce, which is what
:func:`check_vocab` compares with the model's embedding rows. ``decode`` never fails on bad
input: invalid UTF-8 becomes U+FFFD and ids the tokenizer does not know are dropped.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer

from fusedrl.config import ConfigError, Startup
from fusedrl.config.checks import built_later
from fusedrl.config.loader import format_value, source_of
from fusedrl.models import model_flavors

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TorchtuneTokenizer",
    "check_tokenizer",
    "check_vocab",
    "load_tokenizer",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What fusedrl needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raise ValueError if the tokenizer can produce ids the model's embedding does not have."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer ids reach {tokenizer.vocab_size - 1} but the model's vocab_size is {model_vocab_size}, "
            f"so ids >= {model_vocab_size} would index past its embedding; use a model flavor with "
            f"vocab_size >= {tokenizer.vocab_size} or the tokenizer that belongs to the model"
        )


# ---------------------------------------------------------------------------- byte-level


class ByteTokenizer:
    """Each UTF-8 byte is its own id (0-255); ``<|pad|>``=256, ``<|bos|>``=257, ``<|eos|>``=258."""

    SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")

    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif not skip_special_tokens and 256 <= i < self.vocab_size:
                out += self.SPECIAL_TOKENS[i - 256].encode()
        return out.decode("utf-8", errors="replace")

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` (+ ``tokenizer_config.json``) giving the same ids as this tokenizer.

        Its post-processor prepends ``<|bos|>``, so transformers' ``AutoTokenizer`` encodes a text as
        ``encode(text)`` does (:class:`HFTokenizer` ignores the post-processor and adds bos as asked).
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        byte_chars = _byte_level_alphabet()
        vocab = {byte_chars[b]: b for b in range(256)}
        tok = _RustTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.SPECIAL_TOKENS])
        bos = self.SPECIAL_TOKENS[self.bos_id - 256]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, self.bos_id)]
        )
        tok.save(str(folder / "tokenizer.json"))
        # the generic class: transformers must not swap in a model-specific tokenizer named by config.json
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return folder


def _byte_level_alphabet() -> list[str]:
    """The printable character GPT-2-style byte-level BPE uses for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


# ---------------------------------------------------------------------------- Hugging Face


_BOS_NAMES = ("<|begin_of_text|>", "<|bos|>", "<s>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "<|eos|>", "<|endoftext|>", "</s>", "<eos>")
_PAD_NAMES = ("<|finetune_right_pad_id|>", "<|pad|>", "<pad>")


class HFTokenizer:
    """A ``tokenizer.json`` tokenizer.

    Special tokens come from the arguments, else ``tokenizer_config.json`` next to the file, else
    well-known names (``<|begin_of_text|>``, ``<s>``, ``<|endoftext|>``, ...). ``pad`` falls back
    to ``eos``. Stop ids are ``eos`` plus any ``eos_token_id`` in ``generation_config.json``.
    The file's own post-processor is not used: ``encode`` adds bos/eos only as asked.

    ``chat_template`` is the Jinja chat template of ``chat_template.jinja`` next to the file, else the
    ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates: the one named
    ``default``), else None; :meth:`render_chat` renders it.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer file {path} does not exist; pass a tokenizer.json file or its folder")
        try:
            self._tok = _RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception
            raise ValueError(f"{path} is not a valid HF tokenizer.json ({e}); re-download it") from e
        self.path = path
        config = _read_json(path.parent / "tokenizer_config.json")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1
        self._specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

        def pick(explicit: str | None, key: str, names: tuple[str, ...]) -> int | None:
            name = explicit or _token_content(config.get(key))
            if name is not None:
                if name not in vocab:
                    raise ValueError(f"{key} {name!r} is not in the vocabulary of {path}; pass a token it has")
                return vocab[name]
            return next((vocab[n] for n in names if n in vocab), None)

        self._bos_id = pick(bos_token, "bos_token", _BOS_NAMES)
        eos_id = pick(eos_token, "eos_token", _EOS_NAMES)
        if eos_id is None:
            raise ValueError(
                f"cannot tell the end-of-sequence token of {path}; pass eos_token=... or add a tokenizer_config.json"
            )
        self._eos_id = eos_id
        pad_id = pick(pad_token, "pad_token", _PAD_NAMES)
        self._pad_id = eos_id if pad_id is None else pad_id
        gen_eos = _read_json(path.parent / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        self._stop = tuple(dict.fromkeys([eos_id, *(int(i) for i in extra)]))
        template = _chat_template_source(path.parent, config)
        self.chat_template = None if template is None else template[0]
        self._chat = None if template is None else _compile_chat_template(*template)
        named = {"bos_token": self._bos_id, "eos_token": eos_id}
        self._chat_tokens = {k: self._tok.id_to_token(i) for k, i in named.items() if i is not None}

    vocab_size = property(lambda self: self._vocab_size)
    bos_id = property(lambda self: self._bos_id)
    eos_id = property(lambda self: self._eos_id)
    pad_id = property(lambda self: self._pad_id)
    stop_token_ids = property(lambda self: self._stop)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        if add_eos:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        known = [int(i) for i in ids if 0 <= int(i) < self._vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``messages`` (``{"role", "content"}`` dicts) through the chat template, followed by the prompt that
        starts the assistant's reply: the text of HF's ``apply_chat_template(messages, tokenize=False,
        add_generation_prompt=True)``. The template writes every special token it wants (``bos_token``,
        ``eos_token`` are its variables), so encode the text with ``add_bos=False``, as HF does.

        Rendering is HF's: a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``,
        ``raise_exception``, a ``tojson`` that does not escape HTML, ``break``/``continue`` and
        ``{% generation %}`` blocks. ``strftime_now`` is left out on purpose, so a prompt does not depend on
        the day it is rendered (templates that test ``strftime_now is defined`` use their fixed date).
        Raises ValueError when there is no template or it rejects the messages.
        """
        if self._chat is None:
            raise ValueError(f"tokenizer {self.path} has no chat template; {CHAT_TEMPLATE_FIX}")
        try:
            return self._chat.render(
                messages=list(messages), tools=None, documents=None, add_generation_prompt=True, **self._chat_tokens
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    def save(self, folder: str | os.PathLike) -> Path:
        """Copy this tokenizer's files (``tokenizer.json`` and the configs and chat template beside it) into
        ``folder``, so that an exported model carries the tokenizer it was trained with."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, folder / "tokenizer.json")
        for name in _TOKENIZER_COMPANIONS:
            if (self.path.parent / name).is_file():
                shutil.copyfile(self.path.parent / name, folder / name)
        return folder


# Files next to tokenizer.json that define special tokens or the chat template (generation_config.json belongs to
# the model and is written by the export).
_TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

CHAT_TEMPLATE_FIX = (
    "use a tokenizer folder whose tokenizer_config.json has a chat_template "
    "(or with a chat_template.jinja next to tokenizer.json)"
)


def _chat_template_source(folder: Path, config: dict) -> tuple[str, Path] | None:
    """The chat template and the file it is in; a ``chat_template.jinja`` file wins, as in HF."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), jinja_file
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja_file} is not UTF-8 text ({e}); repair or delete it") from e
    where = folder / "tokenizer_config.json"
    template = config.get("chat_template")
    if isinstance(template, list):  # the older form of several named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"{where} has chat templates {sorted(map(str, named))} but none named 'default'; "
                "name the one to use 'default' or put it in chat_template.jinja next to it"
            )
        template = named["default"]
    if template is None:
        return None
    if not isinstance(template, str):
        raise ValueError(f"chat_template in {where} is a {type(template).__name__}, not a Jinja string; repair it")
    return template, where


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's marker of assistant text) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the tag
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile_chat_template(source: str, where: Path) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template in {where} does not parse (line {e.lineno}: {e.message}); fix the template") from e


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); repair or delete it") from e
    return data if isinstance(data, dict) else {}


def _token_content(entry: str | dict | None) -> str | None:
    return entry.get("content") if isinstance(entry, dict) else entry


# ---------------------------------------------------------------------------- torchtune


class TorchtuneTokenizer:
    """torchtune's Llama 3 or Qwen 2.5 tokenizer; ``.model_tokenizer`` is the torchtune object
    (chat templates: ``tokenize_messages``)."""

    def __init__(self, model_tokenizer, vocab_size: int, known_ids, stop_token_ids: Sequence[int]):
        self.model_tokenizer = model_tokenizer
        self._vocab_size = vocab_size
        self._is_known = known_ids
        self._stop = tuple(dict.fromkeys(int(i) for i in stop_token_ids if i is not None))

    @classmethod
    def llama3(cls, path: str | os.PathLike, special_tokens_path: str | os.PathLike | None = None) -> TorchtuneTokenizer:
        """From a Llama 3 tiktoken ``tokenizer.model`` file."""
        from torchtune.models.llama3 import llama3_tokenizer

        with _special_token_errors(special_tokens_path):
            tok = llama3_tokenizer(str(path), special_tokens_path=_opt_str(special_tokens_path))
        # torchtune's default table includes the vision-only <|image|> (128256), one past the rows of
        # the text models' embedding; text encoding never emits it, so it does not count here.
        text_special = {i for name, i in tok.special_tokens.items() if name != "<|image|>"}
        base = tok.base_vocab_size
        vocab_size = max(base, max(text_special) + 1)
        return cls(tok, vocab_size, lambda i: 0 <= i < base or i in text_special, tok.stop_tokens)

    @classmethod
    def qwen2_5(
        cls,
        vocab_path: str | os.PathLike,
        merges_path: str | os.PathLike,
        special_tokens_path: str | os.PathLike | None = None,
    ) -> TorchtuneTokenizer:
        """From Qwen 2.5 ``vocab.json`` and ``merges.txt`` files."""
        from torchtune.models.qwen2_5 import qwen2_5_tokenizer

        with _special_token_errors(special_tokens_path):
            tok = qwen2_5_tokenizer(str(vocab_path), str(merges_path), special_tokens_path=_opt_str(special_tokens_path))
        known = set(tok.decoder) | set(tok.special_tokens.values())
        return cls(tok, max(known) + 1, known.__contains__, tok.stop_tokens)

    vocab_size = property(lambda self: self._vocab_size)
    bos_id = property(lambda self: self.model_tokenizer.bos_id)
    eos_id = property(lambda self: self.model_tokenizer.eos_id)
    stop_token_ids = property(lambda self: self._stop)

    @property
    def pad_id(self) -> int:
        pad = self.model_tokenizer.pad_id
        return self.eos_id if pad is None else pad

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        return list(self.model_tokenizer.encode(text, add_bos=add_bos, add_eos=add_eos))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        known = [int(i) for i in ids if self._is_known(int(i))]
        tok = self.model_tokenizer
        if hasattr(tok, "tt_model"):  # Llama 3: do not cut at eos, the caller decides where to stop
            return tok.decode(known, truncate_at_eos=False, skip_special_tokens=skip_special_tokens)
        return tok.decode(known, skip_special_tokens=skip_special_tokens)


def _opt_str(path: str | os.PathLike | None) -> str | None:
    return None if path is None else str(path)


@contextmanager
def _special_token_errors(special_tokens_path: str | os.PathLike | None):
    try:
        yield
    except KeyError as e:  # torchtune looks required special tokens up by name
        raise ValueError(
            f"special token {e.args[0]!r} is missing from {special_tokens_path}; pass a special-tokens file "
            "of this model family or None for torchtune's canonical table"
        ) from e


# ---------------------------------------------------------------------------- loading


def load_tokenizer(path_or_name: str | os.PathLike, kind: str | None = None) -> Tokenizer:
    """Load a tokenizer, chosen by its files.

    ``"byte"`` gives :class:`ByteTokenizer`. A ``*.json`` file, or a folder with ``tokenizer.json``,
    gives :class:`HFTokenizer`; a ``tokenizer.model`` file (also ``original/tokenizer.model`` in a
    folder) gives torchtune's Llama 3 tokenizer; a folder with ``vocab.json`` and ``merges.txt``
    gives torchtune's Qwen 2.5 tokenizer. ``kind`` ("hf" or "torchtune") forces one when a folder
    has both.
    """
    if str(path_or_name) == "byte":
        return ByteTokenizer()
    if kind not in (None, "hf", "torchtune"):
        raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: hf, torchtune (or None to pick by files)")
    path = Path(path_or_name)
    if not path.exists():
        raise ValueError(f"tokenizer path {path} does not exist; pass 'byte' or a tokenizer file/folder")
    if path.is_file():
        if path.suffix == ".json" and kind != "torchtune":
            return HFTokenizer(path)
        if path.suffix in (".model", ".tiktoken") and kind != "hf":
            return TorchtuneTokenizer.llama3(path)
        raise ValueError(f"cannot tell the tokenizer type of {path}; pass a tokenizer.json, a tokenizer.model or a folder")
    hf_file = path / "tokenizer.json"
    tiktoken_file = next((p for p in (path / "tokenizer.model", path / "original" / "tokenizer.model") if p.is_file()), None)
    has_bpe_files = (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    if hf_file.is_file() and kind != "torchtune":
        return HFTokenizer(path)
    if kind != "hf":  # torchtune's canonical special-token tables are used
        if tiktoken_file is not None:
            return TorchtuneTokenizer.llama3(tiktoken_file)
        if has_bpe_files:
            return TorchtuneTokenizer.qwen2_5(path / "vocab.json", path / "merges.txt")
    wanted = (
        "tokenizer.json"
        if kind == "hf"
        else "tokenizer.model or vocab.json + merges.txt"
        if kind
        else ("tokenizer.json, tokenizer.model, or vocab.json + merges.txt")
    )
    raise ValueError(f"no tokenizer files in {path}: expected {wanted}")


def check_tokenizer(startup: Startup) -> None:
    """Startup check of ``model.tokenizer_path`` (raises ConfigError; skipped for a tokenizer a task builds later): it
    exists and loads, its ids fit the Actor's vocabulary, and it has a chat template where the config asks for one."""
    cfg = startup.cfg
    path = cfg.model.tokenizer_path
    where = f"model.tokenizer_path = {path!r}"
    if path != "byte" and built_later(startup.assets, path) is not None:
        return
    if path != "byte" and not Path(path).exists():
        raise ConfigError(
            f"model.tokenizer_path = {format_value(path)} ({source_of(cfg, 'model.tokenizer_path')}): not found; "
            'give a tokenizer file or folder, or "byte" for the built-in byte tokenizer'
        )
    vocab_size = model_flavors(cfg, startup.assets)["actor"].vocab_size
    try:
        tokenizer = load_tokenizer(path)
        check_vocab(tokenizer, vocab_size)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if cfg.data.chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"data.chat_template = true, but the tokenizer ({where}) has no chat template; {CHAT_TEMPLATE_FIX}, "
            "or set --data.chat_template=false"
        )
