"""Collectives of picklable Python objects, as two native collectives each.

A length, then the pickled bytes, both through :meth:`.Transport.collective` so that
object collectives wait (and stall, and raise) like every other collective. A rank
that cannot pickle its object sends the length -1, so that every rank raises instead
of waiting for bytes that never come.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..errors import CommunicationError
from .transport import Transport

_FAILED = -1


def _pickle(obj: Any) -> tuple[np.ndarray[Any, Any] | None, BaseException | None]:
    try:
        return np.frombuffer(pickle.dumps(obj), np.uint8), None
    except Exception as exc:  # pickle raises many kinds (TypeError, PicklingError, ...)
        return None, exc


def broadcast_object(t: Transport, obj: Any, root: int) -> Any:
    """Return the root's ``obj`` on every rank (the root gets ``obj`` itself)."""
    data, error = _pickle(obj) if t.rank == root else (None, None)
    length = np.array([_FAILED if error else 0 if data is None else data.size], np.int64)
    t.bcast(length, root)
    if error is not None:
        raise error
    if length[0] == _FAILED:
        raise CommunicationError(f"rank {t.rank}: broadcast_object failed: the root, rank "
                                 f"{root}, could not pickle its object (it raised the error)")
    if data is None:
        data = np.empty(int(length[0]), np.uint8)
        t.bcast(data, root)
        return pickle.loads(data.tobytes())
    t.bcast(data.copy(), root)
    return obj


def allgather_object(t: Transport, obj: Any) -> list[Any]:
    """Return every rank's ``obj``, in rank order."""
    mine, error = _pickle(obj)
    lengths = np.empty(t.size, np.int64)
    size = np.array([_FAILED if mine is None else mine.size], np.int64)
    t.allgather(size, lengths)
    if error is not None:
        raise error
    failed = [r for r in range(t.size) if lengths[r] == _FAILED]
    if failed:
        raise CommunicationError(f"rank {t.rank}: allgather_object failed: rank(s) "
                                 f"{', '.join(map(str, failed))} could not pickle their object")
    assert mine is not None
    displs = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    data = np.empty(int(lengths.sum()), np.uint8)
    t.allgatherv(mine, data, lengths.tolist(), displs.tolist())
    return [pickle.loads(data[lo:lo + n].tobytes()) for lo, n in zip(displs, lengths)]
