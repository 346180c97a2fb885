"""T1/T2: synthetic training with hvdlite.torch's DistributedOptimizer against torch DDP and one
GPU without communication, all in one launch, on the same model, initial weights and batch.

Per rank: a synthetic model (torchvision ResNet-50 by default, any torchvision name such as
``resnet18``; ``--model transformer``, 12 x ``nn.TransformerEncoderLayer(768, 12, 3072)``
without dropout on ``--seq-len`` (128) tokens; ``--model tiny``, a small CNN, for a CPU smoke
test; ``--model g4``, G4's stack of 24 x Linear(4096, 4096) without bias, the layer shape
BENCHMARKS.md names for T2), one fixed random batch of ``--batch-size`` (32) that differs per
rank, plain SGD. Variants, each its own copy of the model from the same initial weights:

- plain torch, no communication (the scaling limit and T2's compute-only step); with
  ``--share-gpu`` it runs on rank 0 alone on the whole batch (every rank's batch), the others
  waiting: one process doing the launch's work;
- hvdlite ``DistributedOptimizer`` with default settings (``import hvdlite.torch as hvd;
  hvd.DistributedOptimizer(opt, named_parameters=...)``), then with each setting changed:
  ``gradient_as_bucket_view=True``; asynchronous completion (CUDA only: the engine's knob,
  set on the live runtime for that variant's rounds, as ``HVDLITE_ENABLE_ASYNC_COMPLETION=1``
  sets it at init; the runtime reads it at every submission);
- torch DDP (NCCL on the GPU, gloo with ``--no-cuda`` or ``--share-gpu``; DDP's defaults).

At one rank hvdlite runs with the ``optimizer_size1_shortcut`` knob off (as every GPU
benchmark turns size-1 shortcuts off), so the optimizer runs its N-rank path: hooks, buckets,
one NCCL allreduce per bucket, the stream-ordered step; DDP at world size 1 runs its reducer.

Correctness first, for every variant the launch times: ``--check-steps`` (10) steps of each
(past two ranks at most 4 for a model with BatchNorm: :func:`check_steps` says why) from the
same initial weights and batches, with deterministic cuDNN. Every variant's parameters must
differ from the initial weights; every distributed one's must be bit-identical on every
rank and equal its reference within ``--atol + --rtol x max|param|`` (the max abs difference
is reported): torch DDP for the eager variants, compiled DDP for the compiled ones (computed
for the check even where it is not timed), and for the captured steps the reference of their
model (compiled DDP under ``--compile on``, else DDP). A captured step's first call runs its
``CAPTURE_WARMUP`` (3) eager warm-up steps, so it gets fewer calls for the same number of steps.
The baselines without communication (plain torch, eager and compiled) train each rank on its
own batch: they are checked to move only. Refused (exit 2) otherwise, and if the launch does
not have ``--np`` ranks. Each variant's first call there is timed (the slowest rank's) and
reported as ``<variant>: first call s``; for a compiled variant it includes compiling its code,
which gives issue 39's compile-time target on a GPU (by regions <= 1.5x the compiled model
alone). The check compiles in launch order (compiled DDP, then the compiled model alone, then
the rest); before each compiled variant dynamo is reset, and inductor's FX graph and autograd
caches are off during the check, so each first call compiles its graphs anew (Triton's
kernel binaries stay cached by source: a kernel the same as an earlier variant's is not
built twice). ``--warm-compile`` leaves those caches on, so variants load what an earlier one
compiled (a cold two-GPU machine did not finish compiling six ViT-B/16 variants in 280 s);
the first calls then measure no compile time, and the compile-time target is not judged.

Timing (cuDNN autotuning on): ``--warmup`` steps per variant, then ``--iters`` rounds; a round
runs ``--batches-per-iter`` steps of each variant in turn (barrier, host clock, the steps, a
device synchronise); a round's time is the slowest rank's; images/s per GPU from the median
round (Horovod's synthetic benchmark's shape). Comm alone: one hvdlite ``grouped_allreduce`` of
tensors of every gradient's shape, and one ``torch.distributed.all_reduce`` of one flat buffer of
all of them (the fused limit), median of ``--comm-reps``, checked exact first.

Reported: images/s per GPU and in all, the ratio to DDP, scaling efficiency (images/s per GPU
over the one-GPU variant's), step time per batch, exposed communication = (step - one-GPU step)
/ comm alone (the faster of the two comm-alone times: the stricter denominator). Targets at 2 or
more ranks, one GPU each (BENCHMARKS.md T1, T2 as worded in issue 21, on this model): hvdlite
>= 1.05x DDP images/s; scaling efficiency >= 0.92; exposed <= 20% of comm alone; step <=
DDP's. At 1 rank (issue 25), hvdlite's default: ResNets step <= 1.05x plain torch's and
images/s >= 1.1x DDP's; the transformer step <= 1.02x plain. Two ranks sharing one GPU
(``--share-gpu``, CUDA IPC): recorded, no target (the processes take turns on the device).

    mpirun -n 1 python3 scripts/gpu/bench_t1.py --np 1 --model resnet18 --json t1.json
    mpirun -n 2 python3 scripts/gpu/bench_t1.py --np 2 --share-gpu
    mpiexec -n 2 python scripts/gpu/bench_t1.py --no-cuda --model tiny --quick   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _gpulib as gl
import numpy as np
from _t1report import report
from _t1run import Env, Runner, digest
from _t1vocab import (
    BASE,
    CAPTURE_WARMUP,
    CAPTURED,
    COMM_HVD,
    COMM_TORCH,
    DDP,
    DDP_C,
    HVD,
    HVDS,
    LOCAL,
    ONE_STEP_FLOOR,
    ONE_STEP_FLOOR_BF16,
    ONE_STEP_RTOL,
    ORDER_X,
    ORDERS,
    SHORT,
    TRANSFORMERS,
    is_compiled,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = gl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50",
                   help="a torchvision.models name, 'tiny' (small CNN) or 'g4' (24 x "
                        "Linear(4096, 4096))")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (rows for g4)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per variant")
    p.add_argument("--batches-per-iter", type=int, default=10)
    p.add_argument("--iters", type=int, default=10, help="timed rounds")
    p.add_argument("--check-steps", type=int, default=10)
    p.add_argument("--comm-reps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="hvdlite's bucket size (DDP's default is 25 MB as well)")
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample (transformer: 128, gpt2: 512)")
    p.add_argument("--autocast", choices=("auto", "none", "bf16"), default="auto",
                   help="bf16 autocast of forward and loss (auto: on for vit_b_16 and gpt2)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="also time torch.compile'd variants (auto: on for vit_b_16 and gpt2)")
    p.add_argument("--warm-compile", action="store_true",
                   help="keep inductor's FX graph and autograd caches on during the check "
                        "(faster on a cold machine; first calls then are no compile times)")
    p.add_argument("--variants", default="",
                   help="comma-separated variants to run beside plain, hvdlite's default and "
                        f"DDP (default: all): {', '.join(SHORT)}")
    p.add_argument("--captured", action="store_true",
                   help="also time the captured steps (T5): hvdlite's make_graphed_step, the "
                        "captured plain step without communication (the captured limit) and a "
                        "captured plain step with one flat allreduce after backward (compiled "
                        "models under --compile on)")
    p.add_argument("--graph-dump", metavar="DIR", default="",
                   help="with --captured: rank 0 writes each captured variant's CUDA graph as "
                        "DOT into DIR (scripts/gpu/graph_overlap.py reads them)")
    p.add_argument("--kernel-trace", metavar="DIR", default="",
                   help="after timing, each variant's --batches-per-iter steps once more under "
                        "torch.profiler (CUDA kernels): every rank's Chrome trace into DIR, and "
                        "how much of the communication's time (NCCL, CUDA IPC) ran beside "
                        "other kernels (scripts/gpu/kernel_overlap.py), rank 0's, in the report")
    p.add_argument("--no-neg", action="store_true",
                   help="leave out the optimizer_schedule-off variant")
    p.add_argument("--no-cuda", action="store_true", help="CPU: gloo for DDP, MPI for hvdlite")
    p.add_argument("--switch-interval-us", type=float, default=0.0,
                   help="sys.setswitchinterval for every variant (0: Python's, 5000 us): how "
                        "long a thread waiting for the GIL lets its holder run on")
    p.add_argument("--share-gpu", action="store_true",
                   help="every rank on GPU 0 (hvdlite over CUDA IPC, DDP over gloo); plain "
                        "torch on rank 0 alone on the whole batch")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.batches_per_iter, args.iters, args.comm_reps = 2, 2, 3, 3
        if args.model == "tiny":
            args.image_size = min(args.image_size, 64)
    if args.seq_len is None:
        args.seq_len = 512 if args.model == "gpt2" else 128
    if args.autocast == "auto":
        args.autocast = "bf16" if args.model in TRANSFORMERS and not args.no_cuda else "none"
    if args.compile == "auto":
        args.compile = "on" if args.model in TRANSFORMERS and not args.no_cuda else "off"
    if args.model == "gpt2" and args.atol == 1e-5:
        # Its embedding's backward adds with atomics: DDP differs from DDP by ~2e-4 here.
        args.atol = 1e-3
    if min(args.batch_size, args.batches_per_iter, args.iters, args.check_steps,
           args.comm_reps) < 1 or args.warmup < 0:
        p.error("sizes and counts must be positive")
    if args.captured and args.no_cuda:
        p.error("--captured needs CUDA (a captured step is a CUDA graph); leave out --no-cuda")
    if args.kernel_trace and args.no_cuda:
        p.error("--kernel-trace traces CUDA kernels; leave out --no-cuda")
    if args.captured and args.check_steps < CAPTURE_WARMUP:
        p.error(f"--captured needs --check-steps >= {CAPTURE_WARMUP} (a captured variant's "
                "first call runs that many eager steps)")
    return args


# -- correctness -------------------------------------------------------------------------------
def reference_of(env: Env, kind: str) -> str:
    """The variant whose parameters ``kind``'s must equal after the same steps."""
    compiled = is_compiled(kind, env.args)
    return DDP_C if compiled else DDP


_COMPILE_CACHES = (("torch._inductor.config", "fx_graph_cache"),
                   ("torch._functorch.config", "enable_autograd_cache"))


def compile_caches(torch: Any, on: bool | dict[str, Any] | None) -> dict[str, Any]:
    """Inductor's FX graph cache and the AOT autograd cache turned ``on`` or off (a dict: the
    settings a former call returned; None: left as they are), dynamo's caches cleared;
    returns the settings they had. Off, the next compiled variant's first call compiles its
    graphs anew: the caches' keys would match an earlier variant's graphs and turn its
    compile into a load."""
    import importlib

    torch._dynamo.reset()
    had = {}
    for path, name in _COMPILE_CACHES:
        module = importlib.import_module(path)
        if hasattr(module, name):
            had[name] = getattr(module, name)
            value = on.get(name, had[name]) if isinstance(on, dict) else on
            if value is not None:
                setattr(module, name, value)
    return had


def check_steps(asked: int, size: int, batch_norm: bool) -> int:
    """Steps the correctness check compares after. Two ranks' sum is the same in any order,
    so every variant equals its reference bit for bit however its buckets are cut; past two,
    DDP's buckets and hvdlite's sum each gradient in another order (fp32 rounding), and
    BatchNorm amplifies that step after step: 4 ranks' gradients summed in two orders moved
    a BatchNorm ResNet-18's parameters apart by 16-19% of their change in 10 steps (CPU), as
    ResNet-18 (7.5e-4) and ResNet-50 (0.10) did at 4 GPUs (run 81). So past two ranks a
    model with BatchNorm is compared after the fewest steps that still replay a captured
    step once (the warm-up, the capture, one replay); every model's tolerance there is
    scaled by the rounding measured in the same launch (:func:`check_correctness`). A model
    without BatchNorm (the transformers) runs the steps asked at any rank count."""
    return asked if size <= 2 or not batch_norm else min(asked, CAPTURE_WARMUP + 1)


def check_correctness(env: Env) -> dict[str, Any]:
    """``--check-steps`` steps of every variant the launch times (and of the references they
    are compared with) from the same start: each moved from the start; each distributed one
    identical on every rank and equal to its reference (:func:`reference_of`) within the
    tolerance. Refuses otherwise.

    Past two ranks the tolerance against eager DDP is at least ``ORDER_X`` times how far DDP
    with other buckets (``DDP_ORDER``: 1 MB buckets; ``DDP_ORDER_ONE``: one bucket; the
    farther of the two) moved from DDP in the same steps: the rounding of
    another summation order, measured rather than guessed (BatchNorm ResNets at 4 GPUs
    differed by 2.3e-4 after 4 steps where the fixed bound was 1.1e-4, run 86). That bound
    is one sample of a chaotic spread (ResNet-50 at 4 H200s: DDP with other buckets 0.043 from
    DDP after 4 steps, where the step moved the weights 0.063, run 127), so it is not the whole
    proof: every eager variant is also compared with its reference after its *first* step,
    update by update (``ONE_STEP_RTOL`` of each update plus ``ONE_STEP_FLOOR`` of the largest),
    where summation order moves an update by rounding only and a wrong sum by a fraction."""
    torch, args = env.torch, env.args
    cudnn = torch.backends.cudnn
    cudnn.deterministic, cudnn.benchmark = True, False
    steps = check_steps(args.check_steps, env.size, env.batch_norm)
    timed = env.variants()
    local = [k for k in timed if k in LOCAL]
    distributed = [k for k in timed if k not in local]
    refs = sorted({reference_of(env, k) for k in distributed}, key=(DDP, DDP_C).index)
    if env.size > 2 and DDP in refs:
        refs += ORDERS
    flats: dict[str, Any] = {}
    firsts: dict[str, float] = {}
    ones: dict[str, Any] = {}  # parameters after the first step (eager variants)
    caches: dict[str, Any] = {}
    for kind in [*refs, *local, *(k for k in distributed if k not in refs)]:
        if is_compiled(kind, args) and not args.warm_compile:
            caches = caches or compile_caches(torch, False)
            compile_caches(torch, None)
        r = Runner(env, kind)
        # A captured variant's first call runs CAPTURE_WARMUP eager steps (then captures).
        calls = steps - CAPTURE_WARMUP + 1 if kind in CAPTURED else steps
        # The first call, the slowest rank's: a compiled variant's includes its compilation
        # (the first of its code in this launch, for the regions and the whole model alike).
        env.barrier()
        t0 = time.perf_counter()
        r.steps(1)
        env.sync()
        firsts[kind] = env.max_over_ranks(time.perf_counter() - t0)
        if kind not in CAPTURED:  # (a captured variant's first call is several steps)
            ones[kind] = r.flat()
        r.steps(calls - 1)
        env.sync()
        flats[kind] = r.flat()
        del r
    if caches:  # the timed variants compile with the caches as the user has them
        compile_caches(torch, caches)
    out: dict[str, Any] = {"steps": steps, "atol": args.atol, "rtol": args.rtol,
                           "compile caches": "on" if args.warm_compile else "off"}
    for kind, first in firsts.items():
        out[f"{kind}: first call s"] = round(first, 2)
    bounds = {}
    for ref in (r for r in refs if r not in ORDERS):
        scale = env.max_over_ranks(float(flats[ref].abs().max()))
        bounds[ref] = args.atol + args.rtol * scale
    for o in (o for o in ORDERS if o in flats):
        order = env.max_over_ranks(float((flats[o] - flats[DDP]).abs().max()))
        out[f"{o}: max abs diff vs {DDP}"] = order
        bounds[DDP] = max(bounds[DDP], ORDER_X * order)
    for ref, bound in bounds.items():
        out[f"bound vs {ref}"] = bound
    check_first_step(env, ones, out)  # first: the sharper of the two
    for kind, flat in flats.items():
        moved = env.max_over_ranks(float((flat - env.init_flat).abs().max()))
        gl.check_all(env.comm, moved > 0, f"{kind}: parameters moved in {steps} "
                     "steps", "the parameters equal the initial weights")
        out[f"{kind}: max abs change from init"] = moved
        if kind in local:
            continue
        digests = env.comm.allgather(digest(flat))
        gl.check_all(env.comm, len(set(digests)) == 1,
                     f"{kind}: parameters identical on every rank", f"digests {digests}")
        ref = reference_of(env, kind)
        if kind == ref or kind in ORDERS:
            continue
        diff = env.max_over_ranks(float((flat - flats[ref]).abs().max()))
        out[f"{kind}: max abs diff vs {ref}"] = diff
        gl.check_all(env.comm, diff <= bounds[ref], f"{kind}: parameters equal {ref}'s after "
                     f"{steps} steps", f"max abs diff {diff:.3g} > {bounds[ref]:.3g}")
    out["checked"] = "; ".join(sorted(flats))
    del flats
    if env.cuda:
        torch.cuda.empty_cache()
    return out


def check_first_step(env: Env, ones: dict[str, Any], out: dict[str, Any]) -> None:
    """Each eager distributed variant's parameters after one step against its reference's
    (see :func:`check_correctness`): refuses where an update differs from the reference's by
    more than ``ONE_STEP_RTOL`` of it plus ``ONE_STEP_FLOOR`` of the largest update."""
    init = env.init_flat
    for kind, flat in ones.items():
        ref = reference_of(env, kind)
        if kind in LOCAL or kind == ref or kind in ORDERS or ref not in ones:
            continue
        want = ones[ref] - init
        share = ONE_STEP_FLOOR_BF16 if env.args.autocast == "bf16" else ONE_STEP_FLOOR
        floor = share * env.max_over_ranks(float(want.abs().max()))
        excess = ((flat - init) - want).abs() - ONE_STEP_RTOL * want.abs() - floor
        worst = env.max_over_ranks(float(excess.max()))
        diff = env.max_over_ranks(float((flat - ones[ref]).abs().max()))
        out[f"{kind}: first step, max abs diff vs {ref}"] = diff
        gl.check_all(env.comm, worst <= 0, f"{kind}: the first step's update equals {ref}'s",
                     f"max abs diff {diff:.3g}, over the bound by {worst:.3g} (bound: "
                     f"{ONE_STEP_RTOL:g} of each update + {floor:.3g})")


# -- timing ------------------------------------------------------------------------------------
def time_training(env: Env) -> dict[str, np.ndarray]:
    """Per-round seconds (slowest rank) of ``--batches-per-iter`` steps, per variant."""
    torch, args = env.torch, env.args
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    runners = {k: Runner(env, k) for k in env.variants()}
    for r in runners.values():
        r.steps(args.warmup)
    env.sync()
    env.routes = {k: route(r.opt) for k, r in runners.items() if k in HVDS}

    def rounds(r: Runner) -> Callable[[], None]:
        def run() -> None:
            r.steps(args.batches_per_iter)
            env.sync()
        return run

    times = gl.time_round_robin(env.comm, {k: rounds(r) for k, r in runners.items()}, args.iters, 0,
                                rotate=True)
    env.kernel_overlap = trace_kernels(env, runners) if args.kernel_trace else {}
    del runners
    if env.cuda:
        torch.cuda.empty_cache()
    return times


def route(opt: Any) -> str:
    """How a hvdlite variant's optimizer launches its buckets: on the agreed schedule (and
    over which transport), or negotiated, and why (a step far slower than its peers' reads
    differently on each)."""
    n = len(opt.bucket_names)
    buckets = f"{n} bucket{'s' if n != 1 else ''}"
    why = opt.unscheduled_reason
    if why:
        return f"negotiated, {buckets}: {why}"
    return f"agreed schedule over {opt.agreed_schedule.via}, {buckets}"


def trace_kernels(env: Env, runners: dict[str, Runner]) -> dict[str, dict[str, float]]:
    """--kernel-trace: each variant's ``--batches-per-iter`` steps under torch.profiler (CUDA
    activity), every rank's trace written to the folder; returns this rank's device's
    kernel overlap per variant (scripts/gpu/kernel_overlap.py's summary)."""
    import kernel_overlap

    torch, args = env.torch, env.args
    root = Path(args.kernel_trace)
    root.mkdir(parents=True, exist_ok=True)
    names = {v: k for k, v in SHORT.items()} | {BASE: "plain", HVD: "hvd", DDP: "ddp"}
    out: dict[str, dict[str, float]] = {}
    for kind, r in runners.items():
        env.barrier()
        activity = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activity) as prof:
            r.steps(args.batches_per_iter)
            env.sync()
        slug = names.get(kind) or "".join(c if c.isalnum() else "_" for c in kind)
        path = root / f"{args.model}_{slug}_rank{env.rank}.json"
        prof.export_chrome_trace(str(path))
        mine = kernel_overlap.summary(json.loads(path.read_text(encoding="utf-8")))
        out[kind] = mine.get(env.device.index) or next(iter(mine.values()), {})
    return out


def time_comm(env: Env) -> dict[str, np.ndarray]:
    """Comm alone: hvdlite grouped_allreduce of every gradient's shape; torch all_reduce of
    one flat buffer of them all. Checked exact (rank + 1 summed) before timing."""
    torch, hvd, args = env.torch, env.hvd, env.args
    want = float(env.size * (env.size + 1) // 2)
    ts = [torch.full(s, float(env.rank + 1), device=env.device) for s in env.grad_shapes]
    flat = torch.full((env.n_params,), float(env.rank + 1), device=env.device)
    got = hvd.grouped_allreduce(ts, name="t1.comm", op=hvd.Sum)
    env.sync()
    bad = next((i for i, g in enumerate(got) if not bool((g == want).all())), None)
    gl.check_all(env.comm, bad is None, "hvdlite grouped_allreduce", f"tensor {bad} wrong")
    torch.distributed.all_reduce(flat)
    env.sync()
    gl.check_all(env.comm, bool((flat == want).all()), "torch all_reduce (flat)", "wrong sum")
    fns: dict[str, Callable[[], object]] = {
        COMM_HVD: lambda: hvd.grouped_allreduce(ts, name="t1.comm", op=hvd.Sum),
        COMM_TORCH: lambda: torch.distributed.all_reduce(flat),
    }
    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            env.sync()
        return run

    return gl.time_round_robin(env.comm, {k: synced(fn) for k, fn in fns.items()}, args.comm_reps,
                               3)



def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.switch_interval_us > 0:
        sys.setswitchinterval(args.switch_interval_us * 1e-6)
    env = Env(args)
    check = check_correctness(env)
    train = time_training(env)
    comm = time_comm(env)
    report(env, check, train, comm)
    env.hvd.shutdown()
    env.torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
