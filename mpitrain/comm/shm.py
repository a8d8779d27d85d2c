"""Shared memory between the ranks of one node: slots, an arena, and a barrier.

When every rank of a communicator is on one node, :class:`SharedMemory` maps one
``MPI.Win.Allocate_shared`` window that every rank reads and writes directly:

* ``flags``: one counter per rank. A rank *arrives* at barrier ``t`` by storing ``t``
  in its counter and *waits* for ``t`` until every counter is at least ``t``. Counters
  only grow, so one barrier per call is enough: nothing is ever reset.
* ``fingerprints``: per parity and rank, the validation exchange's fingerprint, right
  after the counters (in their cache line up to 2 ranks; 5 ranks share two lines), so
  a rank that sees the others' counters has their fingerprints without another
  cache-line transfer.
* ``headers`` and ``slots``: per parity (``t % 2``) and rank, a small int64 header
  (``headers[parity, field, rank]``) and ``slot_bytes`` of payload. The validation
  exchange writes a rank's fingerprint (and a small collective's whole input) there
  before arriving, and every rank reads every slot after waiting.
* ``arena``: per rank, ``arena_bytes`` for the stripes of large shared-memory
  collectives (:mod:`mpitrain.algorithms.shared_memory`).

The parity rule that makes one barrier per step safe: data for barrier ``t`` goes to
parity ``t % 2`` after this rank has waited for ``t - 1``, and is read after waiting
for ``t`` and before waiting for ``t + 2``. A rank that writes parity ``t % 2`` for
``t`` has seen every rank arrive at ``t - 1``, so every rank has finished reading what
was written for ``t - 2``.

Stores are ordered before the counter store, and loads after the counter load, by
``MPI_Win_sync`` (a full memory barrier in Open MPI and MPICH). Where the ``_hostcopy``
extension is built, :meth:`SharedMemory.agree` and :meth:`SharedMemory.barrier` pass
in one compiled call (:func:`~mpitrain.backends.hostcopy.counters`): the fingerprint
store, the counter as a release store, then up to :data:`SPIN_POLLS` tests of the
counters with acquire loads; a wait longer than that goes on in the interpreter's
loop, which yields the core and watches for stalls. Through the interpreter, a loop of
``agree`` took 0.80-0.85 us a call at 2 ranks, compiled 0.16-0.46 us (docs/benchmarks.md,
"A compiled barrier").

A rank spins while it waits only if the ranks have a core each: :func:`node_cores`
(the union of their affinity masks) is at least the rank count. Otherwise every test
yields the core to the rank that is late.

``single_copy`` says whether the ranks may read each other's private memory with
``process_vm_readv`` (:mod:`mpitrain.algorithms.single_copy`). :func:`create` finds
out once, collectively: every rank reads a marker from every other rank, and it is on
only if every read on every rank succeeded (so every rank agrees), and
``MPITRAIN_SINGLE_COPY`` is on everywhere.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..backends import hostcopy

HEADER_WORDS = 4
"""int64 words of a slot header: fingerprint, row count, payload bytes, buffer address
(of an allgather's block, for the single-copy algorithm)."""
FP, ROWS, PAYLOAD, ADDRESS = 0, 1, 2, 3
NO_PAYLOAD = -1
"""A header's payload field when the rank left no data in its slot."""
CACHE_LINE = 64
SPIN_POLLS = 256
"""Tests of the counters that :meth:`SharedMemory.agree` and :meth:`SharedMemory.barrier`
make in compiled code before a wait goes on in :meth:`SharedMemory._poll` (about 6 us
on the 2-core host, holding the GIL)."""

StallHook = Callable[[float, list[int]], None]
yield_cpu: Callable[[], None] = os.sched_yield if hasattr(os, "sched_yield") \
    else (lambda: time.sleep(0))
"""Give the core to another runnable thread or process (releases the GIL)."""
SPIN_S = 0.002
"""How long a wait tests without sleeping: an MPI wait of an interruptible transport,
and a barrier of ranks that share cores (which yields the core between tests)."""
MAX_PAUSE_S = 0.005
"""Longest sleep between two tests of a wait that has gone on past :data:`SPIN_S`."""
BUSY_SPIN_S = 50e-6
"""How long a barrier tests without sleeping while this process's other threads have
work (:attr:`SharedMemory.others_busy`), on cores the ranks do not share."""
BUSY_MAX_PAUSE_S = 250e-6
"""Longest sleep between two tests of such a wait: how late it may notice the last
rank's arrival."""


def next_pause(pause: float, longest: float = MAX_PAUSE_S) -> float:
    """The sleep between the next two tests of a long wait that slept ``pause`` last
    (0: the first): doubling from 10 us up to ``longest``. A rank that waits
    for a late one on cores they share sleeps rather than yields: yielding keeps it
    runnable, and four ranks yielding on two cores left the late one a fraction of a
    core, so it came tens of seconds late (long enough for a stall error)."""
    return min(2 * pause + 1e-5, longest)


def _align(nbytes: int) -> int:
    return -(-nbytes // CACHE_LINE) * CACHE_LINE


def node_cores(comm: MPI.Intracomm) -> int:
    """How many cores the ranks of ``comm`` (all on one node) may run on between them:
    the union of their affinity masks (collective). A rank that ``mpirun`` binds to
    one core sees only that core in its own mask, so no rank alone can tell whether
    the others share it."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    return len(set().union(*comm.allgather(mine)))


class SharedMemory:
    """The shared window of a single-node communicator (collective to create).

    Args:
        comm: the private communicator; every rank must be on this node.
        slot_bytes: payload capacity of one rank's slot (per parity).
        arena_bytes: size of one rank's arena.
    """

    def __init__(self, comm: MPI.Intracomm, slot_bytes: int, arena_bytes: int) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        n = self.size
        self.slot_bytes = _align(slot_bytes)
        self.arena_bytes = _align(arena_bytes)
        flags_bytes = _align(3 * n * 8)  # the counters, then the fingerprints of both parities
        headers_bytes = _align(2 * n * HEADER_WORDS * 8)
        slots_bytes = 2 * n * self.slot_bytes
        total = flags_bytes + headers_bytes + slots_bytes + n * self.arena_bytes
        self.win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=comm)
        buf, _ = self.win.Shared_query(0)
        raw: Any = np.frombuffer(buf, dtype=np.uint8, count=total)  # type: ignore[call-overload]
        self.raw = raw
        words = memoryview(raw[:3 * n * 8]).cast("q")
        self.flags = words[:n]
        # Per parity, every rank's fingerprint (fast to compare as a memoryview).
        self.fingerprints = [words[n:2 * n], words[2 * n:]]
        off = flags_bytes
        self.headers = raw[off:off + 2 * n * HEADER_WORDS * 8].view(np.int64) \
            .reshape(2, HEADER_WORDS, n)
        off += headers_bytes
        self.slots = raw[off:off + slots_bytes].reshape(2, n, self.slot_bytes)
        off += slots_bytes
        self.arena = raw[off:off + n * self.arena_bytes].reshape(n, self.arena_bytes)
        # Per parity, the whole header as a flat memoryview: field f of rank r is at
        # f * n + r (the fingerprint field is unused here: see ``fingerprints``).
        self.header_words = [memoryview(self.headers[p].reshape(-1)) for p in range(2)]
        self.win.Lock_all()
        self.sync: Callable[[], None] = self.win.Sync  # bound once: called twice per barrier
        # The compiled barrier of agree() and barrier() (None: the extension is not built).
        self.counters = hostcopy.counters(raw[:3 * n * 8], self.rank, n)
        if self.rank == 0:
            raw[:flags_bytes + headers_bytes] = 0
        self.win.Sync()
        comm.Barrier()
        self.win.Sync()
        self.seq = 0
        self.oversubscribed = n > node_cores(comm)
        # Tests after the first that the compiled barrier makes before a wait goes on in
        # _poll: none when oversubscribed, where _poll yields the core at once.
        self.polls = 0 if self.oversubscribed else SPIN_POLLS
        self.stall_hook: StallHook | None = None
        self.stall_seconds = 60.0
        # An object whose ``waiting`` is True while a barrier waits (the transport: the
        # stall inspector serves that flag to the other ranks).
        self.waiter: Any = None
        # Set by the async engine that runs its collectives on this window: True while
        # this process's own threads have work (no caller blocked on the engine). A
        # barrier that waits past BUSY_SPIN_S then sleeps between tests instead of
        # taking their core (see _poll).
        self.others_busy: Callable[[], bool] | None = None
        # True if every rank can read every other rank's memory (set by create()).
        self.single_copy = False
        self.single_copy_reason = "not probed"
        self.pids: list[int] = []  # every rank's process id, where single_copy

    @property
    def next_parity(self) -> int:
        """The parity of the next barrier: where data for it goes."""
        return (self.seq + 1) & 1

    def arrive(self) -> int:
        """Publish everything written so far and arrive at the next barrier; returns it."""
        self.seq += 1
        self.sync()
        self.flags[self.rank] = self.seq
        return self.seq

    def wait(self, target: int) -> None:
        """Block until every rank has arrived at barrier ``target``."""
        flags = self.flags
        if min(flags) < target:
            self._poll(target)
        self.sync()

    def barrier(self) -> int:
        """Arrive at the next barrier and wait for it; returns the barrier's number."""
        counters = self.counters
        if counters is None:
            t = self.arrive()
            self.wait(t)
            return t
        # the compiled agree() with a fingerprint nobody reads: barrier t's words are
        # read only by an agree() at t
        t = self.seq = self.seq + 1
        if counters.agree(t, 0, self.polls) < 0:
            self._poll(t)
            self.sync()
        return t

    def agree(self, fingerprint: int) -> bool:
        """Publish ``fingerprint`` for the next barrier, pass it, and say whether every
        rank published the same (the validation exchange of a call that has nothing
        else to publish; :meth:`barrier` with one more word)."""
        t = self.seq = self.seq + 1
        counters = self.counters
        if counters is not None:
            agreed = counters.agree(t, fingerprint, self.polls)
            if agreed >= 0:
                return agreed == 1
            self._poll(t)
            self.sync()
            return self.fingerprints[t & 1].tolist().count(fingerprint) == self.size
        fps = self.fingerprints[t & 1]
        fps[self.rank] = fingerprint
        self.sync()
        flags = self.flags
        flags[self.rank] = t
        if min(flags) < t:
            self._poll(t)
        self.sync()
        return fps.tolist().count(fingerprint) == self.size

    def wait_quietly(self, target: int) -> None:
        """Like :meth:`wait`, yielding the core between tests and never calling the
        stall hook: for waits that may legitimately be long (the async engine's
        exchanges wait for ranks that have not submitted yet).

        This loop stays in an interpreted module on purpose: the engine's modules may
        be compiled (mypyc), and a compiled loop never lets the interpreter hand the
        GIL to another thread, which this process's other engines may need to let
        the ranks we wait for move on.
        """
        flags = self.flags
        while min(flags) < target:
            yield_cpu()
        self.win.Sync()

    def _poll(self, target: int) -> None:
        """Wait for barrier ``target``: spin (on cores of its own: 64 tests, then yield
        between tests), or, where ranks share cores, yield between tests for
        :data:`SPIN_S`, then sleep between them (:func:`next_pause`). A wait of the
        async engine's thread while the process's other threads compute
        (:attr:`others_busy`) sleeps between tests from :data:`BUSY_SPIN_S` on, for at
        most :data:`BUSY_MAX_PAUSE_S` at a time: a training step's backward pass runs on
        the cores that a yielding wait keeps taking, and the late rank is usually late
        because its own core is shared the same way. The stall hook hears of the wait
        every :attr:`stall_seconds`."""
        flags = self.flags
        spin = not self.oversubscribed
        busy = self.others_busy if spin else None
        check = 0xF if busy is not None else 0xFF  # yields between looks at the clock
        polls = 0
        begun = start = 0.0  # when the wait, and the current stall period, began
        pause = 0.0
        longest = MAX_PAUSE_S if busy is None else BUSY_MAX_PAUSE_S
        waiter = self.waiter
        if waiter is not None:
            waiter.waiting = True
        try:
            while min(flags) < target:
                polls += 1
                if pause:
                    time.sleep(pause)
                    pause = next_pause(pause, longest)
                elif not spin or polls > 64:
                    yield_cpu()
                    if polls & check:
                        continue
                else:
                    continue
                now = time.monotonic()
                if begun == 0.0:
                    begun = start = now
                    continue
                if not pause and (
                        (not spin and now - begun >= SPIN_S)
                        or (busy is not None and now - begun >= BUSY_SPIN_S and busy())):
                    pause = next_pause(0.0, longest)
                if self.stall_hook is not None and now - start >= self.stall_seconds:
                    self.stall_hook(now - start, self.missing(target))
                    start = now
        finally:
            if waiter is not None:
                waiter.waiting = False

    def missing(self, target: int) -> list[int]:
        """Ranks that have not arrived at barrier ``target`` yet."""
        return [r for r, f in enumerate(self.flags) if f < target]

    def slot(self, parity: int, rank: int) -> Any:
        """The payload bytes of ``rank``'s slot at ``parity``."""
        return self.slots[parity, rank]

    def offer(self, data: Any) -> int:
        """Put ``data`` (bytes, a uint8 array) in this rank's next slot if it fits.

        Returns:
            Its size in bytes, for the header's payload field, or :data:`NO_PAYLOAD`.
        """
        nbytes = data.size
        if nbytes > self.slot_bytes:
            return NO_PAYLOAD
        np.copyto(self.slot(self.next_parity, self.rank)[:nbytes], data)
        return int(nbytes)

    def free(self) -> None:
        """Release the window (collective)."""
        self.counters = None  # its hold on the window's memory goes first
        if self.win != MPI.WIN_NULL:
            self.win.Unlock_all()
            self.win.Free()


MARKER = 0x6D70_6974_7261_696E
"""Mixed into the word every rank offers to be read by the others in the probe."""


def probe_single_copy(comm: MPI.Intracomm, enabled: bool) -> tuple[bool, str, list[int]]:
    """Whether every rank can read every other rank's memory, why not, and every rank's
    pid (collective; every rank gets the same answer).

    Each rank offers a marker (its pid and rank, mixed with :data:`MARKER`); every
    rank reads every other's with ``process_vm_readv``. Under Yama's ptrace_scope 1,
    a rank first lets this user's processes read it (``PR_SET_PTRACER_ANY``).
    """
    rank = comm.Get_rank()
    wanted = enabled and hostcopy.compiled()
    if not comm.allreduce(wanted, op=MPI.LAND):
        return False, ("MPITRAIN_SINGLE_COPY=0 or the _hostcopy extension not built on "
                       "some rank"), []
    if hostcopy.yama_scope() == 1:
        hostcopy.allow_peers()
    marker = np.array([os.getpid() ^ MARKER, rank], np.int64)
    peers = comm.allgather((os.getpid(), hostcopy.address(marker)))
    read = np.zeros(2, np.int64)
    error = ""
    for q, (pid, where) in enumerate(peers):
        if q == rank:
            continue
        try:
            hostcopy.read_peer(pid, read, where)
        except OSError as exc:
            error = f"rank {rank} cannot read rank {q}: {exc}"
            break
        if read[0] != pid ^ MARKER or read[1] != q:
            error = f"rank {rank} read a wrong marker from rank {q}"
            break
    # the allgather also keeps every marker alive until every rank has read
    errors = [e for e in comm.allgather(error) if e]
    return (not errors, errors[0] if errors else "every rank reads every other",
            [pid for pid, _ in peers])


def create(comm: MPI.Intracomm, single_node: bool, enabled: bool, slot_bytes: int,
           arena_bytes: int, single_copy: bool = False) -> SharedMemory | None:
    """A :class:`SharedMemory` for ``comm`` if every rank agrees it can have one.

    Collective. Returns ``None`` on every rank when shared memory is disabled on any
    rank, the ranks span several nodes, or the window cannot be allocated anywhere.
    With ``single_copy``, also probes whether the ranks can read each other's memory
    (:func:`probe_single_copy`).
    """
    wanted = bool(single_node and enabled and comm.Get_size() > 1)
    if not comm.allreduce(wanted, op=MPI.LAND):
        return None
    shm: SharedMemory | None
    try:
        shm = SharedMemory(comm, slot_bytes, arena_bytes)
    except MPI.Exception:
        shm = None
    if not comm.allreduce(shm is not None, op=MPI.LAND):
        if shm is not None:
            shm.free()
        return None
    assert shm is not None
    shm.single_copy, shm.single_copy_reason, shm.pids = probe_single_copy(comm, single_copy)
    return shm
