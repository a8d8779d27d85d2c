"""Agreeing across ranks on which named operations every rank has submitted.

Ranks may submit the same named operations in different orders (autograd hooks fire
in no fixed order), so the engine never runs an operation because it was submitted
here: it runs it once every rank has submitted it. Each *cycle* every rank
contributes its *announcements* (name and signature of each request submitted since
its last cycle), its stop flag and its fusion threshold; every rank adds all
announcements to the same ``table`` (name -> rank -> signature, in order of first
announcement), so every rank computes the same ``ready`` list, in the same order,
from the same data. In the common case, where every rank announced the same
requests in the same order and nothing older is waiting, the payloads are equal
byte for byte and are not even decoded.

Like Horovod's response cache, a (name, signature) pair that has run once gets a
number, the same on every rank because numbers are handed out in ``ready`` order;
later announcements of the pair send the number instead of the two strings. A cycle
is one ``MPI_Iallgather`` of a fixed-size *slot* per rank (payload length, stop flag,
threshold, and the payload itself when it fits), polled with a growing sleep so that
a rank waiting for slower ranks does not burn a core (after a first 100 us of tests,
enough for ranks that are in step, and unless the caller is blocked waiting anyway);
only a payload too large for the slot costs a second exchange (``MPI_Allgatherv``).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Union

import numpy as np
from mpi4py import MPI

from .request import Waiters

Signatures = dict[int, str]
Announcement = Union[int, tuple[str, str]]  # a cached pair's number, or (name, signature)

SLOT_BYTES = 4096
_FIELDS = 3  # payload length, stop flag, threshold: int64s at the start of a slot
_INLINE = SLOT_BYTES - 8 * _FIELDS
CACHE_LIMIT = 1 << 16
SPIN_S = 100e-6


@dataclass
class Agreement:
    """The outcome of one cycle, identical on every rank.

    Attributes:
        ready: the names that all ranks have now submitted, in order of first
            announcement.
        mismatched: those of them whose signatures differ, with each rank's.
        all_stopped: every rank has asked the engine to stop.
        news: some rank announced something this cycle.
        same: ``ready`` is exactly this rank's announcements, in order (every rank
            announced the same, and nothing older was waiting).
        threshold: the smallest fusion threshold of any rank, so that every rank cuts
            the ready requests into the same buckets even if their settings differ.
    """

    ready: list[str]
    mismatched: dict[str, Signatures]
    all_stopped: bool
    news: bool
    threshold: int
    same: bool = False


class Negotiator:
    """Runs the cycles' exchanges on the engine's private communicator.

    Args:
        comm: the engine's communicator (used by the progress thread only).
        max_poll_s: longest sleep between two tests of a pending exchange.
        waiters: how many callers are blocked on the engine's handles.
    """

    def __init__(self, comm: MPI.Intracomm, max_poll_s: float, waiters: Waiters) -> None:
        self.comm = comm
        self.waiters = waiters
        self.size = comm.Get_size()
        self.max_poll_s = max_poll_s
        self.table: dict[str, Signatures] = {}
        self.known: list[tuple[str, str]] = []  # number -> (name, signature)
        self.numbers: dict[tuple[str, str], int] = {}
        self._slot = np.zeros(SLOT_BYTES, np.uint8)
        self._slots = np.zeros((self.size, SLOT_BYTES), np.uint8)

    def exchange(self, pairs: list[tuple[str, str]], stopping: bool,
                 threshold: int) -> Agreement:
        """One cycle: share ``(name, signature)`` pairs, stop flag and threshold."""
        numbers = self.numbers
        announcements: list[Announcement] | list[tuple[str, str]] = \
            [numbers.get(pair, pair) for pair in pairs] if numbers else pairs
        payload = pickle.dumps(announcements, pickle.HIGHEST_PROTOCOL) if pairs else b""
        self._slot[:8 * _FIELDS].view(np.int64)[:] = (len(payload), int(stopping), threshold)
        if len(payload) <= _INLINE:
            self._slot[8 * _FIELDS:8 * _FIELDS + len(payload)] = np.frombuffer(payload, np.uint8)
        self._poll(self.comm.Iallgather(self._slot, self._slots))
        fields = self._slots[:, :8 * _FIELDS].copy().view(np.int64)
        lengths = [int(n) for n in fields[:, 0]]
        agreement = Agreement([], {}, bool(fields[:, 1].all()), any(lengths),
                              int(fields[:, 2].min()))
        if agreement.news:
            payloads = self._payloads(payload, lengths)
            if not self.table and all(p == payloads[0] for p in payloads):
                # Every rank announced the same requests in the same order, and nothing
                # older is waiting: all of them are ready, in this rank's order.
                agreement.ready = [name for name, _ in pairs]
                agreement.same = True
                for pair in pairs:
                    if pair not in numbers:  # a pair is numbered once
                        self.remember(*pair)
            else:
                for rank, data in enumerate(payloads):
                    self._record(rank, data)
                self._collect(agreement)
        return agreement

    def _collect(self, agreement: Agreement) -> None:
        """Move the names every rank has announced from the table to ``agreement``."""
        for name, sigs in list(self.table.items()):
            if len(sigs) == self.size:
                del self.table[name]
                agreement.ready.append(name)
                first = sigs[0]
                if any(sig != first for sig in sigs.values()):
                    agreement.mismatched[name] = sigs
                elif (name, first) not in self.numbers:
                    self.remember(name, first)

    def remember(self, name: str, signature: str) -> None:
        """Number a pair that every rank agreed on (call in ``ready`` order everywhere).

        Automatic names (``<kind>.noname.<n>``) never repeat, so they are not numbered.
        """
        if ".noname." in name:
            return
        if len(self.known) >= CACHE_LIMIT:  # every rank reaches the limit in the same cycle
            self.known.clear()
            self.numbers.clear()
        self.numbers[(name, signature)] = len(self.known)
        self.known.append((name, signature))

    def waiting_for(self, name: str) -> list[int]:
        """Ranks that have not yet announced ``name``."""
        have = self.table.get(name, {})
        return [r for r in range(self.size) if r not in have]

    def _payloads(self, payload: bytes, lengths: list[int]) -> list[memoryview]:
        """Every rank's payload: from the slots, or from a second exchange if any is long."""
        if max(lengths) <= _INLINE:
            start = 8 * _FIELDS
            return [self._slots[r, start:start + n].data for r, n in enumerate(lengths)]
        displs = [sum(lengths[:r]) for r in range(self.size)]
        recv = bytearray(sum(lengths))
        self.comm.Allgatherv([payload, MPI.BYTE], [recv, (lengths, displs), MPI.BYTE])
        view = memoryview(recv)
        return [view[d:d + n] for d, n in zip(displs, lengths)]

    def _record(self, rank: int, data: memoryview) -> None:
        if not len(data):
            return
        table, known = self.table, self.known
        for item in pickle.loads(data):
            name, signature = known[item] if isinstance(item, int) else item
            sigs = table.get(name)
            if sigs is None:
                sigs = table[name] = {}
            sigs[rank] = signature

    def _poll(self, request: MPI.Request) -> None:
        """Wait for ``request``: test it for up to ``SPIN_S`` (ranks that are in step
        meet within that); then, while a caller is blocked in ``wait()`` (so this
        process has nothing else to run), wait inside MPI like a blocking call does;
        otherwise sleep between tests, 20 us doubling to ``max_poll_s``."""
        spin_until = time.perf_counter() + SPIN_S
        while not request.Test():
            if time.perf_counter() > spin_until:
                break
            time.sleep(0)  # lets the caller's threads run
        else:
            return
        delay = 20e-6
        while not request.Test():
            if self.waiters.blocked:
                request.Wait()
                return
            time.sleep(delay)
            delay = min(2.0 * delay, self.max_poll_s)
