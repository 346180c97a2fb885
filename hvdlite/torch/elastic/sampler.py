"""``ElasticSampler``: Horovod's re-sharding sampler for elastic jobs."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from hvdlite.torch import basics

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Shards a dataset over the ranks and re-shards what is left of an epoch after a reset.

    Like ``DistributedSampler``, each rank gets every ``size()``-th index of the epoch's order
    (shuffled with ``seed + epoch`` when ``shuffle``; the same on every rank). The sampler
    counts the samples the job has processed in this epoch (``record_batch``); kept in a
    ``TorchState`` it is committed with the model, and after a reset the indices not yet
    processed are split over the new number of ranks, so no sample of the epoch is skipped or
    processed twice (beyond the padding that makes the last round even, as in
    ``DistributedSampler``). Call ``record_batch`` after each batch and ``set_epoch`` at the
    end of each epoch. Needs ``hvd.init()`` first. Not thread-safe.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new order when shuffling) with nothing processed yet. Call it at
        the end of an epoch, so that a reset within an epoch does not repeat samples."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the number of its samples processed (all a reset needs)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``state_dict``'s position and re-shard the rest over the current ranks."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-shard the epoch's unprocessed indices over the current ``size()`` ranks."""
        self.num_replicas = basics.size()
        self.rank = basics.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:  # pad with the first ones to an even split
            padded += padded[: self.total_size - len(padded)]
        self.indices = padded[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
