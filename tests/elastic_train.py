"""The training job of the elastic tests, run under the elastic ``hvdliterun``
(tests/elastic_util.py checks its output).

A linear model in float64 trained with SGD + momentum on integer features: every value stays a
dyadic rational, so each result is exact whatever the order of the sums, and a replay in one
process (``replay``) must match bit for bit. The global batch is ``GLOBAL_BATCH`` samples
whatever the world size (``GLOBAL_BATCH // size()`` per rank), the learning rate is the world
size (set by a reset callback, as Horovod's examples scale it), so the result depends on which
commit ran at which size. One commit per step.

Every rank prints ``ELASTIC {json}`` lines: ``restored`` (what the world started from),
``step`` (the samples of a step and the commit it will be) and ``committed``. Test hooks, from
the environment: ``ELASTIC_KILL`` ("gen:commit:rank,...": that rank SIGKILLs itself in that
world before the allreduce of the step that would be that commit) and ``ELASTIC_HOSTS``
("gen:commit:text;...": in that world rank 0 writes text to the file ``ELASTIC_HOSTS_FILE``
after the first commit numbered at least that), ``ELASTIC_STEP_S`` (a sleep per step).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time

import torch

N_SAMPLES = 120
GLOBAL_BATCH = 12
EPOCHS = 2
SEED = 7


def features(index: int) -> torch.Tensor:
    return torch.tensor([index % 13, (index * 7) % 5, 1, index // 10], dtype=torch.float64)


def make_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(os.getpid())  # restarted ranks begin elsewhere: only the commit counts
    model = torch.nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randint(-8, 8, (1, 4), dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
    return model, opt


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int,
           processed: int) -> str:
    h = hashlib.sha256()
    h.update(model.weight.detach().numpy().tobytes())
    buf = opt.state.get(model.weight, {}).get("momentum_buffer")
    h.update(b"none" if buf is None else buf.numpy().tobytes())
    h.update(f"{epoch}:{processed}".encode())
    return h.hexdigest()[:16]


def epoch_order(epoch: int) -> list[int]:
    order = list(range(N_SAMPLES))
    random.Random(SEED + epoch).shuffle(order)
    return order


def replay(sizes: list[int], initial: list[float]) -> list[str]:
    """Digests after commits 1..len(sizes) of a one-process run that takes commit k at world
    size ``sizes[k-1]``, from weights ``initial`` (the reference)."""
    model = torch.nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([initial], dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
    epoch, processed, out = 0, 0, []
    for size in sizes:
        opt.param_groups[0]["lr"] = float(size)
        batch = epoch_order(epoch)[processed:processed + GLOBAL_BATCH]
        model.weight.grad = torch.stack([features(i) for i in batch]).sum(0).view(1, 4)
        opt.step()
        processed += GLOBAL_BATCH
        if processed == N_SAMPLES:
            epoch, processed = epoch + 1, 0
        out.append(digest(model, opt, epoch, processed))
    return out


def _hooks(name: str) -> dict[tuple[int, int], str]:
    out = {}
    for item in filter(None, os.environ.get(name, "").split(";" if name == "ELASTIC_HOSTS"
                                                              else ",")):
        gen, commit, what = item.split(":", 2)
        out[(int(gen), int(commit))] = what
    return out


def main() -> None:
    import hvdlite.torch as hvd

    hvd.init()
    gen = int(os.environ.get("HVDLITE_ELASTIC_GENERATION", "0"))
    kills = _hooks("ELASTIC_KILL")
    host_changes = _hooks("ELASTIC_HOSTS")
    step_s = float(os.environ.get("ELASTIC_STEP_S", "0"))
    model, opt = make_state()
    sampler = hvd.elastic.ElasticSampler(range(N_SAMPLES), shuffle=True, seed=SEED)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0,
                                   initial=model.weight.detach().flatten().tolist())

    def on_reset() -> None:
        opt.param_groups[0]["lr"] = float(hvd.size())

    on_reset()
    state.register_reset_callbacks([on_reset])

    def say(kind: str, **fields: object) -> None:
        line = {"kind": kind, "gen": gen, "rank": hvd.rank(), "size": hvd.size(),
                "time": time.time(), **fields}
        print("ELASTIC " + json.dumps(line), flush=True)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        say("restored", commit=state._commit_number, initial=state.initial,
            digest=digest(model, opt, state.epoch, state.sampler.processed_num))
        while state.epoch < EPOCHS:
            mine = list(state.sampler)
            per_rank = GLOBAL_BATCH // hvd.size()
            for b in range(len(mine) // per_rank):
                batch = mine[b * per_rank:(b + 1) * per_rank]
                commit = state._commit_number + 1
                grad = torch.stack([features(i) for i in batch]).sum(0)
                if kills.get((gen, commit)) == str(hvd.rank()):
                    say("killing", commit=commit)
                    os.kill(os.getpid(), signal.SIGKILL)
                total = hvd.allreduce(grad, op=hvd.Sum, name="grad")
                model.weight.grad = total.view(1, 4)
                opt.step()
                state.sampler.record_batch(b, per_rank)
                epoch = state.epoch
                if state.sampler.processed_num == N_SAMPLES:
                    state.epoch += 1
                    state.sampler.set_epoch(state.epoch)
                say("step", commit=commit, epoch=epoch, samples=batch, lr=opt.param_groups[0]["lr"],
                    digest=digest(model, opt, state.epoch, state.sampler.processed_num))
                time.sleep(step_s)
                state.commit()
                say("committed", commit=commit)
                due = [k for k in host_changes if k[0] == gen and commit >= k[1]]
                change = host_changes.pop(due[0]) if due else None
                if change is not None and hvd.rank() == 0:
                    with open(os.environ["ELASTIC_HOSTS_FILE"], "w") as handle:
                        handle.write(change.replace(",", "\n") + "\n")

    train(state)
    say("done", commit=state._commit_number,
        digest=digest(model, opt, state.epoch, state.sampler.processed_num))


if __name__ == "__main__":
    sys.exit(main())
