"""``python -m fusedrl.config --job.config_file FILE [--section.key=value ...] [--print] [--world_size N] [--local_world_size L]``.

Without ``--print`` it only validates. ``--help`` lists every key; ``--markdown`` prints the key table
of docs/config.md. Errors print ``error: <one line>`` to stderr and exit with status 2. With ``--world_size N``
it runs the trainer's own startup checks (:func:`fusedrl.config.checks.run_checks`: the checks each package
registers under the entry-point group ``fusedrl.config_checks``).
"""

from __future__ import annotations

import os
import sys

from fusedrl.config.checks import run_checks
from fusedrl.config.job_config import JobConfig
from fusedrl.config.loader import (
    ConfigError,
    InputError,
    config_to_toml,
    format_value,
    load_config,
    section_keys,
    section_types,
    type_name,
)

USAGE = """\
usage: python -m fusedrl.config [--job.config_file FILE] [--section.key=VALUE ...] [--print] [--world_size N]
                                [--local_world_size L]

Loads FILE (TOML), applies the overrides in order (also written --section.key VALUE; a bare
--section.key sets a bool to true; lists as 1,2,3 or [1, 2, 3]; "" unsets an optional path) and
validates the result. --print writes the effective config as TOML; --world_size N also runs every check
the trainer makes at startup for N ranks on this machine (parallel sizes, flavors, devices, paths, the
tokenizer); --local_world_size L adds its node checks for L ranks per node (torchrun's LOCAL_WORLD_SIZE:
no generation instance or TP group across nodes); --markdown prints the key table of docs/config.md.
"""


def _rows() -> list[tuple[str, str, str, str, str]]:
    """(section, key, type, default, help) for every key, in file order."""
    defaults = JobConfig()
    rows = []
    for section in section_types():
        for key, (tp, meta) in section_keys(section).items():
            default = getattr(getattr(defaults, section), key)
            rows.append((section, key, type_name(tp), "unset" if default is None else format_value(default), meta["help"]))
    return rows


def help_text() -> str:
    lines = [USAGE]
    current = None
    for section, key, tp, default, doc in _rows():
        if section != current:
            current = section
            summary = section_types()[section].__doc__
            assert summary is not None  # every section dataclass has a docstring
            lines.append(f"[{section}]  {summary.split(':', 1)[1].strip()}")
        lines.append(f"  --{section}.{key}  ({tp}; default {default})")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def markdown_table() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for section, key, tp, default, doc in _rows():
        cells = [f"`{section}.{key}`", tp, default if default == "unset" else f"`{default}`", doc]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(help_text())
        return 0
    if "--markdown" in args:
        print(markdown_table())
        return 0
    show = "--print" in args
    args = [a for a in args if a != "--print"]
    try:
        args, world_size = _pop_count(args, "--world_size")
        args, local_world_size = _pop_count(args, "--local_world_size")
        if local_world_size is not None and world_size is None:
            raise ConfigError("--local_world_size (command line): the node checks need the job's size too; add --world_size N")
        cfg = load_config(args)
        if world_size is not None:
            run_checks(cfg, world_size, local_world_size)
    except InputError as e:  # a ConfigError, or the checks not registered
        print(f"error: {e}", file=sys.stderr)
        return 2
    if show:
        sys.stdout.write(config_to_toml(cfg))
    else:
        print(f"config ok ({cfg.job.config_file or 'defaults'})")
    return 0


def _pop_count(args: list[str], flag: str) -> tuple[list[str], int | None]:
    """``args`` without ``flag N`` / ``flag=N``, and N (a positive int; None when absent)."""
    rest, value = [], None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == flag or arg.startswith(f"{flag}="):
            if "=" in arg:
                text = arg.partition("=")[2]
            else:
                text = args[i + 1] if i + 1 < len(args) else ""
                i += 1
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"{flag} (command line): expected a positive int, got {text!r}")
            value = int(text)
        else:
            rest.append(arg)
        i += 1
    return rest, value


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # stdout piped into a reader that stopped early, e.g. `| head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
