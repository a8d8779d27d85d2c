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
later announcements of the pair send the number instead of the two strings. Generated
names never repeat, so they are never numbered; instead, a run of them (consecutive
``<kind>.noname.<n>`` of one spec, as a burst of unnamed submissions makes) is sent as
one ``[kind, first n, count, signature]`` item, whatever the length of the run, instead
of one (name, signature) pair per request. A cycle
is one exchange of a fixed-size *slot* per rank (payload length, stop flag,
threshold, and the payload itself when it fits): through the communicator's
shared-memory slots (512 KiB) when all ranks are on one node, else one
``MPI_Iallgather`` of 4 KiB slots (under ULFM, point-to-point messages: see
:mod:`mpitrain.comm.p2p`). While a caller is blocked in ``wait()`` the
exchange waits like a blocking call; otherwise it is polled with a growing sleep
(after a first 100 us of tests, enough for ranks that are in step), so that a rank
waiting for slower ranks does not take a core from the caller's computation. Only a
payload too large for the slot costs a second exchange (``MPI_Allgatherv``).
"""

from __future__ import annotations

import logging
import pickle
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, Union

import numpy as np
from mpi4py import MPI

from ..comm import p2p
from ..comm.inspector import abort
from ..comm.shm import SharedMemory
from ..comm.transport import Transport
from .request import Waiters

log = logging.getLogger("mpitrain")

Signatures = dict[int, str]
# a numbered pair, (name, signature), or a run of generated names [kind, n, count, signature]
Announcement = Union[int, tuple[str, str], list[Any]]
NONAME = ".noname."
"""Names generated for unnamed calls are ``<kind>.noname.<n>`` (:func:`generated_name`)."""
ORDERED = "collective"
"""The counter of every unnamed submission of an ordered engine (``Engine.ordered``),
whatever its kind: its generated names are ``collective.noname.<n>``."""
CALL_SERIALS = 1_000_000
"""In an ordered engine, the serials of one call: the unnamed submissions of one
``Engine.call()`` block (or one submission made outside any) are numbered from
``CALL_SERIALS * c``, ``c`` counting the calls (``collective.noname.3000001`` is the
second submission of call 3). So a call that submits more on one rank than on another
(a sparse allreduce's two allgathers against a dense allreduce) leaves the next call's
names the same on every rank; and when the ranks disagree on a call, its other
submissions are given up with it (:meth:`Negotiator.exchange`)."""
DEAD_CALLS_KEPT = 4096
"""How many given-up calls the negotiator remembers, to give up their late submissions."""


def shown(items: list[str], sep: str) -> str:
    """The first :data:`SHOWN_NAMES` of ``items`` joined by ``sep``, and how many more."""
    more = f"{sep}and {len(items) - SHOWN_NAMES} more" if len(items) > SHOWN_NAMES else ""
    return sep.join(items[:SHOWN_NAMES]) + more


def generated_name(kind: str, n: int) -> str:
    """The name of the ``n``-th unnamed call of ``kind``: ``<kind>.noname.<n>``."""
    return f"{kind}{NONAME}{n}"


def ordered_call(name: str) -> int:
    """The call ``c`` of an ordered engine's generated name (:data:`CALL_SERIALS`), -1
    for any other name."""
    kind, sep, n = name.partition(NONAME)
    return int(n) // CALL_SERIALS if kind == ORDERED and sep and n.isdigit() else -1


def is_generated(name: str) -> bool:
    """True for a name :func:`generated_name` makes (such names never repeat). A given
    name that merely contains ``.noname.`` (e.g. ``allreduce.noname.0.3``, which the
    torch adapter gives unnamed parameters every step) is not one."""
    _, sep, n = name.rpartition(NONAME)
    return bool(sep) and n.isdigit()


class Announced(Protocol):
    """What the negotiator reads of a request (:class:`~.request.Request`)."""

    name: str
    spec: Any  # its ``signature`` is what every rank must agree on
    serial: int  # n of a generated name ``<kind>.noname.<n>``, else -1

SLOT_BYTES = 4096
# The start of a slot: payload length, stop flag, fusion threshold, the birth cycle of
# the newest table entry this rank finds past the stall timeout (-1: none), and the
# join flag (the rank is in join(): it submits nothing and stands in for what it lacks).
_HEAD = struct.Struct("=5q")
CACHE_LIMIT = 1 << 16
SPIN_S = 100e-6
STALL_CHECK_S = 1.0
"""How often (at most) a cycle looks for table entries past the stall limits."""
EXCHANGE = "the async engine's exchange"
"""The name of a cycle's exchange as a collective of the engine's transport."""
SHOWN_NAMES = 8
"""How many names a stall report lists before it says how many more there are."""


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
        abandoned: names some rank submitted that will never run, each with why (the
            same text on every rank): they waited past the stall timeout for ranks
            that never submitted them, or a rank that never submitted them stopped
            its engine.
        stalled: those of ``abandoned`` that were given up at the stall timeout.
        disagreed: those of ``abandoned`` that were given up because the ranks
            disagreed on another submission of their call (:data:`CALL_SERIALS`).
        joined: the ranks in ``join()`` this cycle; a name is ready once every other
            rank has submitted it.
        missing: the names of ``ready`` that some joined ranks never submitted, each
            with those ranks (they take part with stand-in arrays).
        all_joined: every rank is in ``join()``: the join is over.
        last_joined: then, the rank that joined last (of those that joined in the
            same cycle, the highest).
        stopped: the ranks that have asked their engine to stop.
    """

    ready: list[str]
    mismatched: dict[str, Signatures]
    all_stopped: bool
    news: bool
    threshold: int
    same: bool = False
    abandoned: dict[str, str] = field(default_factory=dict)
    stalled: set[str] = field(default_factory=set)
    disagreed: set[str] = field(default_factory=set)
    joined: list[int] = field(default_factory=list)
    missing: dict[str, list[int]] = field(default_factory=dict)
    all_joined: bool = False
    last_joined: int = -1
    stopped: list[int] = field(default_factory=list)


class Negotiator:
    """Runs the cycles' exchanges on the engine's private communicator.

    Stalls are watched in two places, with the stall inspector's limits
    (``MPITRAIN_STALL_WARNING_S``, ``MPITRAIN_STALL_TIMEOUT_S``, ``MPITRAIN_STALL_ACTION``):

    * an *exchange* that waits for ranks that have not begun the cycle (their engines
      are idle: they have not submitted anything) is a collective of ``transport``:
      each cycle is counted there (``begin``) and raises its ``waiting`` flag while it
      waits, so the inspector reports it like a blocking collective and the exit
      guard sees it; past the timeout (action ``raise``) the exchange raises
      :class:`~mpitrain.StallError`, which fails the engine;
    * an entry of the *table* (a name some ranks submitted and others have not, while
      cycles go on) is reported on every rank past the warning, with the ranks that
      have not submitted it; past the timeout every rank gives it up in the same
      cycle (:attr:`Agreement.abandoned`), and the engine goes on.

    Args:
        comm: the engine's communicator (used by the progress thread only).
        max_poll_s: longest sleep between two tests of a pending exchange.
        waiters: how many callers are blocked on the engine's handles.
        shm: the shared memory of that communicator when all its ranks are on one node
            (its slots then carry the cycles instead of ``MPI_Iallgather``: no MPI
            progress loop, whose idle yield costs tens of microseconds per exchange).
        transport: the engine's transport, whose stall inspector watches the
            exchanges (``None``: stalls are not watched).
        ordered: the engine is ordered (``Engine.ordered``): its unnamed submissions
            carry call numbers (:func:`ordered_call`), and waiting calls that can never
            run are given up (:meth:`_give_up_calls`).
    """

    def __init__(self, comm: MPI.Intracomm, max_poll_s: float, waiters: Waiters,
                 shm: SharedMemory | None = None, transport: Transport | None = None,
                 ordered: bool = False) -> None:
        self.comm = comm
        self.ordered = ordered
        self.waiters = waiters
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.max_poll_s = max_poll_s
        self.transport = transport
        inspector = transport.inspector if transport is not None else None
        self.warning_s = inspector.warning_s if inspector is not None else 0.0
        self.timeout_s = inspector.timeout_s if inspector is not None else 0.0
        self.action = inspector.action if inspector is not None else "raise"
        self.cycle = 0  # cycles begun: the same count on every rank
        self.table: dict[str, Signatures] = {}
        self.born: dict[str, tuple[int, float]] = {}  # table name -> (cycle, local time)
        self.warned: set[str] = set()
        self.dead_calls: dict[int, str] = {}  # ordered calls given up -> why (oldest first)
        # each rank's latest ordered call announced (-1: none), as recorded in the table
        self.latest_call = [-1] * self.size
        self._next_check = 0.0
        self._announcing: Sequence[Announced] = ()
        self._joined: set[int] = set()  # ranks in join() as of the last cycle
        self._last_joined = -1
        if transport is not None:
            transport.detail = self.waiting_on
        self.known: list[tuple[str, str]] = []  # number -> (name, signature)
        self.numbers: dict[tuple[str, str], int] = {}
        self.shm = shm if shm is not None and shm.slot_bytes >= SLOT_BYTES else None
        slot_bytes = self.shm.slot_bytes if self.shm is not None else SLOT_BYTES
        self._room = slot_bytes - _HEAD.size
        self._slot = np.zeros(SLOT_BYTES, np.uint8)
        self._slots = np.zeros((self.size, SLOT_BYTES), np.uint8)

    def exchange(self, requests: Sequence[Announced], stopping: bool,
                 threshold: int, joined: bool = False) -> Agreement:
        """One cycle: share the requests' names and signatures, stop flag, threshold and
        join flag (``joined``: this rank is in ``join()``; its wait for the other ranks'
        cycles is then never a stall, as they may compute for long before they join)."""
        self.cycle += 1
        expire = self._check_stalls(requests) if self.table else -1
        self._announcing = requests
        if self.transport is not None:
            self.transport.begin(EXCHANGE)
        announcements, fresh = self._announce(requests)
        payload = pickle.dumps(announcements, pickle.HIGHEST_PROTOCOL) if requests else b""
        shm = self.shm
        if shm is not None:
            parity = shm.next_parity
            slot = shm.slot(parity, self.rank)
        else:
            slot = self._slot
        _HEAD.pack_into(slot.data, 0, len(payload), int(stopping), threshold, expire,
                        int(joined))
        if len(payload) <= self._room:
            slot.data[_HEAD.size:_HEAD.size + len(payload)] = payload
        if shm is not None:
            target = shm.arrive()
            flags = shm.flags
            self._wait(lambda: min(flags) >= target, lambda: shm.wait_quietly(target), joined)
            slots = shm.slots[parity]  # read before this thread's next two barriers
        elif self.transport is not None and self.transport.elastic:
            # point-to-point, so that a failed rank prints nothing (mpitrain.comm.p2p)
            posted = p2p.allgather(self.comm, self._slot, self._slots)
            self._wait(lambda: p2p.testall(posted), lambda: p2p.waitall(posted), joined)
            slots = self._slots
        else:
            request = self.comm.Iallgather(self._slot, self._slots)
            self._wait(request.Test, request.Wait, joined)
            slots = self._slots
        heads = [_HEAD.unpack_from(slots[r].data) for r in range(self.size)]
        lengths = [h[0] for h in heads]
        stopped = [r for r, h in enumerate(heads) if h[1]]
        agreement = Agreement([], {}, len(stopped) == self.size, any(lengths),
                              min(h[2] for h in heads), stopped=stopped)
        if self._joined or any(h[4] for h in heads):
            self._join_state(agreement, [r for r, h in enumerate(heads) if h[4]])
        if agreement.news:
            payloads = self._payloads(slots, payload, lengths)
            if not self.table and self._all_equal(payloads):
                # Every rank announced the same requests in the same order, and nothing
                # older is waiting: all of them are ready, in this rank's order.
                agreement.ready = [r.name for r in requests]
                agreement.same = True
                for pair in fresh:
                    self.remember(*pair)
            else:
                for rank, data in enumerate(payloads):
                    self._record(rank, data)
                self._collect(agreement)
        elif self.table and agreement.joined:  # a join can make waiting names ready
            self._collect(agreement)
        if agreement.mismatched or (self.ordered and self.table):
            self._give_up_calls(agreement)
        if self.table:
            expire = max(h[3] for h in heads)
            if stopped or expire >= 0:
                self._abandon(agreement, expire, stopped)
        return agreement

    def _join_state(self, agreement: Agreement, joined: list[int]) -> None:
        """Record which ranks are in ``join()`` this cycle, and whether all are."""
        agreement.joined = joined
        new = [r for r in joined if r not in self._joined]
        if new:
            self._last_joined = max(new)
        if len(joined) == self.size:
            agreement.all_joined = True
            agreement.last_joined = self._last_joined
            self._joined, self._last_joined = set(), -1
        else:
            self._joined = set(joined)

    def _check_stalls(self, requests: Sequence[Announced]) -> int:
        """Warn of table entries past the stall warning (on this rank), and return the
        birth cycle of the newest entry past the stall timeout (-1: none), which the
        exchange proposes to give up. Looks at most every :data:`STALL_CHECK_S`."""
        now = time.monotonic()
        if now < self._next_check or not (self.warning_s or self.timeout_s):
            return -1
        self._next_check = now + STALL_CHECK_S
        born = self.born
        if self.warning_s:
            late = [n for n, (_, t) in born.items()
                    if now - t >= self.warning_s and n not in self.warned]
            if late:
                self.warned.update(late)
                then = (f"At {self.timeout_s:g} s (the stall timeout) they are given up "
                        "with mpitrain.StallError" if self.timeout_s else
                        "Set MPITRAIN_STALL_TIMEOUT_S to give up such operations with "
                        "mpitrain.StallError")
                log.warning("mpitrain rank %d: %s. %s.", self.rank,
                            self._unsubmitted(late, now), then)
        expire = -1
        if self.timeout_s:
            for cycle, t in born.values():  # in order of birth
                if now - t < self.timeout_s:
                    break
                expire = cycle
            if expire >= 0 and self.action == "abort":
                late = [n for n, (c, _) in born.items() if c <= expire]
                abort(f"rank {self.rank}: {self._unsubmitted(late, now)}")
        return expire

    def _unsubmitted(self, names: list[str], now: float) -> str:
        """Which ranks have not submitted ``names`` (table entries), and for how long
        the others have waited."""
        parts = [f"{name!r} ({next(iter(self.table[name].values()))}) has waited "
                 f"{now - self.born[name][1]:.0f} s for rank(s) {self.waiting_for(name)}"
                 for name in names]
        return ("async operations submitted by some ranks only: " + shown(parts, "; ")
                + " (check that every rank submits the same names, or whether those "
                  "ranks are only slow)")

    def _abandon(self, agreement: Agreement, expire: int, stopped: list[int]) -> None:
        """Give up the table entries born at or before cycle ``expire`` (some rank found
        them past the stall timeout) and those that a rank in ``stopped`` has not
        submitted (it never will): the same entries, with the same words, on every rank."""
        for name, sigs in list(self.table.items()):
            missing = self.waiting_for(name)
            gone = [r for r in missing if r in stopped]
            if self.born[name][0] <= expire:
                agreement.abandoned[name] = (
                    f"{name!r} ({next(iter(sigs.values()))}) waited past the stall timeout "
                    f"(MPITRAIN_STALL_TIMEOUT_S={self.timeout_s:g} s on some rank) for "
                    f"rank(s) {missing}, which did not submit it; it is "
                    "given up on every rank. Every rank must submit each async operation "
                    "(check that all ranks take the same code path), or raise "
                    "MPITRAIN_STALL_TIMEOUT_S if those ranks are only slow")
                agreement.stalled.add(name)
            elif gone:
                agreement.abandoned[name] = (
                    f"rank(s) {gone} stopped their async engine "
                    "(mpitrain.shutdown(), or the end of the program) without submitting "
                    f"{name!r}; it can never run. Every rank must submit each async "
                    "operation before it shuts down")
            else:
                continue
            del self.table[name]
            self._forget(name)

    def _give_up_calls(self, agreement: Agreement) -> None:
        """Give up, on every rank alike, the waiting submissions of ordered calls
        (:data:`CALL_SERIALS`) that can never run, which would otherwise wait until the
        stall timeout:

        * those of a call the ranks disagreed on (a mismatched submission of the call,
          this cycle or before): the ranks that made them will never see the others'
          (those submitted something else);
        * those that some rank did not submit although it has announced a later call:
          its call submitted fewer operations (a rank submits all of a call's before
          any of the next one's).
        """
        dead = self.dead_calls
        for name, sigs in agreement.mismatched.items():
            call = ordered_call(name)
            if call >= 0 and call not in dead:
                each = ", ".join(f"rank {r} {sig}" for r, sig in sorted(sigs.items()))
                dead[call] = (f"the ranks disagreed on {name!r}, another operation of its "
                              f"call ({each})")
                if len(dead) > DEAD_CALLS_KEPT:
                    del dead[next(iter(dead))]
        latest = self.latest_call
        for name, sigs in list(self.table.items()):
            call = ordered_call(name)
            if call < 0:
                continue
            why = dead.get(call)
            if why is None:
                missing = self.waiting_for(name)
                if not missing or any(latest[r] <= call for r in missing):
                    continue
                why = (f"rank(s) {missing} made call {call} of this group without it and went "
                       f"on to later calls: their call submitted fewer operations than rank(s) "
                       f"{sorted(sigs)}'s ({next(iter(sigs.values()))})")
            agreement.abandoned[name] = (f"{name!r} is given up on every rank: {why}. Every "
                                         "rank must make the same collective calls in the "
                                         "same order, with the same arguments")
            agreement.disagreed.add(name)
            del self.table[name]
            self._forget(name)

    def _forget(self, name: str) -> None:
        """A table entry is gone (ready or abandoned): stop watching it."""
        del self.born[name]
        self.warned.discard(name)

    def _announce(self, requests: Sequence[Announced]) -> tuple[list[Announcement],
                                                                 list[tuple[str, str]]]:
        """The announcements of ``requests``, and the (name, signature) pairs of given
        names that are sent as text (not numbered yet).

        A run of generated names (``<kind>.noname.<n>``, ``<kind>.noname.<n + 1>``, ...
        of one spec, in that order) is one ``[kind, n, count, signature]`` item: a
        burst of unnamed submissions costs one item, not one per request.
        """
        numbers = self.numbers
        out: list[Announcement] = []
        fresh = []
        run: list[Any] | None = None
        spec = None
        serial = -2
        for r in requests:
            if r.serial < 0:
                pair = (r.name, r.spec.signature)
                number = numbers.get(pair)
                if number is None:
                    out.append(pair)
                    fresh.append(pair)
                else:
                    out.append(number)
                run = None
            # one spec is one kind (the engine keeps specs by kind and arguments), so the
            # run's kind holds; serials are counted per kind
            elif run is not None and r.serial == serial + 1 and r.spec is spec:
                run[2] += 1
                serial += 1
            else:
                spec, serial = r.spec, r.serial
                run = [r.name.rpartition(NONAME)[0], serial, 1, spec.signature]
                out.append(run)
        return out, fresh

    def _collect(self, agreement: Agreement) -> None:
        """Move the names every rank has announced (every rank not in ``join()``) from
        the table to ``agreement``."""
        joined = agreement.joined
        for name, sigs in list(self.table.items()):
            if len(sigs) < self.size:
                if not joined:
                    continue
                missing = [r for r in range(self.size) if r not in sigs]
                if any(r not in joined for r in missing):
                    continue
                agreement.missing[name] = missing
            del self.table[name]
            self._forget(name)
            agreement.ready.append(name)
            first = next(iter(sigs.values()))  # rank 0's, unless it is joined
            if any(sig != first for sig in sigs.values()):
                agreement.mismatched[name] = sigs
            elif (name, first) not in self.numbers:
                self.remember(name, first)

    def remember(self, name: str, signature: str) -> None:
        """Number a pair that every rank agreed on (call in ``ready`` order everywhere).

        Generated names (:func:`is_generated`) never repeat, so they are not numbered.
        """
        if is_generated(name):
            return
        if len(self.known) >= CACHE_LIMIT:  # every rank reaches the limit in the same cycle
            self.known.clear()
            self.numbers.clear()
        self.numbers[(name, signature)] = len(self.known)
        self.known.append((name, signature))

    def waiting_for(self, name: str) -> list[int]:
        """Ranks that have not yet announced ``name`` (a rank in ``join()`` never will,
        and is not waited for)."""
        have, joined = self.table.get(name, {}), self._joined
        return [r for r in range(self.size) if r not in have and r not in joined]

    def share(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective of this communicator, run
        by every rank in the same cycle: the stand-ins of a join)."""
        return self.comm.allgather(value)

    def _payloads(self, slots: np.ndarray[Any, Any], payload: bytes,
                  lengths: list[int]) -> list[memoryview]:
        """Every rank's payload: from the slots, or from a second exchange if any is long."""
        if max(lengths) <= self._room:
            start = _HEAD.size
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
        table, known, born = self.table, self.known, self.born
        for item in pickle.loads(data):
            if isinstance(item, list):  # a run of generated names
                kind, first, count, signature = item
                pairs = [(generated_name(kind, n), signature)
                         for n in range(first, first + count)]
                if kind == ORDERED:
                    self.latest_call[rank] = max(self.latest_call[rank],
                                                 (first + count - 1) // CALL_SERIALS)
            else:
                pairs = [known[item] if isinstance(item, int) else item]
            for name, signature in pairs:
                sigs = table.get(name)
                if sigs is None:
                    sigs = table[name] = {}
                    born[name] = (self.cycle, time.monotonic())
                sigs[rank] = signature

    def _wait(self, done: Callable[[], bool], block: Callable[[], object],
              joined: bool = False) -> None:
        """Wait for this cycle's exchange: ``done()`` tests it, ``block()`` waits for it
        like a blocking call. While a caller is blocked in ``wait()`` (this process has
        nothing else to run) that is at once ``block()``. Otherwise test for up to
        ``SPIN_S`` (ranks that are in step meet within that), then sleep between tests,
        20 us doubling to ``max_poll_s``, so that a rank waiting for slower ranks does
        not take a core from the caller's computation.

        Meanwhile the transport's ``waiting`` flag is up, for the stall inspector; with
        a stall timeout and the action ``raise`` (an interruptible transport) the wait
        of a blocked caller polls instead of blocking, and either wait raises
        :class:`~mpitrain.StallError` past the timeout (which fails the engine: its
        handles raise it), unless this rank is ``joined``: it waits for ranks that may
        compute for long before their next submission, which is no stall."""
        waiters, t = self.waiters, self.transport
        begun = time.perf_counter()
        spin_until = begun + SPIN_S
        delay = 0.0
        interruptible = t is not None and t.interruptible and not joined
        timeout = t.inspector.timeout_s if t is not None and interruptible else 0.0
        if t is not None:
            t.waiting = True
        try:
            while not waiters.blocked and not done():
                if delay:
                    time.sleep(delay)
                    delay = min(2.0 * delay, self.max_poll_s)
                    waited = time.perf_counter() - begun
                    if timeout and waited >= timeout and t is not None:
                        raise t.stalled(waited)
                elif time.perf_counter() > spin_until:
                    delay = 20e-6
                else:
                    time.sleep(0)  # lets the caller's threads run
            if t is not None and interruptible:
                t.poll(done)
            block()
        finally:
            if t is not None:
                t.waiting = False

    def waiting_on(self) -> str:
        """What this rank's pending exchange carries (the stall inspector adds it to its
        reports): the names this rank has submitted that have not run yet. It names the
        rank, as other ranks' reports quote it too."""
        if self.transport is None or self.transport.current != EXCHANGE:
            return ""  # a collective of a bucket
        try:
            named = [f"{r.name!r} ({r.spec.signature})" for r in self._announcing] + [
                f"{n!r} ({sigs[self.rank]})" for n, sigs in self.table.items()
                if self.rank in sigs]
        except RuntimeError:  # the table changed under the inspector's thread
            return ""
        if not named:
            if self.rank in self._joined:
                return f" (rank {self.rank} is in join(): it waits for the other ranks to join)"
            return f" (rank {self.rank} has no operation pending: it is stopping)"
        return f" (rank {self.rank} has submitted " + shown(named, ", ") + ")"
