"""Collectives of picklable Python objects, as two native collectives each.

A length, then the pickled bytes, both through :meth:`.Transport.collective` so that
object collectives wait (and stall, and raise) like every other collective.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from .transport import Transport


def broadcast_object(t: Transport, obj: Any, root: int) -> Any:
    """Return the root's ``obj`` on every rank (the root gets ``obj`` itself)."""
    comm = t.comm
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if t.rank == root else None
    length = np.array([0 if data is None else data.size], np.int64)
    t.collective(comm.Bcast, comm.Ibcast, length, root)
    if data is None:
        data = np.empty(int(length[0]), np.uint8)
        t.collective(comm.Bcast, comm.Ibcast, data, root)
        return pickle.loads(data.tobytes())
    t.collective(comm.Bcast, comm.Ibcast, data.copy(), root)
    return obj


def allgather_object(t: Transport, obj: Any) -> list[Any]:
    """Return every rank's ``obj``, in rank order."""
    comm = t.comm
    mine = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = np.empty(t.size, np.int64)
    t.collective(comm.Allgather, comm.Iallgather, np.array([mine.size], np.int64), lengths)
    displs = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    data = np.empty(int(lengths.sum()), np.uint8)
    t.collective(comm.Allgatherv, comm.Iallgatherv, mine,
                 [data, (lengths.tolist(), displs.tolist())])
    return [pickle.loads(data[lo:lo + n].tobytes()) for lo, n in zip(displs, lengths)]
