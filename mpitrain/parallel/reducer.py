"""Gradient averaging: one async allreduce per gradient, started as soon as it is final.

:class:`GradientReducer` is the framework-neutral core of both
:class:`mpitrain.trainer.DistributedOptimizer` (numpy/cupy) and
:class:`mpitrain.torch.DistributedOptimizer`. It decides *when* (counting backward
passes, batching final groups, waiting in ``synchronize()``); a framework plugs in
through one :class:`GradientBridge`, which decides *what*: its ``start`` reads a
group's gradients and starts their reduction (usually :meth:`Reduction.allreduce`:
compress, view, submit), its ``store`` writes each result back. One gradient crosses
the seam twice: out in ``start``, back in ``store``.

Life of one step, per parameter ``p``:

1. ``grad_ready(p)`` after each backward pass that produced ``p``'s gradient
   (autograd hooks call it in the torch adapter). The ``backward_passes_per_step``-th
   call makes the gradient final; once every parameter of ``p``'s group is final,
   the group is compressed and its allreduce submitted, in place
   (``allreduce_async_``, or ``grouped_allreduce_async_`` for a group of several)
   once :attr:`GradientReducer.batch_bytes` of final gradients are waiting (below),
   all the waiting groups in one :meth:`~mpitrain.Communicator.batch`.
2. ``synchronize()`` (called by ``step()``) submits the groups that were not
   submitted yet (a parameter without gradient contributes zeros, as other ranks
   may have one) in one batch, waits for every allreduce, decompresses and stores
   the averages (a built-in compressor's cast back is the converting copy into the
   gradient: :attr:`~mpitrain.parallel.compression.Compressor.casts`).

When to start (``MPITRAIN_GRAD_BATCH_BYTES``, :func:`grad_batch_bytes`): Horovod
starts each allreduce as soon as its gradient is final (``batch_bytes`` 0), which
overlaps the communication with the rest of backward where the communication does
not need the cores that backward is using: device gradients, or a network between
nodes. Between the ranks of one node, host gradients are reduced by copies through
shared memory, which the engine's thread does on the CPU. Where a rank has no core
beyond its compute threads, that thread and backward take turns on one core, and each
negotiation cycle waits until the operating system happens to run every rank's
engine thread at once. There the reducer holds final gradients until 8 MiB are
waiting: a model of many small tensors then pays for one cycle and one fused
collective per step (in ``synchronize()``, on the caller's thread), while gradients
of several MiB still start during backward.

Scaling follows Horovod: with ``op=Average`` and ``gradient_predivide_factor=f``
each rank's gradient is multiplied by ``1/f`` before the sum and the sum by
``f/size`` after it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Protocol, Sequence, TypeVar

from .. import config
from ..communicator import Communicator
from ..errors import ArgumentError
from ..ops import ReduceOp, parse_op
from .broadcast import resolve
from .compression import Compression

P = TypeVar("P")
P_contra = TypeVar("P_contra", contravariant=True)



class GradientBridge(Protocol[P_contra]):
    """How the reducer reaches one framework's gradients."""

    def start(self, reduction: Reduction, name: str, params: Sequence[P_contra]) -> Submitted:
        """Read the gradients of ``params`` (zeros where one has none) and start their
        reduction, named ``name``; usually :meth:`Reduction.allreduce`."""

    def store(self, param: P_contra, value: Any) -> None:
        """Store ``value`` (what :attr:`Submitted.collect` returned for ``param``) as
        ``param``'s result, converted to the gradient's dtype (no-op when it already is
        the gradient)."""

    def nbytes(self, param: P_contra) -> int:
        """The size of ``param``'s gradient in bytes (that of ``param``)."""


@dataclass
class Submitted:
    """A group's reduction in flight."""

    params: list[Any]
    handles: list[Any]
    collect: Callable[[], list[Any]]  # waits; returns the value to store per parameter


@dataclass(frozen=True)
class Reduction:
    """What every gradient of a reducer goes through: the communicator, the op, the
    compression and Horovod's scaling (``prescale`` before the sum, ``postscale``
    after it)."""

    comm: Communicator
    op: ReduceOp
    compression: Any
    prescale: float
    postscale: float

    def allreduce(self, name: str, params: list[Any], values: list[Any],
                  view: Callable[[Any], Any], stream: Callable[[Any], Any]) -> Submitted:
        """Compress ``values`` (one per parameter of ``params``) and start their
        in-place allreduce: ``allreduce_async_`` of one, ``grouped_allreduce_async_`` of
        several. ``view(value)`` is the array the comm layer gets, ``stream(value)`` the
        device stream producing it (``None``: the current one). The collected values are
        decompressed, except a built-in cast back, which is left to the bridge's
        converting ``store`` (:attr:`~mpitrain.parallel.compression.Compressor.casts`)."""
        packed = [self.compression.compress(v) for v in values]
        sent = [c for c, _ in packed]
        buffers = [view(c) for c in sent]
        scaling = {"name": name, "prescale_factor": self.prescale,
                   "postscale_factor": self.postscale, "stream": stream(sent[0])}
        if len(buffers) == 1:
            handle = self.comm.allreduce_async_(buffers[0], self.op, **scaling)
        else:
            handle = self.comm.grouped_allreduce_async_(buffers, self.op, **scaling)
        folds = bool(getattr(self.compression, "casts", False))

        def collect() -> list[Any]:
            handle.wait()  # in place: the sent values hold the sums
            if folds:
                return sent
            return [self.compression.decompress(c, ctx) for c, ctx in packed]
        return Submitted(list(params), [handle], collect)


def build_groups(params: Sequence[P], groups: Any) -> list[list[P]]:
    """Horovod's ``groups``: None/0 (one per parameter), a count, or lists of parameters.

    With a count ``n`` the parameters are cut into ``n`` contiguous groups of nearly
    equal length; with lists, parameters in no list form a group of their own.
    """
    if groups is None or (isinstance(groups, int) and groups == 0):
        return [[p] for p in params]
    if isinstance(groups, int):
        if groups < 0:
            raise ArgumentError(f"groups={groups} must be >= 0 (0: no grouping)")
        n = min(groups, len(params))
        bounds = [len(params) * i // n for i in range(n + 1)]
        return [list(params[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    known = {id(p) for p in params}
    seen: set[int] = set()
    result: list[list[P]] = []
    for group in groups:
        members = list(group)
        for p in members:
            if id(p) not in known:
                raise ArgumentError("groups lists a parameter that the optimizer does not "
                                    "update; list only the optimizer's parameters")
            if id(p) in seen:
                raise ArgumentError("groups lists a parameter twice; each parameter may be "
                                    "in one group only")
            seen.add(id(p))
        if members:
            result.append(members)
    result.extend([p] for p in params if id(p) not in seen)
    return result


def cores_per_rank(local_size: int) -> float:
    """The cores one of ``local_size`` ranks of this node may run on: its affinity mask
    where it is bound (the mask is smaller than the machine), else an equal share of
    the machine's cores."""
    total = os.cpu_count() or 1
    mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return float(mask) if mask < total else total / max(local_size, 1)


SHARED_CORE_BATCH_BYTES = 8 << 20
"""``auto``'s :func:`grad_batch_bytes` where the engine's thread has no core of its own.
On the 2-core host a 2 MiB threshold made a ConvNet step (41 gradients, 6.2 MB) as
slow as starting every gradient at once; 8 MiB kept all of its gradients for one
batch in ``step()`` and still started each of an MLP's 14.7 MB gradients during
backward (docs/benchmarks.md, "Gradient batches on shared cores")."""


def grad_batch_bytes(comm: Communicator, host: bool, compute_threads: int = 1) -> int:
    """How many bytes of final gradients a reducer holds before starting their
    allreduces (see the module text): ``MPITRAIN_GRAD_BATCH_BYTES`` if it is a size;
    ``auto`` (the default): 0 unless the gradients are ``host`` arrays, every rank is on
    one node, and a rank has no more cores (:func:`cores_per_rank`) than its
    ``compute_threads``, where it is :data:`SHARED_CORE_BATCH_BYTES`.
    """
    setting = config.GRAD_BATCH_BYTES.get()
    if setting is not None:
        return setting
    if not host or comm.cross_size > 1 or cores_per_rank(comm.local_size) > compute_threads:
        return 0
    return SHARED_CORE_BATCH_BYTES


class GradientReducer(Generic[P]):
    """Averages the gradients of named parameters over all ranks, asynchronously.

    Args:
        named_params: ``(name, parameter)`` pairs; names must be unique and the same on
            every rank (they name the allreduces, so ranks may submit in any order).
        bridge: how to reach the gradients of these parameters (reads them and starts
            their reduction, stores the results).
        comm: the communicator (default: that of :func:`mpitrain.init`).
        compression: a compressor (``Compression.none``, ``.fp16``, ``.bf16``).
        op: ``Average`` (default) or ``Sum`` (or ``Min``/``Max``/``Product``).
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        gradient_predivide_factor: split Average's ``1/size`` into ``1/f`` before and
            ``f/size`` after the sum (only with ``op=Average``).
        groups: ``None``, a group count, or lists of parameters reduced together.
        host: the gradients are host (numpy, CPU) arrays; with ``compute_threads``
            (the threads computing them), decides :attr:`batch_bytes`.

    Attributes:
        batch_bytes: final gradients are held until this many bytes are waiting, then
            their allreduces start together (0: each group's as soon as it is final):
            :func:`grad_batch_bytes`, decided when the reducer is built.
    """

    def __init__(self, named_params: Sequence[tuple[str, P]], bridge: GradientBridge[P], *,
                 comm: Communicator | None = None, compression: Any = Compression.none,
                 op: Any = ReduceOp.AVERAGE, backward_passes_per_step: int = 1,
                 gradient_predivide_factor: float = 1.0, groups: Any = None,
                 host: bool = True, compute_threads: int = 1) -> None:
        self.op = parse_op(op)
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ArgumentError(f"backward_passes_per_step={backward_passes_per_step!r} must "
                                "be an integer >= 1")
        if not gradient_predivide_factor > 0:
            raise ArgumentError(f"gradient_predivide_factor={gradient_predivide_factor} must "
                                "be > 0")
        if gradient_predivide_factor != 1.0 and self.op is not ReduceOp.AVERAGE:
            raise ArgumentError(f"gradient_predivide_factor={gradient_predivide_factor} needs "
                                f"op=Average, got op={self.op!r}")
        names = [name for name, _ in named_params]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ArgumentError(f"parameter names must be unique; duplicates: {', '.join(dups)}")
        self.comm = resolve(comm)
        self.batch_bytes = grad_batch_bytes(self.comm, host, compute_threads)
        self._waiting: list[int] = []  # final groups not submitted yet
        self._waiting_bytes = 0
        self.bridge = bridge
        self.reduction = Reduction(self.comm, self.op, compression,
                                   1.0 / gradient_predivide_factor, gradient_predivide_factor)
        self.backward_passes_per_step = backward_passes_per_step
        self.params: list[P] = [p for _, p in named_params]
        self._names = {id(p): name for name, p in named_params}
        self.groups = build_groups(self.params, groups)
        self._group_of = {id(p): g for g, group in enumerate(self.groups) for p in group}
        self._group_bytes = [sum(bridge.nbytes(p) for p in group) for group in self.groups]
        self._delay = {id(p): backward_passes_per_step for p in self.params}
        self._final: dict[int, int] = {}  # group -> number of final gradients
        self._submitted: dict[int, Submitted] = {}
        self.synchronized = False
        self.should_synchronize = True

    # -- the three events -------------------------------------------------------------
    def grad_ready(self, param: P) -> None:
        """Count one backward pass of ``param``; submit its group when all are final."""
        key = id(param)
        if key not in self._delay:
            raise ArgumentError(f"grad_ready got a parameter that this optimizer does not "
                                f"update ({type(param).__name__} of id {key})")
        if self._delay[key] <= 0:
            raise ArgumentError(
                f"the gradient of {self._names[key]!r} was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before "
                "step(); increase backward_passes_per_step to accumulate gradients locally")
        self._delay[key] -= 1
        if self._delay[key] == 0:
            g = self._group_of[key]
            self._final[g] = self._final.get(g, 0) + 1
            if self._final[g] == len(self.groups[g]):
                self._waiting.append(g)
                self._waiting_bytes += self._group_bytes[g]
                if self._waiting_bytes >= self.batch_bytes:  # 0: at once, as Horovod
                    self._submit_batch(self._waiting)
                    self._waiting = []
                    self._waiting_bytes = 0

    def synchronize(self) -> None:
        """Submit what is left, wait for every allreduce and store the averaged gradients."""
        error: BaseException | None = None
        try:
            self._submit_batch([g for g in range(len(self.groups)) if g not in self._submitted])
        finally:
            # Wait for every group, even after a failure, so that no name stays in flight.
            for sub in self._submitted.values():
                try:
                    for p, value in zip(sub.params, sub.collect()):
                        self.bridge.store(p, value)
                except Exception as exc:
                    error = error or exc
            self._reset()
        if error is not None:
            raise error
        self.synchronized = True

    @property
    def accumulating(self) -> bool:
        """True between the first backward pass of a step and :meth:`synchronize`."""
        return any(d != self.backward_passes_per_step for d in self._delay.values())

    def handles(self) -> dict[str, Any]:
        """The engine handles in flight, by operation name (timestamps, ``test()``)."""
        return {h.name: h for sub in self._submitted.values() for h in sub.handles}

    # -- internals --------------------------------------------------------------------
    def _reset(self) -> None:
        self._submitted.clear()
        self._final.clear()
        self._waiting = []
        self._waiting_bytes = 0
        for key in self._delay:
            self._delay[key] = self.backward_passes_per_step

    def _group_name(self, group: list[P]) -> str:
        first = self._names[id(group[0])]
        return first if len(group) == 1 else f"group[{len(group)}].{first}"

    def _submit_batch(self, gs: list[int]) -> None:
        """Submit groups ``gs`` so that they reach one engine cycle together."""
        if len(gs) == 1:
            self._submit(gs[0])
        elif gs:
            with self.comm.batch():
                for g in gs:
                    self._submit(g)

    def _submit(self, g: int) -> None:
        group = self.groups[g]
        self._submitted[g] = self.bridge.start(self.reduction, f"grad.{self._group_name(group)}",
                                               group)


class DistributedOptimizerBase:
    """``step()`` / ``synchronize()`` / ``skip_synchronize()`` / ``zero_grad()`` over a
    :class:`GradientReducer`, delegating everything else to the wrapped optimizer."""

    optimizer: Any
    reducer: GradientReducer[Any]

    def synchronize(self) -> None:
        """Wait for every gradient allreduce and store the averaged gradients."""
        self.reducer.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize (call it yourself first).

        For gradient clipping: ``optimizer.synchronize()``, clip, then
        ``with optimizer.skip_synchronize(): optimizer.step()``.
        """
        self.reducer.should_synchronize = False
        try:
            yield
        finally:
            self.reducer.should_synchronize = True

    def _before_step(self) -> None:
        reducer = self.reducer
        if reducer.should_synchronize:
            if reducer.synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients are averaged "
                              "again. Wrap step() in `with optimizer.skip_synchronize():`.",
                              stacklevel=3)
            reducer.synchronize()
        reducer.synchronized = False

    def _check_zero_grad(self) -> None:
        if self.reducer.accumulating:
            raise ArgumentError("optimizer.zero_grad() was called after backward() but before "
                                "optimizer.step() or optimizer.synchronize(); this would race "
                                "with the gradient allreduces. Call step() first.")

    def state_dict(self) -> Any:
        """The wrapped optimizer's ``state_dict()``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """The wrapped optimizer's ``load_state_dict()``."""
        self.optimizer.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper: delegate to the optimizer.
        if name.startswith("__") or name in ("optimizer", "reducer"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"Distributed({self.optimizer!r})"
