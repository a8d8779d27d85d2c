"""The contract of every algorithm: built from a :class:`PlanRequest`, run as a :class:`Plan`.

An algorithm is a class whose constructor takes a :class:`PlanRequest` and plans
everything (peers, chunk offsets, scratch buffers) and whose ``run(src, out, sig,
postscale)`` only moves and reduces data. What ``src`` and ``out`` are per collective:

* allreduce: flat arrays of ``count`` elements; ``src`` may be ``out``;
* reduce_scatter: ``src`` the flat input, ``out`` this rank's chunk;
* allgather: ``src`` this rank's block, ``out`` every rank's chunk;
* broadcast: the same buffer twice (the root's data on the root, overwritten elsewhere).

The capabilities a :class:`Plan` declares (class attributes, all ``False`` unless an
algorithm says otherwise) tell the dispatcher how to call ``run``:

* ``fuses_check``: the algorithm validates the call itself (its data rides the
  validation exchange) with ``sig``; otherwise the dispatcher validates first and
  passes ``sig=None``;
* ``fuses_postscale``: the algorithm multiplies the result by ``postscale`` itself,
  where it is cheapest; otherwise the dispatcher scales ``out`` after ``run``;
* ``takes_pieces``: ``src`` and ``out`` may be :class:`~.pieces.Pieces` (the arrays
  of a fusion bucket, not packed into one buffer);
* ``point_to_point``: every byte moves through the transport's isend/irecv, so a
  device transport can stand in for the host one;
* ``needs_shared_memory``: it runs only when every rank is on one node (it uses the
  node's shared-memory window);
* ``host_only``: it runs on host (numpy) buffers only;
* ``device_only``: it runs on device buffers only, device to device (``ipc``,
  ``nccl``): offered where the communicator's device layout allows its ``link``
  (:class:`~mpitrain.comm.links.Layout`), never through a transfer policy;
* ``needs_single_copy``: it also reads other ranks' memory directly
  (:attr:`~mpitrain.comm.shm.SharedMemory.single_copy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

import numpy as np

from ..backends import ArrayBackend
from ..comm.links import DeviceLinks
from ..comm.shm import SharedMemory
from ..comm.topology import Topology
from ..comm.transport import PeerTransport
from ..comm.validation import Signature, Validator
from ..ops import ReduceOp
from .chunks import Bounds

Chooser = Callable[[str, int, int, str, tuple[str, ...]], str]
"""``choose(collective, nbytes, ranks, buffer, available)``: the algorithm, among the
``available`` names, for a call of ``nbytes`` over ``ranks`` ranks on ``buffer``
(``"numpy"``, ``"cupy"``) buffers."""


def first_available(collective: str, nbytes: int, ranks: int, buffer: str,
                    available: tuple[str, ...]) -> str:
    """The :data:`Chooser` of a request made without one: the first available name."""
    return available[0]


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
        choose: picks the algorithm of a sub-collective (the phases of a hierarchical
            algorithm); the dispatcher passes its selection table.
        inter_segment_bytes: largest message of the inter-node phases of hierarchical
            algorithms (``MPITRAIN_INTER_SEGMENT_BYTES``; 0: as ``segment_bytes``).
        cross_ranks: how many ranks of each node exchange across nodes in a
            hierarchical allreduce (``MPITRAIN_CROSS_RANKS``; 0: every local rank).
        links: the communicator's device-to-device links (device-only algorithms).
        fallback: builds the plan that runs this call where a device-only algorithm's
            link cannot carry it: what ``auto`` would choose without the device links,
            through the communicator's transfer policy.
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
    choose: Chooser = first_available
    inter_segment_bytes: int = 60 << 10
    cross_ranks: int = 1
    links: DeviceLinks | None = None
    fallback: Callable[[], Plan] | None = None

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


class Plan(Protocol):
    """A collective planned for one shape (see the module documentation).

    Algorithms subclass it to inherit the capability defaults.
    """

    fuses_check: ClassVar[bool] = False
    fuses_postscale: ClassVar[bool] = False
    takes_pieces: ClassVar[bool] = False
    point_to_point: ClassVar[bool] = False
    needs_shared_memory: ClassVar[bool] = False
    host_only: ClassVar[bool] = False
    device_only: ClassVar[bool] = False
    link: ClassVar[str] = ""
    needs_single_copy: ClassVar[bool] = False

    def __init__(self, req: PlanRequest) -> None:
        """Plan everything the calls of ``req``'s shape need."""

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """Move and reduce the data of one call (``sig`` and ``postscale`` as declared)."""
