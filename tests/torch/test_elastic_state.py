"""hvdlite.torch.elastic without the elastic launcher (a plain ``mpiexec`` job): TorchState's
save/restore/sync of a model, an optimizer, a sampler and plain attributes; ObjectState;
``elastic.run`` syncs from rank 0 and calls the function once; ``check_host_updates`` never
interrupts; ElasticSampler shards an epoch and, from its state_dict, what is left of it.
(Resets under the elastic ``hvdliterun``: tests/launcher/test_elastic.py.)"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
    opt.step()


def test_torch_state_sync_restore_commit(hvd: Any) -> None:
    model, opt = _model(100 + hvd.rank())  # every rank starts elsewhere
    sampler = hvd.elastic.ElasticSampler(range(40), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=hvd.rank(), log=[])

    calls = []

    @hvd.elastic.run
    def train(state: Any, tag: str) -> str:
        calls.append(tag)
        return tag + "!"

    assert train(state, "x") == "x!" and calls == ["x"]
    ref_model, _ = _model(100)  # rank 0's start
    for got, want in zip(model.state_dict().values(), ref_model.state_dict().values(),
                         strict=True):
        assert torch.equal(got, want)
    assert state.epoch == 0 and state.sampler is sampler

    _step(model, opt)
    state.epoch, state.log = 3, ["a"]
    sampler.record_batch(0, 5)
    state.commit()  # no elastic launcher: save only, never an interrupt
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    _step(model, opt)
    state.epoch, state.log = 4, ["a", "b"]
    sampler.record_batch(1, 5)
    state.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, committed[k]), k
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
    assert state.epoch == 3 and state.log == ["a"]
    assert sampler.processed_num == 5 * hvd.size()
    state.check_host_updates()


def test_object_state_sync_and_callbacks(hvd: Any) -> None:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=hvd.rank() + 10,
                                    names=[hvd.rank()])
    fired = []
    state.register_reset_callbacks([lambda: fired.append(hvd.size())])
    state.sync()
    assert state.step == 10 and state.names == [0]
    state.step = 11
    state.commit()
    state.step = 12
    state.restore()
    assert state.step == 11
    state.on_reset()
    assert fired == [hvd.size()]


@pytest.mark.parametrize("shuffle", [False, True])
def test_elastic_sampler_reshards_the_rest_of_an_epoch(hvd: Any, shuffle: bool) -> None:
    n, size, rank = 48, hvd.size(), hvd.rank()
    sampler = hvd.elastic.ElasticSampler(range(n), shuffle=shuffle, seed=3)
    sampler.set_epoch(2)
    order = list(range(n))
    if shuffle:
        random.Random(3 + 2).shuffle(order)
    assert list(sampler) == order[rank::size] and len(sampler) == n // size
    sampler.record_batch(0, 4)  # 4 samples on each rank: order[:4 * size] are done
    state = sampler.state_dict()
    assert state == {"epoch": 2, "processed_num": 4 * size}
    # What a world of this size restored from that commit iterates: the rest, re-sharded.
    again = hvd.elastic.ElasticSampler(range(n), shuffle=shuffle, seed=3)
    again.load_state_dict(state)
    rest = order[4 * size:]
    assert list(again) == rest[rank::size] and len(again) == len(rest) // size
    sampler.set_epoch(3)
    assert sampler.processed_num == 0 and len(sampler) == n // size
