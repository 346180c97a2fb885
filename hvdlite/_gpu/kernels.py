"""Batched copy kernels for device fusion: one launch copies a whole bucket in or out.

Per-tensor ``cudaMemcpyAsync`` calls cost more than the collective itself on a 100 MB bucket
of ~100 tensors (DEVICE.md: 0.91 ms vs 0.39 ms); one kernel over the bucket costs about one
pass over the bytes. Each block owns a contiguous slice of the fused buffer, finds its first
tensor once by binary search and walks forward, so loads and stores stay coalesced.

Scaling is fused in: copy-in multiplies by the prescale factor; copy-out divides by the
contributor count (Average; integers truncated toward zero) and multiplies by the postscale
factor, with the same rules as the host path (integers scale in double, truncated).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

__all__ = ["batched_copy", "CTYPES", "ipc_oneshot", "ipc_reduce", "prepare_schedule",
           "sched_signal", "sched_step"]

# Element type of the kernel for each wire dtype (complex travels as pairs of its real type).
CTYPES = {
    "bool": "unsigned char", "uint8": "unsigned char", "int8": "signed char",
    "int32": "int", "uint32": "unsigned int", "int64": "long long",
    "uint64": "unsigned long long", "float16": "__half", "float32": "float",
    "float64": "double",
}  # fmt: skip

_SOURCE = r"""
#include <cuda_fp16.h>

template <typename T> __device__ __forceinline__ T scale_in(T x, double f) {
    return (T)((double)x * f);
}
template <> __device__ __forceinline__ float scale_in<float>(float x, double f) {
    return x * (float)f;
}
template <> __device__ __forceinline__ __half scale_in<__half>(__half x, double f) {
    return __float2half(__half2float(x) * (float)f);
}

template <typename T> __device__ __forceinline__ T finish(T x, long long d, double f, bool sgn) {
    // Average: C's integer division truncates toward zero, the contract's rule for integers
    // (finish_reduce on the host); ``sgn`` is kept for the signature of the wire types.
    (void)sgn;
    if (d > 1) x = (T)(x / (T)d);
    return f == 1.0 ? x : (T)((double)x * f);
}
template <>
__device__ __forceinline__ float finish<float>(float x, long long d, double f, bool) {
    if (d > 1) x = x / (float)d;
    return f == 1.0 ? x : x * (float)f;
}
template <>
__device__ __forceinline__ double finish<double>(double x, long long d, double f, bool) {
    if (d > 1) x = x / (double)d;
    return f == 1.0 ? x : x * f;
}
template <>
__device__ __forceinline__ __half finish<__half>(__half x, long long d, double f, bool) {
    float y = __half2float(x);
    if (d > 1) y = y / (float)d;
    return __float2half(f == 1.0 ? y : y * (float)f);
}

// meta = [offs(n+1) | ptrs(n)]: tensor t occupies fused[offs[t], offs[t+1]) and lives at ptrs[t].
// mode 0: fused[i] = scale_in(src_t[i - offs[t]]); mode 1: dst_t[...] = finish(fused[i]).
template <typename T>
__device__ void batched(const long long* meta, int n, T* fused, long long per_block,
                        double scale, long long divisor, int mode, int sgn) {
    const long long* offs = meta;
    const long long* ptrs = meta + n + 1;
    long long total = offs[n];
    long long begin = (long long)blockIdx.x * per_block;
    long long end = min(begin + per_block, total);
    if (begin >= end) return;
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (offs[mid] <= begin) lo = mid; else hi = mid;
    }
    const long long step = blockDim.x;
    for (int t = lo; t < n && offs[t] < end; ++t) {
        long long a = max(offs[t], begin), b = min(offs[t + 1], end);
        T* p = (T*)ptrs[t] - offs[t];
        const T* src = mode == 0 ? p : fused;
        T* dst = mode == 0 ? fused : p;
        long long i = a + threadIdx.x;
        // Four loads in flight per thread before their stores: a copy is bound by memory
        // latency unless each thread keeps several requests outstanding.
        for (; i + 3 * step < b; i += 4 * step) {
            T v0 = src[i], v1 = src[i + step], v2 = src[i + 2 * step], v3 = src[i + 3 * step];
            if (mode == 0) {
                dst[i] = scale_in(v0, scale);
                dst[i + step] = scale_in(v1, scale);
                dst[i + 2 * step] = scale_in(v2, scale);
                dst[i + 3 * step] = scale_in(v3, scale);
            } else {
                dst[i] = finish(v0, divisor, scale, sgn != 0);
                dst[i + step] = finish(v1, divisor, scale, sgn != 0);
                dst[i + 2 * step] = finish(v2, divisor, scale, sgn != 0);
                dst[i + 3 * step] = finish(v3, divisor, scale, sgn != 0);
            }
        }
        for (; i < b; i += step)
            dst[i] = mode == 0 ? scale_in(src[i], scale) : finish(src[i], divisor, scale,
                                                                 sgn != 0);
    }
}
"""

_ENTRY = """
extern "C" __global__ void hvd_batched_{name}(const long long* meta, int n, {ctype}* fused,
        long long per_block, double scale, long long divisor, int mode, int sgn) {{
    batched<{ctype}>(meta, n, fused, per_block, scale, divisor, mode, sgn);
}}
"""

_SIGNED = frozenset({"int8", "int32", "int64"})
_THREADS = 256
_PER_BLOCK = 16384  # elements per block: long enough to amortise the search, short for balance


@functools.cache
def _module() -> Any:
    import cupy

    code = _SOURCE + "".join(_ENTRY.format(name=k, ctype=v) for k, v in CTYPES.items())
    return cupy.RawModule(code=code, options=("--std=c++14",))


@functools.cache
def _kernel(wire: str) -> Any:
    return _module().get_function(f"hvd_batched_{wire}")


def batched_copy(wire: str, meta: Any, n: int, fused: Any, total: int, *, mode: int,
                 scale: float, divisor: int) -> None:
    """Launch one batched copy over ``total`` elements of the fused buffer on the current
    stream (the caller makes hvdlite's stream current).

    ``meta`` is a device int64 array ``[offsets(n+1) | pointers(n)]``; ``mode`` 0 copies in
    (with ``scale`` = prescale), 1 copies out (``divisor`` for Average, ``scale`` = postscale).
    """
    import cupy

    if total == 0:
        return
    blocks = (total + _PER_BLOCK - 1) // _PER_BLOCK
    _kernel(wire)((blocks,), (_THREADS,),
                  (meta, cupy.int32(n), fused, cupy.int64(_PER_BLOCK), cupy.float64(scale),
                   cupy.int64(divisor), cupy.int32(mode), cupy.int32(wire in _SIGNED)))


# -- CUDA IPC: one rank-ordered reduction over every rank's staging slot ---------------------------
# ``y[i] = a0[i] op a1[i] op ...`` left to right (every rank computes the same bits), each step
# rounded to the element type (float16 through float, as NumPy's float16 arithmetic). Built per
# (op, ranks, type) from raw pointers, so a call creates no array objects. The agreed schedule
# passes its own share as both an input and ``y``: still sound under ``__restrict__``, since each
# element is read once, by the thread that then writes it (the store depends on the load).
_IPC_STEP = {
    "sum": "v = L(F(v) + F(a{i}[k]));",
    "avg": "v = L(F(v) + F(a{i}[k]));",
    "prod": "v = L(F(v) * F(a{i}[k]));",
    "max": "if (F(a{i}[k]) > F(v)) v = a{i}[k];",
    "min": "if (F(a{i}[k]) < F(v)) v = a{i}[k];",
}


@functools.cache
def _ipc_kernel(op: str, ranks: int, wire: str) -> Any:
    import cupy

    ctype = CTYPES[wire]
    # F widens to the type the step computes in, L narrows back (identity but for float16).
    half = wire == "float16"
    widen = "__half2float" if half else ""
    narrow = "__float2half" if half else f"({ctype})"
    args = ", ".join(f"const {ctype}* __restrict__ a{i}" for i in range(ranks))
    steps = "\n        ".join(_IPC_STEP[op].format(i=i) for i in range(1, ranks))
    finish = (f"v = L(F(v) / ({'float' if half else ctype}){ranks});"
              if op == "avg" and ranks > 1 else "")
    name = f"hvd_ipc_{op}_{ranks}_{wire}"
    code = f"""
#include <cuda_fp16.h>
#define F(x) {widen}(x)
#define L(x) {narrow}(x)
extern "C" __global__ void {name}({args}, {ctype}* __restrict__ y, long long n) {{
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (long long)blockDim.x * gridDim.x) {{
        {ctype} v = a0[k];
        {steps}
        {finish}
        y[k] = v;
    }}
}}
"""
    return cupy.RawKernel(code, name)


def ipc_reduce(op: str, wire: str, inputs: list[int], out: int, count: int,
               max_blocks: int = 4096) -> None:
    """``out = inputs[0] op inputs[1] op ...`` over ``count`` elements of type ``wire``
    (device pointers), on the current stream, in at most ``max_blocks`` thread blocks."""
    import cupy
    import numpy as np

    blocks = max(1, min((count + _THREADS - 1) // _THREADS, max_blocks))
    _ipc_kernel(op, len(inputs), wire)(
        (blocks,), (_THREADS,), (*[np.uint64(p) for p in inputs], np.uint64(out),
                                 cupy.int64(count)))


# -- CUDA IPC, one-shot: a whole small allreduce step in one kernel (a GPU per rank) --------------
# The step of ``_gpu/ipc.py`` with the flag protocol's fences done by the kernel itself instead
# of one stream memory operation each: thread 0 waits for every rank's READ of this rank's slot
# (its previous use), the block copies the input in, thread 0 publishes WRITTEN to the peers
# and waits for theirs, the block reduces every rank's slot in rank order (the same bits on
# every rank, as ``ipc_reduce``), thread 0 publishes READ to every rank. Flags are 32-bit epochs
# compared cyclically (``semaphores.cyclic_geq``), at ``flag_index``'s place in each inbox, so
# this path and the stream-memop path interleave, and ``Semaphores.release`` (the flags set far
# ahead) lets a kernel parked on a dead peer finish. One block: the calls this takes are small
# (``ipc.ONESHOT_BYTES``), and a block barrier orders its copy, signals and reads. Spinning on
# an SM is why ranks that share a GPU never take it (their contexts take turns on the GPU).
_ONESHOT_THREADS = 1024

_ONESHOT_SOURCE = r"""
#include <cuda_fp16.h>
#define F(x) {widen}(x)
#define L(x) {narrow}(x)
__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {{
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}}
__device__ __forceinline__ void st_release(unsigned int* p, unsigned int v) {{
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}}
__device__ __forceinline__ void await_flag(const unsigned int* p, unsigned int epoch) {{
    while ((int)(ld_acquire(p) - epoch) < 0) {{ }}
}}
// flag_index(kind, slot, peer) = (kind * SLOTS + slot) * RANKS + peer; WRITTEN 0, READ 1.
#define FLAG(inbox, kind, slot, peer) \
    ((unsigned int*)(inbox) + (((kind) * {slots} + (slot)) * {ranks} + (peer)))
extern "C" __global__ void {name}(const {ctype}* x,  // x may be y (in place)
        const unsigned long long* __restrict__ slot_ptrs,
        const unsigned long long* __restrict__ inboxes, {ctype}* y,
        long long n, int me, int slot, unsigned int epoch, int first) {{
    const unsigned long long mine = inboxes[me];
    if (threadIdx.x == 0 && !first) {{
        for (int r = 0; r < {ranks}; ++r) await_flag(FLAG(mine, 1, slot, r), epoch - 1u);
    }}
    __syncthreads();
    {ctype}* own = ({ctype}*)slot_ptrs[me];
    for (long long k = threadIdx.x; k < n; k += blockDim.x) own[k] = x[k];
    __syncthreads();
    if (threadIdx.x == 0) {{
        __threadfence_system();
        for (int r = 0; r < {ranks}; ++r)
            if (r != me) st_release(FLAG(inboxes[r], 0, slot, me), epoch);
        for (int r = 0; r < {ranks}; ++r)
            if (r != me) await_flag(FLAG(mine, 0, slot, r), epoch);
    }}
    __syncthreads();
    for (long long k = threadIdx.x; k < n; k += blockDim.x) {{
        {loads}
        {ctype} v = a0;
        {steps}
        {finish}
        y[k] = v;
    }}
    __syncthreads();
    if (threadIdx.x == 0) {{
        __threadfence_system();
        for (int r = 0; r < {ranks}; ++r) st_release(FLAG(inboxes[r], 1, slot, me), epoch);
    }}
}}
"""


@functools.cache
def _oneshot_kernel(op: str, ranks: int, slots: int, wire: str) -> Any:
    import cupy

    return cupy.RawKernel(*reversed(oneshot_source(op, ranks, slots, wire)))


def oneshot_source(op: str, ranks: int, slots: int, wire: str) -> tuple[str, str]:
    """(name, CUDA source) of the one-shot kernel for ``op`` over ``ranks`` ranks' slots of
    ``wire`` elements (pure: no CuPy)."""
    ctype = CTYPES[wire]
    half = wire == "float16"
    loads = " ".join(f"const {ctype} a{i} = ((const {ctype}*)slot_ptrs[{i}])[k];"
                     for i in range(ranks))
    steps = "\n        ".join(_IPC_STEP[op].format(i=i).replace(f"a{i}[k]", f"a{i}")
                              for i in range(1, ranks))
    finish = (f"v = L(F(v) / ({'float' if half else ctype}){ranks});"
              if op == "avg" and ranks > 1 else "")
    name = f"hvd_oneshot_{op}_{ranks}_{slots}_{wire}"
    code = _ONESHOT_SOURCE.format(
        widen="__half2float" if half else "", narrow="__float2half" if half else f"({ctype})",
        slots=slots, ranks=ranks, name=name, ctype=ctype, loads=loads, steps=steps,
        finish=finish)
    return name, code


def ipc_oneshot(op: str, wire: str, ranks: int, slots: int, x: int, slot_table: Any,
                inbox_table: Any, y: int, count: int, me: int, slot: int, epoch: int,
                first: bool) -> None:
    """One step of a small allreduce in one kernel on the current stream (see above):
    ``x`` this rank's input, ``y`` its output (device pointers, ``count`` elements of
    ``wire``); ``slot_table``: a device uint64 array of every rank's pointer to ``slot``'s
    staging memory, ``inbox_table`` of every rank's flag inbox, both in this context."""
    import cupy
    import numpy as np

    _oneshot_kernel(op, ranks, slots, wire)(
        (1,), (_ONESHOT_THREADS,),
        (np.uint64(x), slot_table, inbox_table, np.uint64(y), cupy.int64(count),
         cupy.int32(me), cupy.int32(slot), np.uint32(epoch), cupy.int32(int(first))))


# -- the agreed schedule over CUDA IPC: flags whose epochs live on the device ------------------
# A captured step replays its launches with the arguments they were captured with, so an epoch
# cannot be an argument (every replay would wait for the first replay's): each rank keeps a
# counter per slot in its own memory, the first signal of a launch bumps it, and every signal
# and wait of that launch reads it there. Ranks launch each slot equally often, so their
# counters agree. Flags: ``inbox[(kind * slots + slot) * ranks + peer]`` (32-bit, compared
# cyclically); a wait also gives up once the host sets its abort word (host memory mapped into
# the device): the way out for a stream parked on a peer that died.
_SCHED_SOURCE = r"""
__device__ __forceinline__ unsigned int sched_signal_(unsigned int* counters,
        const unsigned long long* __restrict__ inboxes, int kind, int slot, int slots,
        int me, int ranks, int bump) {
    unsigned int epoch = counters[slot];
    if (bump) {
        epoch += 1u;
        counters[slot] = epoch;
    }
    __threadfence_system();  // this stream's earlier work, visible before the flag
    for (int r = 0; r < ranks; ++r) {
        if (r == me) continue;
        unsigned int* f = (unsigned int*)inboxes[r] + (kind * slots + slot) * ranks + me;
        asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(f), "r"(epoch) : "memory");
    }
    return epoch;
}

extern "C" __global__ void hvd_sched_signal(unsigned int* counters,
        const unsigned long long* __restrict__ inboxes, int kind, int slot, int slots,
        int me, int ranks, int bump) {
    if (threadIdx.x != 0) return;
    sched_signal_(counters, inboxes, kind, slot, slots, me, ranks, bump);
}

// A step: signal, then wait until every peer signalled the same (one launch where the two
// always come together: a launch's host calls and the graph's nodes are the fewer).
extern "C" __global__ void hvd_sched_step(unsigned int* counters,
        const unsigned long long* __restrict__ inboxes, const unsigned int* abort_word,
        int kind, int slot, int slots, int me, int ranks, int bump) {
    if (threadIdx.x != 0) return;
    const unsigned int epoch = sched_signal_(counters, inboxes, kind, slot, slots, me, ranks,
                                             bump);
    const unsigned int* inbox = (const unsigned int*)inboxes[me];
    for (int r = 0; r < ranks; ++r) {
        if (r == me) continue;
        const unsigned int* f = inbox + (kind * slots + slot) * ranks + r;
        for (unsigned int spins = 0;; ++spins) {
            unsigned int v;
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
            if ((int)(v - epoch) >= 0) break;
            if ((spins & 1023u) == 0u && *(const volatile unsigned int*)abort_word) return;
        }
    }
}
"""


@functools.cache
def _sched_kernel(name: str) -> Any:
    import cupy

    return cupy.RawModule(code=_SCHED_SOURCE).get_function(name)


def prepare_schedule(reductions: Iterable[tuple[str, str]], ranks: int) -> None:
    """Compile and load the schedule's kernels now (signal, step, and the reduce of each
    ``(op, wire)`` over ``ranks`` inputs): a compiler failure is then the rank's answer when
    its schedule opens, never an error between a launch's signals."""
    _sched_kernel("hvd_sched_signal")
    _sched_kernel("hvd_sched_step")
    for op, wire in set(reductions):
        _ipc_kernel(op, ranks, wire).compile()


def sched_signal(counters: int, inboxes: Any, kind: int, slot: int, slots: int, me: int,
                 ranks: int, bump: bool) -> None:
    """On the current stream, after its earlier work: tell every peer this rank reached
    ``kind`` of ``slot``'s current launch (``bump``: a new launch, the counter first moves
    on). ``counters``: this rank's device counters; ``inboxes``: a device table of every
    rank's inbox in this context."""
    import numpy as np

    _sched_kernel("hvd_sched_signal")(
        (1,), (32,), (np.uint64(counters), inboxes, np.int32(kind), np.int32(slot),
                      np.int32(slots), np.int32(me), np.int32(ranks), np.int32(int(bump))))


def sched_step(counters: int, inboxes: Any, abort_word: int, kind: int, slot: int,
               slots: int, me: int, ranks: int, bump: bool) -> None:
    """On the current stream, in one kernel: :func:`sched_signal`, then wait until every
    peer reached ``kind`` of ``slot``'s current launch too, or the abort word is set (its
    inbox is ``inboxes[me]``); the stream's later work starts after."""
    import numpy as np

    _sched_kernel("hvd_sched_step")(
        (1,), (32,), (np.uint64(counters), inboxes, np.uint64(abort_word), np.int32(kind),
                      np.int32(slot), np.int32(slots), np.int32(me), np.int32(ranks),
                      np.int32(int(bump))))
