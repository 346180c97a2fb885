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
from typing import Any

__all__ = ["batched_copy", "CTYPES"]

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
# (op, ranks, type) from raw pointers, so a call creates no array objects.
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


def ipc_reduce(op: str, wire: str, inputs: list[int], out: int, count: int) -> None:
    """``out = inputs[0] op inputs[1] op ...`` over ``count`` elements of type ``wire``
    (device pointers), on the current stream."""
    import cupy
    import numpy as np

    blocks = min((count + _THREADS - 1) // _THREADS, 4096)
    _ipc_kernel(op, len(inputs), wire)(
        (blocks,), (_THREADS,), (*[np.uint64(p) for p in inputs], np.uint64(out),
                                 cupy.int64(count)))
