"""A flat buffer made of separate 1-D arrays laid end to end (a gather/scatter list).

Tensor fusion reduces many small arrays as one flat buffer. Packing them into one new
array first costs a full copy, and an in-place operation a second one to copy the
result back. An algorithm whose class sets ``takes_pieces = True`` accepts
:class:`Pieces` as its input and output instead, and copies each element range
straight between the pieces and its own buffers: the shared-memory allreduce, whose
every step is such a copy anyway (:mod:`.shared_memory`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any

import numpy as np
from mpi4py import MPI

from ..backends import ArrayBackend

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    byte_bounds = np.byte_bounds  # type: ignore[attr-defined]

Array = Any


class Pieces:
    """``arrays`` as one flat buffer of ``size`` elements, the first array's first.

    Args:
        backend: the arrays' library.
        arrays: 1-D arrays of one dtype, contiguous or strided (writing the buffer
            writes them: pass the caller's arrays, or views of them).
    """

    def __init__(self, backend: ArrayBackend, arrays: list[Array]) -> None:
        self.backend, self.arrays = backend, arrays
        starts = [0]
        for a in arrays:
            starts.append(starts[-1] + a.size)
        self.starts = starts
        self.size: int = starts[-1]
        self._overlapping: bool | None = None

    def parts(self, lo: int, hi: int) -> list[Array]:
        """Views of the pieces that hold elements ``lo .. hi`` of the buffer, in order
        (whole pieces as they are: only the first and the last may be sliced)."""
        if lo >= hi:
            return []
        starts, arrays = self.starts, self.arrays
        first = bisect_right(starts, lo) - 1  # the piece that holds element lo
        last = bisect_left(starts, hi) - 1  # the piece that holds element hi - 1
        if first == last:
            start = starts[first]
            return [arrays[first][lo - start:hi - start]]
        head = arrays[first] if lo == starts[first] else arrays[first][lo - starts[first]:]
        tail = arrays[last] if hi == starts[last + 1] else arrays[last][:hi - starts[last]]
        return [head, *arrays[first + 1:last], tail]

    def overlapping(self) -> bool:
        """True if two pieces may share memory: their byte ranges intersect (host
        arrays; computed once). Writing such pieces can change what is read later."""
        if self._overlapping is None:
            end, self._overlapping = -1, False
            for lo, hi in sorted(_byte_range(a) for a in self.arrays if a.size):
                if lo < end:
                    self._overlapping = True
                    break
                end = max(end, hi)
        return self._overlapping

    def read(self, lo: int, hi: int, dst: Array) -> None:
        """``dst[:] = buffer[lo:hi]`` (``dst`` contiguous, ``hi - lo`` elements)."""
        self.backend.pack_into(dst, self.parts(lo, hi))

    def write(self, lo: int, hi: int, src: Array) -> None:
        """``buffer[lo:hi] = src``."""
        self.backend.unpack_from(src, self.parts(lo, hi))


def read_range(backend: ArrayBackend, src: Array | Pieces, lo: int, hi: int,
               dst: Array) -> None:
    """``dst[:] = src[lo:hi]`` for a flat array or :class:`Pieces`."""
    if isinstance(src, Pieces):
        src.read(lo, hi, dst)
    else:
        backend.copy_into(dst, src[lo:hi])


def write_range(backend: ArrayBackend, out: Array | Pieces, lo: int, hi: int,
                src: Array) -> None:
    """``out[lo:hi] = src`` for a flat array or :class:`Pieces`."""
    if isinstance(out, Pieces):
        out.write(lo, hi, src)
    else:
        backend.copy_into(out[lo:hi], src)


def _byte_range(a: Array) -> tuple[int, int]:
    """The addresses of ``a``'s first byte and one past its last (host arrays)."""
    try:
        start = MPI.Get_address(a)  # a contiguous array: one C call
    except (BufferError, ValueError, TypeError):
        low, high = byte_bounds(a)
        return int(low), int(high)
    return start, start + a.nbytes
