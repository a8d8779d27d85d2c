"""The stall inspector: which ranks have not arrived at a collective.

Every :class:`~.transport.Transport` counts the collectives it has begun (``seq``),
names the current one (``current``) and raises its ``waiting`` flag while it blocks on
MPI. One daemon thread per process (:class:`_Server`) ticks every :data:`TICK_S` and,
for each transport's :class:`Inspector`:

* *serves*: answers the queries of other ranks, which arrive on the inspector's own
  duplicate of the communicator (so they never match collective traffic), with this
  rank's ``(seq, waiting, current)``, and with what this process waits in elsewhere
  (another transport, of this communicator or of another one): a rank that has not
  called a collective is often waiting in a different one, and the report says which;
* *watches*: when the transport has been waiting in the same collective for
  ``MPITRAIN_STALL_WARNING_S``, it *surveys* every other rank and logs a warning that
  names the collective and the ranks whose ``seq`` is smaller, i.e. that have not
  called it yet; past ``MPITRAIN_STALL_TIMEOUT_S`` with ``MPITRAIN_STALL_ACTION=abort`` it
  aborts the job with that message. (With ``raise`` the waiting thread raises
  :class:`~mpitrain.StallError` itself, see :meth:`.Transport.wait`, after asking the
  daemon for a survey through :meth:`Inspector.survey`.)

The daemon never blocks in MPI: it posts non-blocking messages, tests them and sleeps
between ticks, so it costs no CPU while nothing stalls. It needs
``MPI.THREAD_MULTIPLE`` (mpi4py's default); at a lower thread level there is no
daemon, hence no warning, and a StallError cannot name the missing ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
from mpi4py import MPI

from .. import config


class Watched(Protocol):
    """What an :class:`Inspector` reads of its transport (:class:`~.transport.Transport`)."""

    comm: MPI.Intracomm
    rank: int
    size: int
    seq: int
    """Collectives begun."""
    current: str
    """The collective begun last."""
    waiting: bool
    """True while the transport waits inside a collective."""

    def what(self) -> str:
        """The current collective, with whatever more the transport knows of it."""


log = logging.getLogger("mpitrain")

TICK_S = 0.02
"""How often the daemon serves queries and checks for stalls."""
SURVEY_S = 2.0
"""How long a survey waits for the other ranks' replies."""
QUERY_TAG, REPLY_TAG = 1, 2
_NAME_BYTES, _ELSEWHERE_BYTES = 104, 256
_REPLY = struct.Struct(f"<qqq{_NAME_BYTES}s{_ELSEWHERE_BYTES}s")
"""Query id, seq, waiting, collective name, the waits in progress on other transports."""


@dataclass(frozen=True)
class StallLimits:
    """When a wait is a stall: warn after ``warning_s``; after ``timeout_s`` (0: never)
    ``action`` (``raise`` or ``abort``)."""

    warning_s: float
    timeout_s: float
    action: str

    @classmethod
    def of(cls, settings: config.Settings) -> StallLimits:
        """The limits of a communicator's ``settings``."""
        return cls(settings.stall_warning_s, settings.stall_timeout_s, settings.stall_action)

    @classmethod
    def from_config(cls) -> StallLimits:
        """``MPITRAIN_STALL_WARNING_S``, ``MPITRAIN_STALL_TIMEOUT_S``, ``MPITRAIN_STALL_ACTION``."""
        return cls(config.STALL_WARNING_S.get(), config.STALL_TIMEOUT_S.get(),
                   config.STALL_ACTION.get())


@dataclass(frozen=True)
class PeerState:
    """What one rank answered to a survey (``seq`` is None if it did not answer).

    ``elsewhere`` names the collectives that rank's process waits in on its other
    transports (empty if none): where a rank that has not called a collective is.
    """

    rank: int
    seq: int | None
    waiting: bool = False
    collective: str = ""
    elsewhere: str = ""

    def where(self) -> str:
        """``rank 1 is at #4 barrier; it waits in allreduce elsewhere``."""
        text = (f"rank {self.rank} is at #{self.seq} {self.collective or '(none)'}"
                f"{' (waiting)' if self.waiting else ''}")
        if self.elsewhere:
            text += f"; it waits in {self.elsewhere}"
        return text


def describe(rank: int, collective: str, seq: int, waited: float,
             peers: list[PeerState] | None, blind: str = "", timed_out: bool = False) -> str:
    """The stall report of ``rank``: who has not arrived at its collective ``seq``.

    ``peers`` is None when no survey could be made, for the reason ``blind``.
    ``timed_out``: the report of the stall timeout (a StallError, an abort), which says
    so in words that log scanners look for ("timeout"), not only of a long wait.
    """
    waits = "hit the stall timeout after" if timed_out else "has waited"
    head = (f"rank {rank}: {collective} (collective #{seq} on this communicator) {waits} "
            f"{waited:.1f} s")
    if peers is None:
        return head + f" for other ranks; which ones have not arrived is unknown ({blind})"
    late = [p for p in peers if p.seq is not None and p.seq < seq]
    other = [p for p in peers if p.seq == seq and p.collective != collective]
    silent = [p.rank for p in peers if p.seq is None]
    parts = []
    if late:
        where = "; ".join(p.where() for p in late)
        parts.append(f"{_ranks([p.rank for p in late])} not called it ({where})")
    if other:
        parts.append("; ".join(f"rank {p.rank} called {p.collective} as #{seq} instead"
                               for p in other))
    if silent:
        parts.append(f"{_ranks(silent)} not answered within "
                     f"{SURVEY_S:.0f} s (busy outside Python, or dead)")
    if not parts:
        parts.append("every rank has called it (a slow network, or a hang inside MPI)")
    return head + ": " + "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    """``rank 2 has`` or ``ranks 1, 3 have``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return f"ranks {', '.join(str(r) for r in ranks)} have"


class Survey:
    """One round of queries to every other rank; ``done`` is set when it is over."""

    def __init__(self, on_done: Callable[[list[PeerState]], None] | None = None) -> None:
        self.qid = 0
        self.deadline = 0.0
        self.replies: dict[int, PeerState] = {}
        self.result: list[PeerState] = []
        self.on_done = on_done
        self.done = threading.Event()


class Inspector:
    """The stall state of one transport, served to the other ranks by the daemon.

    Args:
        transport: the transport whose ``seq``, ``current`` and ``waiting`` are served.
        limits: the stall limits (default: read from the environment, once, here).
    """

    def __init__(self, transport: Watched, limits: StallLimits | None = None) -> None:
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.limits = limits = limits or StallLimits.from_config()
        self.warning_s = limits.warning_s
        self.timeout_s = limits.timeout_s
        self.action = limits.action
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.comm: MPI.Intracomm | None = None
        self.stopped = ""  # why the daemon stopped serving this inspector
        if self.peers and (self.warning_s or self.timeout_s) and _SERVER.available():
            self.comm = transport.comm.Dup()
            self._query = np.zeros(1, np.int64)
            self._query_req = self.comm.Irecv(self._query, MPI.ANY_SOURCE, QUERY_TAG)
            self._status = MPI.Status()
            self._sends: list[MPI.Request] = []
            self._reply_bufs = {p: bytearray(_REPLY.size) for p in self.peers}
            self._reply_reqs: dict[int, MPI.Request | None] = dict.fromkeys(self.peers)
            self._qid = 0
            self._survey: Survey | None = None
            self._queue: list[Survey] = []
            self._watch_seq = -1
            self._watch_since = 0.0
            self._warned = self._aborting = self._noted = False
            _SERVER.add(self)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("mpitrain rank %d: stall inspector of a %d-rank communicator: %s",
                      self.rank, self.size, self.state())

    def state(self) -> str:
        """This inspector's limits, and whether other ranks can be asked where they are."""
        limits = (f"warning after {self.warning_s:g} s, " if self.warning_s else
                  "no warning, ") + (f"{self.action} after {self.timeout_s:g} s"
                                     if self.timeout_s else "no timeout")
        serving = ("surveys the other ranks" if self.comm is not None and not self.stopped
                   else f"stopped ({self.stopped})" if self.stopped
                   else "off (no other rank, no limit, or no MPI.THREAD_MULTIPLE)")
        return f"{limits}; {serving}"

    @property
    def watching(self) -> bool:
        """True while the daemon watches this inspector's transport: it then warns (and
        aborts) for every wait the transport flags, a shared-memory barrier's included."""
        return self.comm is not None and not self.stopped and _SERVER.running()

    @property
    def raises(self) -> bool:
        """True if a stall past the timeout raises StallError in the waiting thread."""
        return self.timeout_s > 0 and self.action == "raise"

    # -- the main thread's side ---------------------------------------------------------
    def survey(self) -> list[PeerState] | None:
        """Ask every other rank where it is; None if no daemon serves this inspector."""
        if self.comm is None or self.stopped or not _SERVER.running():
            return None
        survey = Survey()
        self._queue.append(survey)
        survey.done.wait(SURVEY_S + 1.0)
        return survey.result if survey.done.is_set() else None

    def report(self, collective: str, seq: int, waited: float,
               timed_out: bool = False) -> str:
        """:func:`describe` of this rank's stall, with a fresh survey."""
        peers = self.survey()
        blind = (f"the stall inspector stopped: {self.stopped}" if self.stopped else
                 "the stall inspector needs MPI.THREAD_MULTIPLE" if self.comm is None else
                 "the survey did not finish")
        return describe(self.rank, collective, seq, waited, peers, blind, timed_out)

    def close(self, free: bool = True) -> None:
        """Stop serving and (if ``free``) release the inspector communicator."""
        if self.comm is None:
            return
        _SERVER.remove(self)
        self._cancel()
        if free:
            with contextlib.suppress(MPI.Exception):  # revoked, or a failed peer
                self.comm.Free()
        self.comm = None

    def _cancel(self) -> None:
        """Cancel this inspector's receives (tolerating a failed or revoked peer)."""
        for req in [self._query_req, *self._reply_reqs.values()]:
            if req:
                try:
                    req.Cancel()
                    req.Wait()
                except MPI.Exception:
                    pass
        for survey in [self._survey, *self._queue]:
            if survey is not None:
                survey.done.set()

    # -- the daemon's side -------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Serve queries, watch for a stall, progress the current survey."""
        self._serve()
        self._watch(now)
        self._progress(now)

    def _serve(self) -> None:
        assert self.comm is not None
        t = self.transport
        while self._query_req.Test(self._status):
            reply = _REPLY.pack(int(self._query[0]), t.seq, int(t.waiting),
                                t.current.encode()[:_NAME_BYTES],
                                _SERVER.waits_besides(t).encode()[:_ELSEWHERE_BYTES])
            self._sends.append(self.comm.Isend(reply, self._status.Get_source(), REPLY_TAG))
            self._query_req = self.comm.Irecv(self._query, MPI.ANY_SOURCE, QUERY_TAG)
        self._sends = [r for r in self._sends if not r.Test()]

    def _watch(self, now: float) -> None:
        t = self.transport
        if not t.waiting:
            self._watch_seq = -1
            return
        if t.seq != self._watch_seq:
            self._watch_seq, self._watch_since = t.seq, now
            self._warned = self._aborting = self._noted = False
            return
        waited = now - self._watch_since
        seq, collective = t.seq, t.what()
        first = min(x for x in (self.warning_s, self.timeout_s) if x)
        if not self._noted and waited >= first / 2 and log.isEnabledFor(logging.DEBUG):
            self._noted = True
            log.debug("mpitrain rank %d: %s (collective #%d) has waited %.1f s for other "
                      "ranks; stall inspector: %s", self.rank, collective, seq, waited,
                      self.state())
        if self.warning_s and not self._warned and waited >= self.warning_s:
            self._warned = True
            self._queue.append(Survey(lambda peers: warn(
                describe(self.rank, collective, seq, waited, peers), self.timeout_s,
                self.action)))
        if (self.timeout_s and self.action == "abort" and not self._aborting
                and waited >= self.timeout_s):
            self._aborting = True
            self._queue.append(Survey(lambda peers: abort(
                describe(self.rank, collective, seq, waited, peers, timed_out=True))))

    def _progress(self, now: float) -> None:
        assert self.comm is not None
        survey = self._survey
        if survey is None:
            if not self._queue:
                return
            survey = self._survey = self._queue.pop(0)
            self._qid += 1
            survey.qid, survey.deadline = self._qid, now + SURVEY_S
            for peer in self.peers:
                self._sends.append(self.comm.Isend(np.array([self._qid], np.int64), peer,
                                                   QUERY_TAG))
        for peer, req in self._reply_reqs.items():
            if req is not None and req.Test():
                self._reply_reqs[peer] = None
                qid, seq, waiting, name, elsewhere = _REPLY.unpack(self._reply_bufs[peer])
                if qid == survey.qid:
                    survey.replies[peer] = PeerState(peer, seq, bool(waiting), _text(name),
                                                     _text(elsewhere))
        for peer in self.peers:
            if peer not in survey.replies and self._reply_reqs[peer] is None:
                self._reply_reqs[peer] = self.comm.Irecv(self._reply_bufs[peer], peer,
                                                         REPLY_TAG)
        if len(survey.replies) == len(self.peers) or now >= survey.deadline:
            survey.result = [survey.replies.get(p, PeerState(p, None)) for p in self.peers]
            self._survey = None
            survey.done.set()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("mpitrain rank %d: stall survey %d: %s", self.rank, survey.qid,
                          "; ".join(f"rank {p.rank} did not answer" if p.seq is None
                                    else p.where() for p in survey.result))
            if survey.on_done is not None:
                survey.on_done(survey.result)


def _text(field: bytes) -> str:
    """A string field of a reply (NUL-padded UTF-8, possibly cut mid-character)."""
    return field.rstrip(b"\0").decode(errors="replace")


def warn(report: str, timeout_s: float = 0.0, action: str = "raise") -> None:
    """Log the stall report of :func:`describe` as a warning, with what follows: the
    stall timeout's action (``timeout_s``), or how to set one."""
    if not timeout_s:
        then = "Set MPITRAIN_STALL_TIMEOUT_S to turn a stall into mpitrain.StallError"
    elif action == "abort":
        then = f"At {timeout_s:g} s (the stall timeout) the job is aborted"
    else:
        then = f"At {timeout_s:g} s (the stall timeout) it raises mpitrain.StallError"
    log.warning("mpitrain %s. %s.", report, then)


def abort(message: str) -> None:
    """MPITRAIN_STALL_ACTION=abort: print the stall report and end the whole job."""
    sys.stderr.write(f"mpitrain {message}; aborting the job (MPITRAIN_STALL_ACTION=abort)\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


class _Server:
    """The daemon thread that ticks every live inspector of this process."""

    def __init__(self) -> None:
        self.inspectors: list[Inspector] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def available(self) -> bool:
        """True if a daemon may call MPI concurrently with the main thread."""
        return (not self.stopping.is_set() and MPI.Is_initialized()
                and not MPI.Is_finalized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE)

    def running(self) -> bool:
        """True while the daemon thread is alive."""
        return self.thread is not None and self.thread.is_alive()

    def add(self, inspector: Inspector) -> None:
        """Serve ``inspector`` from the next tick on (starts the daemon on first use)."""
        with self.lock:
            self.inspectors.append(inspector)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="mpitrain-inspector",
                                               daemon=True)
                self.thread.start()

    def waits_besides(self, transport: Watched) -> str:
        """What this process waits in on transports other than ``transport`` (called on
        the daemon's tick, with the lock held): ``allreduce and barrier``, or ``""``."""
        return " and ".join(t.what() for t in (i.transport for i in self.inspectors)
                            if t is not transport and t.waiting)

    def remove(self, inspector: Inspector) -> None:
        """Stop serving ``inspector`` (waits for a tick in progress)."""
        with self.lock:
            if inspector in self.inspectors:
                self.inspectors.remove(inspector)

    def _run(self) -> None:
        while not self.stopping.wait(TICK_S):
            with self.lock:
                now = time.monotonic()
                for inspector in list(self.inspectors):
                    try:
                        inspector.tick(now)
                    except MPI.Exception as exc:  # a failed peer (ULFM) or a revoked comm
                        log.debug("mpitrain stall inspector of rank %d stops: %s",
                                  inspector.rank, exc)
                        inspector.stopped = str(exc)
                        self.inspectors.remove(inspector)

    def stop(self) -> None:
        """Stop the daemon and cancel its receives (before MPI is finalized)."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=1.0)
        with self.lock:
            for inspector in self.inspectors:
                inspector._cancel()
            self.inspectors.clear()


_SERVER = _Server()
atexit.register(_SERVER.stop)  # runs before mpi4py finalizes MPI


def live_inspectors() -> list[Inspector]:
    """The inspectors the daemon serves now (every communicator that can be surveyed)."""
    with _SERVER.lock:
        return list(_SERVER.inspectors)
