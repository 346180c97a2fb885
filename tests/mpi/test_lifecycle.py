"""Lifecycle: before init, after shutdown, pending work at shutdown, re-init, init arguments.

Tests here run their own init/shutdown cycles through the ``restart`` fixture, which leaves
hvdlite initialised with the defaults for the tests that follow.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpi_util import (
    all_inputs,
    assert_equal_result,
    make_input,
    reference_allreduce,
    seed_for,
    timed_barrier,
)

import hvdlite
from hvdlite._engine import default_engine

QUERIES = ["rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous"]


def _sum_check(hvd: Any, tag: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("lifecycle", tag)
    got = hvd.allreduce(make_input(seed, rank, (5,), "int64"), name=tag, op=hvd.Sum)
    want = reference_allreduce(all_inputs(seed, size, (5,), "int64"), "Sum")
    assert_equal_result(got, want, tag)


def _assert_unusable() -> None:
    assert not hvdlite.is_initialized()
    for query in QUERIES:
        with pytest.raises(hvdlite.NotInitializedError):
            getattr(hvdlite, query)()
    with pytest.raises(hvdlite.NotInitializedError):
        hvdlite.allreduce(np.ones(3), name="unusable")
    with pytest.raises(hvdlite.NotInitializedError):
        hvdlite.allgather_async(np.ones(3), name="unusable")
    with pytest.raises(hvdlite.NotInitializedError):
        hvdlite.barrier()


@pytest.mark.before_init
def test_calls_before_init_raise() -> None:
    """Runs first in the job (``before_init``), before the session fixture's init."""
    if hvdlite.is_initialized():
        pytest.fail("hvdlite was initialised before the before_init tests ran")
    _assert_unusable()
    hvdlite.shutdown()  # a no-op before init
    assert not hvdlite.is_initialized()


def test_calls_after_shutdown_raise(hvd: Any, restart: Callable[..., Any]) -> None:
    hvd.shutdown()
    _assert_unusable()
    hvd.shutdown()
    hvd.shutdown()
    _assert_unusable()
    hvd.init()
    assert hvd.is_initialized()
    _sum_check(hvd, "after_shutdown_reinit")


def test_completed_handle_survives_shutdown(hvd: Any, restart: Callable[..., Any]) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("survivor")
    handle = hvd.allreduce_async(make_input(seed, rank, (3,), "int32"), name="survivor", op=hvd.Sum)
    want = reference_allreduce(all_inputs(seed, size, (3,), "int32"), "Sum")
    assert_equal_result(handle.wait(timeout=20), want)
    hvd.shutdown()
    assert_equal_result(handle.wait(), want, "result read after shutdown")


def test_init_is_idempotent(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    capacity = default_engine().config.cache_capacity
    hvd.init()
    hvd.init(cache_capacity=capacity + 5)  # ignored while running
    assert hvd.is_initialized() and (hvd.rank(), hvd.size()) == (rank, size)
    assert default_engine().config.cache_capacity == capacity
    _sum_check(hvd, "idempotent_init")


def test_rank_queries_match_the_communicator(hvd: Any) -> None:
    world = MPI.COMM_WORLD
    assert (hvd.rank(), hvd.size()) == (world.Get_rank(), world.Get_size())
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        assert (hvd.local_rank(), hvd.local_size()) == (local.Get_rank(), local.Get_size())
    finally:
        local.Free()
    assert 0 <= hvd.cross_rank() < hvd.cross_size() <= hvd.size()
    assert hvd.local_size() * hvd.cross_size() == hvd.size()  # one host: cross_size 1
    assert hvd.is_homogeneous() is True  # one host


def test_several_reinit_cycles(hvd: Any, restart: Callable[..., Any]) -> None:
    for cycle in range(3):
        restart()
        assert hvd.is_initialized()
        _sum_check(hvd, f"cycle.{cycle}")
        hvd.barrier()


def test_shutdown_fails_pending_handles(hvd: Any, restart: Callable[..., Any]) -> None:
    """A handle still pending at shutdown fails with ShutdownError; none stays pending.

    With two or more ranks, the last rank never submits ``pending.held``, so it is provably
    pending on the others when every rank shuts down together. The burst of other requests is
    either completed correctly or failed with ShutdownError (both are allowed).
    """
    rank, size = hvd.rank(), hvd.size()
    held = None
    if size > 1 and rank < size - 1:
        held = hvd.allreduce_async(np.ones(3), name="pending.held", op=hvd.Sum)
    burst = [
        hvd.allreduce_async(make_input(seed_for("burst", i), rank, (2,), "int32"),
                            name=f"pending.burst.{i}", op=hvd.Sum)
        for i in range(50)
    ]  # fmt: skip
    # Once a peer has shut down, new submissions fail at the call: submit everything first.
    timed_barrier("all submitted before shutdown")
    hvd.shutdown()
    if held is not None:
        assert held.poll()
        with pytest.raises(hvd.ShutdownError):
            held.wait(timeout=1)
        assert isinstance(held.exception(), hvd.ShutdownError)
    for i, handle in enumerate(burst):
        assert handle.poll(), f"burst {i} still pending after shutdown"
        if handle.exception() is None:
            want = reference_allreduce(all_inputs(seed_for("burst", i), size, (2,), "int32"), "Sum")
            assert_equal_result(handle.wait(), want, f"burst {i}")
        else:
            assert isinstance(handle.exception(), hvd.ShutdownError), repr(handle.exception())


def test_init_on_a_sub_communicator(hvd: Any, restart: Callable[..., Any]) -> None:
    world = MPI.COMM_WORLD
    sub = world.Split(color=world.Get_rank() % 2, key=world.Get_rank())
    try:
        restart(comm=sub)
        assert (hvd.rank(), hvd.size()) == (sub.Get_rank(), sub.Get_size())
        members = [r for r in range(world.Get_size()) if r % 2 == world.Get_rank() % 2]
        seed = seed_for("subcomm", world.Get_rank() % 2)
        got = hvd.allreduce(
            make_input(seed, world.Get_rank(), (4,), "int32"), name="sub", op=hvd.Sum
        )
        want = reference_allreduce([make_input(seed, r, (4,), "int32") for r in members], "Sum")
        assert_equal_result(got, want, f"allreduce over world ranks {members}")
    finally:
        hvd.shutdown()
        sub.Free()


def test_init_overrides_take_effect(hvd: Any, restart: Callable[..., Any]) -> None:
    restart(cache_capacity=0, fusion_threshold="1KiB", cycle_time_ms=2.5)
    config = default_engine().config
    assert (config.cache_capacity, config.fusion_threshold, config.cycle_time_ms) == (0, 1024, 2.5)
    _sum_check(hvd, "overrides")


def test_unknown_or_bad_override_is_config_error(hvd: Any, restart: Callable[..., Any]) -> None:
    hvd.shutdown()
    with pytest.raises(hvd.ConfigError, match="fusion_threshhold"):
        hvd.init(fusion_threshhold=1)
    with pytest.raises(hvd.ConfigError, match="cache_capacity"):
        hvd.init(cache_capacity="lots")
    assert not hvd.is_initialized()
    hvd.init()
    _sum_check(hvd, "after_config_error")


def test_precedence_override_env_yaml(
    hvd: Any, restart: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """init() keyword > HVDLITE_* env > HOROVOD_* alias > YAML file > default, end to end."""
    config_file = tmp_path / "hvdlite.yaml"
    config_file.write_text("cache_capacity: 11\ncycle_time_ms: 3\nfusion_threshold: 4KiB\n")
    restart(config=str(config_file))
    config = default_engine().config
    assert (config.cache_capacity, config.cycle_time_ms, config.fusion_threshold) == (11, 3.0, 4096)
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "22")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "4")
    restart(config=str(config_file))
    config = default_engine().config
    assert (config.cache_capacity, config.cycle_time_ms) == (22, 4.0)
    monkeypatch.setenv("HVDLITE_CACHE_CAPACITY", "33")
    restart(config=str(config_file))
    assert default_engine().config.cache_capacity == 33
    restart(config=str(config_file), cache_capacity=44)
    assert default_engine().config.cache_capacity == 44
    assert default_engine().negotiator.cache.capacity == 44
    _sum_check(hvd, "precedence")


def test_one_core_per_rank_is_warned_about(hvd: Any, restart: Callable[..., Any],
                                           caplog: pytest.LogCaptureFixture) -> None:
    """A rank pinned to one core (Open MPI's default binding for small jobs) shares it between
    the training thread and the background thread: init says so and names the fix."""
    import os

    before = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs a machine with more than one core")
    try:
        os.sched_setaffinity(0, {min(before)})
        with caplog.at_level("WARNING", logger="hvdlite"):
            restart()
        assert any("one CPU core" in r.getMessage() and "--bind-to none" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        os.sched_setaffinity(0, before)
    caplog.clear()
    with caplog.at_level("WARNING", logger="hvdlite"):
        restart()
    warned = any("one CPU core" in r.getMessage() for r in caplog.records)
    assert warned == (len(before) == 1)
