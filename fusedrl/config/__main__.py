"""``python -m fusedrl.config --job.config_file FILE [--section.key=value ...] [--print] [--world_size N]``.

Without ``--print`` it only validates. ``--help`` lists every key; ``--markdown`` prints the key table
of docs/config.md. Errors print ``error: <one line>`` to stderr and exit with status 2.
"""

from __future__ import annotations

import os
import sys

from fusedrl.config.job_config import JobConfig
from fusedrl.config.loader import (
    ConfigError,
    config_to_toml,
    format_value,
    load_config,
    section_keys,
    section_types,
    type_name,
    validate_world_size,
)

USAGE = """\
usage: python -m fusedrl.config [--job.config_file FILE] [--section.key=VALUE ...] [--print] [--world_size N]

Loads FILE (TOML), applies the overrides in order (also written --section.key VALUE; a bare
--section.key sets a bool to true; lists as 1,2,3 or [1, 2, 3]; "" unsets an optional path) and
validates the result. --print writes the effective config as TOML; --world_size N also checks the
parallel sizes against N ranks; --markdown prints the key table of docs/config.md.
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
            lines.append(f"[{section}]  {section_types()[section].__doc__.split(':', 1)[1].strip()}")
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
        args, world_size = _pop_world_size(args)
        cfg = load_config(args)
        if world_size is not None:
            validate_world_size(cfg, world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if show:
        sys.stdout.write(config_to_toml(cfg))
    else:
        print(f"config ok ({cfg.job.config_file or 'defaults'})")
    return 0


def _pop_world_size(args: list[str]) -> tuple[list[str], int | None]:
    rest, value = [], None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--world_size" or arg.startswith("--world_size="):
            if "=" in arg:
                text = arg.partition("=")[2]
            else:
                text = args[i + 1] if i + 1 < len(args) else ""
                i += 1
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"--world_size (command line): expected a positive int, got {text!r}")
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
