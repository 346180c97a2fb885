"""Adapters: NumPy, CuPy and torch tensors -> one internal view (array + device + converter).

Only NumPy is imported eagerly; CuPy and torch are recognised by their module names, so
importing hvdlite never imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hvdlite._tensorref import TensorRef, identity, label

__all__ = ["TensorRef", "wrap", "identity", "label"]

_CUDA_NAMES = tuple(f"cuda:{i}" for i in range(16))


def _module_of(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def wrap(obj: Any, what: Any, name: str | None = None) -> TensorRef:
    """View ``obj`` as a :class:`TensorRef`; ``TypeError``/``ValueError`` naming the call
    (``what``, or ``what`` a collective kind and ``name`` the tensor: see :func:`label`)."""
    if type(obj) is np.ndarray:
        if not obj.flags.c_contiguous:
            _require_contiguous(False, label(what, name), "np.ascontiguousarray(x)")
        return TensorRef(obj, "cpu", "numpy", identity)
    module = _module_of(obj)
    if module == "cupy":
        if not obj.flags.c_contiguous:
            _require_contiguous(False, label(what, name), "cupy.ascontiguousarray(x)")
        device_id = obj.data.device_id  # an int attribute; obj.device builds an object
        return TensorRef(obj, _CUDA_NAMES[device_id] if device_id < len(_CUDA_NAMES)
                         else f"cuda:{device_id}", "cupy", identity, device_id)
    if module == "torch":
        return _wrap_torch(obj, what, name)
    if isinstance(obj, np.ndarray):  # a subclass
        return wrap(np.asarray(obj), what, name)
    what = label(what, name)
    raise TypeError(
        f"{what}: expected a numpy.ndarray, cupy.ndarray or torch.Tensor, "
        f"got {type(obj).__name__}"
    )


def _require_contiguous(ok: bool, what: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"{what}: tensor is not C-contiguous; pass {fix} instead")


def _load_torch_wrapper(t: Any, what: Any, name: str | None) -> TensorRef:
    global _wrap_torch
    from hvdlite._torchref import ref_of

    _wrap_torch = ref_of  # from now on, straight to the cached views
    return ref_of(t, what, name)


# The torch adapter (hvdlite/_torchref.py) caches each tensor's view: no torch operator per
# call. It is imported by the first torch tensor, never by ``import hvdlite``.
_wrap_torch: Callable[[Any, Any, str | None], TensorRef] = _load_torch_wrapper
