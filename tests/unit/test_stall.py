"""Stall inspector: when it warns, when it gives up, and the table it prints."""

from __future__ import annotations

import logging

import pytest

from hvdlite._control.negotiation import CoordinatorTable, StallReport
from hvdlite._control.stall import StallInspector, format_stall_table
from hvdlite._vocab.messages import Kind, Request
from hvdlite.config import Config


def req(name: str) -> Request:
    return Request(name, Kind.ALLREDUCE, "float32", (3, 2))


def stalled_table(first_seen: float = 100.0) -> CoordinatorTable:
    """Four ranks: 'grad.a' sent by ranks 0 and 2, 'grad.b' by rank 0 only, 'ok' by nobody."""
    table = CoordinatorTable(4)
    table.add(0, [req("grad.a"), req("grad.b")], now=first_seen)
    table.add(2, [req("grad.a")], now=first_seen)
    return table


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "hvdlite" and r.levelno == logging.WARNING]


def test_warning_only_after_the_warn_time(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hvdlite")
    table = stalled_table()
    insp = StallInspector(Config(stall_check_time_s=10.0))
    assert insp.check(table, 109.9) == ""
    assert warnings(caplog) == []
    assert insp.check(table, 110.0) == ""
    (msg,) = warnings(caplog)
    assert msg.startswith("hvdlite stall: 2 tensor(s) waited over 10 s for other ranks")
    assert "grad.a" in msg and "grad.b" in msg
    lines = msg.splitlines()
    assert lines[1].split() == ["tensor", "op", "dtype", "shape", "ready", "missing", "waited"]


def test_warnings_repeat_once_per_warn_period(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hvdlite")
    table = stalled_table()
    insp = StallInspector(Config(stall_check_time_s=10.0))
    for now in (110.0, 111.0, 115.0, 119.9):
        insp.check(table, now)
    assert len(warnings(caplog)) == 1
    insp.check(table, 120.0)
    assert len(warnings(caplog)) == 2


def test_quiet_check_neither_warns_nor_shuts_down(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hvdlite")
    table = stalled_table()
    insp = StallInspector(Config(stall_check_time_s=10.0, stall_shutdown_time_s=30.0))
    assert insp.check(table, 120.0, quiet=True) == ""
    assert insp.check(table, 140.0, quiet=True) == ""
    assert warnings(caplog) == []
    # Once nobody expects the stall any more, it is fatal at once (waited 40 s > 30 s).
    assert insp.check(table, 141.0).startswith("stall shutdown: tensors 'grad.a'")


def test_no_warning_when_nothing_waits(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hvdlite")
    table = CoordinatorTable(2)
    table.add(0, [req("x")], now=0.0)
    table.add(1, [req("x")], now=0.0)
    table.pop_ready()
    insp = StallInspector(Config(stall_check_time_s=1.0, stall_shutdown_time_s=2.0))
    assert insp.check(table, 1000.0) == ""
    assert warnings(caplog) == []


def test_fatal_after_shutdown_time() -> None:
    table = stalled_table()
    insp = StallInspector(Config(stall_check_time_s=10.0, stall_shutdown_time_s=30.0))
    assert insp.check(table, 129.9) == ""
    msg = insp.check(table, 130.0)
    assert msg.startswith("stall shutdown: tensors ")
    assert ("'grad.a' (missing ranks 1,3, submitted by 0,2, waited 30.0 s); "
            "'grad.b' (missing ranks 1,2,3, submitted by 0, waited 30.0 s)") in msg
    assert "raise stall_shutdown_time_s" in msg


def test_fatal_names_only_tensors_past_the_shutdown_time() -> None:
    table = stalled_table(100.0)
    table.add(1, [req("young")], now=125.0)
    insp = StallInspector(Config(stall_check_time_s=1.0, stall_shutdown_time_s=30.0))
    msg = insp.check(table, 131.0)
    assert "'grad.a'" in msg and "'grad.b'" in msg
    assert "young" not in msg


def test_fatal_lists_at_most_eight_tensors() -> None:
    table = CoordinatorTable(2)
    table.add(0, [req(f"t{i}") for i in range(11)], now=0.0)
    insp = StallInspector(Config(stall_check_time_s=1.0, stall_shutdown_time_s=5.0))
    msg = insp.check(table, 5.0)
    assert [f"'t{i}'" in msg for i in range(11)] == [True] * 8 + [False] * 3
    assert " and 3 more: " in msg


def test_shutdown_time_zero_never_fatal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hvdlite")
    table = stalled_table()
    insp = StallInspector(Config(stall_check_time_s=10.0, stall_shutdown_time_s=0.0))
    assert insp.check(table, 100_000.0) == ""
    assert len(warnings(caplog)) == 1


def test_due_every_second_when_enabled() -> None:
    insp = StallInspector(Config(stall_check_time_s=10.0))
    table = CoordinatorTable(1)
    insp.check(table, 500.0)
    assert not insp.due(500.5)
    assert insp.due(501.0)
    off = StallInspector(Config(stall_check=False))
    assert not off.due(1e12)


def test_format_stall_table() -> None:
    reports = [
        StallReport("short", "allreduce", "float32", (4,), (0,), (1, 2), 12.25),
        StallReport("n" * 40, "broadcast", "int64", (2, 3), (0, 1, 2), (), 61.0),
    ]
    lines = format_stall_table(reports).splitlines()
    assert len(lines) == 3
    head = lines[0]
    assert head.split() == ["tensor", "op", "dtype", "shape", "ready", "missing", "waited"]
    # Longest wait first; names cut to 32 characters; "-" when no rank is missing.
    assert lines[1].split() == ["n" * 32, "broadcast", "int64", "(2,", "3)", "0,1,2", "-",
                                "61.0s"]
    assert lines[2].split() == ["short", "allreduce", "float32", "(4,)", "0", "1,2", "12.2s"]
    for line in lines[1:]:  # every column starts under its heading
        cells = line.split()
        assert line.index(cells[1]) == head.index("op")
        assert line.index(cells[2]) == head.index("dtype")
        assert line.index(cells[3]) == head.index("shape")
    assert lines[1].index("0,1,2") == head.index("ready")
    assert lines[2].index("0 ") == head.index("ready")
    assert lines[2].index("1,2") == head.index("missing")
    assert lines[1].index("- ") == head.index("missing")


def test_format_empty_table_is_only_the_header() -> None:
    assert format_stall_table([]).splitlines() == [format_stall_table([])]
    assert format_stall_table([]).split() == [
        "tensor", "op", "dtype", "shape", "ready", "missing", "waited"]
