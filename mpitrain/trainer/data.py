"""Data sharding: each rank a disjoint part of the dataset, reshuffled every epoch.

:class:`DistributedSampler` follows ``torch.utils.data.DistributedSampler``: every
epoch, all ranks draw the same permutation of ``range(n)`` from ``(seed, epoch)``,
pad it (by repeating its head) or cut it to a multiple of ``num_replicas``, and
take every ``num_replicas``-th index starting at ``rank``. So the shards are
disjoint (apart from the padding), every rank gets the same number of samples,
and the order is reproducible from ``(seed, epoch)`` alone, which is all a
checkpoint needs to store.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..errors import ArgumentError
from ..session import default_communicator


class DistributedSampler:
    """Indices of this rank's shard of a dataset of ``num_samples`` items.

    Args:
        num_samples: dataset length (or any object with ``len()``).
        num_replicas: number of shards (default: the default communicator's size).
        rank: this shard (default: the default communicator's rank).
        shuffle: draw a new permutation every epoch (else the natural order).
        seed: permutation seed; must be the same on every rank.
        drop_last: cut the tail instead of padding to a multiple of ``num_replicas``.

    Call :meth:`set_epoch` at the start of every epoch, or each epoch repeats the
    order of epoch 0.
    """

    def __init__(self, num_samples: Any, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            comm = default_communicator()
            num_replicas = comm.size if num_replicas is None else num_replicas
            rank = comm.rank if rank is None else rank
        n = num_samples if isinstance(num_samples, (int, np.integer)) else len(num_samples)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ArgumentError(f"DistributedSampler: rank={rank} is not in "
                                f"0..num_replicas-1 (num_replicas={num_replicas})")
        if n < 0 or (drop_last and n < num_replicas):
            raise ArgumentError(f"DistributedSampler: {n} samples cannot give each of "
                                f"{num_replicas} ranks a sample with drop_last=True")
        self.dataset_size = int(n)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = self.dataset_size // self.num_replicas
        else:
            self.num_samples = -(-self.dataset_size // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Choose the permutation of ``epoch`` (call at the start of each epoch)."""
        self.epoch = int(epoch)

    def indices(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """This rank's indices for the current epoch, as an int64 array."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(
                self.dataset_size)
        else:
            order = np.arange(self.dataset_size)
        if self.total_size > self.dataset_size:
            order = np.resize(order, self.total_size)  # repeats the head as padding
        return order[self.rank:self.total_size:self.num_replicas].astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        """``seed`` and ``epoch``: enough to reproduce the data order after a restart."""
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
