"""Agreeing across ranks on which named operations every rank has submitted.

Ranks may submit the same named operations in different orders (autograd hooks fire
in no fixed order), so the engine never runs an operation because it was submitted
here: it runs it once every rank has submitted it. Each *cycle* every rank
contributes its *announcements* (name and signature of each request submitted since
its last cycle), its stop flag and its fusion threshold; every rank adds all
announcements to the same ``table`` (name -> rank -> signature, in order of first
announcement), so every rank computes the same ``ready`` list, in the same order,
from the same data.

A cycle is an ``MPI_Iallgather`` of a small header (payload length, stop flag,
fusion threshold),
polled with a growing sleep so that a rank waiting for slower ranks does not burn a
core, followed by an ``MPI_Allgatherv`` of the pickled announcements when any rank has
some.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

Signatures = dict[int, str]


@dataclass
class Agreement:
    """The outcome of one cycle, identical on every rank.

    Attributes:
        ready: ``(name, signature of each rank)`` of every name that all ranks have now
            submitted, in order of first announcement.
        all_stopped: every rank has asked the engine to stop.
        news: some rank announced something this cycle.
        threshold: the smallest fusion threshold of any rank, so that every rank cuts
            the ready requests into the same buckets even if their settings differ.
    """

    ready: list[tuple[str, Signatures]]
    all_stopped: bool
    news: bool
    threshold: int


class Negotiator:
    """Runs the cycles' exchanges on the engine's private communicator.

    Args:
        comm: the engine's communicator (used by the progress thread only).
        max_poll_s: longest sleep between two tests of a pending header exchange.
    """

    def __init__(self, comm: MPI.Intracomm, max_poll_s: float) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.max_poll_s = max_poll_s
        self.table: dict[str, Signatures] = {}
        self._header = np.zeros(3, np.int64)
        self._headers = np.zeros((self.size, 3), np.int64)

    def exchange(self, announcements: list[tuple[str, str]], stopping: bool,
                 threshold: int) -> Agreement:
        """One cycle: share ``announcements``, stop flag and threshold; return what is ready."""
        payload = pickle.dumps(announcements, pickle.HIGHEST_PROTOCOL) if announcements else b""
        self._header[:] = (len(payload), int(stopping), threshold)
        self._poll(self.comm.Iallgather(self._header, self._headers))
        lengths = [int(n) for n in self._headers[:, 0]]
        news = any(lengths)
        if news:
            self._receive(payload, lengths)
        ready = [(name, sigs) for name, sigs in self.table.items() if len(sigs) == self.size]
        for name, _ in ready:
            del self.table[name]
        return Agreement(ready, bool(self._headers[:, 1].all()), news,
                         int(self._headers[:, 2].min()))

    def waiting_for(self, name: str) -> list[int]:
        """Ranks that have not yet announced ``name``."""
        have = self.table.get(name, {})
        return [r for r in range(self.size) if r not in have]

    def _receive(self, payload: bytes, lengths: list[int]) -> None:
        displs = [sum(lengths[:r]) for r in range(self.size)]
        recv = bytearray(sum(lengths))
        self.comm.Allgatherv([payload, MPI.BYTE], [recv, (lengths, displs), MPI.BYTE])
        view = memoryview(recv)
        for rank, (start, length) in enumerate(zip(displs, lengths)):
            if length:
                for name, signature in pickle.loads(view[start:start + length]):
                    self.table.setdefault(name, {})[rank] = signature

    def _poll(self, request: MPI.Request) -> None:
        """Wait for ``request``: yield at once, then sleep 20 us doubling to ``max_poll_s``."""
        delay = 0.0
        while not request.Test():
            time.sleep(delay)
            delay = min(max(2.0 * delay, 20e-6), self.max_poll_s)
