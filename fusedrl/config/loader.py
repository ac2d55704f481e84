"""Loading, overriding, validating and printing a :class:`JobConfig`.

``load_config(argv)`` reads ``--job.config_file FILE`` (TOML), then applies ``--section.key=value``
(or ``--section.key value``) overrides in order. Every problem raises :class:`ConfigError` with one
line naming the key, where its value came from (the file or ``command line``) and the fix.
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from functools import cache
from typing import Any, Literal, Union

from fusedrl.config.job_config import JobConfig

COMMAND_LINE = "command line"
DEFAULT = "default"


class InputError(ValueError):
    """Bad input the user fixes (config, checkpoint, dataset, tokenizer): a one-line message naming the problem and
    the fix. The trainer prints it once, from one rank, without a traceback, and exits with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


class ConfigError(InputError):
    """A bad config: a one-line message naming the key, where it came from and the fix."""


# ---------------------------------------------------------------------------- schema


def section_types() -> dict[str, type]:
    """TOML section name -> its dataclass, in file order."""
    hints = _hints(JobConfig)
    return {f.name: hints[f.name] for f in fields(JobConfig) if f.name != "sources"}


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_keys(section: str) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """Key name -> (type, field metadata) of one section, in declaration order."""
    cls = section_types()[section]
    hints = _hints(cls)
    return {f.name: (hints[f.name], f.metadata) for f in fields(cls)}


def type_name(tp: Any) -> str:
    """Short human name of a key's type, used in errors and in --help."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        quoted = ", ".join(f'"{a}"' for a in args)
        return quoted if len(args) == 1 else f"one of {quoted}"
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (' (optional; "" unsets)' if type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    return {bool: "bool (true/false)", int: "int", float: "float", str: "str"}[tp]


# ---------------------------------------------------------------------------- values


class _BadValue(Exception):
    """A value that does not fit a key's type (message completed by the caller)."""


def coerce(tp: Any, value: Any, text: bool) -> Any:
    """Convert ``value`` to type ``tp``. ``text``: it is a command-line string, else a TOML/Python value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f'; did you mean "{close[0]}"?' if close else ""
        raise _BadValue(f"expected {type_name(tp)}, got {value!r}{hint}")
    if origin in (Union, types.UnionType):
        if type(None) in args and (value is None or value == ""):
            return None
        for member in args:
            if member is type(None):
                continue
            try:
                return coerce(member, value, text)
            except _BadValue:
                pass
        raise _BadValue(f"expected {type_name(tp)}, got {value!r}")
    if origin is list:
        if text:
            stripped = value.strip()
            if stripped.startswith("["):
                try:
                    value, text = tomllib.loads(f"v = {stripped}")["v"], False
                except tomllib.TOMLDecodeError as e:
                    raise _BadValue(f"{value!r} is not a valid TOML array ({e})") from None
            else:
                value = [p.strip() for p in stripped.split(",")] if stripped else []
        if not isinstance(value, list):
            raise _BadValue(f"expected {type_name(tp)}, got {value!r}")
        return [coerce(args[0], v, text) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text:
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif text:
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise _BadValue(f"expected a finite float, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config keys of type {tp!r} are not supported")
    raise _BadValue(f"expected {type_name(tp)}, got {value!r}")


def _set(cfg: JobConfig, section: str, key: str, value: Any, source: str, text: bool) -> None:
    """Check and assign one key, recording its source."""
    sections = section_types()
    if section not in sections:
        raise ConfigError(
            f"{section}.{key} ({source}): unknown section [{section}]; {_suggest(section, list(sections))}"
            f"valid sections: {', '.join(sections)}"
        )
    keys = section_keys(section)
    if key not in keys:
        elsewhere = [f"{s}.{key}" for s in sections if key in section_keys(s)]
        hint = f"did you mean {elsewhere[0]}? " if elsewhere else _suggest(key, list(keys))
        raise ConfigError(f"{section}.{key} ({source}): unknown key in [{section}]; {hint}valid keys: {', '.join(keys)}")
    if section == "job" and key == "config_file":
        raise ConfigError(f"job.config_file ({source}): cannot be set here; pass --job.config_file FILE on the command line")
    tp, meta = keys[key]
    if value is None:  # a bare --section.key flag
        if tp is not bool and bool not in typing.get_args(tp):
            raise ConfigError(f"{section}.{key} ({source}): needs a value, e.g. --{section}.{key}=VALUE ({type_name(tp)})")
        value = "true"
    try:
        value = coerce(tp, value, text)
    except _BadValue as e:
        raise ConfigError(f"{section}.{key} ({source}): {e}") from None
    _check(section, key, value, meta, source)
    setattr(getattr(cfg, section), key, value)
    cfg.sources[f"{section}.{key}"] = source


def _check(section: str, key: str, value: Any, meta: Mapping[str, Any], source: str) -> None:
    check = meta.get("check")
    problem = check(value) if check is not None and value is not None else None
    if problem:
        raise ConfigError(f"{section}.{key} = {format_value(value)} ({source}): {problem}")


def _suggest(name: str, choices: list[str]) -> str:
    """ "did you mean X? " for the closest of ``choices``, or ""."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]}? " if close else ""


# ---------------------------------------------------------------------------- loading


def load_config(argv: list[str]) -> JobConfig:
    """Build the config from ``--job.config_file FILE`` and ``--section.key=value`` overrides.

    The file is read first wherever it appears in ``argv``; overrides then apply in order (the last
    one of a key wins). Raises :class:`ConfigError` on any problem.
    """
    config_file, overrides = _parse_argv(argv)
    cfg = JobConfig()
    if config_file is not None:
        _load_file(cfg, config_file)
    for name, value in overrides:
        section, _, key = name.partition(".")
        _set(cfg, section, key, value, COMMAND_LINE, text=True)
    validate_config(cfg)
    return cfg


def _parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str | None]]]:
    config_file: str | None = None
    overrides: list[tuple[str, str | None]] = []
    value: str | None
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if not name or "." not in name:
            raise ConfigError(
                f"{arg!r} ({COMMAND_LINE}): unexpected argument; {_qualify(name)}"
                "overrides look like --section.key=value, e.g. --ppo.clip_eps=0.2"
            )
        i += 1
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            else:
                value = None
        if name == "job.config_file":
            if not value:
                raise ConfigError(
                    f"job.config_file ({COMMAND_LINE}): needs a file, e.g. --job.config_file train_configs/debug_ppo.toml"
                )
            config_file = value
        else:
            overrides.append((name, value))
    return config_file, overrides


def _qualify(name: str) -> str:
    """Suggest the section of a key given without one (``--clip_eps`` -> ``--ppo.clip_eps``)."""
    found = [f"{s}.{name}" for s in section_types() if name and name in section_keys(s)]
    return f"did you mean --{found[0]}? " if found else ""


def _load_file(cfg: JobConfig, path: str) -> None:
    where = f"job.config_file = {path!r} ({COMMAND_LINE})"
    if not os.path.exists(path):
        raise ConfigError(f"{where}: file not found (relative paths start at {os.getcwd()}); check the path")
    if os.path.isdir(path):
        raise ConfigError(f"{where}: is a folder; give a TOML file such as train_configs/debug_ppo.toml")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: invalid TOML: {e}; fix the file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot read it ({e})") from None
    cfg.job.config_file = path
    cfg.sources["job.config_file"] = COMMAND_LINE
    sections = section_types()
    for section, table in data.items():
        if not isinstance(table, dict):
            owners = [s for s in sections if section in section_keys(s)]
            header = f"[{owners[0]}]" if owners else "its [section]"
            raise ConfigError(
                f"{section} ({path}): key outside any section; put it under {header} (valid sections: {', '.join(sections)})"
            )
        if section not in sections:
            raise ConfigError(
                f"[{section}] ({path}): unknown section; {_suggest(section, list(sections))}valid sections: {', '.join(sections)}"
            )
        for key, value in table.items():
            _set(cfg, section, key, value, path, text=False)


# ---------------------------------------------------------------------------- validation


def source_of(cfg: JobConfig, key: str) -> str:
    """Where ``key`` ("section.key") got its value: a file path, "command line", "default" or "set in Python"."""
    if key in cfg.sources:
        return cfg.sources[key]
    section, _, name = key.partition(".")
    default = getattr(getattr(JobConfig(), section), name)
    return DEFAULT if getattr(getattr(cfg, section), name) == default else "set in Python"


def validate_config(cfg: JobConfig) -> None:
    """Check every key's type and value and the rules between keys (also for configs built in Python)."""
    for section in section_types():
        obj = getattr(cfg, section)
        for key, (tp, meta) in section_keys(section).items():
            source = source_of(cfg, f"{section}.{key}")
            try:
                value = coerce(tp, getattr(obj, key), text=False)
            except _BadValue as e:
                raise ConfigError(f"{section}.{key} ({source}): {e}") from None
            _check(section, key, value, meta, source)
            setattr(obj, key, value)
    _check_batches(cfg)
    _check_split_backward(cfg)
    _check_algorithm(cfg)
    if cfg.data.format != "synthetic" and cfg.data.path is None:
        raise ConfigError(
            f'data.path ({source_of(cfg, "data.path")}): is unset but data.format = "{cfg.data.format}" '
            f"needs a dataset; set --data.path=PATH or --data.format=synthetic"
        )


def _check_split_backward(cfg: JobConfig) -> None:
    if not cfg.fusion.split_backward:
        return
    where = f"fusion.split_backward = true ({source_of(cfg, 'fusion.split_backward')})"
    if not cfg.fusion.intra_stage:
        raise ConfigError(
            f"{where}: only the fused schedule (fusion.intra_stage = true) splits backwards; turn intra_stage on or "
            "set --fusion.split_backward=false"
        )
    if cfg.training.activation_checkpointing != "none":
        raise ConfigError(
            f'{where}: torch cannot split the backward of layers recomputed in it (training.activation_checkpointing = "'
            f'{cfg.training.activation_checkpointing}"); set --training.activation_checkpointing=none or '
            "--fusion.split_backward=false"
        )


CRITIC_KEYS = ("model.critic", "model.critic_path", "parallelism.pp_critic", "optimizer.critic_lr", "ppo.value_clip_eps")
"""Keys that only a Critic reads: set with a critic-free estimator they are refused (the Critic is never built)."""


def _check_algorithm(cfg: JobConfig) -> None:
    """The advantage estimator against the group size, the Critic's keys and DAPO's options."""
    ppo, n = cfg.ppo, cfg.generation.n
    est = f"ppo.advantage_estimator = {ppo.advantage_estimator!r} ({source_of(cfg, 'ppo.advantage_estimator')})"
    if ppo.advantage_estimator in ("grpo", "rloo") and n < 2:
        raise ConfigError(
            f"{est}: compares the samples of a prompt's group, but generation.n = {n} ({source_of(cfg, 'generation.n')}); "
            "set --generation.n=2 or more (e.g. 8)"
        )
    if ppo.critic_free:
        for key in CRITIC_KEYS:
            if source_of(cfg, key) != DEFAULT:
                raise ConfigError(
                    f"{key} ({source_of(cfg, key)}): {est} trains no Critic; remove the key, or use "
                    "--ppo.advantage_estimator=gae (PPO with a Critic)"
                )
    if ppo.batch_size % n:
        raise ConfigError(
            f"ppo.batch_size = {ppo.batch_size} ({source_of(cfg, 'ppo.batch_size')}): must be a multiple of "
            f"generation.n = {n} (whole groups of samples per prompt); choose one of {n}, {2 * n}, {4 * n}, ..."
        )
    if ppo.dynamic_sampling and ppo.advantage_estimator not in ("grpo", "rloo"):
        raise ConfigError(
            f"ppo.dynamic_sampling = true ({source_of(cfg, 'ppo.dynamic_sampling')}): drops groups of equal scores, "
            f"which only grpo and rloo compare ({est}); set --ppo.advantage_estimator=grpo or --ppo.dynamic_sampling=false"
        )
    if ppo.overlong_buffer >= cfg.response_budget:
        key = "env.max_tokens" if cfg.env.env else "generation.max_new_tokens"
        raise ConfigError(
            f"ppo.overlong_buffer = {ppo.overlong_buffer} ({source_of(cfg, 'ppo.overlong_buffer')}): must be below "
            f"{key} = {cfg.response_budget} (the punished span ends there); lower it"
        )


def _check_batches(cfg: JobConfig) -> None:
    ppo, dp = cfg.ppo, cfg.parallelism.dp_shard
    if ppo.batch_size % ppo.minibatch_size:
        raise ConfigError(
            f"ppo.batch_size = {ppo.batch_size} ({source_of(cfg, 'ppo.batch_size')}): must be a multiple of "
            f"ppo.minibatch_size = {ppo.minibatch_size} ({source_of(cfg, 'ppo.minibatch_size')}); "
            f"choose a minibatch_size among {divisors(ppo.batch_size)}"
        )
    if ppo.minibatch_size % dp:
        raise ConfigError(
            f"ppo.minibatch_size = {ppo.minibatch_size} ({source_of(cfg, 'ppo.minibatch_size')}): must be a "
            f"multiple of parallelism.dp_shard = {dp} (each shard takes an equal share)"
        )
    per_shard = ppo.minibatch_size // dp
    if per_shard % ppo.microbatch_size:
        share = (
            f"ppo.minibatch_size / parallelism.dp_shard = {ppo.minibatch_size} / {dp} = {per_shard}"
            if dp > 1
            else f"ppo.minibatch_size = {per_shard}"
        )
        raise ConfigError(
            f"ppo.microbatch_size = {ppo.microbatch_size} ({source_of(cfg, 'ppo.microbatch_size')}): must divide "
            f"{share}; choose one of {divisors(per_shard)}"
        )


def divisors(n: int) -> str:
    """The divisors of ``n`` for an error's fix ("1, 2, 4"; a phrase when there are many)."""
    found = sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})
    return ", ".join(map(str, found)) if len(found) <= 16 else f"the divisors of {n}"


# ---------------------------------------------------------------------------- printing


def format_value(value: Any) -> str:
    """TOML literal of a config value (None, meaning unset, is written as "")."""
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} values as TOML")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def config_to_toml(cfg: JobConfig) -> str:
    """The whole config as TOML that :func:`load_config` reads back to an equal config."""
    overridden = [
        f"{s}.{k}"
        for s in section_types()
        for k in section_keys(s)
        if cfg.sources.get(f"{s}.{k}") == COMMAND_LINE and (s, k) != ("job", "config_file")
    ]
    lines = [
        f"# effective fusedrl config from {cfg.job.config_file or 'the defaults'}"
        + (f"; set on the command line: {', '.join(overridden)}" if overridden else "")
    ]
    for section in section_types():
        lines += ["", f"[{section}]"]
        obj = getattr(cfg, section)
        for key in section_keys(section):
            if section == "job" and key == "config_file":
                continue
            lines.append(f"{key} = {format_value(getattr(obj, key))}")
    return "\n".join(lines) + "\n"


def import_object(path: str) -> object:
    """The object a config value names as ``"package.module:attribute"`` (a dotted attribute path after the colon is
    followed), such as ``model.reward_fn`` or ``job.task``. Raises ValueError (one line) when the path is malformed,
    the module cannot be imported or the attribute is missing."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f'{path!r} is not an import path "package.module:attribute"')
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - a user module may fail to import in any way
        text = " ".join(str(e).split())[:300]
        absent = isinstance(e, ModuleNotFoundError) and e.name is not None and f"{module_name}.".startswith(f"{e.name}.")
        if absent:  # the module itself (or a package of its path) is not there
            raise ValueError(
                f"cannot import module {module_name!r} ({type(e).__name__}: {text}); check the module path and that its "
                "package is installed or on PYTHONPATH"
            ) from None
        raise ValueError(f"importing module {module_name!r} raised {type(e).__name__}: {text}; fix that module") from None
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = ":".join((module_name, ".".join(attr.split(".")[:i]))) if i else f"module {module_name!r}"
            raise ValueError(f"{where} has no attribute {part!r}; check the name after the colon")
        obj = getattr(obj, part)
    return obj
