"""``horovodrun``'s flags on ``hvdliterun``: the same meanings, or an error naming why not.

Flags that set a knob under another name (``--timeline-filename``,
``--stall-check-warning-time-seconds``, ``--start-timeout``, ...) are declared with the knob
in :mod:`hvdlite.config` (``flag_aliases``). This module adds the rest: ``--fusion-threshold-mb``
(the fusion threshold in MiB), ``--config-file`` (Horovod's YAML layout), ``--check-build``,
``--output-filename``, ``--disable-cache`` (nothing is cached: accepted), ``--mpi`` (always),
``--network-interfaces``, and the flags whose meaning hvdlite cannot match, each refused with
the reason and what to use instead. Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import yaml

from hvdlite.config import knob, parse_bool

__all__ = ["UNSUPPORTED", "add_flags", "check_build_text", "config_file_overrides"]

_MIB = 1024 * 1024

# horovodrun flag -> why hvdliterun refuses it (and what to use instead).
UNSUPPORTED: dict[str, str] = {
    "--gloo": "hvdlite runs on MPI only (leave it out)",
    "--jsrun": "hvdlite starts ranks with mpiexec (give it with --mpiexec PATH)",
    "--hierarchical-allreduce": "hvdlite has no hierarchical allreduce (leave it out)",
    "--hierarchical-allgather": "hvdlite has no hierarchical allgather (leave it out)",
    "--torus-allreduce": "hvdlite has no torus allreduce (leave it out)",
    "--autotune": "hvdlite has no autotuner; set --fusion-threshold and --cycle-time-ms",
    "--autotune-log-file": "hvdlite has no autotuner",
    "--autotune-warmup-samples": "hvdlite has no autotuner",
    "--autotune-steps-per-sample": "hvdlite has no autotuner",
    "--autotune-bayes-opt-max-samples": "hvdlite has no autotuner",
    "--autotune-gaussian-process-noise": "hvdlite has no autotuner",
    "--mpi-threads-disable": "hvdlite needs MPI_THREAD_MULTIPLE for its background thread",
    "--num-nccl-streams": "hvdlite uses one NCCL stream per rank",
    "--thread-affinity": "hvdlite leaves thread placement to the OS (use --mpi-args for "
                         "binding)",
    "--gloo-timeout-seconds": "hvdlite runs on MPI only; see --peer-timeout-s",
    "--binding-args": "pass binding arguments with --mpi-args",
    "--log-with-timestamp": "hvdlite's log lines carry no timestamp option",
    "--log-hide-timestamp": "hvdlite's log lines carry no timestamp option",
    "--prefix-output-with-timestamp": "hvdliterun does not rewrite the ranks' output",
}

def _mib(value: object) -> int:
    """Horovod's ``fusion_threshold_mb`` (a number of MiB, whole or not) in bytes."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number of MiB >= 0, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number of MiB >= 0, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"expected a finite number of MiB >= 0, got {value!r}")
    return int(number * _MIB)


def _level(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a log level name, got {value!r}")
    return str(knob("log_level").parse(value.lower()))


# Horovod's --config-file sections and keys -> hvdlite knob and the parser of the value (the
# knob's own, as strict as for hvdlite's --config: null, .inf, a list or "false" for a number
# is an error naming the key, never a traceback).
_CONFIG_KEYS: dict[tuple[str, str], tuple[str, Callable[[Any], Any]]] = {
    ("params", "fusion_threshold_mb"): ("fusion_threshold", _mib),
    ("params", "cycle_time_ms"): ("cycle_time_ms", knob("cycle_time_ms").parse),
    ("params", "cache_capacity"): ("cache_capacity", knob("cache_capacity").parse),
    ("timeline", "filename"): ("timeline", knob("timeline").parse),
    ("timeline", "mark_cycles"): ("timeline_mark_cycles", parse_bool),
    ("stall_check", "enabled"): ("stall_check", parse_bool),
    ("stall_check", "warning_time_seconds"): ("stall_check_time_s",
                                              knob("stall_check_time_s").parse),
    ("stall_check", "shutdown_time_seconds"): ("stall_shutdown_time_s",
                                               knob("stall_shutdown_time_s").parse),
    ("logging", "level"): ("log_level", _level),
}
# Keys hvdlite accepts only when they ask for what it does anyway (false / off / mpi).
_NEUTRAL = {("params", "hierarchical_allreduce"), ("params", "hierarchical_allgather"),
            ("params", "torus_allreduce"), ("autotune", "enabled"),
            ("library_options", "mpi_threads_disable"), ("logging", "with_timestamp")}


def _refuse(flag: str, why: str) -> type[argparse.Action]:
    class Refuse(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: Any, option_string: str | None = None) -> None:
            parser.error(f"{flag} (horovodrun) has no hvdliterun counterpart: {why}")

    return Refuse


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add horovodrun's flags that are not knobs (and the refusals) to ``parser``."""
    group = parser.add_argument_group("horovodrun's flags (same meanings)")
    group.add_argument("--fusion-threshold-mb", type=int, metavar="MB",
                       help="the fusion threshold in MiB (Horovod's unit); as --fusion-threshold")
    group.add_argument("--config-file", metavar="FILE",
                       help="a horovodrun YAML config (params, timeline, stall_check, logging); "
                       "flags beat it, it beats the environment")
    group.add_argument("-cb", "--check-build", action="store_true",
                       help="print the frameworks, controllers and tensor operations "
                       "available, then exit")
    group.add_argument("--output-filename", metavar="DIR",
                       help="also write each rank's stdout and stderr to "
                       "DIR/rank.<rank>/stdout and stderr (rank zero-padded)")
    group.add_argument("--disable-cache", action="store_true",
                       help="accepted: hvdliterun caches no start-up checks")
    group.add_argument("--mpi", action="store_true", help="accepted: hvdlite always uses MPI")
    group.add_argument("--version", action="version",
                       version=f"hvdlite {_version('hvdlite')}")
    for flag, why in UNSUPPORTED.items():
        takes = flag.startswith("--autotune-") or flag in (
            "--num-nccl-streams", "--thread-affinity", "--gloo-timeout-seconds",
            "--binding-args")
        group.add_argument(flag, nargs=1 if takes else 0, action=_refuse(flag, why),
                           help=argparse.SUPPRESS)
    for flag in ("--no-hierarchical-allreduce", "--no-hierarchical-allgather",
                 "--no-torus-allreduce", "--no-autotune", "--no-mpi-threads-disable",
                 "--log-without-timestamp", "--no-log-hide-timestamp"):
        group.add_argument(flag, action="store_true", help=argparse.SUPPRESS)


def config_file_overrides(path: str) -> dict[str, object]:
    """The knob values a horovodrun ``--config-file`` sets; ValueError naming a key hvdlite
    cannot honour (with why) or a file that cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config-file {path}: cannot read it: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--config-file {path}: expected a mapping of sections, got "
                         f"{type(data).__name__}")
    out: dict[str, object] = {}
    for section, body in data.items():
        if section == "controller":
            if not isinstance(body, str) or body.lower() != "mpi":
                raise ValueError(f"--config-file {path}: controller {body!r}: hvdlite runs on "
                                 "MPI only")
            continue
        if not isinstance(body, dict):
            raise ValueError(f"--config-file {path}: section {section!r} must be a mapping, "
                             f"got {body!r}")
        for key, value in body.items():
            if (section, key) in _CONFIG_KEYS:
                name, parse = _CONFIG_KEYS[(section, key)]
                try:
                    out[name] = parse(value)
                except ValueError as exc:
                    raise ValueError(f"--config-file {path}: {section}.{key}: {exc}") from None
                continue
            if (section, key) in _NEUTRAL:
                with contextlib.suppress(ValueError):
                    if not parse_bool(value):
                        continue
            raise ValueError(f"--config-file {path}: {section}.{key} = {value!r} has no "
                             "hvdlite counterpart (see docs/horovod.md, 'hvdliterun and "
                             "horovodrun')")
    return out


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_build_text() -> str:
    """What ``horovodrun --check-build`` prints, for hvdlite: frameworks, controllers and
    tensor operations, ``[X]`` where available here."""

    def box(found: bool) -> str:
        return "[X]" if found else "[ ]"

    def has(module: str) -> bool:
        return importlib.util.find_spec(module) is not None

    gpu = has("cupy")
    lines = [f"hvdlite v{_version('hvdlite')}:", "", "Available Frameworks:",
             f"    {box(False)} TensorFlow", f"    {box(has('torch'))} PyTorch",
             f"    {box(False)} MXNet", f"    {box(True)} NumPy (CuPy: {box(gpu)})", "",
             "Available Controllers:", f"    {box(has('mpi4py'))} MPI", f"    {box(False)} Gloo",
             "", "Available Tensor Operations:", f"    {box(gpu)} NCCL", f"    {box(False)} DDL",
             f"    {box(False)} CCL", f"    {box(has('mpi4py'))} MPI", f"    {box(False)} Gloo",
             ""]
    return "\n".join(lines)
