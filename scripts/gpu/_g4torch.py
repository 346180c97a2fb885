"""G4's torch baselines: the same layer shapes as a torch model, plain and under DDP.

``nn.Sequential`` of ``layers`` x ``Linear(width, width, bias=False)``; one step is forward,
``backward(dy)``, ``SGD.step()``, ``zero_grad()`` and a stream synchronise. Variants: the plain
model (torch's compute only) and DDP with 25 MB buckets (the default) and with 100 MB buckets
and ``gradient_as_bucket_view=True``. Before timing, each DDP model's averaging is checked: the
gradients after a DDP backward must be identical on every rank and equal the mean of the ranks'
local gradients (from a ``no_sync`` backward) under a fixed random linear functional per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _gpulib as gl
import numpy as np

COMPUTE = "torch compute only (no DDP)"
DDP25 = "torch DDP, 25 MB buckets"
DDP100 = "torch DDP, 100 MB buckets, gradient_as_bucket_view"
CHECK_RTOL = 1e-4


class TorchCase:
    """The models, inputs and step functions of one batch size."""

    def __init__(self, gpu: gl.Gpu, torch: Any, rows: int, lr: float) -> None:
        a = gpu.args
        self.gpu, self.torch = gpu, torch
        self.dev = torch.device("cuda", gpu.device_id)
        torch.backends.cuda.matmul.allow_tf32 = not a.fp32
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(gl.data_key(a.seed, gpu.rank, 7))
        self.x = torch.randn(rows, a.width, generator=gen, device=self.dev)
        self.dy = torch.randn(rows, a.width, generator=gen, device=self.dev)
        shared = torch.Generator(device=self.dev)
        shared.manual_seed(gl.data_key(a.seed, -1, 7))
        self.pattern = (
            torch.rand(a.width, a.width, generator=shared, device=self.dev) < 0.5
        ).double() * 2 - 1
        self.lr = lr
        ddp = torch.nn.parallel.DistributedDataParallel
        ids = [gpu.device_id]
        self.models: dict[str, tuple[Any, Any, bool]] = {
            COMPUTE: self._pair(self._model(), None, True),
            DDP25: self._pair(
                self._model(), lambda m: ddp(m, device_ids=ids, bucket_cap_mb=25), True
            ),
            DDP100: self._pair(
                self._model(),
                lambda m: ddp(m, device_ids=ids, bucket_cap_mb=100, gradient_as_bucket_view=True),
                False,
            ),
        }

    def _model(self) -> Any:
        torch, a = self.torch, self.gpu.args
        torch.manual_seed(a.seed)  # the same initial weights on every rank
        layers = [torch.nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)]
        return torch.nn.Sequential(*layers).to(self.dev)

    @staticmethod
    def _pair(
        inner: Any, wrap: Callable[[Any], Any] | None, grads_to_none: bool
    ) -> tuple[Any, Any, bool]:
        return (inner if wrap is None else wrap(inner)), inner, grads_to_none

    def step_fn(self, name: str) -> Callable[[], None]:
        """One training step of model ``name``, ending with a stream synchronise."""
        outer, inner, to_none = self.models[name]
        opt = self.torch.optim.SGD(inner.parameters(), lr=self.lr)
        x, dy, stream = self.x, self.dy, self.torch.cuda.current_stream(self.dev)

        def step() -> None:
            outer(x).backward(dy)
            opt.step()
            opt.zero_grad(set_to_none=to_none)
            stream.synchronize()

        return step

    def _functional(self, inner: Any) -> tuple[np.ndarray, np.ndarray]:
        grads = [p.grad.double() for p in inner.parameters()]
        val = self.torch.stack([(g * self.pattern).sum() for g in grads]).cpu().numpy()
        scale = self.torch.stack([g.abs().sum() for g in grads]).cpu().numpy()
        return val, scale

    def _zero(self, inner: Any, to_none: bool) -> None:
        for p in inner.parameters():
            if to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def check_ddp(self, name: str) -> None:
        """DDP's gradients equal the mean of the local ones and agree across ranks."""
        gpu = self.gpu
        outer, inner, to_none = self.models[name]
        with outer.no_sync():
            outer(self.x).backward(self.dy)
        local, scale = self._functional(inner)
        self._zero(inner, to_none)
        outer(self.x).backward(self.dy)
        got, _ = self._functional(inner)
        self._zero(inner, to_none)
        locals_ = gpu.comm.allgather(local)
        gots = gpu.comm.allgather(got)
        want = np.mean(locals_, axis=0)
        tol = CHECK_RTOL * np.mean(gpu.comm.allgather(scale), axis=0)
        err = np.abs(got - want)
        differ = bool(np.any(np.abs(np.asarray(gots) - got) > 1e-12 * tol))
        ok = bool(np.all(err <= tol)) and not differ
        detail = (
            f"layer {int(np.argmax(err - tol))}: functional {got.tolist()[:3]}..., "
            f"mean of local {want.tolist()[:3]}...; ranks differ: {differ}"
        )
        gl.check_all(gpu.comm, ok, f"{name}: averaged gradients", detail)

    def close(self) -> None:
        self.models.clear()
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()


def run(gpu: gl.Gpu, torch: Any, rows: int, lr: float) -> dict[str, np.ndarray]:
    """Check the DDP variants, then time all three round robin; per-step seconds."""
    case = TorchCase(gpu, torch, rows, lr)
    for name in (DDP25, DDP100):
        case.check_ddp(name)
    fns = {name: case.step_fn(name) for name in (COMPUTE, DDP25, DDP100)}
    times = gl.time_round_robin(gpu.comm, fns, gpu.args.steps, gpu.args.warmup)
    for name in (DDP25, DDP100):
        case.check_ddp(name)
    del fns
    case.close()
    return times
