"""Compiled models whose gradient buckets overlap backward: regional compilation.

``torch.compile`` of a whole model runs its backward as one autograd operation, so every
gradient hook fires after the whole backward pass: a ``DistributedOptimizer``'s buckets then
start only when backward has ended, and their allreduces overlap nothing. Compiled region by
region (each transformer block, say), every region's backward is an operation of its own; a
region's gradients are final as soon as its backward ends, so a bucket that holds exactly the
regions that finished starts while the earlier layers' backward still runs.

:func:`compile_regions` compiles the regions of a model in place (the repeated blocks, found
or given); :func:`region_groups` turns them into the optimizer's ``groups=``, in the order
backward finishes them, so bucket boundaries fall on region boundaries::

    regions = hvd.compile_regions(model)                  # kwargs go to torch.compile
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   groups=hvd.region_groups(model, regions))

A region falls back to eager execution the way ``torch.compile`` says (graph breaks, dynamic
shapes, recompilations past its limit: ``TORCH_LOGS=graph_breaks,recompiles``); the parameters
outside every region (embeddings, a head) stay eager and form the last group. Give a heavy
language-model head as a region too, with its loss in the same module and its matmuls padded
(``head_loss.compile(options={"force_shape_pad": True})``, then among the regions given to
:func:`region_groups`: a vocabulary width such as GPT-2's 50257 otherwise runs unaligned
GEMMs; docs/captured-step.md); a parameter tied to the embedding still waits in the last
group. Regions share their compiled code: arguments that differ from one region to the next
(a Hugging Face model's key/value cache, on by default: set ``model.config.use_cache = False``
for training, which :func:`compile_regions` warns of) recompile it per region.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hvdlite.torch._buckets import mib_bytes

__all__ = ["compile_regions", "find_regions", "region_groups"]


def find_regions(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: the children of its ``nn.ModuleList`` or
    ``nn.Sequential`` with the most parameter-holding children of one type (a transformer's
    layers); else its direct children that hold parameters. In forward order."""
    best: list[nn.Module] = []
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [m for m in module.children() if any(True for _ in m.parameters())]
        if len(kids) < 2:
            continue
        common = max({type(k) for k in kids}, key=lambda t: sum(type(k) is t for k in kids))
        same = [k for k in kids if type(k) is common]
        if len(same) > len(best):
            best = same
    if best:
        return best
    return [m for m in model.children() if any(True for _ in m.parameters())]


def compile_regions(model: nn.Module, regions: Sequence[nn.Module] | None = None,
                    **compile_kwargs: Any) -> list[nn.Module]:
    """Compile each region of ``model`` in place (``nn.Module.compile(**compile_kwargs)``:
    ``mode``, ``backend``, ``dynamic``, ... as ``torch.compile`` takes them) and return the
    regions, in forward order. ``regions``: submodules of ``model`` (default
    :func:`find_regions`). The regions share one compiled frame, and a block's input layout
    may differ between the first region and the rest (torchvision's ViT: batch-first, then
    sequence-first after attention), so it compiles twice; with torch's default
    (``dynamic=None``, automatic dynamic shapes) the second graph has symbolic strides.
    For fixed shapes ``dynamic=False`` compiles one static graph per layout instead (2% of
    ViT-B/16's eager step, docs/captured-step.md); for shapes that vary (dynamic padding)
    keep the default, since static graphs would reach torch's recompile limit (8 a frame)
    after four shapes. Not collective; call it on every rank alike. ``ValueError`` if a
    region is not a submodule of ``model`` or two regions overlap."""
    chosen = list(regions) if regions is not None else find_regions(model)
    if not chosen:
        raise ValueError("compile_regions: the model has no submodule with parameters to "
                         "compile; compile it whole with torch.compile")
    inside = {id(m) for m in model.modules()}
    seen: set[int] = set()
    for i, region in enumerate(chosen):
        if not isinstance(region, nn.Module) or id(region) not in inside:
            raise ValueError(f"compile_regions: region {i} is not a submodule of the model")
        params = {id(p) for p in region.parameters()}
        if params & seen:
            raise ValueError(f"compile_regions: region {i} shares parameters with an earlier "
                             "region; give regions that do not nest")
        seen |= params
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is True:
        # Hugging Face models with a key/value cache on make a cache object every forward
        # and hand it to every block; each block sees it in another state, so the shared
        # compiled code recompiles per block until torch's recompile limit runs the rest
        # eager (GPT-2 small: 8 of 12 blocks compiled, none once captured).
        warnings.warn("compile_regions: model.config.use_cache is True: the per-forward "
                      "cache makes each region recompile until torch.compile's recompile "
                      "limit leaves the rest eager; set model.config.use_cache = False for "
                      "training", stacklevel=2)
    for region in chosen:
        region.compile(**compile_kwargs)
    return chosen


def region_groups(model: nn.Module, regions: Sequence[nn.Module],
                  bucket_cap_mb: float = 25.0) -> list[list[torch.Tensor]]:
    """``DistributedOptimizer``'s ``groups=`` for ``regions`` (in forward order): one group
    per run of consecutive regions, in the order backward finishes them (the last region
    first), each run at most ``bucket_cap_mb`` MiB but never split inside a region; the
    first and the last region alone (the first bucket starts as early as it can, the last
    leaves no long tail); the parameters outside every region in one last group. A
    parameter a region shares with a module outside every region (a language model's head
    tied to its embedding) goes to that last group too: its gradient is final only when the
    outside module's backward has run, at the end, and a bucket holding it would wait that
    long. Only parameters that require a gradient are grouped."""
    cap = mib_bytes("bucket_cap_mb", bucket_cap_mb)
    inside = {id(m) for r in regions for m in r.modules()}
    tied = {id(p) for m in model.modules() if id(m) not in inside
            for p in m.parameters(recurse=False)}
    per_region: list[list[torch.Tensor]] = [
        [p for p in r.parameters() if p.requires_grad and id(p) not in tied] for r in regions]
    taken = {id(p) for ps in per_region for p in ps}
    groups: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    last = len(per_region) - 1
    for k in range(last, -1, -1):  # backward finishes the last region first
        ps = per_region[k]
        if not ps:
            continue
        nbytes = sum(p.numel() * p.element_size() for p in ps)
        alone = k in (0, last)
        if current and (alone or size + nbytes > cap):
            groups.append(current)
            current, size = [], 0
        current = current + ps
        size += nbytes
        if alone:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    rest: list[torch.Tensor] = [p for p in model.parameters()
                                if p.requires_grad and id(p) not in taken]
    if rest:
        groups.append(rest)
    return groups
