"""The dispatcher: from a collective call to a plan run on the private communicator.

A :class:`Dispatcher` owns one private duplicate of an MPI communicator (its
:class:`~mpitrain.comm.transport.Transport`), the node's shared memory, the
:class:`~mpitrain.comm.validation.Validator` and a cache of plans. For each call it

1. checks the arguments locally (dtype, op, ``out``, ``root``): ``check_*``;
2. picks the algorithm: the requested one, else the selection table (:meth:`algorithm`);
3. validates the call across ranks with its :class:`~mpitrain.comm.validation.Signature`
   (unless checking is off);
4. fetches, or builds once, the algorithm's :class:`~mpitrain.algorithms.base.Plan`
   for this shape through the buffer kind's transfer policy (:mod:`.policy`);
5. runs it and applies ``prescale_factor``/``postscale_factor`` (``Average`` is ``Sum``
   then a postscale of ``1/size``).

:meth:`run_plan` is the one place where a call is validated and its plan run. The
blocking methods of :class:`~mpitrain.Communicator` are these; the async engine owns
a dispatcher of its own and calls the same methods from its progress thread.

Device arrays (CuPy, torch CUDA tensors, ...) take the same path: every collective
accepts ``stream=`` (default: the current stream), runs on that stream and the
array's device, and synchronizes the stream before MPI touches the data and before
returning (:meth:`~mpitrain.backends.base.ArrayBackend.scope`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Callable, TypeVar, cast

import numpy as np
from mpi4py import MPI

from .. import algorithms, config
from ..algorithms import Plan, PlanRequest
from ..algorithms.chunks import bounds_from_counts, split_bounds
from ..backends import NUMPY, ArrayBackend, backend_and_array, backend_for, hostcopy
from ..comm import objects
from ..comm import shm as shared
from ..comm.inspector import StallLimits
from ..comm.topology import Topology
from ..comm.transport import Transport
from ..comm.validation import NO_PAYLOAD, Signature, Validator, signature
from ..dtypes import check_dtype, check_op_for_dtype, dtype_name
from ..errors import ArgumentError, MpitrainError, UnsupportedError
from ..ops import ReduceOp, parse_op
from .fastpath import SmallAllgather, SmallAllreduce, SmallCall, SmallReduceScatter, fits_out
from .policy import policy_for
from .selection import may_select, select

Array = Any
PLAN_CACHE_SIZE = 32
"""Plans kept per dispatcher (least recently used first out)."""
SMALL_CACHE_SIZE = 64
"""Small-call plans (:mod:`.fastpath`) kept per dispatcher and kind (all dropped when full)."""
SLOT_BYTES = 512 << 10
"""Shared-memory slot per rank: calls up to this size ride the validation exchange
(a slot copies a block in and every rank's out with one barrier, where the stripes
need two; BENCHMARKS.md shows where it wins)."""
ARENA_BYTES = 8 << 20
"""Shared-memory arena per rank for the stripes of large shm collectives."""
BARRIER = signature("barrier")
"""The signature of every barrier."""
_Small = TypeVar("_Small", bound=SmallCall)
_Method = TypeVar("_Method", bound=Callable[..., Any])


def on_stream(method: _Method) -> _Method:
    """Run a collective inside its array's backend scope (device and ``stream=``)."""

    @functools.wraps(method)
    def scoped(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        with backend_for(x).scope(x, kwargs.get("stream")):
            return method(self, x, *args, **kwargs)

    return cast(_Method, scoped)


def row_size(shape: tuple[int, ...]) -> int:
    """Elements per row of axis 0."""
    row = 1
    for d in shape[1:]:
        row *= int(d)
    return row


class Dispatcher:
    """Argument checks, algorithm choice, validation, plans and scaling over one
    private duplicate of ``comm`` (collective to create).

    Args:
        comm: any intracommunicator; the dispatcher duplicates it.
        check: validate every call across ranks (default: ``MPITRAIN_CHECK``, on).
        shared_memory: use shared-memory windows when every rank is on one node
            (default: ``MPITRAIN_SHM``, on).
        stall: the stall limits (default: ``MPITRAIN_STALL_*``).
    """

    def __init__(self, comm: MPI.Intracomm, *, check: bool | None = None,
                 shared_memory: bool | None = None, stall: StallLimits | None = None) -> None:
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise ArgumentError(f"mpitrain.Communicator needs an MPI intracommunicator, got "
                                f"{comm!r}")
        self.transport = Transport(comm, stall)
        self.mpi_comm: MPI.Intracomm = self.transport.comm
        self.rank, self.size = self.transport.rank, self.transport.size
        self.topology = Topology.detect(self.mpi_comm)
        # Not under ULFM: a rank that dies is only noticed by MPI calls, never by a
        # shared-memory barrier, which would wait for it forever.
        self.shm = shared.create(self.mpi_comm, self.topology.local_size == self.size,
                                 config.SHM.get(shared_memory) and not config.ELASTIC.get(),
                                 SLOT_BYTES, ARENA_BYTES, config.SINGLE_COPY.get())
        if self.shm is not None:
            self.transport.watch(self.shm)
        self.validator = Validator(self.transport, self.shm)
        self.check = check
        self._plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        self._available: dict[tuple[str, str], tuple[str, ...]] = {}
        self._choices: dict[tuple[Any, ...], str] = {}
        # per kind: (dtype, shape, op, algorithm) -> (config.plan_texts() when planned,
        # the plan or None)
        self._small: dict[tuple[Any, ...], tuple[tuple[Any, ...], SmallAllreduce | None]] = {}
        self._small_rs: dict[tuple[Any, ...],
                             tuple[tuple[Any, ...], SmallReduceScatter | None]] = {}
        self._small_ag: dict[tuple[Any, ...], tuple[tuple[Any, ...], SmallAllgather | None]] = {}

    @property
    def checking(self) -> bool:
        """Whether calls are validated (the constructor's ``check``, else MPITRAIN_CHECK)."""
        return self.check if self.check is not None else config.CHECK.get()

    # -- argument checks (local: misuse raises on the rank that made it) ---------------
    def check_reducible(self, arr: Array, op: ReduceOp) -> np.dtype[Any]:
        """``arr``'s dtype, if it is supported and ``op`` can reduce it."""
        dt = check_dtype(arr.dtype, rank=self.rank)
        check_op_for_dtype(op, dt)
        if op is ReduceOp.ADASUM:
            self.check_adasum(arr)
        return dt

    def check_adasum(self, arr: Array) -> None:
        """Raise unless Adasum can reduce ``arr`` here: host memory, and a power-of-two
        number of ranks (Horovod's CPU Adasum refuses other counts too)."""
        if self.size & (self.size - 1):
            below = 1 << (self.size.bit_length() - 1)
            raise UnsupportedError(
                f"rank {self.rank}: op=Adasum needs a power-of-two number of ranks, but this "
                f"communicator has {self.size}; run on {below} or {2 * below} ranks, or use "
                "op=Average")
        if backend_for(arr).is_device:
            raise UnsupportedError(f"rank {self.rank}: op=Adasum reduces host arrays only, got "
                                   f"a device {type(arr).__name__}; copy it to the host first "
                                   "(cupy.asnumpy(x), tensor.cpu())")

    def check_out(self, be: ArrayBackend, out: Array, shape: tuple[int, ...],
                  dt: np.dtype[Any], what: str) -> Array:
        """``out`` if it is a writeable C-contiguous ``dt`` array of ``shape``."""
        if not be.owns(out) or tuple(out.shape) != tuple(shape) or out.dtype != dt:
            raise ArgumentError(
                f"rank {self.rank}: {what} out= must be a {dt}{list(shape)} array, got "
                f"{getattr(out, 'dtype', type(out).__name__)}{list(getattr(out, 'shape', []))}")
        if not be.is_contiguous(out):
            raise ArgumentError(f"rank {self.rank}: {what} out= must be C-contiguous; pass "
                                "np.empty_like(x) or leave out= unset")
        self.check_writeable(be, out, what)
        return out

    def check_writeable(self, be: ArrayBackend, arr: Array, what: str) -> None:
        """Raise if ``what`` would write into a read-only ``arr``."""
        if not be.is_writeable(arr):
            raise ArgumentError(f"rank {self.rank}: {what} writes into its buffer, but the "
                                "array is read-only; pass a writeable array or use the "
                                "out-of-place variant")

    def check_root(self, root: int) -> None:
        """Raise if ``root`` is not a rank of this communicator."""
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise ArgumentError(f"rank {self.rank}: root={root!r} is not a rank of this "
                                f"communicator of size {self.size}; use 0..{self.size - 1}")

    def check_gathered_rows(self, total: int, rows: Sequence[int],
                            trailing: tuple[int, ...]) -> None:
        """Raise if an allgather ``out=`` of ``total`` rows cannot hold ``rows``."""
        if total != sum(rows):
            raise ArgumentError(
                f"rank {self.rank}: allgather out= has {total} rows, but the ranks send "
                f"{sum(rows)} rows in all ({list(rows)}); pass an array of shape "
                f"{(sum(rows), *trailing)}")

    def check_algorithm(self, collective: str, algorithm: Any, be: ArrayBackend,
                        dt: np.dtype[Any]) -> str | None:
        """The requested algorithm name, lower-cased and checked (raises if this
        dispatcher cannot run it); ``None`` if none was requested."""
        if algorithm is None:
            return None
        if not isinstance(algorithm, str):
            raise ArgumentError(f"rank {self.rank}: algorithm must be a name (a string) or "
                                f"None, got {algorithm!r}")
        name = algorithm.lower()
        if name != "auto":
            self.algorithm(collective, name, 0, be, dt)
        return name

    # -- algorithm choice --------------------------------------------------------------
    def algorithms(self, collective: str) -> list[str]:
        """The algorithms this dispatcher can run for ``collective`` on host buffers."""
        if collective not in algorithms.ALGORITHMS:
            raise ArgumentError(f"unknown collective {collective!r}; use one of "
                                f"{', '.join(algorithms.ALGORITHMS)}")
        return list(self._available_for(collective, NUMPY))

    def _available_for(self, collective: str, be: ArrayBackend) -> tuple[str, ...]:
        key = (collective, be.name)
        names = self._available.get(key)
        if names is None:
            shm_ok = self.shm is not None and be is NUMPY
            peers_ok = shm_ok and self.shm is not None and self.shm.single_copy
            plans = algorithms.REGISTRY[collective]
            names = tuple(a for a in algorithms.ALGORITHMS[collective]
                          if (shm_ok or not plans[a].needs_shared_memory)
                          and (peers_ok or not plans[a].needs_single_copy))
            self._available[key] = names
        return names

    def algorithm(self, collective: str, requested: str | None, nbytes: int,
                  be: ArrayBackend, dt: np.dtype[Any]) -> str:
        """The algorithm of a call: the requested one, or the selection table's choice.

        A name from ``MPITRAIN_ALGORITHM`` that this collective (or this dispatcher)
        cannot run falls back to the table; a name passed as ``algorithm=`` raises.
        Memoized: the same arguments always give the same name.
        """
        name = requested or config.ALGORITHM.get()
        key = (collective, name, requested is None, nbytes, dt, be.name, config.TUNING_FILE.get())
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choose(collective, name.lower(), requested is None, nbytes, be, dt)
            if len(self._choices) >= 1024:
                self._choices.clear()
            self._choices[key] = choice
        return choice

    def _choose(self, collective: str, name: str, from_env: bool, nbytes: int,
                be: ArrayBackend, dt: np.dtype[Any]) -> str:
        available = self._available_for(collective, be)
        if name in available or (self.size == 1 and name in algorithms.ALGORITHMS[collective]):
            return name
        if name == "auto" or (from_env and name in algorithms.KNOWN):
            return select(collective, nbytes, self.size, be.name, available, dtype_name(dt),
                          self.topology.node_count)
        if name in algorithms.ALGORITHMS[collective]:
            raise ArgumentError(f"rank {self.rank}: the {name} {collective} needs every rank "
                                "on one node and host (numpy) buffers; use algorithm='auto'")
        raise ArgumentError(f"rank {self.rank}: unknown {collective} algorithm "
                            f"{name!r}; use one of auto, {', '.join(available)}")

    def takes_pieces(self, algorithm: str | None, nbytes: int, be: ArrayBackend,
                     dt: np.dtype[Any]) -> bool:
        """True if an allreduce of ``nbytes`` runs an algorithm that reads and writes
        :class:`~mpitrain.algorithms.pieces.Pieces`: a fusion bucket may then go to
        :meth:`allreduce_flat` unpacked (without a prescale factor)."""
        if self.size == 1:
            return False
        name = self.algorithm("allreduce", algorithm, nbytes, be, dt)
        return algorithms.REGISTRY["allreduce"][name].takes_pieces

    # -- allreduce ---------------------------------------------------------------------
    def allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, algorithm: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  out: Array | None = None, name: str | None = None, *,
                  stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.allreduce`."""
        if (type(x) is np.ndarray and name is None
                and (algorithm is None or type(algorithm) is str)
                and prescale_factor == 1.0 and postscale_factor == 1.0
                and (type(op) is ReduceOp or type(op) is str)):
            entry = self._small.get((x.dtype, x.shape, op, algorithm))  # small_allreduce()
            small = entry[1] if entry is not None and entry[0] == config.plan_texts() else \
                self.small_allreduce(x, op, algorithm)
            if small is not None and (out is None or fits_out(out, x.shape, x.dtype)):
                return small.allreduce(x, out)
        return self._allreduce(x, op, algorithm, prescale_factor, postscale_factor, out, name,
                               stream=stream)

    def small_allreduce(self, x: np.ndarray[Any, Any], op: ReduceOp | str,
                        algorithm: str | None = None) -> SmallAllreduce | None:
        """The fast-path plan (:mod:`.fastpath`) of an allreduce of ``x`` with ``op``,
        ``algorithm`` (as requested: ``None``, ``"auto"`` or a name) and otherwise default
        arguments, made on first use; ``None`` if the call needs the general path."""
        return self._small_plan(self._small, SmallAllreduce, x, op, algorithm)

    def _small_plan(self, cache: dict[tuple[Any, ...], tuple[tuple[Any, ...], _Small | None]],
                    kind: type[_Small], x: np.ndarray[Any, Any], op: ReduceOp | str | None,
                    algorithm: str | None) -> _Small | None:
        """The plan of ``kind`` for the call in ``cache`` while the configuration texts
        it was made under still hold, else a new one (remembered, ``None`` included)."""
        texts = config.plan_texts()
        key = (x.dtype, x.shape, op, algorithm)
        entry = cache.get(key)
        if entry is not None and entry[0] == texts:
            return entry[1]
        small = self._plan_small(kind, x, op, algorithm, texts)
        if len(cache) >= SMALL_CACHE_SIZE:
            cache.clear()
        cache[key] = (texts, small)
        return small

    def _plan_small(self, kind: type[_Small], x: np.ndarray[Any, Any], op: ReduceOp | str | None,
                    algorithm: str | None, texts: tuple[Any, ...]) -> _Small | None:
        """A new fast-path plan of ``kind`` (:mod:`.fastpath`) for ``x``, or ``None`` where
        the call needs the general path (which also raises for invalid input).

        A reduction needs an ``op``; an allgather (``op`` ``None``) is chosen by its
        gathered size, as if every rank sent ``x``'s rows, and is always validated."""
        if x.ndim < kind.min_ndim:
            return None
        try:
            if op is None:
                rop = None
                dt = check_dtype(x.dtype, rank=self.rank)
                total = x.size * self.size * dt.itemsize
            else:
                rop = op if type(op) is ReduceOp else parse_op(op)
                if rop is ReduceOp.ADASUM:
                    return None
                dt = self.check_reducible(x, rop)
                total = x.size * dt.itemsize
            alg = self.algorithm(kind.collective, algorithm, total, NUMPY, dt)
        except MpitrainError:
            return None
        shape = tuple(x.shape)
        if self.size == 1:
            return kind(self.transport, None, self.validator, dt, shape, rop, None, texts)
        shm, segment = self.shm, config.SEGMENT_BYTES.get()
        if alg != "shm" or shm is None or x.size * dt.itemsize > shm.slot_bytes or \
                (segment and total > segment):
            return None
        if rop is None:
            # the general path's signature: the trailing shape and the requested name
            if shm.single_copy and may_select("allgather", "single_copy"):
                return None  # a table that may pick it needs every rank's block address
            sig: Signature | None = signature(
                kind.collective, "", dtype_name(dt), shape[1:], True, -1, 1.0, 1.0, "",
                (algorithm or config.ALGORITHM.get()).lower())
        else:
            sig = signature(kind.collective, rop.value, dtype_name(dt), shape or (x.size,),
                            False, -1, 1.0, 1.0, "", alg) if self.checking else None
        return kind(self.transport, shm, self.validator, dt, shape, rop, sig, texts)

    @on_stream
    def _allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                   algorithm: str | None = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, out: Array | None = None,
                   name: str | None = None, *, stream: Any = None) -> Array:
        be, arr = backend_and_array(x)
        rop = op if type(op) is ReduceOp else parse_op(op)
        dt = self.check_reducible(arr, rop)
        if out is None:
            result = be.empty_like(arr) if be.is_contiguous(arr) else be.empty(arr.size, dt) \
                .reshape(arr.shape)
        else:
            result = self.check_out(be, out, arr.shape, dt, "allreduce")
        src = be.ascontiguous(arr)
        self.allreduce_flat(be, be.flat(src), be.flat(result), dt, rop, algorithm,
                            prescale_factor, postscale_factor, name, arr.shape)
        return result

    def allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                   algorithm: str | None = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, name: str | None = None, *,
                   stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.allreduce_`."""
        if (type(x) is np.ndarray and name is None
                and (algorithm is None or type(algorithm) is str)
                and prescale_factor == 1.0 and postscale_factor == 1.0
                and (type(op) is ReduceOp or type(op) is str)):
            small = self.small_allreduce(x, op, algorithm)
            if small is not None and x.flags.writeable:
                return small.allreduce(x, x)
        return self._allreduce_(x, op, algorithm, prescale_factor, postscale_factor, name,
                                stream=stream)

    @on_stream
    def _allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                    algorithm: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, name: str | None = None, *,
                    stream: Any = None) -> Array:
        be, arr = backend_and_array(x)
        if not be.writes_through(arr, x):
            raise ArgumentError(f"rank {self.rank}: allreduce_ needs an array to write into, "
                                f"got {type(x).__name__}; use allreduce() instead")
        rop = op if type(op) is ReduceOp else parse_op(op)
        dt = self.check_reducible(arr, rop)
        self.check_writeable(be, arr, "allreduce_")
        work = be.ascontiguous(arr)
        flat = be.flat(work)
        self.allreduce_flat(be, flat, flat, dt, rop, algorithm, prescale_factor,
                            postscale_factor, name, arr.shape)
        if work is not arr:
            be.copy_into(arr, work)
        return x

    def allreduce_flat(self, be: ArrayBackend, src: Array, out: Array, dt: np.dtype[Any],
                       op: ReduceOp, algorithm: str | None, prescale: float,
                       postscale: float, name: str | None = None,
                       shape: tuple[int, ...] | None = None) -> str:
        """Allreduce of flat contiguous arrays, with no argument checks (the entry point
        of fused buffers, which may be :class:`~mpitrain.algorithms.pieces.Pieces`
        where :meth:`takes_pieces` says so).

        ``name`` and ``shape`` (default: the flat shape) only enter validation.

        Returns:
            The name of the algorithm that ran.
        """
        n = self.size
        scale = postscale / n if op is ReduceOp.AVERAGE else postscale
        if prescale != 1.0:
            be.scale_into(out, src, prescale)  # one pass: copy and prescale
            src = out
        count = src.size
        if op is ReduceOp.ADASUM:
            alg = self.adasum_algorithm(algorithm)
        else:
            alg = self.algorithm("allreduce", algorithm, count * dt.itemsize, be, dt)
        if n == 1:
            be.scale_into(out, src, scale)
        else:
            self.transport.begin("allreduce")
            sig = signature("allreduce", op.value, dtype_name(dt), shape or (count,), False, -1,
                            prescale, postscale, name or "", alg) if self.checking else None
            self.run_plan("allreduce", alg, be, dt, op.reduction, (count,), 0, sig, src, out,
                          scale)
        return alg

    def adasum_algorithm(self, requested: str | None) -> str:
        """The algorithm of an Adasum allreduce: its own, whatever ``MPITRAIN_ALGORITHM``
        says; ``algorithm=`` may only be ``None`` or ``"auto"``."""
        if requested is not None and requested.lower() != "auto":
            raise ArgumentError(f"rank {self.rank}: op=Adasum runs its own algorithm, not "
                                f"{requested!r}; leave algorithm unset (or 'auto')")
        return algorithms.ADASUM

    # -- reduce-scatter ----------------------------------------------------------------
    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                       algorithm: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, name: str | None = None, *,
                       out: Array | None = None, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.reduce_scatter`."""
        if (type(x) is np.ndarray and name is None and stream is None
                and (algorithm is None or type(algorithm) is str)
                and prescale_factor == 1.0 and postscale_factor == 1.0
                and (type(op) is ReduceOp or type(op) is str)):
            entry = self._small_rs.get((x.dtype, x.shape, op, algorithm))
            small = entry[1] if entry is not None and entry[0] == config.plan_texts() else \
                self.small_reduce_scatter(x, op, algorithm)
            if small is not None and (out is None or fits_out(out, small.out_shape, x.dtype)):
                return small.reduce_scatter(x, out)
        return self._reduce_scatter(x, op, algorithm, prescale_factor, postscale_factor, name,
                                    out=out, stream=stream)

    def small_reduce_scatter(self, x: np.ndarray[Any, Any], op: ReduceOp | str,
                             algorithm: str | None = None) -> SmallReduceScatter | None:
        """The fast-path plan (:mod:`.fastpath`) of a reduce-scatter of ``x`` with ``op``
        and ``algorithm`` (as requested) and otherwise default arguments, made on first
        use; ``None`` if the call needs the general path."""
        return self._small_plan(self._small_rs, SmallReduceScatter, x, op, algorithm)

    @on_stream
    def _reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                        algorithm: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, name: str | None = None, *,
                        out: Array | None = None, stream: Any = None) -> Array:
        be, arr = backend_and_array(x)
        rop = op if type(op) is ReduceOp else parse_op(op)
        if rop is ReduceOp.ADASUM:
            raise UnsupportedError(f"rank {self.rank}: op=Adasum is an allreduce only (as in "
                                   "Horovod); use allreduce(x, op=Adasum), or reduce_scatter "
                                   "with op=Sum or Average")
        dt = self.check_reducible(arr, rop)
        if arr.ndim == 0:
            raise ArgumentError(f"rank {self.rank}: reduce_scatter splits axis 0, but got a "
                                "0-d array; pass x.reshape(1) or a larger array")
        row = row_size(arr.shape)
        n, count = self.size, arr.size
        rows, extra = divmod(arr.shape[0], n)
        mine = rows + (self.rank < extra)
        shape = (mine, *tuple(arr.shape[1:]))
        result = be.empty(mine * row, dt) if out is None else \
            be.flat(self.check_out(be, out, shape, dt, "reduce_scatter"))
        src = be.flat(be.ascontiguous(arr))
        scale = postscale_factor / n if rop is ReduceOp.AVERAGE else postscale_factor
        if prescale_factor != 1.0:
            scaled = be.empty(src.size, dt)
            be.scale_into(scaled, src, prescale_factor)
            src = scaled
        alg = self.algorithm("reduce_scatter", algorithm, count * dt.itemsize, be, dt)
        if n == 1:
            be.scale_into(result, src, scale)
        else:
            self.transport.begin("reduce_scatter")
            sig = signature("reduce_scatter", rop.value, dtype_name(dt), arr.shape, False, -1,
                            prescale_factor, postscale_factor, name or "", alg) \
                if self.checking else None
            self.run_plan("reduce_scatter", alg, be, dt, rop.reduction, (count, row), 0, sig,
                          src, result, scale)
        return result.reshape(shape) if out is None else out

    # -- allgather ---------------------------------------------------------------------
    def allgather(self, x: Array, algorithm: str | None = None, name: str | None = None, *,
                  out: Array | None = None, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.allgather`."""
        if (type(x) is np.ndarray and name is None and stream is None
                and (algorithm is None or type(algorithm) is str)):
            entry = self._small_ag.get((x.dtype, x.shape, None, algorithm))
            small = entry[1] if entry is not None and entry[0] == config.plan_texts() else \
                self.small_allgather(x, algorithm)
            if small is not None and (out is None or fits_out(out, small.out_shape, x.dtype)):
                result = small.allgather(x, out)
                if result is not None:
                    return result
                # the ranks' rows differ from the plan's: finish from the same exchange
                total = -1 if out is None else small.out_shape[0]
                return self._gathered(NUMPY, np.ascontiguousarray(x).reshape(-1),
                                      small.shape[1:], small.dtype, algorithm, out, total)
        return self._allgather(x, algorithm, name, out=out, stream=stream)

    def small_allgather(self, x: np.ndarray[Any, Any],
                        algorithm: str | None = None) -> SmallAllgather | None:
        """The fast-path plan (:mod:`.fastpath`) of an allgather of ``x`` with
        ``algorithm`` (as requested) and otherwise default arguments, made on first use;
        ``None`` if the call needs the general path."""
        return self._small_plan(self._small_ag, SmallAllgather, x, None, algorithm)

    @on_stream
    def _allgather(self, x: Array, algorithm: str | None = None, name: str | None = None, *,
                   out: Array | None = None, stream: Any = None) -> Array:
        be, arr = backend_and_array(x)
        dt = check_dtype(arr.dtype, rank=self.rank)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        block = be.flat(be.ascontiguous(arr))
        trailing = tuple(arr.shape[1:])
        total = -1  # the rows of out=, which every rank must agree on
        if out is not None:
            total = int(out.shape[0]) if getattr(out, "ndim", 0) else -1
            self.check_out(be, out, (total, *trailing), dt, "allgather")
        if self.size == 1:
            self.algorithm("allgather", algorithm, block.size * dt.itemsize, be, dt)
            if out is None:
                return be.ascontiguous(arr).copy()
            self.check_gathered_rows(total, (arr.shape[0],), trailing)
            be.copy_into(out, arr)
            return out
        requested = (algorithm or config.ALGORITHM.get()).lower()
        self.transport.begin("allgather")
        # With out=, its row count joins the agreed shape: ranks that disagree fail
        # together here, and ranks that agree all check it against the gathered rows.
        agreed = trailing if out is None else (total, *trailing)
        sig = signature("allgather", "", dtype_name(dt), agreed, True, -1, 1.0, 1.0, name or "",
                        requested)
        # a small block rides the exchange in this rank's shared-memory slot, where the
        # call would run shm if every rank sent as many rows (ShmAllgather reads the
        # slots only if every rank's block is there)
        payload = self.shm.offer(be.as_bytes(block)) \
            if self.shm is not None and be is NUMPY and self.algorithm(
                "allgather", algorithm, block.size * dt.itemsize * self.size, be, dt) == "shm" \
            else NO_PAYLOAD
        # where the others may read the block, if the call may run single_copy
        address = hostcopy.address(block) \
            if self.shm is not None and self.shm.single_copy and be is NUMPY and (
                requested == "single_copy" or may_select("allgather", "single_copy")) else 0
        self.validator.exchange(sig, rows=arr.shape[0], payload=payload, address=address)
        return self._gathered(be, block, trailing, dt, algorithm, out, total)

    def _gathered(self, be: ArrayBackend, block: Array, trailing: tuple[int, ...],
                  dt: np.dtype[Any], algorithm: str | None, out: Array | None,
                  total: int) -> Array:
        """The rest of an allgather once its exchange has run: every rank's rows from the
        headers, the algorithm for the gathered size, and its plan (``block``: this
        rank's flat block; ``total``: the rows of ``out=``, else -1)."""
        rows = self.validator.rows()
        row = row_size((1, *trailing))
        counts = tuple(r * row for r in rows)
        if out is not None:  # total and rows are the same on every rank: all raise
            self.check_gathered_rows(total, rows, trailing)
        result = be.empty(sum(counts), dt) if out is None else be.flat(out)
        alg = self.algorithm("allgather", algorithm, sum(counts) * dt.itemsize, be, dt)
        self.run_plan("allgather", alg, be, dt, None, counts, 0, None, block, result)
        return result.reshape((sum(rows), *trailing)) if out is None else out

    # -- broadcast ---------------------------------------------------------------------
    @on_stream
    def broadcast(self, x: Array, root: int = 0, algorithm: str | None = None,
                  name: str | None = None, *, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.broadcast`."""
        be, arr = backend_and_array(x)
        out = be.empty(arr.size, check_dtype(arr.dtype, rank=self.rank)).reshape(arr.shape)
        if self.rank == root:
            be.copy_into(out, arr)
        self._broadcast_into(be, out, root, algorithm, name)
        return out

    @on_stream
    def broadcast_(self, x: Array, root: int = 0, algorithm: str | None = None,
                   name: str | None = None, *, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.broadcast_`."""
        be, arr = backend_and_array(x)
        check_dtype(arr.dtype, rank=self.rank)
        self.check_writeable(be, arr, "broadcast_")
        work = be.ascontiguous(arr)
        self._broadcast_into(be, work, root, algorithm, name)
        if work is not arr:
            be.copy_into(arr, work)
        return x

    def _broadcast_into(self, be: ArrayBackend, buf: Array, root: int,
                        algorithm: str | None, name: str | None) -> None:
        self.check_root(root)
        dt, count = buf.dtype, buf.size
        alg = self.algorithm("broadcast", algorithm, count * dt.itemsize, be, dt)
        if self.size == 1:
            return
        self.transport.begin("broadcast")
        sig = signature("broadcast", "", dtype_name(dt), buf.shape, False, int(root), 1.0, 1.0,
                        name or "", alg) if self.checking else None
        flat = be.flat(buf)
        self.run_plan("broadcast", alg, be, dt, None, (count,), int(root), sig, flat, flat)

    # -- objects and synchronisation ---------------------------------------------------
    def barrier(self) -> None:
        """See :meth:`mpitrain.Communicator.barrier`."""
        self.rendezvous("barrier", BARRIER)

    def rendezvous(self, collective: str, sig: Signature | None = None) -> None:
        """A barrier counted as ``collective``: validated against the other ranks' calls
        (a rank in another collective gets MismatchError), watched by the stall
        inspector, interruptible at the stall timeout like every collective.

        ``sig`` is ``signature(collective)``, when the caller has it at hand.
        """
        if self.size == 1:
            return
        self.transport.begin(collective)
        checking = self.check if self.check is not None else config.CHECK.get()
        if checking or self.shm is not None:  # the exchange is itself a barrier
            self.validator.meet((sig or signature(collective)) if checking else None)
        else:
            self.transport.collective(self.mpi_comm.Barrier, self.mpi_comm.Ibarrier)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """See :meth:`mpitrain.Communicator.broadcast_object`."""
        self.check_root(root)
        self.transport.begin("broadcast_object")
        if self.size > 1 and self.checking:
            self.validator.check(signature("broadcast_object", root=int(root)))
        return objects.broadcast_object(self.transport, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """See :meth:`mpitrain.Communicator.allgather_object`."""
        self.transport.begin("allgather_object")
        if self.size > 1 and self.checking:
            self.validator.check(signature("allgather_object"))
        return objects.allgather_object(self.transport, obj)

    def free(self) -> None:
        """Release the private communicator, shared memory and plans (collective)."""
        self._plans.clear()
        if self.shm is not None:
            self.shm.free()
            self.shm = None
        self.topology.free()
        self.transport.free()

    # -- plans -------------------------------------------------------------------------
    def run_plan(self, collective: str, name: str, be: ArrayBackend, dt: np.dtype[Any],
                 op: ReduceOp | None, shape: tuple[int, ...], root: int, sig: Signature | None,
                 src: Array, out: Array, postscale: float = 1.0) -> None:
        """Validate the call (``sig``; ``None``: not here), run its plan, postscale ``out``.

        The one place where data moves: the plan of ``name`` for this call's ``shape``
        key (allreduce and broadcast: ``(count,)``; reduce_scatter: ``(count, row)``;
        allgather: every rank's element count).
        """
        plan = self.plan(collective, name, be, dt, op, shape, root)
        if plan.fuses_check:
            plan.run(src, out, sig, postscale)
        else:
            if sig is not None:
                self.validator.check(sig)
            plan.run(src, out, None, postscale)
        if not plan.fuses_postscale:
            be.scale(out, postscale)

    def plan(self, collective: str, name: str, be: ArrayBackend, dt: np.dtype[Any],
             op: ReduceOp | None, shape: tuple[int, ...], root: int = 0) -> Plan:
        """The cached plan of ``name`` for this call's shape, built on first use."""
        configured = config.SEGMENT_BYTES.get()
        policy = policy_for(be)
        key = (collective, name, be.name, be.device_id(), policy.name, dt, op, shape, root,
               configured, config.INTER_SEGMENT_BYTES.get(), config.CROSS_RANKS.get())
        plan = self._plans.get(key)
        if plan is None:
            if collective == "allgather":
                chunks = bounds_from_counts(list(shape))
            else:
                chunks = split_bounds(shape[0], self.size, shape[1] if len(shape) > 1 else 1)
            request = PlanRequest(self.transport, self.topology, be, dt, op, tuple(chunks), root,
                                  configured, self.shm, self.validator, select)
            plan = policy.build(collective, name, request)
            self._plans[key] = plan
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan
