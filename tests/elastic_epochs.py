"""An elastic NumPy job shaped like Horovod's elastic integration job, for
``tests/elastic_scenarios.py``: it trains in epochs of batches, commits after every batch and
every epoch, and after each epoch rank 0 appends one JSON line to ``--logfile`` (epoch, batch,
commits, the worker's ``HOROVOD_HOSTNAME`` and ``HOROVOD_RANK``, its rank, the size and how
many times ``train`` was entered). A discovery script reads that file to change the hosts at
an epoch; when it will, rank 0 waits for the driver's notice in ``state._host_messages``.
``--exit-schedule`` makes the workers whose ``HOROVOD_RANK`` is listed fail at
``(epoch, batch)`` by an exception or by SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

import hvdlite as hvd
from hvdlite.elastic import ObjectState, run

parser = argparse.ArgumentParser()
parser.add_argument("--logfile", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches-per-epoch", type=int, default=4)
parser.add_argument("--epoch-wait", type=float, default=0.0)
parser.add_argument("--discovery-schedule", default="[]")
parser.add_argument("--discovery-wait", type=float, default=5.0)
parser.add_argument("--exit-schedule", default="{}")
parser.add_argument("--exit-mode", default="exception", choices=("exception", "kill"))
args = parser.parse_args()

hvd.init()
HOST = os.environ.get("HOROVOD_HOSTNAME")
WORKER = int(os.environ.get("HOROVOD_RANK", "0"))
schedule = json.loads(args.discovery_schedule)
hosts_at = {epoch: hosts for epoch, hosts in schedule if epoch is not None}
later_hosts = schedule[-1][1] if schedule else []
exits = json.loads(args.exit_schedule)


def maybe_fail(epoch: int, batch: int) -> None:
    if WORKER in exits.get(f"({epoch}, {batch})", []):
        if args.exit_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"worker {WORKER} (rank {hvd.rank()}) fails at epoch {epoch} "
                           f"batch {batch} on purpose")


@run
def train(state: ObjectState) -> None:
    state.rendezvous += 1
    weights = np.zeros(4)
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            maybe_fail(state.epoch, state.batch)
            weights += hvd.allreduce(np.ones(4), name="grad")
            state.batch += 1
            state.commits += 1
            state.commit()
        if hvd.rank() == 0:
            record = {"epoch": state.epoch, "batch": state.batch, "commits": state.commits,
                      "hostname": HOST, "start_rank": WORKER, "rank": hvd.rank(),
                      "size": hvd.size(), "rendezvous": state.rendezvous}
            with open(args.logfile, "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")
            now, then = (hosts_at.get(e, later_hosts) for e in (state.epoch, state.epoch + 1))
            if args.discovery_wait > 0 and now != then:
                state._last_updated_timestamp = 0
                give_up = time.monotonic() + args.discovery_wait
                while state._host_messages.empty():
                    if time.monotonic() > give_up:
                        raise TimeoutError("no host-change notice from the driver")
                    time.sleep(0.05)
        if args.epoch_wait > 0:
            time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        state.commits += 1
        state.commit()


train(ObjectState(epoch=0, batch=0, commits=0, rendezvous=0))
