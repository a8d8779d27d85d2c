"""The user-facing communicator: argument checks, algorithm choice, scaling.

A :class:`Communicator` wraps any MPI intracommunicator. It checks each call's
arguments locally (dtype, op, ``out``), picks an algorithm from the selection table,
fetches (or builds once) the algorithm's plan for that shape, runs it on a private
duplicate of the communicator, and applies ``prescale_factor``/``postscale_factor``.
``Average`` is ``Sum`` followed by a postscale of ``1/size``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import algorithms, config
from ..algorithms.chunks import Bounds, bounds_from_counts, default_segment_bytes, split_bounds
from ..backends import ArrayBackend, backend_for
from ..dtypes import check_dtype, check_op_for_dtype, dtype_code
from ..errors import ArgumentError, MismatchError
from ..ops import ReduceOp, parse_op
from . import objects
from .topology import Topology
from .transport import Transport

Array = Any
_PLAN_CACHE_SIZE = 32


class Communicator:
    """Collectives over the ranks of an MPI intracommunicator.

    Args:
        comm: any intracommunicator (``MPI.COMM_WORLD``, a split, ...). mpitrain
            duplicates it, so its messages never interfere with the caller's.

    Every method is collective: all ranks of the communicator must call it, in the
    same order, with agreeing arguments.
    """

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise ArgumentError(f"mpitrain.Communicator needs an MPI intracommunicator, got "
                                f"{comm!r}")
        self.transport = Transport(comm)
        self.mpi_comm: MPI.Intracomm = self.transport.comm
        self.topology = Topology.detect(self.mpi_comm)
        self._plans: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

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

    def __repr__(self) -> str:
        return (f"<mpitrain.Communicator rank {self.rank}/{self.size}, local "
                f"{self.local_rank}/{self.local_size}, cross {self.cross_rank}/{self.cross_size}>")

    # -- allreduce --------------------------------------------------------------------
    def allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, algorithm: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  out: Array | None = None) -> Array:
        """Reduce ``x`` elementwise over all ranks and return the result on every rank.

        Args:
            x: the array to reduce (numpy; any contiguity: non-contiguous input is copied).
            op: ``Sum``, ``Average``, ``Min``, ``Max``, ``Product`` or its name.
            algorithm: ``"auto"`` (default, from ``MPITRAIN_ALGORITHM``), ``"ring"`` or
                ``"mpi"`` (the MPI library's own ``MPI_Allreduce``).
            prescale_factor: multiply each rank's input by this before reducing.
            postscale_factor: multiply the result by this (``Average`` adds ``1/size``).
            out: optional array of ``x``'s shape and dtype that receives the result.

        Returns:
            A new array (or ``out``) with the reduction.
        """
        be = backend_for(x)
        arr = be.asarray(x)
        rop = parse_op(op)
        dt = self._check_reducible(arr, rop)
        if out is None:
            result = be.empty_like(arr) if be.is_contiguous(arr) else be.empty(arr.size, dt) \
                .reshape(arr.shape)
        else:
            result = self._check_out(be, out, arr.shape, dt, "allreduce")
        src = be.ascontiguous(arr)
        self._allreduce_flat(be, be.flat(src), be.flat(result), dt, rop, algorithm,
                             prescale_factor, postscale_factor)
        return result

    def allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                   algorithm: str | None = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0) -> Array:
        """In-place :meth:`allreduce`: ``x`` is overwritten with the result and returned.

        A non-contiguous ``x`` is reduced through a contiguous copy written back.
        """
        be = backend_for(x)
        arr = be.asarray(x)
        if arr is not x and not isinstance(x, type(arr)):
            raise ArgumentError(f"rank {self.rank}: allreduce_ needs an array to write into, "
                                f"got {type(x).__name__}; use allreduce() instead")
        rop = parse_op(op)
        dt = self._check_reducible(arr, rop)
        self._check_writeable(be, arr, "allreduce_")
        work = be.ascontiguous(arr)
        flat = be.flat(work)
        self._allreduce_flat(be, flat, flat, dt, rop, algorithm, prescale_factor,
                             postscale_factor)
        if work is not arr:
            be.copy_into(arr, work)
        return x

    def _allreduce_flat(self, be: ArrayBackend, src: Array, out: Array, dt: np.dtype[Any],
                        op: ReduceOp, algorithm: str | None, prescale: float,
                        postscale: float) -> None:
        name = self._algorithm("allreduce", algorithm, src.size * dt.itemsize, be)
        self.transport.begin("allreduce")
        if op is ReduceOp.AVERAGE:
            postscale = postscale / self.size
        if prescale != 1.0:
            if src is not out:
                be.copy_into(out, src)
                src = out
            be.scale(out, prescale)
        if self.size == 1:
            if src is not out:
                be.copy_into(out, src)
        else:
            chunks = split_bounds(src.size, self.size)
            self._plan("allreduce", name, be, dt, op.reduction, chunks).run(src, out)
        be.scale(out, postscale)

    # -- reduce-scatter ---------------------------------------------------------------
    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                       algorithm: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> Array:
        """Reduce ``x`` over ranks and return this rank's block of axis 0.

        Blocks are those of ``np.array_split(x, size)``: with ``d`` rows, the first
        ``d % size`` ranks get ``d // size + 1`` rows, the others ``d // size``.

        Args:
            x: array with at least one dimension, same shape on every rank.
            op, algorithm, prescale_factor, postscale_factor: as for :meth:`allreduce`.

        Returns:
            A new array of shape ``(rows of this rank,) + x.shape[1:]``.
        """
        be = backend_for(x)
        arr = be.asarray(x)
        rop = parse_op(op)
        dt = self._check_reducible(arr, rop)
        if arr.ndim == 0:
            raise ArgumentError(f"rank {self.rank}: reduce_scatter splits axis 0, but got a "
                                "0-d array; pass x.reshape(1) or a larger array")
        row = int(np.prod(arr.shape[1:], dtype=np.int64))
        chunks = split_bounds(arr.size, self.size, row)
        lo, hi = chunks[self.rank]
        result = be.empty(hi - lo, dt)
        src = be.flat(be.ascontiguous(arr))
        postscale = postscale_factor / self.size if rop is ReduceOp.AVERAGE else postscale_factor
        if prescale_factor != 1.0:
            src = src.copy()
            be.scale(src, prescale_factor)
        name = self._algorithm("reduce_scatter", algorithm, arr.size * dt.itemsize, be)
        self.transport.begin("reduce_scatter")
        if self.size == 1:
            be.copy_into(result, src)
        else:
            self._plan("reduce_scatter", name, be, dt, rop.reduction, chunks).run(src, result)
        be.scale(result, postscale)
        return result.reshape(((hi - lo) // row if row else 0, *tuple(arr.shape[1:])))

    # -- allgather --------------------------------------------------------------------
    def allgather(self, x: Array, algorithm: str | None = None) -> Array:
        """Concatenate every rank's ``x`` along axis 0.

        Axis 0 may differ between ranks; the other axes and the dtype must agree (a
        disagreement raises :class:`~mpitrain.MismatchError` on every rank).

        Returns:
            A new array of shape ``(sum of every rank's rows,) + x.shape[1:]``.
        """
        be = backend_for(x)
        arr = be.asarray(x)
        dt = check_dtype(arr.dtype, rank=self.rank)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        self.transport.begin("allgather")
        rows = self._gather_rows(arr, dt)
        row = int(np.prod(arr.shape[1:], dtype=np.int64))
        counts = [r * row for r in rows]
        out = be.empty(sum(counts), dt)
        block = be.flat(be.ascontiguous(arr))
        name = self._algorithm("allgather", algorithm, sum(counts) * dt.itemsize, be)
        if self.size == 1:
            be.copy_into(out, block)
        else:
            self._plan("allgather", name, be, dt, None, bounds_from_counts(counts)).run(block, out)
        return out.reshape((sum(rows), *tuple(arr.shape[1:])))

    def _gather_rows(self, arr: Array, dt: np.dtype[Any]) -> list[int]:
        """Every rank's row count, checking that dtype and trailing shape agree."""
        trailing = tuple(int(d) for d in arr.shape[1:])
        mine = np.array([arr.shape[0], dtype_code(dt), hash(trailing) & ((1 << 62) - 1)],
                        dtype=np.int64)
        table = np.empty((self.size, 3), dtype=np.int64)
        self.transport.collective(self.mpi_comm.Allgather, self.mpi_comm.Iallgather, mine, table)
        if np.any(table[:, 1:] != table[0, 1:]):
            details = self.mpi_comm.allgather((str(dt), trailing))
            bad = next(i for i in range(self.size) if details[i] != details[0])
            raise MismatchError(
                f"rank {self.rank}: allgather needs the same dtype and trailing shape on every "
                f"rank, but rank {bad} sent {details[bad][0]}[*, {_dims(details[bad][1])}] and "
                f"rank 0 sent {details[0][0]}[*, {_dims(details[0][1])}]")
        return [int(r) for r in table[:, 0]]

    # -- broadcast --------------------------------------------------------------------
    def broadcast(self, x: Array, root: int = 0, algorithm: str | None = None) -> Array:
        """Return a copy of the root's ``x`` on every rank.

        On other ranks ``x`` only gives the shape and dtype (like Horovod).
        """
        be = backend_for(x)
        arr = be.asarray(x)
        out = be.empty(arr.size, check_dtype(arr.dtype, rank=self.rank)).reshape(arr.shape)
        if self.rank == root:
            be.copy_into(out, arr)
        return self._broadcast_inplace(be, out, root, algorithm)

    def broadcast_(self, x: Array, root: int = 0, algorithm: str | None = None) -> Array:
        """Overwrite ``x`` on every rank with the root's ``x``; returns ``x``."""
        be = backend_for(x)
        arr = be.asarray(x)
        check_dtype(arr.dtype, rank=self.rank)
        self._check_writeable(be, arr, "broadcast_")
        work = be.ascontiguous(arr)
        self._broadcast_inplace(be, work, root, algorithm)
        if work is not arr:
            be.copy_into(arr, work)
        return x

    def _broadcast_inplace(self, be: ArrayBackend, buf: Array, root: int,
                           algorithm: str | None) -> Array:
        self._check_root(root)
        dt = buf.dtype
        name = self._algorithm("broadcast", algorithm, buf.size * dt.itemsize, be)
        self.transport.begin("broadcast")
        if self.size > 1 and buf.size:
            chunks = split_bounds(buf.size, self.size)
            self._plan("broadcast", name, be, dt, None, chunks, root).run(be.flat(buf))
        return buf

    # -- objects and synchronisation --------------------------------------------------
    def barrier(self) -> None:
        """Block until every rank has called :meth:`barrier`."""
        self.transport.begin("barrier")
        self.transport.collective(self.mpi_comm.Barrier, self.mpi_comm.Ibarrier)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return the root's ``obj`` (any picklable object) on every rank."""
        self._check_root(root)
        self.transport.begin("broadcast_object")
        return objects.broadcast_object(self.transport, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's ``obj``, in rank order."""
        self.transport.begin("allgather_object")
        return objects.allgather_object(self.transport, obj)

    def free(self) -> None:
        """Release the communicator's private MPI resources (collective)."""
        self._plans.clear()
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

    def _check_writeable(self, be: ArrayBackend, arr: Array, what: str) -> None:
        if not be.is_writeable(arr):
            raise ArgumentError(f"rank {self.rank}: {what} writes into its buffer, but the "
                                "array is read-only; pass a writeable array or use the "
                                "out-of-place variant")

    def _check_root(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise ArgumentError(f"rank {self.rank}: root={root!r} is not a rank of this "
                                f"communicator of size {self.size}; use 0..{self.size - 1}")

    def _algorithm(self, collective: str, requested: str | None, nbytes: int,
                   be: ArrayBackend) -> str:
        available = algorithms.ALGORITHMS[collective]
        name = (requested or config.ALGORITHM.get()).lower()
        if name == "auto":
            return algorithms.select(collective, nbytes, self.size, be.name, available,
                                     self.topology.node_count)
        if name not in available:
            raise ArgumentError(f"rank {self.rank}: unknown {collective} algorithm "
                                f"{name!r}; use one of auto, {', '.join(available)}")
        return name

    def _plan(self, collective: str, name: str, be: ArrayBackend, dt: np.dtype[Any],
              op: ReduceOp | None, chunks: list[Bounds], root: int = 0) -> Any:
        """The cached plan of ``name`` for this call's shape, built on first use."""
        configured = config.SEGMENT_BYTES.get()
        segment = configured or default_segment_bytes(chunks[-1][1] * dt.itemsize, self.size)
        key = (collective, name, be.name, dt, op, tuple(chunks), root, segment,
               config.INTER_SEGMENT_BYTES.get())
        plan = self._plans.get(key)
        if plan is None:
            request = algorithms.PlanRequest(self.transport, self.topology, be, dt, op,
                                             tuple(chunks), root, segment)
            plan = algorithms.build(collective, name, request)
            self._plans[key] = plan
            if len(self._plans) > _PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

def _dims(shape: tuple[int, ...]) -> str:
    return ", ".join(str(d) for d in shape) if shape else ""
