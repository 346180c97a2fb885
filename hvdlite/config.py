"""Every hvdlite configuration knob, declared once.

The body of :class:`Config` is the table: each field is declared with :func:`_knob`, which
records its parser, default, unit, environment variables and help line. Everything else is
derived from that one declaration: :data:`KNOBS`, environment parsing, YAML parsing, the
``hvdliterun`` flags and :meth:`Config.to_env`; the generated documentation
(``configs/default.yaml``, the table in docs/config.md) is tooling, in
:mod:`hvdlite.launcher.configdoc`.

Where a value comes from, strongest first (:func:`load_config`)::

    overrides (init() keyword / hvdliterun flag) > environment > YAML file > default

Environment variables are ``HVDLITE_<NAME>`` (a few keep Horovod's word order, e.g.
``HVDLITE_ENABLE_ASYNC_COMPLETION``; the table in docs/config.md lists each); the matching
Horovod variable (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``, ...) is accepted as an
alias, with the same unit as in Horovod. When both are set, the ``HVDLITE_`` one wins.

Importing this module has no side effects.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from hvdlite.errors import ConfigError

__all__ = ["KNOBS", "Config", "Knob", "format_value", "knob", "load_config", "parse_bool",
           "parse_size", "resolve"]

CONFIG_ENV = "HVDLITE_CONFIG"
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")

# ---------------------------------------------------------------------------------------------
# Value parsers. Each takes whatever a source produced (env/CLI strings, YAML scalars, Python
# objects from init()) and returns the typed value, or raises ValueError saying what it expected.
# ---------------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
# Bare letters (K, M, G, T) are binary, as in most tools that take buffer sizes.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Parse a byte count: ``4096``, ``"64MiB"``, ``"64M"``, ``"1.5GB"``, ``"0"``.

    ``KiB``/``MiB``/``GiB``/``TiB`` and the bare letters ``K``/``M``/``G``/``T`` are powers of
    1024; ``KB``/``MB``/``GB``/``TB`` are powers of 1000; units are case-insensitive. The
    result must be a whole, non-negative number of bytes. Raises ``ValueError`` otherwise.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size in bytes such as 65536 or '64MiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"expected a size >= 0 bytes, got {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"expected a size in bytes such as 65536 or '64MiB', got {text!r}")
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"expected a size such as 65536, '64MiB', '64M' or '1.5GB' "
            f"(units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), got {text!r}"
        )
    number = match.group(1)
    if "." not in number:
        return int(number) * _SIZE_UNITS[unit]
    value = float(number) * _SIZE_UNITS[unit]
    if not value.is_integer():
        raise ValueError(f"expected a whole number of bytes, got {text!r} = {value} bytes")
    return int(value)


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(value: object) -> bool:
    """A boolean: bool, 1/0, or 1/0, true/false, yes/no, on/off in any case; else ValueError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {value!r}")


def _parse_count(value: object) -> int:
    """A whole number >= 0 (an int, or a string of digits)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    return value


def _number(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, int | float):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    else:
        raise ValueError(f"expected a number, got {value!r}")
    if not math.isfinite(result):
        raise ValueError(f"expected a finite number, got {value!r}")
    return result


def _parse_positive(value: object) -> float:
    result = _number(value)
    if result <= 0:
        raise ValueError(f"expected a number > 0, got {value!r}")
    return result


def _parse_non_negative(value: object) -> float:
    result = _number(value)
    if result < 0:
        raise ValueError(f"expected a number >= 0, got {value!r}")
    return result


def _parse_optional_path(value: object) -> str | None:
    """A file path; ``None`` or an empty string means "off"."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a file path (or empty / null for off), got {value!r}")
    return value if value.strip() else None


def _parse_log_level(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in LOG_LEVELS:
        return value.strip().lower()
    raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")


IPC_MODES = ("auto", "always", "off")
STREAM_PRIORITIES = ("high", "normal")
SCHEDULE_TRANSPORTS = ("nccl", "ipc", "auto")


def _parse_stream_priority(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in STREAM_PRIORITIES:
        return value.strip().lower()
    raise ValueError(f"expected one of {', '.join(STREAM_PRIORITIES)}, got {value!r}")


def _parse_schedule_transport(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in SCHEDULE_TRANSPORTS:
        return value.strip().lower()
    raise ValueError(f"expected one of {', '.join(SCHEDULE_TRANSPORTS)}, got {value!r}")


def _parse_ipc(value: object) -> str:
    if isinstance(value, str) and value.strip().lower() in IPC_MODES:
        return value.strip().lower()
    raise ValueError(f"expected one of {', '.join(IPC_MODES)}, got {value!r}")


def _parse_ipc_buffer(value: str | int) -> int:
    size = parse_size(value)
    if size < 4096:
        raise ValueError(f"expected at least 4KiB, got {value!r}")
    return size


# ---------------------------------------------------------------------------------------------
# The knob declaration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    """One configuration knob: everything the env, YAML, CLI and docs layers need to know.

    ``kind`` is one of ``size``, ``int``, ``float``, ``bool``, ``path``, ``choice``.
    ``inverted_aliases`` are boolean env vars that mean the opposite of the knob
    (``HOROVOD_STALL_CHECK_DISABLE``).
    """

    name: str
    kind: str
    parse: Callable[[Any], Any]
    default: Any
    unit: str
    help: str
    env: str
    aliases: tuple[str, ...] = ()
    inverted_aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    flag_aliases: tuple[str, ...] = ()  # more hvdliterun spellings (horovodrun's), same unit

    @property
    def yaml_key(self) -> str:
        """The key of this knob in a YAML config file."""
        return self.name

    @property
    def flag(self) -> str:
        """The ``hvdliterun`` option for this knob (booleans also get ``--no-...``)."""
        return "--" + self.name.replace("_", "-")


def _knob(
    *,
    kind: str,
    parse: Callable[[Any], Any],
    default: Any,
    unit: str,
    help: str,
    env: str | None = None,
    aliases: tuple[str, ...] = (),
    inverted_aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] = (),
    flag_aliases: tuple[str, ...] = (),
) -> Any:
    """Declare a :class:`Config` field as a knob (the name comes from the field)."""
    spec = {
        "kind": kind, "parse": parse, "default": default, "unit": unit, "help": help,
        "env": env, "aliases": aliases, "inverted_aliases": inverted_aliases, "choices": choices,
        "flag_aliases": flag_aliases,
    }  # fmt: skip
    return dataclasses.field(default=default, metadata={"knob": spec})


_MIB = 1024 * 1024


@dataclass(frozen=True)
class Config:
    """Resolved hvdlite settings. ``Config()`` holds every default; see :func:`load_config`."""

    fusion_threshold: int = _knob(
        kind="size", parse=parse_size, default=64 * _MIB, unit="bytes",
        aliases=("HOROVOD_FUSION_THRESHOLD",),
        help="Largest fusion bucket; units accepted ('64MiB', '1GB'); 0 disables fusion.",
    )  # fmt: skip
    fusion_direct_bytes: int = _knob(
        kind="size", parse=parse_size, default=4 * _MIB, unit="bytes",
        help="GPU: a fused tensor at least this large is reduced where it lies, not copied "
             "into the fusion buffer (copying it costs more than its own launch saves).",
    )  # fmt: skip
    ipc: str = _knob(
        kind="choice", parse=_parse_ipc, default="auto", unit="", choices=IPC_MODES,
        help="GPU: when device data moves through CUDA IPC instead of NCCL. auto: ranks that "
             "share a GPU (NCCL refuses them), and buckets up to ipc_max_bytes between GPUs of "
             "one host with peer access; always: every bucket wherever the set's ranks are on "
             "one host with peer access; off: never.",
    )  # fmt: skip
    ipc_max_bytes: int = _knob(
        kind="size", parse=parse_size, default=0, unit="bytes",
        help="GPU, ipc=auto, a GPU per rank on one host: buckets up to this size take CUDA IPC, "
             "larger ones NCCL (0: NCCL for all).",
    )  # fmt: skip
    ipc_buffer_bytes: int = _knob(
        kind="size", parse=_parse_ipc_buffer, default=16 * _MIB, unit="bytes",
        help="GPU: each of a rank's two CUDA IPC staging slots (larger collectives move in "
             "chunks of this size).",
    )  # fmt: skip
    cycle_time_ms: float = _knob(
        kind="float", parse=_parse_positive, default=1.0, unit="ms",
        aliases=("HOROVOD_CYCLE_TIME",),
        help="How long the background loop batches requests before negotiating (> 0).",
    )  # fmt: skip
    cache_capacity: int = _knob(
        kind="int", parse=_parse_count, default=1024, unit="entries",
        aliases=("HOROVOD_CACHE_CAPACITY",),
        help="Tensor names whose state is kept between calls: response-cache slots, and "
             "with them each name's request, replay lane, recycled results and plans (least "
             "recently used out, agreed by every rank); a name not kept costs a full "
             "negotiation round. 0 keeps nothing (no cache).",
    )  # fmt: skip
    async_completion: bool = _knob(
        kind="bool", parse=parse_bool, default=False, unit="",
        env="HVDLITE_ENABLE_ASYNC_COMPLETION", aliases=("HOROVOD_ENABLE_ASYNC_COMPLETION",),
        help="GPU: complete handles with a CUDA event instead of a CPU wait.",
    )  # fmt: skip
    timeline: str | None = _knob(
        kind="path", parse=_parse_optional_path, default=None, unit="path",
        aliases=("HOROVOD_TIMELINE",), flag_aliases=("--timeline-filename",),
        help="Write a Chrome-trace timeline to this file; empty / null = off.",
    )  # fmt: skip
    timeline_mark_cycles: bool = _knob(
        kind="bool", parse=parse_bool, default=False, unit="",
        aliases=("HOROVOD_TIMELINE_MARK_CYCLES",),
        help="Mark each background-loop cycle in the timeline.",
    )  # fmt: skip
    timeline_max_bytes: int = _knob(
        kind="size", parse=parse_size, default=0, unit="bytes",
        help="Cap on a timeline file; past it the file is rotated to PATH.1, PATH.2, ... "
             "(0 = no cap).",
    )  # fmt: skip
    timeline_max_files: int = _knob(
        kind="int", parse=_parse_count, default=16, unit="files",
        help="With timeline_max_bytes: rotated files kept (PATH.1 ... PATH.N, the oldest "
             "removed), so a long job's timeline stays bounded on disk too. 0 keeps them all.",
    )  # fmt: skip
    timeline_device_events: bool = _knob(
        kind="bool", parse=parse_bool, default=False, unit="",
        help="GPU + timeline: time device phases with CUDA event pairs and keep stream waits "
             "and async completion, instead of the default CPU-sync fallback.",
    )  # fmt: skip
    stall_check: bool = _knob(
        kind="bool", parse=parse_bool, default=True, unit="",
        inverted_aliases=("HOROVOD_STALL_CHECK_DISABLE",),
        help="Warn about tensors that some ranks submitted and others did not.",
    )  # fmt: skip
    stall_check_time_s: float = _knob(
        kind="float", parse=_parse_positive, default=60.0, unit="s",
        env="HVDLITE_STALL_CHECK_TIME_SECONDS", aliases=("HOROVOD_STALL_CHECK_TIME_SECONDS",),
        flag_aliases=("--stall-check-warning-time-seconds",),
        help="Seconds a tensor may wait for other ranks before a stall warning.",
    )  # fmt: skip
    stall_shutdown_time_s: float = _knob(
        kind="float", parse=_parse_non_negative, default=0.0, unit="s",
        env="HVDLITE_STALL_SHUTDOWN_TIME_SECONDS",
        aliases=("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",),
        flag_aliases=("--stall-check-shutdown-time-seconds",),
        help="Seconds of stall after which hvdlite fails with StallError; 0 = never. Needs "
             "stall_check; acts no earlier than stall_check_time_s.",
    )  # fmt: skip
    peer_timeout_s: float = _knob(
        kind="float", parse=_parse_positive, default=30.0, unit="s",
        env="HVDLITE_PEER_TIMEOUT_SECONDS",
        help="hvdliterun: seconds without a heartbeat from a rank's host before the host is "
             "declared lost and the job ended (a host whose processes die is seen at once). "
             "With stall_shutdown_time_s set, at most that + 3.",
    )  # fmt: skip
    idle_backoff_max_ms: float = _knob(
        kind="float", parse=_parse_positive, default=20.0, unit="ms",
        help="Longest sleep of the background loop while no rank has work.",
    )  # fmt: skip
    gil_switch_interval_us: float = _knob(
        kind="float", parse=_parse_non_negative, default=0.0, unit="us",
        help="While hvdlite runs, cap Python's GIL switch interval (sys.setswitchinterval) at "
             "this; its background thread waits that long for the GIL whenever the training "
             "thread is busy in Python. 0 = leave it alone.",
    )  # fmt: skip
    optimizer_size1_shortcut: bool = _knob(
        kind="bool", parse=parse_bool, default=True, unit="",
        help="hvdlite.torch DistributedOptimizer at one rank registers no hooks and "
             "communicates nothing (Horovod's rule). Off: it runs the N-rank path (hooks, "
             "buckets, allreduces) at one rank; for benchmarks that measure that path.",
    )  # fmt: skip
    optimizer_schedule: bool = _knob(
        kind="bool", parse=parse_bool, default=True, unit="",
        help="hvdlite.torch DistributedOptimizer with CUDA buckets over NCCL: once every rank "
             "has shown it builds the same buckets (checked at the first step), each bucket is "
             "launched by the autograd thread itself, in the agreed order, on the schedule's "
             "own NCCL communicator (no background-thread wake-up per bucket); the same for "
             "hvdlite.torch.grouped_allreduce_init's calls after its first. Off: every "
             "bucket and call is negotiated by the background thread, as other collectives "
             "are.",
    )  # fmt: skip
    optimizer_host_schedule: bool = _knob(
        kind="bool", parse=parse_bool, default=False, unit="",
        help="hvdlite.torch DistributedOptimizer with host (CPU) buckets: put them on an "
             "agreed schedule too (each launched by the autograd thread as a nonblocking "
             "MPI allreduce on the schedule's own communicator). Off: they are negotiated "
             "and run by the background thread, beside the rest of backward.",
    )  # fmt: skip
    optimizer_max_ctas: int = _knob(
        kind="int", parse=_parse_count, default=0, unit="CTAs",
        help="CUDA thread blocks (CTAs) each NCCL collective of the optimizer's schedule may "
             "take (NCCL_MAX_CTAS for that communicator alone): an NCCL kernel holds its SMs "
             "for as long as it waits for a peer, so fewer leave more of the GPU to the "
             "backward pass the buckets overlap. 0 = NCCL's choice.",
    )  # fmt: skip
    stream_priority: str = _knob(
        kind="choice", parse=_parse_stream_priority, default="high", unit="",
        choices=STREAM_PRIORITIES,
        help="CUDA priority of hvdlite's streams (collectives, their copies, the agreed "
             "schedules): high puts their kernels ahead of compute waiting for SMs; normal "
             "(DDP's default) queues them with it. An agreed schedule takes the value it has "
             "when the schedule opens.",
    )  # fmt: skip
    schedule_transport: str = _knob(
        kind="choice", parse=_parse_schedule_transport, default="auto", unit="",
        choices=SCHEDULE_TRANSPORTS,
        help="How an agreed schedule's device buckets travel (a GPU per rank, one host for "
             "ipc): nccl; ipc: the copy engines bring each rank its share of every peer's "
             "bucket (mapped once), a short kernel reduces it, and the copy engines bring "
             "back the other shares, no SMs taken from compute; auto: nccl, and ipc for the "
             "step make_graphed_step captures where every rank can (else nccl). Read when a "
             "schedule opens.",
    )  # fmt: skip
    log_level: str = _knob(
        kind="choice", parse=_parse_log_level, default="warning", unit="",
        choices=LOG_LEVELS, aliases=("HOROVOD_LOG_LEVEL",),
        help="hvdlite logging threshold.",
    )  # fmt: skip
    nvtx: bool = _knob(
        kind="bool", parse=parse_bool, default=False, unit="",
        help="Emit NVTX ranges around the pipeline phases (needs the nvtx package).",
    )  # fmt: skip
    start_timeout_s: float = _knob(
        kind="float", parse=_parse_positive, default=30.0, unit="s",
        env="HVDLITE_START_TIMEOUT", aliases=("HOROVOD_START_TIMEOUT",),
        flag_aliases=("--start-timeout",),
        help="hvdliterun: seconds for every rank of a world to start (its wrapper reaches the "
             "launcher) before the world is ended with the hosts that did not start named.",
    )  # fmt: skip
    elastic_timeout_s: float = _knob(
        kind="float", parse=_parse_positive, default=600.0, unit="s",
        env="HVDLITE_ELASTIC_TIMEOUT", aliases=("HOROVOD_ELASTIC_TIMEOUT",),
        flag_aliases=("--elastic-timeout",),
        help="hvdliterun, elastic jobs: how long to wait for --min-np slots (a job whose hosts "
             "all failed or are gone ends at once).",
    )  # fmt: skip
    discovery_interval_s: float = _knob(
        kind="float", parse=_parse_positive, default=1.0, unit="s",
        env="HVDLITE_DISCOVERY_INTERVAL_SECONDS",
        help="hvdliterun, elastic jobs: how often the host discovery script runs (Horovod: "
             "every 1 s, no knob).",
    )  # fmt: skip

    def to_env(self, names: Collection[str] | None = None) -> dict[str, str]:
        """Return ``HVDLITE_*`` variables for every knob (or those in ``names``);
        :func:`load_config` reads them back."""
        return {k.env: format_value(k, getattr(self, k.name)) for k in KNOBS
                if names is None or k.name in names}


def _build_knobs() -> tuple[Knob, ...]:
    knobs = []
    for field in dataclasses.fields(Config):
        spec = dict(field.metadata["knob"])
        spec["env"] = spec["env"] or "HVDLITE_" + field.name.upper()
        knobs.append(Knob(name=field.name, **spec))
    return tuple(knobs)


KNOBS: tuple[Knob, ...] = _build_knobs()
_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


def knob(name: str) -> Knob:
    """Return the :class:`Knob` called ``name``; unknown names raise :class:`ConfigError`."""
    if name not in _BY_NAME:
        raise ConfigError(_unknown_key_message(name, "knob name"))
    return _BY_NAME[name]


def format_value(k: Knob, value: Any) -> str:
    """Render ``value`` of knob ``k`` as a string that ``k.parse`` reads back unchanged."""
    if k.kind == "bool":
        return "1" if value else "0"
    if value is None:
        return ""
    if k.kind == "float":
        return repr(float(value))
    return str(value)


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------


def _unknown_key_message(key: object, source: str) -> str:
    valid = [k.name for k in KNOBS]
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{source}: unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}"


def _parse(k: Knob, value: object, source: str) -> Any:
    try:
        return k.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{source}: bad value for {k.name!r}: {exc}") from exc


def _from_yaml(path: str | os.PathLike[str]) -> dict[str, tuple[Any, str]]:
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(f"config file {name!r} cannot be read: {exc.strerror}") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {name!r} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {name!r}: expected a mapping of knob names to values, "
            f"got {type(data).__name__}"
        )
    values: dict[str, tuple[Any, str]] = {}
    for key, raw in data.items():
        source = f"{name}:{key}"
        if key not in _BY_NAME:
            raise ConfigError(_unknown_key_message(key, name))
        values[key] = (_parse(_BY_NAME[key], raw, source), source)
    return values


def _from_env(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    values: dict[str, tuple[Any, str]] = {}
    for k in KNOBS:
        for var in (k.env, *k.aliases):
            if var in environ:
                values[k.name] = (_parse(k, environ[var], var), var)
                break
        else:
            for var in k.inverted_aliases:
                if var in environ:
                    values[k.name] = (not _parse(k, environ[var], var), var)
                    break
    return values


def _from_overrides(overrides: Mapping[str, object],
                    flags: bool = False) -> dict[str, tuple[Any, str]]:
    values: dict[str, tuple[Any, str]] = {}
    for key, raw in overrides.items():
        if key not in _BY_NAME:
            raise ConfigError(_unknown_key_message(key, "init argument"))
        source = _BY_NAME[key].flag if flags else f"init argument {key}="
        values[key] = (_parse(_BY_NAME[key], raw, source), source)
    return values


def resolve(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    overrides_are_flags: bool = False,
) -> tuple[Config, dict[str, str]]:
    """Like :func:`load_config`, and also say where each value came from.

    The second item maps every knob name to its source: ``"default"``, ``"<file>:<key>"``,
    the environment variable's name, or ``"init argument <name>="`` (the ``hvdliterun``
    flag instead, with ``overrides_are_flags``).
    """
    env = os.environ if environ is None else environ
    config_path = path if path is not None else (env.get(CONFIG_ENV) or None)
    chosen: dict[str, tuple[Any, str]] = {k.name: (k.default, "default") for k in KNOBS}
    if config_path is not None:
        chosen.update(_from_yaml(config_path))
    chosen.update(_from_env(env))
    chosen.update(_from_overrides(overrides or {}, overrides_are_flags))
    config = Config(**{name: value for name, (value, _) in chosen.items()})
    return config, {name: source for name, (_, source) in chosen.items()}


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Resolve the configuration: overrides > environment > YAML file > defaults.

    ``path`` is a YAML file of ``knob: value`` pairs; without it ``environ["HVDLITE_CONFIG"]``
    names the file, if set. ``environ`` defaults to ``os.environ``. Unknown keys and malformed
    values raise :class:`~hvdlite.errors.ConfigError` naming the key, its source, what was
    expected and what was got.
    """
    return resolve(path, overrides, environ)[0]
