"""Adapters: NumPy, CuPy and torch tensors -> one internal view (array + device + converter).

Only NumPy is imported eagerly; CuPy and torch are recognised by their module names, so
importing hvdlite never imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TensorRef", "wrap", "identity"]


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A caller's tensor seen as an array hvdlite can move.

    ``array`` is a NumPy array for host memory or a CuPy array for device memory (a torch
    tensor is viewed without a copy); ``device`` is "cpu" or "cuda:<id>"; ``to_user`` turns an
    array of the same kind back into the caller's framework type.
    """

    array: Any
    device: str
    framework: str
    to_user: Callable[[Any], Any]
    device_id: int = -1  # CUDA device ordinal; -1 for host memory

    @property
    def is_cuda(self) -> bool:
        return self.device_id >= 0


_CUDA_NAMES = tuple(f"cuda:{i}" for i in range(16))


def _identity(a: Any) -> Any:
    return a


identity = _identity  # the converter of arrays hvdlite hands back as they are


def _module_of(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def label(what: Any, name: str | None) -> str:
    """The call as error messages name it: ``what`` itself, or "<kind> of tensor '<name>'"
    when a collective kind and a tensor name are given (formatted only on error)."""
    if name is None:
        return str(what)
    return f"{what.name.lower()} of tensor {name!r}"


def wrap(obj: Any, what: Any, name: str | None = None) -> TensorRef:
    """View ``obj`` as a :class:`TensorRef`; ``TypeError``/``ValueError`` naming the call
    (``what``, or ``what`` a collective kind and ``name`` the tensor: see :func:`label`)."""
    if type(obj) is np.ndarray:
        if not obj.flags.c_contiguous:
            _require_contiguous(False, label(what, name), "np.ascontiguousarray(x)")
        return TensorRef(obj, "cpu", "numpy", _identity)
    module = _module_of(obj)
    if module == "cupy":
        if not obj.flags.c_contiguous:
            _require_contiguous(False, label(what, name), "cupy.ascontiguousarray(x)")
        device_id = obj.data.device_id  # an int attribute; obj.device builds an object
        return TensorRef(obj, _CUDA_NAMES[device_id] if device_id < len(_CUDA_NAMES)
                         else f"cuda:{device_id}", "cupy", _identity, device_id)
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
    from hvdlite import _torchref  # rebinds _wrap_torch to its cached ref_of on import

    return _torchref.ref_of(t, what, name)


# The torch adapter (hvdlite/_torchref.py) caches each tensor's view: no torch operator per
# call. It is imported by the first torch tensor, never by ``import hvdlite``.
_wrap_torch: Callable[[Any, Any, str | None], TensorRef] = _load_torch_wrapper
