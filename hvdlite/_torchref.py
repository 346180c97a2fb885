"""torch tensors seen as NumPy (host) or CuPy (device) arrays, with no torch operator per call.

On a machine whose hvdlite thread is busy, every torch operator that makes or frees a tensor
(``detach``, ``numpy``, ``from_numpy``, ``torch.tensor`` ...) drops the GIL and costs 6-15 us
(the other thread runs in between); attribute reads (``data_ptr``, ``shape``, ``dtype``) do
not. So the array view of a tensor is built from its data pointer (NumPy's array interface,
CuPy's unowned memory) once, cached per tensor object, and re-used while a cheap check
(pointer, shape, dtype, contiguity) says the tensor still holds the same memory.

The cache holds a tensor's *storage* (which keeps the memory alive while hvdlite uses it), not
the tensor, so it never keeps a tensor alive: an entry is dropped when its tensor dies.
Imported only once a torch tensor is seen, so ``import hvdlite`` never imports torch.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hvdlite._tensorref import Ring, TensorRef, label

__all__ = ["Edge", "array_of", "ref_of", "entry_of", "views", "counter", "stream_of",
           "to_torch", "numpy_dtype"]

# torch dtype -> NumPy type string; bfloat16 and the float8 types have no NumPy twin.
_TYPESTR: dict[torch.dtype, str] = {
    torch.bool: "|b1", torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2",
    torch.int32: "<i4", torch.int64: "<i8", torch.float16: "<f2", torch.float32: "<f4",
    torch.float64: "<f8", torch.complex64: "<c8", torch.complex128: "<c16",
}
_NP_DTYPE = {k: np.dtype(v) for k, v in _TYPESTR.items()}
_CUDA_NAMES = tuple(f"cuda:{i}" for i in range(16))


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The NumPy dtype with the same bits as ``dtype`` (None if NumPy has none)."""
    return _NP_DTYPE.get(dtype)


class _Iface:
    """An object NumPy reads as an array (``np.asarray``) without copying; it keeps the
    tensor's storage alive for as long as the array lives."""

    __slots__ = ("__array_interface__", "storage")

    def __init__(self, storage: Any, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.storage = storage
        self.__array_interface__ = {"data": (ptr, False), "shape": shape,
                                    "typestr": typestr, "version": 3}


class Edge:
    """One tensor's cache entry: the array over its memory (``array``), the layout that array
    was made for (``ptr``, ``shape``, ``dtype``), its CUDA device (``device_id``, -1: host) and
    its :class:`TensorRef`."""

    __slots__ = ("alive", "ptr", "shape", "dtype", "array", "ref", "device_id")

    def __init__(self, alive: Any, ptr: int, shape: Any, dtype: torch.dtype, array: Any,
                 ref: TensorRef) -> None:
        self.alive = alive  # weakref to the tensor (its death drops the entry)
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.array = array
        self.ref = ref
        self.device_id = ref.device_id


_views: dict[int, Edge] = {}
# The bare lookup by ``id(tensor)``: an entry still to be checked against its tensor (its
# memory, shape, dtype and contiguity, as views() checks them) before it is used; the per-call
# path of hvdlite/torch/mpi_ops.py inlines that check and reads the dtype and the device from
# the entry instead of from the tensor.
entry_of: Callable[[int], Edge | None] = _views.get


def _forget(key: int, alive: Any, table: dict[int, Edge] = _views) -> None:
    # ``table`` bound at definition: a tensor collected during interpreter teardown calls
    # this after the module's globals were cleared.
    entry = table.get(key)
    if entry is not None and entry.alive is alive:
        del table[key]


def _lookup(t: torch.Tensor) -> Edge | None:
    """``t``'s cache entry if it still describes ``t``'s memory, else None."""
    entry = _views.get(id(t))
    if (entry is not None and entry.ptr == t.data_ptr() and entry.shape == t.shape
            and entry.dtype is t.dtype and t.is_contiguous() and entry.alive() is t):
        return entry
    return None


def views(tensors: Sequence[Any]) -> list[Any]:
    """The edge of the call route: each tensor's cached array if the tensor still holds the
    memory it covers (the same object every call, so the core's lane matches it), else the
    tensor itself (the lane then misses and the call is built anew). One call for a whole
    grouped call: the check is inlined, no frame per member."""
    get = _views.get
    if len(tensors) == 1:  # a single tensor: no loop
        t = tensors[0]
        entry = get(id(t))
        if (entry is not None and entry.ptr == t.data_ptr() and entry.shape == t.shape
                and entry.dtype is t.dtype and t.is_contiguous()):
            return [entry.array]
        return [t]
    out = []
    for t in tensors:
        entry = get(id(t))  # an entry lives exactly as long as its tensor (_forget)
        if (entry is not None and entry.ptr == t.data_ptr() and entry.shape == t.shape
                and entry.dtype is t.dtype and t.is_contiguous()):
            out.append(entry.array)
        else:
            out.append(t)
    return out


_storage_users: Callable[[int], int] = torch._C._storage_Use_Count


def counter(tensors: Sequence[torch.Tensor]) -> Callable[[], list[int]]:
    """Who refers to result tensors handed out, measured by a function made once per result
    set: each tensor's reference count and its storage's use count (a view the caller made
    of a result holds the storage, not the tensor). The storages are looked up here, once,
    and held by the counter: their use counts are read by address every call, and a result
    whose storage the caller replaced (``set_``) stays busy for good instead of being
    counted through memory it no longer covers."""
    held = tuple(t.untyped_storage() for t in tensors)
    cdatas = tuple(s._cdata for s in held)
    ts = tuple(tensors)
    if len(ts) == 1:  # a single tensor's result: no loop
        t, cdata = ts[0], cdatas[0]

        # What a call reads is bound as defaults (one tuple), not closed over: a counter runs
        # once per call that reuses a result set, and each closure cell is one more object to
        # read (a cache miss, in a loop over 1,000 tensors).
        def one(t: torch.Tensor = t, cdata: int = cdata,
                refs: Callable[[Any], int] = sys.getrefcount,
                users: Callable[[int], int] = _storage_users) -> list[int]:
            return [refs(t), users(cdata)]

        fn: Callable[[], list[int]] = one
    else:
        def count(ts: tuple[torch.Tensor, ...] = ts, cdatas: tuple[int, ...] = cdatas,
                  refs: Callable[[Any], int] = sys.getrefcount,
                  users: Callable[[int], int] = _storage_users) -> list[int]:
            return [*map(refs, ts), *map(users, cdatas)]

        fn = count
    fn.__dict__["held"] = held  # the storages live as long as the counter (not read per call)
    return fn


def array_of(t: torch.Tensor, what: Any, name: str | None = None) -> Any:
    """The NumPy (CPU) or CuPy (CUDA) array over ``t``'s memory: no copy, cached per tensor.

    ``t`` must be a dense, C-contiguous CPU or CUDA tensor of a dtype NumPy can hold;
    otherwise ``ValueError`` (not contiguous) or ``TypeError`` naming the call (``what``, or
    ``what`` a collective kind and ``name`` the tensor, as ``hvdlite._tensorref.label``).
    """
    entry = _lookup(t)
    if entry is None:
        entry = _insert(t, label(what, name))
    return entry.array


def ref_of(t: torch.Tensor, what: Any, name: str | None = None) -> TensorRef:
    """``t`` as the core's :class:`TensorRef` (framework ``"torch"``; results are handed back
    as torch tensors), cached with its array; errors as :func:`array_of`."""
    entry = _lookup(t)
    if entry is None:
        entry = _insert(t, label(what, name))
    return entry.ref


def _insert(t: torch.Tensor, what: str) -> Edge:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise TypeError(f"{what}: {t.layout} tensors are not supported; pass a dense tensor "
                        "(x.to_dense()), or reduce a sparse one with "
                        "hvdlite.torch.sparse_allreduce_async")
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor is not C-contiguous; pass x.contiguous() instead")
    typestr = _TYPESTR.get(t.dtype)
    if typestr is None:
        raise TypeError(f"{what}: torch dtype {t.dtype} has no NumPy equivalent and cannot be "
                        "moved as is; cast it (e.g. x.float())")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{what}: tensor has a lazy conjugate/negative bit; pass "
                         "x.resolve_conj().resolve_neg() instead")
    storage = t.untyped_storage()
    shape = tuple(t.shape)
    if t.is_cuda:
        index = t.get_device()
        array = _cupy_view(t, storage, shape)
        device = _CUDA_NAMES[index] if index < len(_CUDA_NAMES) else f"cuda:{index}"
        ref = TensorRef(array, device, "torch", torch.from_dlpack, index, views, counter,
                        Ring())
    elif t.device.type == "cpu":
        array = np.asarray(_Iface(storage, t.data_ptr(), shape, typestr))
        ref = TensorRef(array, "cpu", "torch", torch.from_numpy, -1, views, counter, Ring())
    else:
        raise TypeError(f"{what}: torch tensors on device {t.device} are not supported "
                        "(cpu, cuda)")
    key = id(t)
    alive = weakref.ref(t, lambda r, k=key, forget=_forget: forget(k, r))  # type: ignore[misc]
    entry = Edge(alive, t.data_ptr(), t.shape, t.dtype, array, ref)
    _views[key] = entry
    return entry


def _cupy_view(t: torch.Tensor, storage: Any, shape: tuple[int, ...]) -> Any:
    import cupy

    nbytes = t.numel() * t.element_size()
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, storage, t.get_device())
    return cupy.ndarray(shape, dtype=_NP_DTYPE[t.dtype],
                        memptr=cupy.cuda.MemoryPointer(mem, 0))


_raw_stream: Callable[[int], int] | None = None  # torch's current stream, as a handle
# (device, handle) -> its CuPy stream object: the runtime's bounded table
# (hvdlite/_gpu/runtime.py's torch_streams), bound at the first CUDA call.
_streams: Mapping[tuple[int, int], Any] = {}


def stream_of(device_id: int) -> Any:
    """torch's current stream on ``device_id`` as a CuPy stream object, made once per stream
    (``hvdlite/_gpu/runtime.py``'s ``current_stream``); per call one raw handle read and one
    dict lookup (``torch.cuda.current_stream()`` builds a torch object every call)."""
    raw = _raw_stream
    if raw is not None:
        stream = _streams.get((device_id, raw(device_id)))
        if stream is not None:
            return stream
    return _new_stream(device_id)


def _new_stream(device_id: int) -> Any:
    global _raw_stream, _streams
    from hvdlite._gpu import runtime

    stream = runtime.current_stream("torch", device_id)  # kept in runtime.torch_streams
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:  # else every call asks runtime.current_stream
        _raw_stream, _streams = raw, runtime.torch_streams
    return stream


def to_torch(array: Any) -> torch.Tensor:
    """A torch tensor over ``array``'s memory (NumPy or CuPy), no copy."""
    if type(array) is np.ndarray:
        return torch.from_numpy(array)
    return torch.from_dlpack(array)

