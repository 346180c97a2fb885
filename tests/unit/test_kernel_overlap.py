"""scripts/gpu/kernel_overlap.py on Chrome traces of torch.profiler's shape: how much of the
communication's time (NCCL, CUDA IPC) other kernels ran beside, per device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import kernel_overlap  # noqa: E402


def _kernel(name: str, ts: float, dur: float, device: int = 0) -> dict[str, object]:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": 7, "ts": ts,
            "dur": dur, "args": {"device": device, "stream": 7}}


def test_overlap_alone_and_devices_are_told_apart() -> None:
    # device 0: backward 0-100 and 120-200; an allreduce 90-150 (10 + 30 beside backward, 20
    # alone in 100-120) and one 210-240 (alone); device 1: an allreduce fully under a GEMM.
    trace = {"traceEvents": [
        _kernel("sm90_xmma_gemm_bf16", 0, 100), _kernel("elementwise_kernel", 120, 80),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 90, 60),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 210, 30),
        _kernel("gemm", 0, 50, device=1), _kernel("ncclKernel_AllReduce", 10, 20, device=1),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # not a kernel
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5},
    ]}
    s = kernel_overlap.summary(trace)
    assert s[0]["comm_us"] == 90 and s[0]["other_us"] == 180
    assert s[0]["overlapped_us"] == 40 and s[0]["alone_us"] == 50
    assert s[0]["span_us"] == 240 and s[0]["comm_kernels"] == 2 and s[0]["other_kernels"] == 2
    assert s[0]["overlapped_share"] == pytest.approx(40 / 90)
    assert s[1]["overlapped_us"] == 20 and s[1]["alone_us"] == 0


def test_overlapping_kernels_of_one_kind_count_once() -> None:
    # two NCCL kernels that overlap each other (two communicators) and three compute kernels
    # on two streams: unions, not sums
    trace = [_kernel("nccl_a", 0, 50), _kernel("nccl_b", 25, 50),
             _kernel("k1", 40, 20), _kernel("k2", 45, 20), _kernel("k3", 100, 10)]
    s = kernel_overlap.summary(trace)[0]
    assert (s["comm_us"], s["other_us"], s["overlapped_us"]) == (75, 35, 25)


def test_a_trace_without_nccl_or_unreadable_is_said(tmp_path: Path) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"traceEvents": [_kernel("gemm", 0, 10)]}))
    text, ok = kernel_overlap.report(plain)
    assert not ok and "0%" in text
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert kernel_overlap.main([str(plain), str(broken)]) == 1
    good = tmp_path / "good.json"
    good.write_text(json.dumps([_kernel("ncclDevKernel", 0, 10), _kernel("gemm", 5, 10)]))
    assert kernel_overlap.main([str(good)]) == 0


def _copy(name: str, ts: float, dur: float, device: int = 0) -> dict[str, object]:
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "pid": device, "tid": 9, "ts": ts,
            "dur": dur, "args": {"device": device, "stream": 9, "bytes": 1 << 20}}


def test_the_ipc_transports_kernels_and_peer_copies_are_communication() -> None:
    # backward 0-100; the IPC slot: a spin 80-90, a pull (peer copy) 90-130, the reduce
    # 130-140, the gather (peer copy) 140-160; a copy within the device (neither) 150-170 and
    # the fused-copy kernel (other) 170-180
    trace = {"traceEvents": [
        _kernel("sm90_xmma_gemm_bf16", 0, 100), _kernel("hvd_sched_step", 80, 10),
        _copy("Memcpy PtoP (Device -> Device)", 90, 40), _kernel("hvd_ipc_sum_2_float", 130, 10),
        _copy("Memcpy PtoP (Device -> Device)", 140, 20),
        _copy("Memcpy DtoD (Device -> Device)", 150, 20), _kernel("hvd_batched_float", 170, 10),
    ]}
    s = kernel_overlap.summary(trace)[0]
    assert s["comm_us"] == 80 and s["comm_kernels"] == 4
    assert s["other_us"] == 110 and s["other_kernels"] == 2
    assert s["overlapped_us"] == 20 and s["alone_us"] == 60
    assert s["span_us"] == 180 and s["idle_us"] == 10
    assert s["copies_us"] == 20  # the copy within the device: said apart, not communication
    assert [kernel_overlap.is_comm(n) for n in (
        "ncclDevKernel_AllReduce", "hvd_oneshot_sum_2_4_float", "Memcpy PtoP (Device -> Device)",
        "Memcpy DtoD (Device -> Device)", "hvd_batched_float", "elementwise_kernel")] == \
        [True, True, True, False, False, False]


def _call(name: str, ts: float, dur: float, cat: str = "cuda_runtime") -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 2, "ts": ts, "dur": dur}


def test_idle_time_and_the_hosts_waiting_and_allocating_calls() -> None:
    # kernels 0-10, 5-20 and 40-50: 20 us of the 50 us span with no kernel; the host's calls:
    # two synchronisations (runtime and driver), two allocations, launches (neither)
    trace = {"traceEvents": [
        _kernel("gemm", 0, 10), _kernel("ncclDevKernel", 5, 15), _kernel("add", 40, 10),
        _call("cudaStreamSynchronize", 20, 19), _call("cuEventSynchronize", 60, 3, "cuda_driver"),
        _call("cudaMalloc", 1, 4), _call("cudaFree", 30, 6), _call("cudaLaunchKernel", 0, 2),
        _call("cudaStreamSynchronize", 0, 99, "cpu_op"),  # not a CUDA call's category
    ]}
    s = kernel_overlap.summary(trace)[0]
    assert s["span_us"] == 50 and s["idle_us"] == 20
    assert (s["sync_us"], s["sync_calls"]) == (22, 2)
    assert (s["alloc_us"], s["alloc_calls"]) == (10, 2)
    assert kernel_overlap.host_calls([]) == {"sync_us": 0.0, "sync_calls": 0.0,
                                             "alloc_us": 0.0, "alloc_calls": 0.0}
