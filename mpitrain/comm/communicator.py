"""The user-facing communicator: argument checks, algorithm choice, validation, scaling.

A :class:`Communicator` wraps any MPI intracommunicator. It checks each call's
arguments locally (dtype, op, ``out``), picks an algorithm from the selection table,
validates the call across ranks (:mod:`.validation`, unless ``MPITRAIN_CHECK=0``),
fetches (or builds once) the algorithm's plan for that shape, runs it on a private
duplicate of the communicator, and applies ``prescale_factor``/``postscale_factor``.
``Average`` is ``Sum`` followed by a postscale of ``1/size``. :meth:`Communicator._run`
is the one place where a call is validated and its plan run.

Device arrays (CuPy, torch CUDA tensors, ...) take the same path: every collective
accepts ``stream=`` (default: the current stream), runs on that stream and the
array's device, and synchronizes the stream before MPI touches the data and before
returning (:meth:`~mpitrain.backends.base.ArrayBackend.scope`). Their plans are
built by the device transfer policy (:attr:`Communicator.cuda_policy`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Callable, TypeVar, cast

import numpy as np
from mpi4py import MPI

from .. import algorithms, config
from ..algorithms.chunks import bounds_from_counts, split_bounds
from ..algorithms.shared_memory import offer_block
from ..backends import NUMPY, ArrayBackend, backend_and_array, backend_for
from ..dtypes import check_dtype, check_op_for_dtype, dtype_name
from ..engine import AsyncCollectives
from ..errors import ArgumentError
from ..ops import ReduceOp, parse_op
from . import objects
from . import shm as shared
from .policy import device_policy, policy_for
from .topology import Topology
from .transport import Transport
from .validation import NO_PAYLOAD, Signature, Validator, signature

Array = Any
_PLAN_CACHE_SIZE = 32
SLOT_BYTES = 64 << 10
"""Shared-memory slot per rank: calls up to this size ride the validation exchange."""
ARENA_BYTES = 8 << 20
"""Shared-memory arena per rank for the stripes of large shm collectives."""
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _on_stream(method: _Method) -> _Method:
    """Run a collective inside its array's backend scope (device and ``stream=``)."""

    @functools.wraps(method)
    def scoped(self: Communicator, x: Any, *args: Any, **kwargs: Any) -> Any:
        with backend_for(x).scope(x, kwargs.get("stream")):
            return method(self, x, *args, **kwargs)

    return cast(_Method, scoped)


class Communicator(AsyncCollectives):
    """Collectives over the ranks of an MPI intracommunicator.

    Args:
        comm: any intracommunicator (``MPI.COMM_WORLD``, a split, ...). mpitrain
            duplicates it, so its messages never interfere with the caller's.
        check: validate every call across ranks (default: ``MPITRAIN_CHECK``, on).
        shared_memory: use shared-memory windows when every rank is on one node
            (default: ``MPITRAIN_SHM``, on).

    Every method is collective: all ranks of the communicator must call it, in the
    same order, with agreeing arguments (checked unless ``check`` is off). A
    communicator is not thread-safe: call it from one thread at a time. The asynchronous
    methods (``allreduce_async``, ``grouped_allreduce``, ...) come from
    :class:`~mpitrain.engine.AsyncCollectives`.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, *, check: bool | None = None,
                 shared_memory: bool | None = None) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise ArgumentError(f"mpitrain.Communicator needs an MPI intracommunicator, got "
                                f"{comm!r}")
        self.transport = Transport(comm)
        self.mpi_comm: MPI.Intracomm = self.transport.comm
        self.topology = Topology.detect(self.mpi_comm)
        # Not under ULFM: a rank that dies is only noticed by MPI calls, never by a
        # shared-memory barrier, which would wait for it forever.
        self.shm = shared.create(self.mpi_comm, self.topology.local_size == self.size,
                                 config.SHM.get(shared_memory) and not config.ELASTIC.get(),
                                 SLOT_BYTES, ARENA_BYTES)
        if self.shm is not None:
            self.transport.watch(self.shm)
        self.validator = Validator(self.transport, self.shm)
        self._check = check
        self._plans: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self.last_algorithm = ""  # the algorithm of the latest call (shown by the timeline)
        self._available: dict[tuple[str, str], tuple[str, ...]] = {}
        self._choices: dict[tuple[Any, ...], str] = {}

    # -- identity ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self.transport.rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.transport.size

    @property
    def local_rank(self) -> int:
        """Rank among the ranks of this node."""
        return self.topology.local_rank

    @property
    def local_size(self) -> int:
        """Number of ranks on this node."""
        return self.topology.local_size

    @property
    def cross_rank(self) -> int:
        """Index of this rank's node (nodes are numbered by their lowest rank)."""
        return self.topology.cross_rank

    @property
    def cross_size(self) -> int:
        """Number of nodes."""
        return self.topology.cross_size

    @property
    def cuda_policy(self) -> str:
        """How device buffers reach MPI in this process: ``"cuda-aware"`` (device
        pointers) or ``"staged"`` (pinned host memory); see :mod:`.policy`."""
        return device_policy().name

    def __repr__(self) -> str:
        return (f"<mpitrain.Communicator rank {self.rank}/{self.size}, local "
                f"{self.local_rank}/{self.local_size}, cross {self.cross_rank}/{self.cross_size}>")

    # -- allreduce --------------------------------------------------------------------
    @_on_stream
    def allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, algorithm: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  out: Array | None = None, name: str | None = None, *,
                  stream: Any = None) -> Array:
        """Reduce ``x`` elementwise over all ranks and return the result on every rank.

        Args:
            x: the array to reduce: numpy, cupy or any CUDA array (torch tensor, ...);
                any contiguity (non-contiguous input is copied).
            op: ``Sum``, ``Average``, ``Min``, ``Max``, ``Product`` or its name.
            algorithm: ``"auto"`` (default, from ``MPITRAIN_ALGORITHM``), one of
                ``mpitrain.algorithms.ALGORITHMS["allreduce"]`` (``"ring"``, ``"shm"``,
                ...), or ``"mpi"`` (the MPI library's own ``MPI_Allreduce``).
            prescale_factor: multiply each rank's input by this before reducing.
            postscale_factor: multiply the result by this (``Average`` adds ``1/size``).
            out: optional array of ``x``'s shape and dtype that receives the result.
            stream: for device arrays, the CUDA stream to work on (default: current);
                ignored for numpy.
            name: optional name of the tensor; validated like the other arguments.

        Returns:
            A new array (or ``out``) with the reduction; a CuPy array on ``x``'s device
            for device input.
        """
        be, arr = backend_and_array(x)
        rop = op if type(op) is ReduceOp else parse_op(op)
        dt = self._check_reducible(arr, rop)
        if out is None:
            result = be.empty_like(arr) if be.is_contiguous(arr) else be.empty(arr.size, dt) \
                .reshape(arr.shape)
        else:
            result = self._check_out(be, out, arr.shape, dt, "allreduce")
        src = be.ascontiguous(arr)
        self._allreduce_flat(be, be.flat(src), be.flat(result), dt, rop, algorithm,
                             prescale_factor, postscale_factor, name, arr.shape)
        return result

    @_on_stream
    def allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                   algorithm: str | None = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, name: str | None = None, *,
                   stream: Any = None) -> Array:
        """In-place :meth:`allreduce`: ``x`` is overwritten with the result and returned.

        A non-contiguous ``x`` is reduced through a contiguous copy written back. A
        torch CUDA tensor is written in place through a zero-copy CuPy view.
        """
        be, arr = backend_and_array(x)
        if not be.writes_through(arr, x):
            raise ArgumentError(f"rank {self.rank}: allreduce_ needs an array to write into, "
                                f"got {type(x).__name__}; use allreduce() instead")
        rop = op if type(op) is ReduceOp else parse_op(op)
        dt = self._check_reducible(arr, rop)
        self._check_writeable(be, arr, "allreduce_")
        work = be.ascontiguous(arr)
        flat = be.flat(work)
        self._allreduce_flat(be, flat, flat, dt, rop, algorithm, prescale_factor,
                             postscale_factor, name, arr.shape)
        if work is not arr:
            be.copy_into(arr, work)
        return x

    def _takes_pieces(self, algorithm: str | None, nbytes: int, be: ArrayBackend,
                      dt: np.dtype[Any]) -> bool:
        """True if an allreduce of ``nbytes`` runs an algorithm that reads and writes
        :class:`~mpitrain.algorithms.pieces.Pieces`: a fusion bucket then goes to
        :meth:`_allreduce_flat` unpacked (without a prescale factor)."""
        if self.size == 1:
            return False
        name = self._algorithm("allreduce", algorithm, nbytes, be, dt)
        return bool(getattr(algorithms.REGISTRY["allreduce"][name], "takes_pieces", False))

    def _allreduce_flat(self, be: ArrayBackend, src: Array, out: Array, dt: np.dtype[Any],
                        op: ReduceOp, algorithm: str | None, prescale: float,
                        postscale: float, name: str | None = None,
                        shape: tuple[int, ...] | None = None) -> None:
        """Allreduce of flat contiguous arrays (the entry point of fused buffers too,
        which may be :class:`~mpitrain.algorithms.pieces.Pieces` where
        :meth:`_takes_pieces` says so).

        ``name`` and ``shape`` (default: the flat shape) only enter validation.
        """
        n = self.size
        scale = postscale / n if op is ReduceOp.AVERAGE else postscale
        if prescale != 1.0:
            be.scale_into(out, src, prescale)  # one pass: copy and prescale
            src = out
        count = src.size
        alg = self._algorithm("allreduce", algorithm, count * dt.itemsize, be, dt)
        if n == 1:
            be.scale_into(out, src, scale)
        else:
            self.transport.begin("allreduce")
            sig = signature("allreduce", op.value, dtype_name(dt), shape or (count,), False, -1,
                            prescale, postscale, name or "", alg) if self._checking() else None
            self._run("allreduce", alg, be, dt, op.reduction, (count,), 0, sig, src, out,
                      postscale=scale)

    # -- reduce-scatter ---------------------------------------------------------------
    @_on_stream
    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                       algorithm: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, name: str | None = None, *,
                       out: Array | None = None, stream: Any = None) -> Array:
        """Reduce ``x`` over ranks and return this rank's block of axis 0.

        Blocks are those of ``np.array_split(x, size)``: with ``d`` rows, the first
        ``d % size`` ranks get ``d // size + 1`` rows, the others ``d // size``.

        Args:
            x: array with at least one dimension, same shape on every rank.
            op, algorithm, prescale_factor, postscale_factor, name, stream: as for
                :meth:`allreduce`.
            out: optional C-contiguous array of shape ``(rows of this rank,) +
                x.shape[1:]`` and ``x``'s dtype that receives the block (no allocation).

        Returns:
            ``out``, or a new array of shape ``(rows of this rank,) + x.shape[1:]``.
        """
        be, arr = backend_and_array(x)
        rop = op if type(op) is ReduceOp else parse_op(op)
        dt = self._check_reducible(arr, rop)
        if arr.ndim == 0:
            raise ArgumentError(f"rank {self.rank}: reduce_scatter splits axis 0, but got a "
                                "0-d array; pass x.reshape(1) or a larger array")
        row = _row_size(arr.shape)
        n, count = self.size, arr.size
        rows, extra = divmod(arr.shape[0], n)
        mine = rows + (self.rank < extra)
        shape = (mine, *tuple(arr.shape[1:]))
        result = be.empty(mine * row, dt) if out is None else \
            be.flat(self._check_out(be, out, shape, dt, "reduce_scatter"))
        src = be.flat(be.ascontiguous(arr))
        scale = postscale_factor / n if rop is ReduceOp.AVERAGE else postscale_factor
        if prescale_factor != 1.0:
            scaled = be.empty(src.size, dt)
            be.scale_into(scaled, src, prescale_factor)
            src = scaled
        alg = self._algorithm("reduce_scatter", algorithm, count * dt.itemsize, be, dt)
        if n == 1:
            be.scale_into(result, src, scale)
        else:
            self.transport.begin("reduce_scatter")
            sig = signature("reduce_scatter", rop.value, dtype_name(dt), arr.shape, False, -1,
                            prescale_factor, postscale_factor, name or "", alg) \
                if self._checking() else None
            self._run("reduce_scatter", alg, be, dt, rop.reduction, (count, row), 0, sig,
                      src, result, postscale=scale)
        return result.reshape(shape) if out is None else out

    # -- allgather --------------------------------------------------------------------
    @_on_stream
    def allgather(self, x: Array, algorithm: str | None = None, name: str | None = None, *,
                  out: Array | None = None, stream: Any = None) -> Array:
        """Concatenate every rank's ``x`` along axis 0.

        Axis 0 may differ between ranks; the other axes and the dtype must agree (a
        disagreement raises :class:`~mpitrain.MismatchError` on every rank). The row
        counts travel in the validation exchange, which allgather always makes.
        ``stream`` is as for :meth:`allreduce`. ``out``: optional C-contiguous array of
        shape ``(sum of every rank's rows,) + x.shape[1:]`` and ``x``'s dtype that
        receives the result (no allocation); every rank passes one, or none does.

        Returns:
            ``out``, or a new array of shape ``(sum of every rank's rows,) + x.shape[1:]``.
        """
        be, arr = backend_and_array(x)
        dt = check_dtype(arr.dtype, rank=self.rank)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        block = be.flat(be.ascontiguous(arr))
        trailing = tuple(arr.shape[1:])
        total = -1  # the rows of out=, which every rank must agree on
        if out is not None:
            total = int(out.shape[0]) if getattr(out, "ndim", 0) else -1
            self._check_out(be, out, (total, *trailing), dt, "allgather")
        if self.size == 1:
            self._algorithm("allgather", algorithm, block.size * dt.itemsize, be, dt)
            if out is None:
                return be.ascontiguous(arr).copy()
            self._check_gathered_rows(total, (arr.shape[0],), trailing)
            be.copy_into(out, arr)
            return out
        requested = (algorithm or config.ALGORITHM.get()).lower()
        self.transport.begin("allgather")
        # With out=, its row count joins the agreed shape: ranks that disagree fail
        # together here, and ranks that agree all check it against the gathered rows.
        agreed = trailing if out is None else (total, *trailing)
        sig = signature("allgather", "", dtype_name(dt), agreed, True, -1, 1.0, 1.0, name or "",
                        requested)
        payload = offer_block(self.shm, be.as_bytes(block)) \
            if self.shm is not None and be is NUMPY else NO_PAYLOAD
        self.validator.exchange(sig, rows=arr.shape[0], payload=payload)
        rows = self.validator.rows()
        row = _row_size(arr.shape)
        counts = tuple(r * row for r in rows)
        if out is not None:  # total and rows are the same on every rank: all raise
            self._check_gathered_rows(total, rows, trailing)
        result = be.empty(sum(counts), dt) if out is None else be.flat(out)
        alg = self._algorithm("allgather", algorithm, sum(counts) * dt.itemsize, be, dt)
        self._run("allgather", alg, be, dt, None, counts, 0, None, block, result)
        return result.reshape((sum(rows), *trailing)) if out is None else out

    # -- broadcast --------------------------------------------------------------------
    @_on_stream
    def broadcast(self, x: Array, root: int = 0, algorithm: str | None = None,
                  name: str | None = None, *, stream: Any = None) -> Array:
        """Return a copy of the root's ``x`` on every rank.

        On other ranks ``x`` only gives the shape and dtype (like Horovod). ``stream``
        is as for :meth:`allreduce`.
        """
        be, arr = backend_and_array(x)
        out = be.empty(arr.size, check_dtype(arr.dtype, rank=self.rank)).reshape(arr.shape)
        if self.rank == root:
            be.copy_into(out, arr)
        return self._broadcast_inplace(be, out, root, algorithm, name)

    @_on_stream
    def broadcast_(self, x: Array, root: int = 0, algorithm: str | None = None,
                   name: str | None = None, *, stream: Any = None) -> Array:
        """Overwrite ``x`` on every rank with the root's ``x``; returns ``x``."""
        be, arr = backend_and_array(x)
        check_dtype(arr.dtype, rank=self.rank)
        self._check_writeable(be, arr, "broadcast_")
        work = be.ascontiguous(arr)
        self._broadcast_inplace(be, work, root, algorithm, name)
        if work is not arr:
            be.copy_into(arr, work)
        return x

    def _broadcast_inplace(self, be: ArrayBackend, buf: Array, root: int,
                           algorithm: str | None, name: str | None) -> Array:
        self._check_root(root)
        dt, count = buf.dtype, buf.size
        alg = self._algorithm("broadcast", algorithm, count * dt.itemsize, be, dt)
        if self.size == 1:
            return buf
        self.transport.begin("broadcast")
        sig = signature("broadcast", "", dtype_name(dt), buf.shape, False, int(root), 1.0, 1.0,
                        name or "", alg) if self._checking() else None
        self._run("broadcast", alg, be, dt, None, (count,), int(root), sig, be.flat(buf))
        return buf

    # -- objects and synchronisation --------------------------------------------------
    def barrier(self) -> None:
        """Block until every rank has called :meth:`barrier`."""
        if self.size == 1:
            return
        self.transport.begin("barrier")
        checking = self._checking()
        if checking or self.shm is not None:  # the exchange is itself a barrier
            self.validator.exchange(signature("barrier") if checking else None)
        else:
            self.transport.collective(self.mpi_comm.Barrier, self.mpi_comm.Ibarrier)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return the root's ``obj`` (any picklable object) on every rank."""
        self._check_root(root)
        self.transport.begin("broadcast_object")
        if self.size > 1 and self._checking():
            self.validator.check(signature("broadcast_object", root=int(root)))
        return objects.broadcast_object(self.transport, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's ``obj``, in rank order."""
        self.transport.begin("allgather_object")
        if self.size > 1 and self._checking():
            self.validator.check(signature("allgather_object"))
        return objects.allgather_object(self.transport, obj)

    def free(self) -> None:
        """Release the communicator's private MPI resources (collective).

        Stops the async engine first: operations every rank submitted are finished,
        the others fail.
        """
        self._stop_async_engine()
        self._plans.clear()
        if self.shm is not None:
            self.shm.free()
            self.shm = None
        self.topology.free()
        self.transport.free()

    # -- helpers ----------------------------------------------------------------------
    def _check_reducible(self, arr: Array, op: ReduceOp) -> np.dtype[Any]:
        dt = check_dtype(arr.dtype, rank=self.rank)
        check_op_for_dtype(op, dt)
        return dt

    def _check_out(self, be: ArrayBackend, out: Array, shape: tuple[int, ...],
                   dt: np.dtype[Any], what: str) -> Array:
        if not be.owns(out) or tuple(out.shape) != tuple(shape) or out.dtype != dt:
            raise ArgumentError(
                f"rank {self.rank}: {what} out= must be a {dt}{list(shape)} array, got "
                f"{getattr(out, 'dtype', type(out).__name__)}{list(getattr(out, 'shape', []))}")
        if not be.is_contiguous(out):
            raise ArgumentError(f"rank {self.rank}: {what} out= must be C-contiguous; pass "
                                "np.empty_like(x) or leave out= unset")
        self._check_writeable(be, out, what)
        return out

    def _check_gathered_rows(self, total: int, rows: Sequence[int],
                             trailing: tuple[int, ...]) -> None:
        if total != sum(rows):
            raise ArgumentError(
                f"rank {self.rank}: allgather out= has {total} rows, but the ranks send "
                f"{sum(rows)} rows in all ({list(rows)}); pass an array of shape "
                f"{(sum(rows), *trailing)}")

    def _check_writeable(self, be: ArrayBackend, arr: Array, what: str) -> None:
        if not be.is_writeable(arr):
            raise ArgumentError(f"rank {self.rank}: {what} writes into its buffer, but the "
                                "array is read-only; pass a writeable array or use the "
                                "out-of-place variant")

    def _check_root(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise ArgumentError(f"rank {self.rank}: root={root!r} is not a rank of this "
                                f"communicator of size {self.size}; use 0..{self.size - 1}")

    def _checking(self) -> bool:
        """Whether calls are validated (the constructor's ``check``, else MPITRAIN_CHECK)."""
        return self._check if self._check is not None else config.CHECK.get()

    def algorithms(self, collective: str) -> list[str]:
        """The algorithms this communicator can run for ``collective`` on host buffers."""
        if collective not in algorithms.ALGORITHMS:
            raise ArgumentError(f"unknown collective {collective!r}; use one of "
                                f"{', '.join(algorithms.ALGORITHMS)}")
        return list(self._available_for(collective, NUMPY))

    def _available_for(self, collective: str, be: ArrayBackend) -> tuple[str, ...]:
        """The algorithms this communicator can run for ``collective`` on ``be``'s buffers."""
        key = (collective, be.name)
        names = self._available.get(key)
        if names is None:
            shm_ok = self.shm is not None and be is NUMPY
            names = tuple(a for a in algorithms.ALGORITHMS[collective]
                          if shm_ok or a not in algorithms.NEEDS_SHARED_MEMORY)
            self._available[key] = names
        return names

    def _algorithm(self, collective: str, requested: str | None, nbytes: int,
                   be: ArrayBackend, dt: np.dtype[Any]) -> str:
        """The algorithm of a call: the requested one, or the selection table's choice.

        A name from ``MPITRAIN_ALGORITHM`` that this collective (or this communicator)
        cannot run falls back to the table; a name passed as ``algorithm=`` raises.
        """
        name = requested or config.ALGORITHM.get()
        key = (collective, name, requested is None, nbytes, dt, be.name, config.TUNING_FILE.get())
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choose(collective, name.lower(), requested is None, nbytes, be, dt)
            if len(self._choices) >= 1024:
                self._choices.clear()
            self._choices[key] = choice
        self.last_algorithm = choice
        return choice

    def _choose(self, collective: str, name: str, from_env: bool, nbytes: int,
                be: ArrayBackend, dt: np.dtype[Any]) -> str:
        """:meth:`_algorithm` without its memo."""
        available = self._available_for(collective, be)
        if name in available or (self.size == 1 and name in algorithms.ALGORITHMS[collective]):
            return name
        if name == "auto" or (from_env and name in algorithms.KNOWN):
            return algorithms.select(collective, nbytes, self.size, be.name, available,
                                     dtype_name(dt), self.topology.node_count)
        if name in algorithms.ALGORITHMS[collective]:
            raise ArgumentError(f"rank {self.rank}: the {name} {collective} needs every rank "
                                "on one node and host (numpy) buffers; use algorithm='auto'")
        raise ArgumentError(f"rank {self.rank}: unknown {collective} algorithm "
                            f"{name!r}; use one of auto, {', '.join(available)}")

    def _run(self, collective: str, name: str, be: ArrayBackend, dt: np.dtype[Any],
             op: ReduceOp | None, shape: tuple[int, ...], root: int, sig: Signature | None,
             *buffers: Array, postscale: float = 1.0) -> None:
        """Validate the call (``sig``; ``None``: not here), run its plan, postscale.

        The one place where data moves: the plan of ``name`` for this call's ``shape``
        key (allreduce and broadcast: ``(count,)``; reduce_scatter: ``(count, row)``;
        allgather: every rank's element count).
        """
        plan = self._plan(collective, name, be, dt, op, shape, root)
        checks = getattr(plan, "fuses_check", False)
        if sig is not None and not checks:
            self.validator.check(sig)
        args = (*buffers, sig) if checks else buffers
        if getattr(plan, "fuses_postscale", False):
            plan.run(*args, postscale)
            return
        plan.run(*args)
        be.scale(buffers[-1], postscale)

    def _plan(self, collective: str, name: str, be: ArrayBackend, dt: np.dtype[Any],
              op: ReduceOp | None, shape: tuple[int, ...], root: int = 0) -> Any:
        """The cached plan of ``name`` for this call's shape, built on first use."""
        configured = config.SEGMENT_BYTES.get()
        policy = policy_for(be)
        key = (collective, name, be.name, be.device_id(), policy.name, dt, op, shape, root,
               configured,
               config.INTER_SEGMENT_BYTES.get(), config.CROSS_RANKS.get())
        plan = self._plans.get(key)
        if plan is None:
            if collective == "allgather":
                chunks = bounds_from_counts(list(shape))
            else:
                chunks = split_bounds(shape[0], self.size, shape[1] if len(shape) > 1 else 1)
            request = algorithms.PlanRequest(self.transport, self.topology, be, dt, op,
                                             tuple(chunks), root, configured, self.shm,
                                             self.validator)
            plan = policy.build(collective, name, request)
            self._plans[key] = plan
            if len(self._plans) > _PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan


def _row_size(shape: tuple[int, ...]) -> int:
    """Elements per row of axis 0."""
    row = 1
    for d in shape[1:]:
        row *= int(d)
    return row
