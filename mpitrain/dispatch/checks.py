"""What a collective call accepts: the one set of argument checks of the blocking and
the async path.

:class:`Checks` turns a call's arguments into a :class:`Call` (the collective, the
array's backend, dtype and shape, the op, the scaling, the requested algorithm, the
root, in place or not); misuse raises there, on the rank that made it, before any data
moves (``ValueError``/``TypeError`` subclasses naming the rank, the value and the fix).
The :class:`~.dispatcher.Dispatcher` checks every blocking call this way and runs the
:class:`Call` (:meth:`~.dispatcher.Dispatcher.execute`); the async engine checks each
submission the same way (once per distinct arguments: a :class:`Call` holds nothing of
the array but its dtype and shape) and, once every rank has submitted it, hands the same
:class:`Call` to the same :meth:`~.dispatcher.Dispatcher.execute`.

What depends on the array object itself (is it writeable, does writing into the
backend's view of it write into it) is checked per call by :meth:`Checks.array`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..backends import ArrayBackend, backend_and_array, backend_for
from ..dtypes import check_dtype, check_op_for_dtype
from ..errors import ArgumentError, UnsupportedError
from ..ops import ReduceOp, parse_op

Array = Any
AlgorithmCheck = Callable[[str, str, ArrayBackend, "np.dtype[Any]"], None]
"""``check(collective, name, backend, dtype)``: raise unless the dispatcher can run the
algorithm ``name`` (lower-cased, not ``"auto"``) for such a call."""


@dataclass(frozen=True)
class Call:
    """A checked collective call: everything but its arrays.

    Attributes:
        collective: ``allreduce``, ``reduce_scatter``, ``allgather`` or ``broadcast``.
        backend: the array library of the input.
        dtype: its element type.
        shape: its shape (an allgather's rows are ``None``: they may differ by rank).
        op: the reduction (``None`` for allgather and broadcast).
        prescale: factor applied to each rank's input before reducing.
        postscale: factor applied to the result (``Average`` adds ``1/size``).
        algorithm: the requested algorithm, lower-cased (``None``: the communicator's
            setting; ``"auto"``: the selection table).
        root: the broadcast's root.
        inplace: the result is written into the input.
    """

    collective: str
    backend: ArrayBackend
    dtype: np.dtype[Any]
    shape: tuple[int | None, ...]
    op: ReduceOp | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    algorithm: str | None = None
    root: int = 0
    inplace: bool = False


class Checks:
    """The argument checks of one communicator's calls.

    Args:
        rank: this rank (named in every message).
        size: the number of ranks.
        check_algorithm: the dispatcher's check of a requested algorithm.
    """

    def __init__(self, rank: int, size: int, check_algorithm: AlgorithmCheck) -> None:
        self.rank, self.size = rank, size
        self._check_algorithm = check_algorithm

    # -- whole calls -------------------------------------------------------------------
    def array(self, x: Any, what: str, inplace: bool) -> tuple[ArrayBackend, Array]:
        """The backend of ``x`` and ``x`` as its array; for an in-place call (``what``
        names it) the array must write through to ``x`` and be writeable."""
        be, arr = backend_and_array(x)
        if inplace:
            if arr is not x and not be.writes_through(arr, x):
                raise ArgumentError(f"rank {self.rank}: {what} needs an array to write into, "
                                    f"got {type(x).__name__}; use the out-of-place variant")
            self.writeable(be, arr, what)
        return be, arr

    def reduction(self, collective: str, be: ArrayBackend, arr: Array, op: Any,
                  prescale: Any = 1.0, postscale: Any = 1.0, algorithm: Any = None,
                  inplace: bool = False) -> Call:
        """The :class:`Call` of an allreduce or reduce-scatter of arrays like ``arr``."""
        rop = op if type(op) is ReduceOp else parse_op(op)
        if collective == "reduce_scatter":
            if rop is ReduceOp.ADASUM:
                raise UnsupportedError(
                    f"rank {self.rank}: op=Adasum is an allreduce only (as in Horovod); use "
                    "allreduce(x, op=Adasum), or reduce_scatter with op=Sum or Average")
            if arr.ndim == 0:
                raise ArgumentError(f"rank {self.rank}: reduce_scatter splits axis 0, but got "
                                    "a 0-d array; pass x.reshape(1) or a larger array")
        dt = self.reducible(arr, rop)
        pre, post = self.factors(prescale, postscale)
        if rop is ReduceOp.ADASUM:
            algo = self.adasum_algorithm(algorithm)
        else:
            algo = self.algorithm(collective, algorithm, be, dt)
        return Call(collective, be, dt, tuple(arr.shape), rop, pre, post, algo,
                    inplace=inplace)

    def allgather(self, be: ArrayBackend, arr: Array, algorithm: Any = None) -> Call:
        """The :class:`Call` of an allgather of blocks like ``arr`` (any rows)."""
        dt = check_dtype(arr.dtype, rank=self.rank)
        algo = self.algorithm("allgather", algorithm, be, dt)
        return Call("allgather", be, dt, (None, *tuple(arr.shape[1:])), algorithm=algo)

    def broadcast(self, be: ArrayBackend, arr: Array, root: Any, algorithm: Any = None,
                  inplace: bool = False) -> Call:
        """The :class:`Call` of a broadcast of arrays like ``arr`` from ``root``."""
        self.root(root)
        dt = check_dtype(arr.dtype, rank=self.rank)
        algo = self.algorithm("broadcast", algorithm, be, dt)
        return Call("broadcast", be, dt, tuple(arr.shape), algorithm=algo, root=int(root),
                    inplace=inplace)

    # -- single arguments --------------------------------------------------------------
    def reducible(self, arr: Array, op: ReduceOp) -> np.dtype[Any]:
        """``arr``'s dtype, if it is supported and ``op`` can reduce it."""
        dt = check_dtype(arr.dtype, rank=self.rank)
        check_op_for_dtype(op, dt)
        if op is ReduceOp.ADASUM:
            self.adasum(arr)
        return dt

    def adasum(self, arr: Array) -> None:
        """Raise unless Adasum can reduce ``arr`` here: a power-of-two number of ranks
        (Horovod's CPU Adasum refuses other counts too), and host memory where there is
        anything to combine (at one rank the result is the input, on any device)."""
        if self.size & (self.size - 1):
            below = 1 << (self.size.bit_length() - 1)
            raise UnsupportedError(
                f"rank {self.rank}: op=Adasum needs a power-of-two number of ranks, but this "
                f"communicator has {self.size}; run on {below} or {2 * below} ranks, or use "
                "op=Average")
        if self.size > 1 and backend_for(arr).is_device:
            raise UnsupportedError(f"rank {self.rank}: op=Adasum reduces host arrays only, got "
                                   f"a device {type(arr).__name__}; copy it to the host first "
                                   "(cupy.asnumpy(x), tensor.cpu())")

    def adasum_algorithm(self, requested: Any) -> str | None:
        """An Adasum allreduce runs its own algorithm: ``algorithm=`` may only be unset
        or ``"auto"``."""
        if requested is not None and (not isinstance(requested, str)
                                      or requested.lower() != "auto"):
            raise ArgumentError(f"rank {self.rank}: op=Adasum runs its own algorithm, not "
                                f"{requested!r}; leave algorithm unset (or 'auto')")
        return None

    def factors(self, prescale: Any, postscale: Any) -> tuple[float, float]:
        """The scaling factors as floats (so that ``1`` and ``1.0`` describe alike)."""
        try:
            return float(prescale), float(postscale)
        except (TypeError, ValueError):
            raise ArgumentError(f"rank {self.rank}: prescale_factor and postscale_factor must "
                                f"be numbers, got {prescale!r} and {postscale!r}") from None

    def algorithm(self, collective: str, algorithm: Any, be: ArrayBackend,
                  dt: np.dtype[Any]) -> str | None:
        """The requested algorithm name, lower-cased and checked (raises if this
        communicator cannot run it); ``None`` if none was requested."""
        if algorithm is None:
            return None
        if not isinstance(algorithm, str):
            raise ArgumentError(f"rank {self.rank}: algorithm must be a name (a string) or "
                                f"None, got {algorithm!r}")
        name = algorithm.lower()
        if name != "auto":
            self._check_algorithm(collective, name, be, dt)
        return name

    def out(self, be: ArrayBackend, out: Array, shape: Sequence[int | None],
            dt: np.dtype[Any], what: str) -> Array:
        """``out`` as ``be``'s array (one that writes through to ``out``: a torch CUDA
        tensor is seen through a CuPy view), if it is a writeable C-contiguous ``dt``
        array of ``shape``."""
        arr = be.asarray(out) if be.owns(out) else None
        if arr is None or tuple(arr.shape) != tuple(shape) or arr.dtype != dt \
                or not (arr is out or be.writes_through(arr, out)):
            raise ArgumentError(
                f"rank {self.rank}: {what} out= must be a {dt}{list(shape)} array, got "
                f"{getattr(out, 'dtype', type(out).__name__)}{list(getattr(out, 'shape', []))}")
        if not be.is_contiguous(arr):
            raise ArgumentError(f"rank {self.rank}: {what} out= must be C-contiguous; pass "
                                "np.empty_like(x) or leave out= unset")
        self.writeable(be, arr, what)
        return arr

    @staticmethod
    def rows(out: Array) -> int:
        """The rows (axis 0) of an allgather's ``out=`` (-1 for a 0-d one)."""
        shape = tuple(getattr(out, "shape", ()))
        return int(shape[0]) if shape else -1

    def writeable(self, be: ArrayBackend, arr: Array, what: str) -> None:
        """Raise if ``what`` would write into a read-only ``arr``."""
        if not be.is_writeable(arr):
            raise ArgumentError(f"rank {self.rank}: {what} writes into its buffer, but the "
                                "array is read-only; pass a writeable array or use the "
                                "out-of-place variant")

    def root(self, root: Any) -> None:
        """Raise if ``root`` is not a rank of this communicator."""
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise ArgumentError(f"rank {self.rank}: root={root!r} is not a rank of this "
                                f"communicator of size {self.size}; use 0..{self.size - 1}")

    def gathered_rows(self, total: int, rows: Sequence[int], trailing: tuple[int, ...]) -> None:
        """Raise if an allgather ``out=`` of ``total`` rows cannot hold ``rows``."""
        if total != sum(rows):
            raise ArgumentError(
                f"rank {self.rank}: allgather out= has {total} rows, but the ranks send "
                f"{sum(rows)} rows in all ({list(rows)}); pass an array of shape "
                f"{(sum(rows), *trailing)}")
