"""``TorchState``: Horovod's elastic state of a PyTorch training process."""

from __future__ import annotations

import copy
from typing import Any

import torch

from hvdlite.elastic import ObjectState
from hvdlite.torch import basics
from hvdlite.torch.elastic.sampler import ElasticSampler
from hvdlite.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["TorchState"]


class _Handler:
    """How one kind of value is saved, restored and synced (a model, an optimizer, ...)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = self.snapshot()

    def snapshot(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self.saved = self.snapshot()

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self, root: int) -> None:
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self, root: int) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=root)


class _OptimizerHandler(_Handler):
    def sync(self, root: int) -> None:
        broadcast_optimizer_state(self.value, root_rank=root)


class _SamplerHandler(_Handler):
    def sync(self, root: int) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=root))


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
]


class TorchState(ObjectState):
    """The elastic state of a PyTorch training process (Horovod's ``TorchState``).

    ``model`` and ``optimizer`` (either may be None), and any keyword argument that is a
    ``torch.nn.Module``, ``torch.optim.Optimizer`` or :class:`ElasticSampler`, are saved by
    ``state_dict()`` (deep copies), restored by ``load_state_dict`` and synced by
    ``broadcast_parameters`` / ``broadcast_optimizer_state`` / ``broadcast_object``; every
    other keyword argument is a picklable attribute (``state.epoch``). Assigning a new model
    (etc.) to its attribute saves it. ``commit()``, ``restore()``, ``sync()``,
    ``check_host_updates()`` and ``register_reset_callbacks()`` as in :class:`State`.
    """

    _handlers: dict[str, _Handler]

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        objects: dict[str, Any] = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                objects[name] = value
            else:
                handlers[name] = kind(value)
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **objects)

    def __setattr__(self, name: str, value: Any) -> None:
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is not None:
            handler.value = value
            handler.save()
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync(self._sync_root)
        super().sync()

    def _payload(self) -> Any:
        return {"handlers": {name: h.saved for name, h in self._handlers.items()},
                **super()._payload()}

    def _load_payload(self, payload: Any) -> None:
        for name, saved in payload["handlers"].items():
            handler = self._handlers[name]
            handler.saved = saved
            handler.restore()
        super()._load_payload(payload)
