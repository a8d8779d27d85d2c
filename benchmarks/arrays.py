"""Where the benchmark's buffers live: ``--array numpy`` (host) or ``--array cupy`` (GPU).

A :class:`Placement` moves the crafted input to where the collective runs and brings
results back for verification (never timed). With ``--array cupy`` every rank uses
GPU ``local_rank % device count``, the hooks' buffers are CuPy arrays (the hooks' numpy
calls reach CuPy through NumPy's ``__array_function__`` protocol), and:

* the ``mpi`` column is MPI's own collective on the device buffers, reached the way
  this MPI library allows: device pointers when it is CUDA-aware, else whole-buffer
  copies through pinned host memory (mpitrain's ``mpi`` algorithm does exactly that;
  see ``mpitrain/comm/policy.py``);
* each size also times a device-to-device copy of the same number of bytes, the
  bandwidth no collective on one GPU can beat, printed as the last column.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

import mpitrain as mt

ARRAYS = ("numpy", "cupy")


class PlacementError(RuntimeError):
    """The requested buffers cannot be used on this machine."""


class Placement(Protocol):
    """Host or device buffers for the benchmark."""

    name: str
    is_device: bool

    def put(self, host: np.ndarray[Any, Any]) -> Any:
        """``host`` where the collective runs."""

    def get(self, arr: Any) -> np.ndarray[Any, Any]:
        """``arr`` as a host array."""

    def settle(self) -> None:
        """Wait until the device has done the work queued on the buffers so far."""

    def describe(self, comm: mt.Communicator) -> str:
        """One header line: where the buffers are and how they reach MPI."""

    def copy_seconds(self, nbytes: int, iters: int, warmup: int) -> float:
        """This rank's median time of a device-to-device copy of ``nbytes``."""


class HostPlacement:
    """numpy arrays in host memory."""

    name = "numpy"
    is_device = False

    def put(self, host: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The array itself."""
        return host

    def get(self, arr: Any) -> np.ndarray[Any, Any]:
        """The array itself."""
        return np.asarray(arr)

    def settle(self) -> None:
        """Nothing: host work is done when it returns."""

    def describe(self, comm: mt.Communicator) -> str:
        """Host memory."""
        return "numpy (host memory)"

    def copy_seconds(self, nbytes: int, iters: int, warmup: int) -> float:
        """Not measured for host buffers."""
        raise NotImplementedError("copy bandwidth is measured for device buffers only")


class DevicePlacement:
    """CuPy arrays on this rank's GPU.

    Raises:
        PlacementError: CuPy cannot be imported or no CUDA device is usable.
    """

    name = "cupy"
    is_device = True

    def __init__(self, local_rank: int) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise PlacementError(f"--array cupy needs CuPy ({exc}); install the CuPy wheel "
                                 "for your CUDA, e.g. pip install cupy-cuda12x") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDARuntimeError, driver missing or too old
            raise PlacementError(f"--array cupy needs a CUDA device, but CUDA says: {exc}; "
                                 "run on a GPU machine or use --array numpy") from None
        if count == 0:
            raise PlacementError("--array cupy needs a CUDA device and there is none; run on "
                                 "a GPU machine or use --array numpy")
        self.cupy = cupy
        self.device = cupy.cuda.Device(local_rank % count)
        self.device.use()
        self.count = count

    def put(self, host: np.ndarray[Any, Any]) -> Any:
        """A device copy of ``host``."""
        return self.cupy.asarray(host)

    def get(self, arr: Any) -> np.ndarray[Any, Any]:
        """A host copy of ``arr``."""
        return np.asarray(self.cupy.asnumpy(arr))

    def settle(self) -> None:
        """Wait for every stream of this rank's GPU."""
        self.device.synchronize()

    def describe(self, comm: mt.Communicator) -> str:
        """The GPU, CuPy's version and the transfer policy with how it was decided."""
        from mpitrain.backends.cuda_aware import decision

        name = self.cupy.cuda.runtime.getDeviceProperties(self.device.id)["name"]
        if isinstance(name, bytes):
            name = name.decode()
        return (f"cupy {self.cupy.__version__} on {name} (GPU {self.device.id} of "
                f"{self.count} on rank 0's node); policy {comm.cuda_policy} "
                f"({decision(comm.settings.cuda_aware).how}); "
                f"{comm.device_links(self.cupy.empty(1, self.cupy.float32))}")

    def copy_seconds(self, nbytes: int, iters: int, warmup: int) -> float:
        """Median seconds of ``cupy.copyto`` of ``nbytes`` between two device buffers."""
        cupy = self.cupy
        src = cupy.ones(nbytes, dtype=cupy.uint8)
        dst = cupy.empty_like(src)
        stream = cupy.cuda.get_current_stream()
        times = []
        for i in range(warmup + iters):
            stream.synchronize()
            start = time.perf_counter()
            cupy.copyto(dst, src)
            stream.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)


def placement_for(name: str, local_rank: int, world: MPI.Intracomm) -> Placement:
    """The placement ``--array name`` asks for, agreed on by every rank of ``world``.

    Raises:
        PlacementError: on every rank, if any rank cannot use the buffers.
    """
    problem = ""
    placement: Placement = HostPlacement()
    if name == "cupy":
        try:
            placement = DevicePlacement(local_rank)
        except PlacementError as exc:
            problem = str(exc)
    problems = [p for p in world.allgather(problem) if p]
    if problems:
        raise PlacementError(problems[0])
    return placement
