"""What the core sees of a caller's tensor: :class:`TensorRef` (array, device, converter back
to the caller's type), shared by the NumPy/CuPy adapter (``_tensors.py``) and the torch one
(``_torchref.py``), which import it and not each other's internals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TensorRef", "Ring", "identity", "label"]


class Ring:
    """A viewed framework's recycled results of one input tensor (``_vocab/plans.py``'s
    ``Lane.result`` keeps them here instead of on the lane): they outlive a lane that the
    response cache let go, and go with the tensor. ``used``: the tensor had an output before
    (its first keeps none, so a tensor reduced once holds no spare memory)."""

    __slots__ = ("sets", "used")

    def __init__(self) -> None:
        self.sets: list[Any] = []
        self.used = False


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A caller's tensor seen as an array hvdlite can move.

    ``array`` is a NumPy array for host memory or a CuPy array for device memory (a torch
    tensor is viewed without a copy); ``device`` is "cpu" or "cuda:<id>"; ``to_user`` turns an
    array of the same kind back into the caller's framework type.

    A framework whose tensors are viewed (torch) also gives the edge of the call route:
    ``view`` maps a call's tensors to their cached arrays (each the same object while its
    tensor holds the same memory, so a lane matches it; anything else comes back as it is),
    and ``counts`` makes, once per result set, the function that measures who refers to the
    result tensors handed out (``_vocab/plans.py``'s recycling), views of their storage
    included; ``ring`` keeps a single tensor's recycled results with the tensor
    (:class:`Ring`).
    """

    array: Any
    device: str
    framework: str
    to_user: Callable[[Any], Any]
    device_id: int = -1  # CUDA device ordinal; -1 for host memory
    view: Callable[[Sequence[Any]], list[Any]] | None = None
    counts: Callable[[Sequence[Any]], Callable[[], list[int]]] | None = None
    ring: Ring | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device_id >= 0


def _identity(a: Any) -> Any:
    return a


identity = _identity  # the converter of arrays hvdlite hands back as they are


def label(what: Any, name: str | None) -> str:
    """The call as error messages name it: ``what`` itself, or "<kind> of tensor '<name>'"
    when a collective kind and a tensor name are given (formatted only on error)."""
    if name is None:
        return str(what)
    return f"{what.name.lower()} of tensor {name!r}"
