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
is one exchange of a fixed-size *slot* per rank (payload length, stop flag,
threshold, and the payload itself when it fits): through the communicator's
shared-memory slots (64 KiB) when all ranks are on one node, else one
``MPI_Iallgather`` of 4 KiB slots. While a caller is blocked in ``wait()`` the
exchange waits like a blocking call; otherwise it is polled with a growing sleep
(after a first 100 us of tests, enough for ranks that are in step), so that a rank
waiting for slower ranks does not take a core from the caller's computation. Only a
payload too large for the slot costs a second exchange (``MPI_Allgatherv``).
"""

from __future__ import annotations

import pickle
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Union

import numpy as np
from mpi4py import MPI

from ..comm.shm import SharedMemory, yield_cpu
from .request import Waiters

Signatures = dict[int, str]
Announcement = Union[int, tuple[str, str]]  # a cached pair's number, or (name, signature)

SLOT_BYTES = 4096
_FIELDS = 3  # payload length, stop flag, threshold: int64s at the start of a slot
_HEAD = struct.Struct(f"={_FIELDS}q")
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
        shm: the shared memory of that communicator when all its ranks are on one node
            (its slots then carry the cycles instead of ``MPI_Iallgather``: no MPI
            progress loop, whose idle yield costs tens of microseconds per exchange).
    """

    def __init__(self, comm: MPI.Intracomm, max_poll_s: float, waiters: Waiters,
                 shm: SharedMemory | None = None) -> None:
        self.comm = comm
        self.waiters = waiters
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.max_poll_s = max_poll_s
        self.table: dict[str, Signatures] = {}
        self.known: list[tuple[str, str]] = []  # number -> (name, signature)
        self.numbers: dict[tuple[str, str], int] = {}
        self.shm = shm if shm is not None and shm.slot_bytes >= SLOT_BYTES else None
        slot_bytes = self.shm.slot_bytes if self.shm is not None else SLOT_BYTES
        self._inline = slot_bytes - 8 * _FIELDS
        self._slot = np.zeros(SLOT_BYTES, np.uint8)
        self._slots = np.zeros((self.size, SLOT_BYTES), np.uint8)

    def exchange(self, pairs: list[tuple[str, str]], given: list[bool], stopping: bool,
                 threshold: int) -> Agreement:
        """One cycle: share ``(name, signature)`` pairs, stop flag and threshold.

        ``given[i]`` is False when the name of ``pairs[i]`` was generated (it never
        repeats, so it is not numbered).
        """
        numbers = self.numbers
        announcements: list[Announcement] | list[tuple[str, str]] = \
            [numbers.get(pair, pair) for pair in pairs] if numbers else pairs
        payload = pickle.dumps(announcements, pickle.HIGHEST_PROTOCOL) if pairs else b""
        shm = self.shm
        if shm is not None:
            parity = shm.next_parity
            slot = shm.slot(parity, self.rank)
        else:
            slot = self._slot
        slot[:8 * _FIELDS].view(np.int64)[:] = (len(payload), int(stopping), threshold)
        if len(payload) <= self._inline:
            slot[8 * _FIELDS:8 * _FIELDS + len(payload)] = np.frombuffer(payload, np.uint8)
        if shm is not None:
            target = shm.arrive()
            flags = shm.flags
            self._wait(lambda: min(flags) >= target, lambda: self._block_shm(target))
            slots = shm.slots[parity]  # read before this thread's next two barriers
        else:
            request = self.comm.Iallgather(self._slot, self._slots)
            self._wait(request.Test, request.Wait)
            slots = self._slots
        heads = [_HEAD.unpack_from(slots[r].data) for r in range(self.size)]
        lengths = [h[0] for h in heads]
        agreement = Agreement([], {}, all(h[1] for h in heads), any(lengths),
                              min(h[2] for h in heads))
        if agreement.news:
            payloads = self._payloads(slots, payload, lengths)
            if not self.table and self._all_equal(payloads):
                # Every rank announced the same requests in the same order, and nothing
                # older is waiting: all of them are ready, in this rank's order.
                agreement.ready = [name for name, _ in pairs]
                agreement.same = True
                for pair, named in zip(pairs, given):
                    if named and pair not in numbers:  # a pair is numbered once
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

    def _payloads(self, slots: np.ndarray[Any, Any], payload: bytes,
                  lengths: list[int]) -> list[memoryview]:
        """Every rank's payload: from the slots, or from a second exchange if any is long."""
        if max(lengths) <= self._inline:
            start = 8 * _FIELDS
            return [slots[r, start:start + n].data for r, n in enumerate(lengths)]
        displs = [sum(lengths[:r]) for r in range(self.size)]
        recv = bytearray(sum(lengths))
        self.comm.Allgatherv([payload, MPI.BYTE], [recv, (lengths, displs), MPI.BYTE])
        view = memoryview(recv)
        return [view[d:d + n] for d, n in zip(displs, lengths)]

    @staticmethod
    def _all_equal(payloads: list[memoryview]) -> bool:
        """Every payload is byte for byte the first (compared as bytes: comparing
        memoryviews goes element by element)."""
        first = bytes(payloads[0])
        return all(len(p) == len(first) and bytes(p) == first for p in payloads[1:])

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

    def _wait(self, done: Callable[[], bool], block: Callable[[], object]) -> None:
        """Wait for this cycle's exchange: ``done()`` tests it, ``block()`` waits for it
        like a blocking call. While a caller is blocked in ``wait()`` (this process has
        nothing else to run) that is at once ``block()``. Otherwise test for up to
        ``SPIN_S`` (ranks that are in step meet within that), then sleep between tests,
        20 us doubling to ``max_poll_s``, so that a rank waiting for slower ranks does
        not take a core from the caller's computation."""
        waiters = self.waiters
        spin_until = time.perf_counter() + SPIN_S
        delay = 0.0
        while not waiters.blocked and not done():
            if delay:
                time.sleep(delay)
                delay = min(2.0 * delay, self.max_poll_s)
            elif time.perf_counter() > spin_until:
                delay = 20e-6
            else:
                time.sleep(0)  # lets the caller's threads run
        block()

    def _block_shm(self, target: int) -> None:
        """Wait until every rank has arrived at shared-memory barrier ``target``,
        yielding the core (no stall warning, unlike the collectives' barriers: a rank
        may legitimately submit much later than the others)."""
        assert self.shm is not None
        flags = self.shm.flags
        while min(flags) < target:
            yield_cpu()
        self.shm.wait(target)  # every rank has arrived: orders the loads after the flags
