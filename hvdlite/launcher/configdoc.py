"""The knobs' generated documentation: ``configs/default.yaml`` and the table in docs/config.md.

Both are derived from the declarations in :mod:`hvdlite.config` (:data:`~hvdlite.config.KNOBS`)
and checked against the files by the unit tests. They are tooling, not library: a training
process never needs them, so they live beside ``hvdliterun --print-default-config``, which
prints :func:`default_yaml_text`. Regenerate the files with::

    hvdliterun --print-default-config > configs/default.yaml
    python -m hvdlite.launcher.configdoc --markdown   # paste under the marker in docs/config.md

Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from hvdlite.config import KNOBS, Knob

__all__ = ["default_yaml_text", "main", "markdown_table"]

# A size default is written in the largest binary unit that divides it (64MiB, not 67108864).
_BINARY_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def _yaml_scalar(k: Knob, value: Any) -> str:
    if value is None:
        return "null"
    if k.kind == "bool":
        return "true" if value else "false"
    if k.kind == "size" and value:
        for unit, size in _BINARY_UNITS:
            if value % size == 0:
                return f"{value // size}{unit}"
    return str(value)


def default_yaml_text() -> str:
    """The text of ``configs/default.yaml``: every knob, documented, set to its default."""
    lines = [
        "# hvdlite configuration: every knob at its default value.",
        "# Precedence: init() argument / hvdliterun flag > environment > this file > default.",
        "# Generated from hvdlite/config.py: hvdliterun --print-default-config > default.yaml",
    ]
    for k in KNOBS:
        unit = f" Unit: {k.unit}." if k.unit else ""
        choices = f" Choices: {', '.join(k.choices)}." if k.choices else ""
        env = ", ".join(k.aliases + tuple(f"{v} (inverted)" for v in k.inverted_aliases))
        lines += [
            "",
            f"# {k.help}{unit}{choices}",
            f"# env: {k.env}" + (f" (alias {env})" if env else "") + f"; flag: {k.flag}",
            f"{k.yaml_key}: {_yaml_scalar(k, k.default)}",
        ]
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """A Markdown table of every knob (the one in ``docs/config.md``)."""
    rows = [
        "| key / flag | default | unit | env (Horovod alias) | meaning |",
        "|---|---|---|---|---|",
    ]
    for k in KNOBS:
        aliases = [*k.aliases, *(f"{v} (inverted)" for v in k.inverted_aliases)]
        env = f"`{k.env}`" + "".join(f"<br>`{a}`" for a in aliases)
        rows.append(
            f"| `{k.name}`<br>`{'`<br>`'.join((k.flag, *k.flag_aliases))}` "
            f"| `{_yaml_scalar(k, k.default)}` | {k.unit or '-'} "
            f"| {env} | {k.help} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hvdlite.launcher.configdoc [--markdown]``: print the default YAML (or, with
    ``--markdown``, docs/config.md's knob table) to stdout; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m hvdlite.launcher.configdoc",
        description="Print configs/default.yaml, or with --markdown docs/config.md's knob table, "
        "as generated from hvdlite/config.py.",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the Markdown knob table instead of the YAML"
    )
    ns = parser.parse_args(argv)
    sys.stdout.write(markdown_table() if ns.markdown else default_yaml_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
