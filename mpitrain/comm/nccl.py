"""NCCL for one communicator: made on first use, its unique id broadcast over MPI.

NCCL is reached through ``cupy.cuda.nccl`` (:func:`module`, where tests put a fake).
An :class:`NcclLink` makes one NCCL communicator of the same ranks as its mpitrain
communicator at its first call: rank 0 asks NCCL for a unique id and broadcasts it on
the private MPI communicator, then every rank joins (with its device current), as
CuPy's own ``init_process_group(use_mpi=True)`` does. Every call runs on the caller's
stream and returns at once: NCCL orders its work on that stream.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from ..errors import CommunicationError, MpitrainError
from ..ops import ReduceOp
from . import objects
from .transport import Transport

REDUCTIONS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.PRODUCT: "NCCL_PROD",
              ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX"}
"""Our reductions as NCCL's (``Average`` runs as a sum, then a scaling)."""
DTYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
          "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
          "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32",
          "float64": "NCCL_FLOAT64"}
"""The dtypes NCCL reduces, by name."""
BFLOAT16_SINCE = 21000
"""The first NCCL version with ``ncclBfloat16`` (2.10). CuPy defines ``NCCL_BFLOAT16``
whichever NCCL it loads; an older one refuses the type (``NCCL_ERROR_INVALID_ARGUMENT``)."""


def module() -> Any:
    """``cupy.cuda.nccl``, or None where it cannot be imported (no CuPy, no NCCL)."""
    try:
        from cupy.cuda import nccl
    except Exception:  # ImportError, or CuPy failing to load its CUDA libraries
        return None
    return nccl if getattr(nccl, "available", True) else None


@functools.cache
def nccl_version() -> int | None:
    """NCCL's version number, or None where NCCL cannot be used in this process."""
    nccl = module()
    if nccl is None:
        return None
    try:
        return int(nccl.get_version())
    except Exception:
        return None


def reduces(dtype: np.dtype[Any], op: ReduceOp) -> bool:
    """True if NCCL reduces ``dtype`` with ``op`` itself (bfloat16: from NCCL 2.10)."""
    nccl = module()
    name = DTYPES.get(np.dtype(dtype).name)
    if nccl is None or op not in REDUCTIONS or name is None or not hasattr(nccl, name):
        return False
    return name != "NCCL_BFLOAT16" or (nccl_version() or 0) >= BFLOAT16_SINCE


def pointer(arr: Any) -> int:
    """The device address of a flat contiguous array (CuPy's, or the fake device's: a
    numpy array, whose ``data`` buffer cannot be made for bfloat16, so never asked)."""
    if isinstance(arr, np.ndarray):
        return int(arr.ctypes.data)
    return int(arr.data.ptr)


def stream_handle(stream: Any) -> Any:
    """What NCCL takes as a stream: CuPy's ``ptr`` (the fake device's stream itself)."""
    return getattr(stream, "ptr", stream)


class NcclLink:
    """One NCCL communicator over the ranks of a transport, on one device.

    Args:
        transport: the mpitrain communicator's private transport (the unique id's
            broadcast runs on it).
        device: this rank's device (current when the NCCL communicator is made).
    """

    def __init__(self, transport: Transport, device: Any) -> None:
        self.transport, self.device = transport, device
        self.nccl = module()
        self._comm: Any = None

    def communicator(self) -> Any:
        """The NCCL communicator (collective the first time: every rank calls it at the
        same call)."""
        if self._comm is None:
            nccl, t = self.nccl, self.transport
            if nccl is None:
                raise MpitrainError(f"rank {t.rank}: the nccl algorithm needs cupy.cuda.nccl "
                                    "(CuPy with NCCL); use algorithm='auto'")
            uid = nccl.get_unique_id() if t.rank == 0 else None
            uid = objects.broadcast_object(t, uid, 0)
            try:
                self._comm = nccl.NcclCommunicator(t.size, uid, t.rank)
            except Exception as exc:  # NcclError, or CUDA's, from any rank's failure
                identity = getattr(self.device, "identity", "?")
                raise CommunicationError(
                    f"rank {t.rank}: NCCL could not make a communicator of {t.size} ranks "
                    f"(this rank on device {identity}, NCCL_HOSTID "
                    f"{os.environ.get('NCCL_HOSTID', 'unset')}): {exc}") from exc
        return self._comm

    def dtype(self, dtype: np.dtype[Any]) -> int:
        """NCCL's number for ``dtype`` (one :func:`reduces` accepts)."""
        return int(getattr(self.nccl, DTYPES[np.dtype(dtype).name]))

    def op(self, op: ReduceOp) -> int:
        """NCCL's number for ``op``."""
        return int(getattr(self.nccl, REDUCTIONS[op]))

    def free(self) -> None:
        """Destroy the NCCL communicator (local)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
