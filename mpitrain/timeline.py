"""Timeline: a Chrome-trace file of the async engine's work (chrome://tracing, Perfetto).

Each named operation gets a row (a trace "thread") showing its phases: ``QUEUE``
(submitted until every rank has submitted it), ``PACK`` (copy into the fusion
buffer), the collective with its algorithm (e.g. ``ALLREDUCE(ring)``) and ``UNPACK``
(results handed out, copied back for in-place ones). On one node the shared-memory
allreduce copies straight between the arrays and shared memory: PACK and UNPACK are
then nearly empty and the collective's span holds the copies.
Operations fused together show the same PACK/collective/UNPACK spans, with the
bucket's id, tensor count and bytes in the event's ``args``. Each communicator's
engine is one trace "process".

The file is written by rank 0 of ``MPI.COMM_WORLD`` only. It is a JSON array that is
valid at every moment: it always ends in ``]``, and each flush overwrites that
closing bracket with the new events followed by a new one in a single ``pwrite``, so
a job killed at any point (even by SIGKILL) leaves a file that ``json.load`` reads.

Start it with ``MPITRAIN_TIMELINE=path.json`` or :func:`start_timeline`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from mpi4py import MPI

from . import config

_TAIL = b"\n]\n"


class Timeline:
    """An open trace file that events are appended to.

    Args:
        path: file to create (truncated if it exists).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        self._rows: dict[tuple[int, str], int] = {}
        self._lanes: set[int] = set()
        self._events: list[dict[str, Any]] = []
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        head = b"[" + json.dumps({"name": "mpitrain", "ph": "M", "pid": 0, "tid": 0,
                                  "args": {"origin": "perf_counter"}}).encode()
        os.write(self._fd, head + _TAIL)
        self._end = len(head)

    def span(self, lane: int, lane_name: str, row: str, phase: str, start: float, end: float,
             args: dict[str, Any] | None = None) -> None:
        """Record ``phase`` of ``row`` from ``start`` to ``end`` (``perf_counter`` values)."""
        with self._lock:
            tid = self._row(lane, lane_name, row)
            event: dict[str, Any] = {"name": phase, "ph": "X", "pid": lane, "tid": tid,
                                     "ts": self._us(start), "dur": self._us(end) - self._us(start)}
            if args:
                event["args"] = args
            self._events.append(event)

    def flush(self) -> None:
        """Append the recorded events to the file, keeping it valid JSON."""
        with self._lock:
            if not self._events or self._fd < 0:
                return
            body = b"".join(b",\n" + json.dumps(e, separators=(",", ":")).encode()
                            for e in self._events)
            self._events.clear()
            os.pwrite(self._fd, body + _TAIL, self._end)
            self._end += len(body)

    def close(self) -> None:
        """Flush and close the file."""
        self.flush()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _row(self, lane: int, lane_name: str, row: str) -> int:
        if lane not in self._lanes:
            self._lanes.add(lane)
            self._events.append({"name": "process_name", "ph": "M", "pid": lane, "tid": 0,
                                 "args": {"name": lane_name}})
        key = (lane, row)
        tid = self._rows.get(key)
        if tid is None:
            tid = self._rows[key] = len(self._rows) + 1
            self._events.append({"name": "thread_name", "ph": "M", "pid": lane, "tid": tid,
                                 "args": {"name": row}})
            self._events.append({"name": "thread_sort_index", "ph": "M", "pid": lane,
                                 "tid": tid, "args": {"sort_index": tid}})
        return tid

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 3)


_active: Timeline | None = None
_env_read = False
_lock = threading.RLock()


def start_timeline(path: str) -> None:
    """Write the engine's timeline to ``path`` from now on (replacing any open one).

    Call it on every rank; only rank 0 of ``MPI.COMM_WORLD`` writes.
    """
    global _active
    with _lock:
        stop_timeline()
        if MPI.COMM_WORLD.Get_rank() == 0:
            _active = Timeline(path)


def stop_timeline() -> None:
    """Flush and close the timeline, if one is open."""
    global _active, _env_read
    with _lock:
        _env_read = True
        if _active is not None:
            _active.close()
            _active = None


def current() -> Timeline | None:
    """The open timeline, opening ``MPITRAIN_TIMELINE`` on first use; ``None`` if off."""
    global _env_read
    if not _env_read:
        with _lock:
            if not _env_read:
                path = config.TIMELINE.get()
                if path:
                    start_timeline(path)
                _env_read = True
    return _active


__all__ = ["Timeline", "current", "start_timeline", "stop_timeline"]
