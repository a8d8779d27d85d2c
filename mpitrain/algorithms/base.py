"""What every algorithm is built from: a :class:`PlanRequest`.

An algorithm is a class whose constructor takes a :class:`PlanRequest` and plans
everything (peers, chunk offsets, scratch buffers) and whose ``run()`` only moves and
reduces data. The signatures of ``run()`` per collective:

* allreduce: ``run(src, out)``, flat arrays of ``count`` elements, ``src`` may be ``out``;
* reduce_scatter: ``run(src, out)``, ``out`` holds this rank's chunk;
* allgather: ``run(block, out)``, ``out`` holds every rank's chunk;
* broadcast: ``run(buf)``.

Class attributes that change how the communicator calls ``run()``:

* ``fuses_check = True``: the algorithm validates the call itself (its data rides the
  validation exchange); ``run`` takes the call's
  :class:`~mpitrain.comm.validation.Signature` (or ``None``) after the buffers;
* ``fuses_postscale = True``: ``run`` takes the factor the result is multiplied by
  as its last argument (and applies it itself, where it is cheapest);
* ``takes_pieces = True``: ``src`` and ``out`` may be :class:`~.pieces.Pieces`
  (the arrays of a fusion bucket, not packed into one buffer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends import ArrayBackend
from ..comm.shm import SharedMemory
from ..comm.topology import Topology
from ..comm.transport import PeerTransport
from ..comm.validation import Validator
from ..ops import ReduceOp
from .chunks import Bounds


@dataclass(frozen=True)
class PlanRequest:
    """Everything an algorithm may plan from.

    Attributes:
        transport: point-to-point messages on the private communicator.
        topology: node split of the communicator (for hierarchical algorithms).
        backend: the array library of the buffers.
        dtype: element type.
        op: the elementwise reduction (``Sum`` for ``Average``); ``None`` for
            collectives that do not reduce.
        chunks: element range of each rank's chunk: the ``np.array_split`` blocks of the
            buffer for allreduce and reduce-scatter, each rank's block for allgather.
        root: the root rank (broadcast).
        segment_bytes: pipeline segment size (0: chosen by the algorithm).
        shm: the node's shared memory (``None`` when the ranks span nodes or it is off).
        validator: the header exchange, for algorithms that carry data in it.
    """

    transport: PeerTransport
    topology: Topology
    backend: ArrayBackend
    dtype: np.dtype[Any]
    op: ReduceOp | None
    chunks: tuple[Bounds, ...]
    root: int = 0
    segment_bytes: int = 0
    shm: SharedMemory | None = None
    validator: Validator | None = None

    @property
    def count(self) -> int:
        """Total number of elements of the (full) buffer."""
        return self.chunks[-1][1] if self.chunks else 0

    @property
    def counts(self) -> list[int]:
        """Element count of each rank's chunk."""
        return [hi - lo for lo, hi in self.chunks]

    @property
    def reduction(self) -> ReduceOp:
        """The reduction, for collectives that need one."""
        assert self.op is not None, "this collective does not reduce"
        return self.op
