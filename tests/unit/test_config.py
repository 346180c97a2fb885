"""hvdlite.config: knob table, parsing, sources and their precedence, generated docs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from hvdlite.config import (
    KNOBS,
    Config,
    Knob,
    format_value,
    knob,
    load_config,
    parse_size,
    resolve,
)
from hvdlite.errors import ConfigError
from hvdlite.launcher import configdoc
from hvdlite.launcher.configdoc import default_yaml_text, markdown_table

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
MIB = 1024 * 1024

EXPECTED_DEFAULTS = {
    "fusion_threshold": 64 * MIB,
    "fusion_direct_bytes": 4 * MIB,
    "ipc": "auto",
    "ipc_max_bytes": 0,
    "ipc_buffer_bytes": 16 * MIB,
    "cycle_time_ms": 1.0,
    "cache_capacity": 1024,
    "async_completion": False,
    "timeline": None,
    "timeline_mark_cycles": False,
    "timeline_max_bytes": 0,
    "timeline_max_files": 16,
    "timeline_device_events": False,
    "stall_check": True,
    "stall_check_time_s": 60.0,
    "stall_shutdown_time_s": 0.0,
    "peer_timeout_s": 30.0,
    "start_timeout_s": 30.0,
    "elastic_timeout_s": 600.0,
    "discovery_interval_s": 1.0,
    "idle_backoff_max_ms": 20.0,
    "gil_switch_interval_us": 0.0,
    "optimizer_size1_shortcut": True,
    "optimizer_schedule": True,
    "optimizer_host_schedule": False,
    "optimizer_max_ctas": 0,
    "stream_priority": "high",
    "schedule_transport": "auto",
    "log_level": "warning",
    "nvtx": False,
}

# knob -> (HVDLITE_ variable, Horovod alias or None, env text, parsed value)
ENV_CASES = {
    "fusion_threshold": ("HVDLITE_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD", "8MiB", 8 * MIB),
    "fusion_direct_bytes": ("HVDLITE_FUSION_DIRECT_BYTES", None, "1MiB", MIB),
    "ipc": ("HVDLITE_IPC", None, "Always", "always"),
    "ipc_max_bytes": ("HVDLITE_IPC_MAX_BYTES", None, "64KiB", 64 * 1024),
    "ipc_buffer_bytes": ("HVDLITE_IPC_BUFFER_BYTES", None, "8MiB", 8 * MIB),
    "cycle_time_ms": ("HVDLITE_CYCLE_TIME_MS", "HOROVOD_CYCLE_TIME", "2.5", 2.5),
    "cache_capacity": ("HVDLITE_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY", "0", 0),
    "async_completion": (
        "HVDLITE_ENABLE_ASYNC_COMPLETION",
        "HOROVOD_ENABLE_ASYNC_COMPLETION",
        "yes",
        True,
    ),
    "timeline": ("HVDLITE_TIMELINE", "HOROVOD_TIMELINE", "/tmp/t.json", "/tmp/t.json"),
    "timeline_mark_cycles": (
        "HVDLITE_TIMELINE_MARK_CYCLES",
        "HOROVOD_TIMELINE_MARK_CYCLES",
        "1",
        True,
    ),
    "stall_check": ("HVDLITE_STALL_CHECK", None, "off", False),
    "stall_check_time_s": (
        "HVDLITE_STALL_CHECK_TIME_SECONDS",
        "HOROVOD_STALL_CHECK_TIME_SECONDS",
        "5",
        5.0,
    ),
    "stall_shutdown_time_s": (
        "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        "30",
        30.0,
    ),
    "peer_timeout_s": ("HVDLITE_PEER_TIMEOUT_SECONDS", None, "12", 12.0),
    "start_timeout_s": ("HVDLITE_START_TIMEOUT", "HOROVOD_START_TIMEOUT", "45", 45.0),
    "elastic_timeout_s": ("HVDLITE_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT", "60", 60.0),
    "discovery_interval_s": ("HVDLITE_DISCOVERY_INTERVAL_SECONDS", None, "0.05", 0.05),
    "idle_backoff_max_ms": ("HVDLITE_IDLE_BACKOFF_MAX_MS", None, "0.5", 0.5),
    "gil_switch_interval_us": ("HVDLITE_GIL_SWITCH_INTERVAL_US", None, "100", 100.0),
    "optimizer_size1_shortcut": ("HVDLITE_OPTIMIZER_SIZE1_SHORTCUT", None, "off", False),
    "optimizer_schedule": ("HVDLITE_OPTIMIZER_SCHEDULE", None, "0", False),
    "optimizer_host_schedule": ("HVDLITE_OPTIMIZER_HOST_SCHEDULE", None, "1", True),
    "optimizer_max_ctas": ("HVDLITE_OPTIMIZER_MAX_CTAS", None, "4", 4),
    "stream_priority": ("HVDLITE_STREAM_PRIORITY", None, " Normal", "normal"),
    "schedule_transport": ("HVDLITE_SCHEDULE_TRANSPORT", None, "IPC", "ipc"),
    "log_level": ("HVDLITE_LOG_LEVEL", "HOROVOD_LOG_LEVEL", "DEBUG", "debug"),
    "nvtx": ("HVDLITE_NVTX", None, "TRUE", True),
    "timeline_device_events": ("HVDLITE_TIMELINE_DEVICE_EVENTS", None, "yes", True),
    "timeline_max_bytes": ("HVDLITE_TIMELINE_MAX_BYTES", None, "1MiB", 1 << 20),
    "timeline_max_files": ("HVDLITE_TIMELINE_MAX_FILES", None, "3", 3),
}


def test_every_knob_has_its_cases_here() -> None:
    assert set(EXPECTED_DEFAULTS) == set(ENV_CASES) == {k.name for k in KNOBS}


@pytest.mark.parametrize("name", list(EXPECTED_DEFAULTS))
def test_default(name: str) -> None:
    assert getattr(Config(), name) == EXPECTED_DEFAULTS[name]
    assert getattr(load_config(environ={}), name) == EXPECTED_DEFAULTS[name]
    assert knob(name).default == EXPECTED_DEFAULTS[name]


@pytest.mark.parametrize("name", list(ENV_CASES))
def test_env_var_and_alias(name: str) -> None:
    var, alias, text, value = ENV_CASES[name]
    assert knob(name).env == var
    assert getattr(load_config(environ={var: text}), name) == value
    if alias is not None:
        assert alias in knob(name).aliases
        assert getattr(load_config(environ={alias: text}), name) == value


def test_hvdlite_variable_beats_horovod_alias() -> None:
    env = {"HOROVOD_FUSION_THRESHOLD": "1000", "HVDLITE_FUSION_THRESHOLD": "2000"}
    assert load_config(environ=env).fusion_threshold == 2000


@pytest.mark.parametrize(("text", "expected"), [("1", False), ("0", True), ("no", True)])
def test_stall_check_disable_is_an_inverted_alias(text: str, expected: bool) -> None:
    config = load_config(environ={"HOROVOD_STALL_CHECK_DISABLE": text})
    assert config.stall_check is expected


def test_stall_check_plain_variable_beats_inverted_alias() -> None:
    env = {"HOROVOD_STALL_CHECK_DISABLE": "1", "HVDLITE_STALL_CHECK": "1"}
    assert load_config(environ=env).stall_check is True


def test_cycle_time_alias_keeps_horovod_milliseconds() -> None:
    assert load_config(environ={"HOROVOD_CYCLE_TIME": "5"}).cycle_time_ms == 5.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        (4096, 4096),
        ("64MiB", 64 * MIB),
        ("64M", 64 * MIB),
        ("64mib", 64 * MIB),
        ("1KiB", 1024),
        ("1KB", 1000),
        ("1.5GB", 1_500_000_000),
        ("1.5KiB", 1536),
        ("2GiB", 2 * 1024**3),
        ("3 MB", 3_000_000),
        ("100B", 100),
        ("1TiB", 1024**4),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "-1", -1, "1.3B", "64XB", "1e6", True, "MiB", 2.5])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="expected"):
        parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [(t, True) for t in ("1", "true", "True", "YES", "on", " On ")]
    + [(t, False) for t in ("0", "false", "FALSE", "no", "off")],
)
def test_bool_env_values(text: str, expected: bool) -> None:
    assert load_config(environ={"HVDLITE_NVTX": text}).nvtx is expected


@pytest.mark.parametrize("bad", ["2", "", "maybe", "y", "enabled"])
def test_bool_env_rejects(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"HVDLITE_NVTX.*'nvtx'.*expected a boolean.*got"):
        load_config(environ={"HVDLITE_NVTX": bad})


def test_empty_timeline_means_off() -> None:
    assert load_config(environ={"HOROVOD_TIMELINE": ""}).timeline is None
    assert load_config(overrides={"timeline": None}, environ={}).timeline is None


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_values(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "c.yaml",
        "fusion_threshold: 16MiB\ncycle_time_ms: 3\nasync_completion: yes\n"
        "timeline: /tmp/x.json\nlog_level: INFO\n",
    )
    config = load_config(path, environ={})
    assert config.fusion_threshold == 16 * MIB
    assert config.cycle_time_ms == 3.0
    assert config.async_completion is True
    assert config.timeline == "/tmp/x.json"
    assert config.log_level == "info"
    assert config.cache_capacity == 1024


def test_yaml_from_hvdlite_config_variable(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "cache_capacity: 7\n")
    assert load_config(environ={"HVDLITE_CONFIG": str(path)}).cache_capacity == 7


def test_explicit_path_beats_hvdlite_config_variable(tmp_path: Path) -> None:
    first = _write(tmp_path / "a.yaml", "cache_capacity: 1\n")
    second = _write(tmp_path / "b.yaml", "cache_capacity: 2\n")
    assert load_config(second, environ={"HVDLITE_CONFIG": str(first)}).cache_capacity == 2


def test_precedence_override_env_yaml_default(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "c.yaml", "fusion_threshold: 1000\ncycle_time_ms: 2\ncache_capacity: 3\n"
    )
    env = {"HOROVOD_FUSION_THRESHOLD": "2000", "HVDLITE_CYCLE_TIME_MS": "4"}
    config, sources = resolve(path, {"fusion_threshold": "3000"}, env)
    assert config.fusion_threshold == 3000  # override > env > yaml
    assert config.cycle_time_ms == 4.0  # env > yaml
    assert config.cache_capacity == 3  # yaml > default
    assert config.log_level == "warning"  # default
    assert sources["fusion_threshold"] == "init argument fusion_threshold="
    assert sources["cycle_time_ms"] == "HVDLITE_CYCLE_TIME_MS"
    assert sources["cache_capacity"] == f"{path}:cache_capacity"
    assert sources["log_level"] == "default"


def test_unknown_override_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"fusion_treshold": 1}, environ={})
    message = str(info.value)
    assert "init argument" in message and "'fusion_treshold'" in message
    assert "did you mean 'fusion_threshold'" in message
    for k in KNOBS:
        assert k.name in message


def test_unknown_yaml_key_names_file_and_valid_keys(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "cycle_time: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert str(path) in message and "'cycle_time'" in message
    assert "did you mean 'cycle_time_ms'" in message
    assert all(k.name in message for k in KNOBS)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"fusion_threshold": "big"}, r"init argument fusion_threshold=.*expected a size.*'big'"),
        ({"fusion_threshold": -5}, r"'fusion_threshold'.*>= 0.*-5"),
        ({"cycle_time_ms": 0}, r"'cycle_time_ms'.*> 0.*got 0"),
        ({"cycle_time_ms": "fast"}, r"'cycle_time_ms'.*expected a number.*'fast'"),
        ({"cycle_time_ms": float("nan")}, r"'cycle_time_ms'.*finite"),
        ({"cache_capacity": 1.5}, r"'cache_capacity'.*whole number.*1.5"),
        ({"cache_capacity": True}, r"'cache_capacity'.*whole number.*True"),
        ({"async_completion": 2}, r"'async_completion'.*boolean.*got 2"),
        ({"stall_check_time_s": -1}, r"'stall_check_time_s'.*> 0"),
        ({"stall_shutdown_time_s": -1}, r"'stall_shutdown_time_s'.*>= 0"),
        ({"log_level": "verbose"}, r"'log_level'.*trace, debug, info, warning, error, fatal.*"),
        ({"schedule_transport": "mpi"}, r"'schedule_transport'.*expected one of nccl, ipc.*'mpi'"),
        ({"timeline": 5}, r"'timeline'.*file path.*got 5"),
    ],
)
def test_bad_override_values(overrides: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=overrides, environ={})


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"^HOROVOD_CYCLE_TIME: bad value for 'cycle_time_ms'"):
        load_config(environ={"HOROVOD_CYCLE_TIME": "soon"})


def test_bad_yaml_value_names_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "cache_capacity: many\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}:cache_capacity: bad value.*'many'"
    ):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("text", "pattern"),
    [("- a\n- b\n", "expected a mapping"), ("a: [\n", "not valid YAML")],
)
def test_malformed_yaml_files(tmp_path: Path, text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(_write(tmp_path / "c.yaml", text), environ={})


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "absent.yaml", environ={})


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path / "c.yaml", ""), environ={}) == Config()


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        load_config(overrides={"nope": 1}, environ={})


def test_default_yaml_matches_the_table() -> None:
    text = (CONFIGS / "default.yaml").read_text(encoding="utf-8")
    assert text == default_yaml_text(), "regenerate: hvdliterun --print-default-config"
    data = yaml.safe_load(text)
    assert list(data) == [k.yaml_key for k in KNOBS]
    assert load_config(CONFIGS / "default.yaml", environ={}) == Config()
    for k in KNOBS:
        assert k.env in text and k.flag in text and all(a in text for a in k.aliases)


@pytest.mark.parametrize("name", ["latency", "throughput", "debug", "gpu-async"])
def test_example_configs_load(name: str) -> None:
    path = CONFIGS / f"{name}.yaml"
    config = load_config(path, environ={})
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert data, f"{path} sets nothing"
    for key, raw in data.items():
        assert getattr(config, key) == knob(key).parse(raw)
        assert getattr(config, key) != knob(key).default, f"{path}:{key} repeats the default"


def test_every_config_file_is_tested() -> None:
    tested = {"default", "latency", "throughput", "debug", "gpu-async"}
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == tested


def test_docs_table_is_current() -> None:
    doc = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert markdown_table() in doc, "regenerate: python -m hvdlite.launcher.configdoc --markdown"


def test_configdoc_prints_either_generated_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert configdoc.main(["--markdown"]) == 0
    assert capsys.readouterr().out == markdown_table()
    assert configdoc.main([]) == 0
    assert capsys.readouterr().out == default_yaml_text()


def test_the_library_module_carries_no_doc_generators() -> None:
    import hvdlite.config

    assert not {"default_yaml_text", "markdown_table", "_yaml_scalar"} & set(vars(hvdlite.config))


def _non_default_config() -> Config:
    return Config(
        fusion_threshold=12345,
        fusion_direct_bytes=4321,
        ipc="off",
        ipc_max_bytes=65536,
        ipc_buffer_bytes=1 << 20,
        cycle_time_ms=0.25,
        cache_capacity=0,
        async_completion=True,
        timeline="/tmp/trace.json",
        timeline_mark_cycles=True,
        timeline_max_bytes=1 << 20,
        timeline_max_files=4,
        timeline_device_events=True,
        stall_check=False,
        stall_check_time_s=1.5,
        stall_shutdown_time_s=9.0,
        peer_timeout_s=7.5,
        idle_backoff_max_ms=3.0,
        gil_switch_interval_us=200.0,
        optimizer_size1_shortcut=False,
        optimizer_schedule=False,
        optimizer_host_schedule=True,
        optimizer_max_ctas=6,
        stream_priority="normal",
        schedule_transport="ipc",
        log_level="trace",
        nvtx=True,
        start_timeout_s=5.0,
        elastic_timeout_s=12.0,
        discovery_interval_s=0.1,
    )


@pytest.mark.parametrize("config", [Config(), _non_default_config()])
def test_to_env_round_trips(config: Config) -> None:
    env = config.to_env()
    assert set(env) == {k.env for k in KNOBS}
    assert all(name.startswith("HVDLITE_") for name in env)
    assert load_config(environ=env) == config


def test_to_env_beats_horovod_aliases_in_the_same_environment() -> None:
    env = {"HOROVOD_FUSION_THRESHOLD": "1", **_non_default_config().to_env()}
    assert load_config(environ=env).fusion_threshold == 12345


def test_non_default_config_differs_everywhere() -> None:
    changed = _non_default_config()
    assert all(getattr(changed, k.name) != k.default for k in KNOBS)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_format_value_reparses(k: Knob) -> None:
    for value in (k.default, getattr(_non_default_config(), k.name)):
        assert k.parse(format_value(k, value)) == value


def test_unknown_knob_lookup() -> None:
    with pytest.raises(ConfigError, match="did you mean 'nvtx'"):
        knob("nvtxx")


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().nvtx = True  # type: ignore[misc]
