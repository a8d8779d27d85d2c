"""Horovod's elastic API, ``hvd.elastic``, over :mod:`mpitrain.elastic`.

::

    import mpitrain.torch as hvd

    hvd.init()
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            state.sampler.set_epoch(state.epoch)
            for batch_idx, (x, y) in enumerate(loader):
                ...                                   # forward, backward, step
                state.sampler.record_batch(batch_idx, 32)
                state.commit()
            state.epoch += 1
            state.commit()

    train(state)

A :class:`TorchState` holds an :class:`mpitrain.elastic.State` (its entries are the
model, the optimizer and the keyword arguments) and adds Horovod's names;
:func:`run` is :func:`mpitrain.elastic.run` called with that state. The loss of a rank
(Horovod's ``HorovodInternalError``: here ULFM's errors, or a
:class:`HorovodInternalError` raised by the training code) and a
:class:`HostsUpdatedInterrupt` both take the reset path: the default communicator is
rebuilt over the survivors, every survivor takes the newest commit any of them holds,
the ``DistributedOptimizer`` of the state is rebuilt over the new communicator, the
samplers of the state pool what the ranks recorded and partition what is left of the
epoch over the new size, the reset callbacks run and the function is called again.

Ranks are only lost, never added: there is no host discovery.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any, Callable, Iterator, Sized, TypeVar

import torch
from mpi4py import MPI

from .. import config, elastic, session
from ..errors import ArgumentError, ResetRequired

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "TorchState", "run"]

T = TypeVar("T")


class HorovodInternalError(ResetRequired):
    """A collective failed because a rank was lost; :func:`run` resets from the last
    commit. Raise it yourself to make every rank reset."""


class HostsUpdatedInterrupt(ResetRequired):
    """The set of ranks changed; raised by :meth:`ObjectState.check_host_updates`, and
    :func:`run` resets (the state was just committed, so nothing is lost)."""


class ObjectState:
    """Named values that :func:`run` commits, restores and shares across a reset.

    Read and assign the values as attributes (``state.epoch += 1``). Values are numbers,
    strings, numpy arrays, torch tensors, dicts and lists of them, and objects with
    ``state_dict()``/``load_state_dict()``.
    """

    def __init__(self, **kwargs: Any) -> None:
        object.__setattr__(self, "_state", elastic.State(**kwargs))
        self._state.register_reset_callbacks([self._after_reset])

    @property
    def state(self) -> elastic.State:
        """The :class:`mpitrain.elastic.State` that holds the values."""
        state: elastic.State = self.__dict__["_state"]
        return state

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.state, name, value)

    def save(self) -> None:
        """Snapshot the values in memory: a reset rolls every survivor back to it."""
        self.state.commit()

    def commit(self) -> None:
        """:meth:`save`, then :meth:`check_host_updates` (every rank at the same points)."""
        self.save()
        self.check_host_updates()

    def restore(self) -> None:
        """Roll the values back to the last :meth:`save`."""
        self.state.restore()

    def sync(self) -> None:
        """Every rank takes rank 0's last commit (collective)."""
        self.state.sync(root=0)
        self._after_reset()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` if this rank knows that a peer of the
        default communicator has failed (local, no communication; under
        ``mpitrain-run --elastic`` only). Otherwise a lost rank shows as the failure
        of the next collective."""
        if not config.ELASTIC.get():
            return
        comm = session.default_communicator()
        try:
            failed = comm.mpi_comm.Get_failed()
        except MPI.Exception as exc:
            raise HostsUpdatedInterrupt(f"rank {comm.rank}: the default communicator of "
                                        f"{comm.size} ranks has failed ({exc})") from exc
        lost = failed.Get_size()
        failed.Free()
        if lost:
            raise HostsUpdatedInterrupt(f"rank {comm.rank}: {lost} of the {comm.size} ranks "
                                        "of the default communicator have failed")

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (to adapt to the new size)."""
        self.state.register_reset_callbacks(callbacks)

    def _after_reset(self) -> None:
        """Adapt the values to the new communicator: pool the samplers' records."""
        comm = session.default_communicator()
        for value in self.state.entries.values():
            if isinstance(value, ElasticSampler):
                pooled: set[int] = set()
                for processed in comm.allgather_object(sorted(value.processed_indices)):
                    pooled.update(processed)
                value.processed_indices = pooled
                value.reset()


class TorchState(ObjectState):
    """Horovod's ``TorchState``: a model, an optimizer and other named values.

    Args:
        model: a ``torch.nn.Module`` (its ``state_dict()`` is committed).
        optimizer: a ``torch.optim`` optimizer or ``hvd.DistributedOptimizer``; a
            ``DistributedOptimizer`` is rebuilt over the new communicator on a reset.
        **kwargs: other values (``epoch=0``, ``batch=0``, an :class:`ElasticSampler`).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None,
                 **kwargs: Any) -> None:
        named = {k: v for k, v in (("model", model), ("optimizer", optimizer))
                 if v is not None}
        super().__init__(**named, **kwargs)

    def _after_reset(self) -> None:
        optimizer = self.state.entries.get("optimizer")
        rebind = getattr(optimizer, "rebind", None)
        if callable(rebind):
            rebind()
        super()._after_reset()


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``func(state, ...)`` so that it survives the loss of ranks (Horovod's
    ``hvd.elastic.run``): :func:`mpitrain.elastic.run` on ``state``'s values, which
    syncs them from rank 0 first and resets after a failure."""

    @functools.wraps(func)
    def wrapper(state: ObjectState, *args: Any, **kwargs: Any) -> T:
        if not isinstance(state, ObjectState):
            raise ArgumentError(f"hvd.elastic.run: the first argument must be an "
                                f"hvd.elastic.TorchState or ObjectState, got "
                                f"{type(state).__name__}")

        def body(_: elastic.State, *a: Any, **k: Any) -> T:
            return func(state, *a, **k)

        return elastic.run(body)(state.state, *args, **kwargs)

    return wrapper


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's ``ElasticSampler``: this rank's share of the samples of the epoch that
    no commit has recorded yet, re-partitioned over the new size after a reset.

    Each epoch's order is Horovod's: ``random.Random(seed + epoch).shuffle`` of the
    indices (the same on every rank, and the same samples in the same order as under
    Horovod); the samples left are padded, by repeating the first ones, to a multiple of
    the rank count, and rank ``r`` takes every size-th from position ``r``.
    ``processed_num`` counts the samples recorded in the epoch, and ``state_dict()``
    carries it beside the recorded indices, so that Horovod's own sampler loads it and
    this one loads Horovod's (``{"epoch", "processed_num"}``: the first ``processed_num``
    samples of the epoch's order, as Horovod counts them).

    Args:
        dataset: anything with ``len()``.
        shuffle: permute the samples every epoch.
        seed: the permutation's seed (the same on every rank).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = self.rank = self.num_samples = 0
        self.remaining: list[int] = []
        self.indices: list[int] = []
        self._taken = 0
        self.reset()

    def reset(self) -> None:
        """Partition the samples not yet processed over the default communicator."""
        comm = session.default_communicator()
        self.num_replicas, self.rank = comm.size, comm.rank
        order = self._order()
        left = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(left) / self.num_replicas)
        total = self.num_samples * self.num_replicas
        self.remaining = (left * math.ceil(total / len(left)))[:total] if left else []
        self.indices = self.remaining[self.rank::self.num_replicas]
        self._taken = 0  # samples of each rank's share recorded since

    def _order(self) -> list[int]:
        """The epoch's order of the samples (Horovod's)."""
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    @property
    def processed_num(self) -> int:
        """The samples of the epoch recorded as processed (by every rank together)."""
        return len(self.processed_indices)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order, and nothing processed yet. The epoch in
        progress again (after a reset) keeps what was recorded."""
        if epoch != self.epoch:
            self.processed_indices = set()
            self.epoch = epoch
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's samples of batch ``batch_idx`` (of ``batch_size``) of this pass."""
        _check_batch(batch_idx, batch_size)
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record the next ``batch_size`` samples of every rank's share as processed
        (call it on every rank after each step; a commit then keeps them). As in
        Horovod, the batches are counted: ``batch_idx`` is only checked, and a pass
        after a reset counts from the first sample left."""
        _check_batch(batch_idx, batch_size)
        done, self._taken = self._taken, self._taken + batch_size
        for rank in range(self.num_replicas):
            share = self.remaining[rank::self.num_replicas]
            self.processed_indices.update(share[done:done + batch_size])

    def record_indices(self, indices: list[int]) -> None:
        """Record ``indices`` as processed (after a reset the ranks' records are pooled)."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the samples processed in it, and their count (Horovod's state)."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices),
                "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``state_dict``'s epoch and records (or, from Horovod's sampler, its count
        of the epoch's first samples), and re-partition."""
        self.epoch = int(state_dict["epoch"])
        if "processed_indices" in state_dict:
            self.processed_indices = set(state_dict["processed_indices"])
        else:
            self.processed_indices = set(self._order()[:int(state_dict["processed_num"])])
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _check_batch(batch_idx: int, batch_size: int) -> None:
    """:class:`ArgumentError` unless ``batch_idx >= 0`` and ``batch_size >= 1``."""
    if batch_idx < 0 or batch_size < 1:
        raise ArgumentError(f"ElasticSampler: batch_idx must be >= 0 and batch_size >= 1, "
                            f"got batch_idx={batch_idx}, batch_size={batch_size}")
