"""Where a grouped allreduce's time goes (1 rank): host time per step with the previous result
held (as a training loop holds it), device time of the whole step and of the raw fused call
(CUDA events), and how many result sets the lane had to allocate.

    mpirun -n 1 python scripts/dev/gpu_grouped_probe.py [--set resnet50|bert_large]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import cupy as cp
from cupy.cuda import nccl

import hvdlite as hvd
from hvdlite._engine import default_engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="resnet50")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--op", default="Sum", choices=["Sum", "Average"])
    p.add_argument("--between", default="none", choices=["none", "async", "raw", "sleep"],
                   help="what runs between two timed grouped calls (untimed)")
    args = p.parse_args()
    hvd.init()
    cp.cuda.Device(hvd.local_rank()).use()
    spec = json.loads((Path(__file__).parents[1] / "data" / f"{args.set}_grads.json").read_text())
    shapes = [tuple(t["shape"]) for t in spec["tensors"]]
    xs = [cp.full(math.prod(s), 1.0, cp.float32).reshape(s) for s in shapes]
    total = sum(x.size for x in xs)
    op = getattr(hvd, args.op)
    code = nccl.NCCL_SUM if args.op == "Sum" else nccl.NCCL_AVG
    stream = cp.cuda.get_current_stream()
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    fused_in, fused_out = cp.ones(total, cp.float32), cp.empty(total, cp.float32)
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def device_ms(fn) -> float:
        stream.synchronize()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end)

    held = None
    for _ in range(5):
        held = hvd.grouped_allreduce(xs, name="g", op=op)
    stream.synchronize()
    lane = default_engine().global_channel.lanes["g"]
    outs = [cp.empty_like(x) for x in xs]

    def between() -> None:
        if args.between == "async":
            hs = [hvd.allreduce_async(x, name=f"a{i}", op=op, out=o)
                  for i, (x, o) in enumerate(zip(xs, outs, strict=True))]
            for h in hs:
                h.wait()
        elif args.between == "raw":
            comm.allReduce(fused_in.data.ptr, fused_out.data.ptr, total, nccl.NCCL_FLOAT32,
                           code, stream.ptr)
        elif args.between == "sleep":
            time.sleep(0.002)
        stream.synchronize()

    host = 0.0
    for _ in range(args.steps):
        between()
        t0 = time.perf_counter()
        held = hvd.grouped_allreduce(xs, name="g", op=op)
        stream.synchronize()
        host += time.perf_counter() - t0
    host = host / args.steps * 1e3
    assert float(held[0].ravel()[0]) == 1.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        comm.allReduce(fused_in.data.ptr, fused_out.data.ptr, total, nccl.NCCL_FLOAT32, code,
                       stream.ptr)
        stream.synchronize()
    raw = (time.perf_counter() - t0) / args.steps * 1e3
    dev_h = device_ms(lambda: hvd.grouped_allreduce(xs, name="g", op=op))
    dev_r = device_ms(lambda: comm.allReduce(fused_in.data.ptr, fused_out.data.ptr, total,
                                             nccl.NCCL_FLOAT32, code, stream.ptr))
    print(f"{args.set} {args.op} ({args.between} between): hvdlite grouped {host:.3f} ms "
          f"per step (wall), raw fused "
          f"{raw:.3f} ms -> {host / raw:.2f}x; events around the call: hvdlite {dev_h:.3f} ms, raw "
          f"{dev_r:.3f} ms; result sets allocated {len(lane.results)}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
