"""The async engine: a progress thread that negotiates, fuses and runs collectives.

Calls like ``comm.allreduce_async(x)`` check their arguments on the caller's thread
(local misuse raises there, at once), queue a :class:`~.request.Request` and wake the
engine's progress thread, which loops over *cycles*:

1. take the requests submitted since the last cycle;
2. agree with every rank on which names all ranks have submitted (:mod:`.negotiation`);
3. fail the agreed names whose submissions disagree (:class:`~mpitrain.MismatchError`
   on every rank, before any data moves);
4. cut the others into buckets (:mod:`.fusion`) and run them, in the same order on
   every rank;
5. finish their handles.

The thread works through its own :class:`~mpitrain.dispatch.Dispatcher` (on a
duplicate of the caller's communicator), so it never interferes with blocking calls
the caller makes meanwhile. A submission is checked by that dispatcher's
:class:`~mpitrain.dispatch.Checks` (the blocking calls' own) into a
:class:`~mpitrain.dispatch.Call`, and what every rank submitted runs through
:meth:`~mpitrain.dispatch.Dispatcher.execute` (a fusion bucket through
:meth:`~mpitrain.dispatch.Dispatcher.allreduce_flat`): the same algorithm selection,
plans and scaling as blocking calls, without a second cross-rank validation (step 3
compared the submissions). Blocking calls never go through the engine.

Device arrays: a submission records an event on the stream that produced its array
(``stream=``, default the submitting thread's current one); the engine waits for it
before it reads the array. An operation that writes only into memory its caller gave
(in place, or an allgather into ``out=``: a DDP bucket, a gradient of
``hvd.DistributedOptimizer``, an FSDP all-gather) then runs on the engine's own stream
of the device, which synchronizes with no other, so its kernels and copies overlap what
the caller queues after the submission (the rest of a backward pass); one stream per
engine, so that two communicators' collectives never queue behind each other. One whose
results are memory it allocates runs on the producer's stream, whose memory pool they
come from, so that the pool reuses them in that stream's order. Whichever thread runs
the cycle, a handle is done only once the results are written (the dispatcher's stream
scope synchronizes), so any stream may use them.

A caller blocked in :meth:`~.request.Handle.wait` runs cycles on its own thread
while no other thread is running one (:meth:`Engine._drive`; one lock makes the
cycles exclusive), which saves the two thread switches of handing the work to the
progress thread and back; it leaves the rest to the progress thread as soon as a
cycle moves nothing.

With nothing in flight the thread sleeps on a doorbell
(:func:`~mpitrain.backends.hostcopy.doorbell`) until a submission or
:meth:`Engine.stop` rings it; a cycle that changed nothing (ranks waiting for each
other's submissions) is followed by a pause of ``MPITRAIN_CYCLE_TIME_MS``, cut short
by the next submission. Woken by a submission, the thread stays off the GIL for
:data:`SUBMIT_SETTLE_S` before it looks for work: a caller that waits at once (every
blocking call of the framework adapters: ``hvd.allreduce``, a ``torch.distributed``
collective without ``async_op``) has run the cycle on its own thread by then, where
the two threads would otherwise pass the GIL back and forth in the middle of it.

:meth:`Engine.stop` is collective: the stop flag travels with the cycles, and the
thread ends in the first cycle in which every rank has asked to stop, after running
what all ranks submitted and failing what some rank never submitted.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from itertools import count
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

from .. import timeline
from ..backends import NUMPY, ArrayBackend, backend_named, hostcopy
from ..config import Settings
from ..dispatch import Call, Dispatcher
from ..errors import ArgumentError, CommunicationError, MismatchError, StallError
from ..ops import ReduceOp, parse_op
from .fusion import Bucket, BucketRunner, fusion_key, plan_buckets
from .negotiation import (
    CALL_SERIALS,
    NONAME,
    ORDERED,
    Agreement,
    Negotiator,
    Signatures,
    ordered_call,
)
from .request import Entry, Handle, Request, Spec, Waiters, complete_all, release_names

_SPEC_CACHE_SIZE = 4096
REFUSED = "refused"
"""The kind of a request that announces a submission refused on its rank
(:meth:`Engine._refused`); its signature, which names the rank, never matches."""
JOIN = "join"
"""The kind (and name) of the handle a caller of :meth:`Engine.join` waits on."""
MEET = "meet"
"""The kind of a meeting point (:meth:`Engine.meet`): it moves nothing."""
_NOTHING = np.empty(0, np.uint8)  # a meeting point's array
Blueprint = tuple[str, str, float, float, Any, int, bool, bool, str,
                  list[tuple[Any, tuple[int | None, ...]]], bool]
"""What a rank in ``join()`` needs to stand in for a request it never submitted: kind,
op, prescale, postscale, algorithm, root, inplace, grouped, backend name, the
(dtype, shape) of each array, and whether ranks in ``join()`` take part in it at all
(the submitting rank's :attr:`Engine.join_serves`)."""
JOIN_SERVES_ALL = frozenset({"allreduce", "reduce_scatter", "allgather", "broadcast"})
"""Every kind of async operation: what ranks in ``join()`` take part in by default."""
EXIT_TIMEOUT_S = 30.0
"""How long interpreter exit waits for the other ranks to stop an engine not stopped
by :func:`mpitrain.shutdown` before leaving its (daemon) thread behind."""

log = logging.getLogger("mpitrain")
SUBMIT_SETTLE_S = 200e-6
"""How long the progress thread, woken by a submission, stays off the GIL before it looks
for work: a caller that waits for what it submitted runs the cycle on its own thread
(:meth:`Engine._drive`) meanwhile, without the two threads handing the GIL back and
forth; an operation nobody waits for starts this much later."""
LOGGED_CYCLES = 256
"""How many kinds of cycle the DEBUG log remembers as logged (then it starts over)."""
_LIVE: set[Engine] = set()  # started and not stopped (each is kept alive by its thread)
_lanes = iter(range(1, 1 << 30))


@dataclass
class EngineStats:
    """Counters of an engine's work since it started.

    Attributes:
        cycles: negotiation cycles run.
        operations: operations finished (with a result or an error).
        collectives: collectives run for them (a fused bucket is one).
        fused: arrays that went through a fusion buffer.
        bytes: bytes of the arrays that were reduced, gathered or broadcast.
    """

    cycles: int = 0
    operations: int = 0
    collectives: int = 0
    fused: int = 0
    bytes: int = 0


class Engine:
    """The progress thread of one communicator and the submission calls that feed it.

    Args:
        comm: the communicator whose async calls this engine serves; the engine's
            dispatcher duplicates it (collective).
        settings: the communicator's settings (also the engine's: fusion threshold,
            cycle time).
        ordered: the callers make their unnamed submissions in one order on every rank,
            whatever their kinds (:attr:`ordered`).
    """

    def __init__(self, comm: MPI.Intracomm, settings: Settings, ordered: bool = False) -> None:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise CommunicationError(
                f"rank {comm.Get_rank()}: async operations need MPI_THREAD_MULTIPLE, but MPI "
                "was initialised with a lower thread level; leave mpi4py.rc.thread_level at "
                "its default ('multiple')")
        self.dispatcher = Dispatcher(comm, settings, validates=False)  # negotiation compares
        self.settings = settings
        self._checks = self.dispatcher.checks
        self.rank, self.size = self.dispatcher.rank, self.dispatcher.size
        self.stats = EngineStats()
        self._waiters = Waiters(self._drive)
        self._negotiator = Negotiator(self.dispatcher.mpi_comm, self._cycle_seconds(),
                                      self._waiters, self.dispatcher.shm,
                                      self.dispatcher.transport, ordered)
        self._runner = BucketRunner(self.dispatcher)
        if self.dispatcher.shm is not None:  # its barriers wait without taking the callers' core
            self.dispatcher.shm.others_busy = self._waiters.none_blocked
        self.lane = next(_lanes)
        """This engine's number in this process, in the order of their starts."""
        self.lane_name = f"mpitrain engine {self.lane} (rank 0 of {self.size})"
        self._lock = threading.Lock()  # guards the submission state below
        self._cond = threading.Condition(self._lock)  # guards the state below
        self._bell = hostcopy.doorbell()  # the progress thread sleeps on it (_sleep)
        self._cycling = threading.Lock()  # held by the thread running a cycle
        self._incoming: list[Request] = []
        self._due: list[tuple[Callable[[Handle], None], Handle]] = []  # callbacks to call
        self._batches = 0  # open batch() blocks: the progress thread leaves _incoming alone
        self._unrung = threading.local()  # .on: this thread is in a waited() block
        self._in_flight: set[str] = set()
        self._counters: defaultdict[str, Iterator[int]] = defaultdict(count)
        self._specs: dict[tuple[Any, ...], Spec] = {}
        self._streams: dict[tuple[str, int], Any] = {}  # (backend, device) -> own stream
        self._stopping = False
        self._closed: str | None = None  # why new submissions are refused
        self._pending: dict[str, Request] = {}  # progress thread only
        self._running: list[Request] = []  # this cycle's submissions (progress thread only)
        self._join: Request | None = None  # the handle of this rank's join() in progress
        self.joined: list[int] = []
        """The ranks in ``join()`` as of this rank's last cycle."""
        self.join_serves: frozenset[str] = JOIN_SERVES_ALL
        """The kinds of operation (``allreduce``, grouped ones included,
        ``reduce_scatter``, ``allgather``, ``broadcast``) that ranks in ``join()`` take
        part in. An operation of another kind, submitted while some ranks are in
        ``join()``, fails with :class:`~mpitrain.CommunicationError` on the ranks that
        submitted it. The submitting ranks' setting decides (the lowest rank's, should
        they differ), so every rank reaches the same verdict."""
        self.ordered = ordered
        """True where the callers make their unnamed submissions in one order on every
        rank, whatever their kinds (torch.distributed's rule): they are numbered from
        one counter (:data:`ORDERED`) instead of one per kind, so that ranks whose
        ``n``-th unnamed submissions are of different kinds get
        :class:`~mpitrain.MismatchError` instead of waiting for each other."""
        self._met = False  # a meeting point was submitted (the cycles look for them)
        # per thread: .on, the thread is in a call() block; .serials, its serials once drawn
        self._call = threading.local()
        self._finished = False
        self._freed = False
        self._logged_cycles: set[tuple[Any, ...]] = set()  # the kinds of cycle logged (DEBUG)
        self._worker = threading.Thread(target=self._loop, daemon=True,
                                        name=f"mpitrain-engine-{self.lane}-rank{self.rank}")
        self._worker.start()
        _LIVE.add(self)

    # -- submission (caller's thread) -------------------------------------------------
    # The caller's values (op, name, scaling, algorithm, root, arrays) are typed Any:
    # they are checked by the dispatcher's Checks (the blocking calls' own), and this
    # module may be compiled (mypyc), where an annotation is enforced at the call (a
    # np.float32 prescale would be a TypeError). Each call looks its arguments up in
    # ``_specs``: the checks, the signature text and the fusion key are made once per
    # distinct arguments (a :class:`Spec`); a submission then only checks what belongs
    # to the array itself (Checks.array: write-through and writeable, in place).
    # ``stream``: where a device input is produced (None: the current stream); an event
    # recorded there now is what the engine waits for before it reads the input (where
    # the operation runs: :meth:`_ready`).
    def allreduce(self, x: Any, op: Any, name: Any, prescale: Any,
                  postscale: Any, algorithm: Any, inplace: bool, stream: Any = None) -> Handle:
        """Queue an allreduce of ``x`` (in place if ``inplace``)."""
        be: ArrayBackend
        try:
            be, arr = self._checks.array(x, "allreduce_async_" if inplace else
                                         "allreduce_async", inplace)
            key = ("allreduce", be, arr.dtype, arr.shape, op, prescale, postscale, algorithm,
                   inplace)
            spec = self._known_spec(key) or self._new_spec(key, lambda: self._spec(
                self._checks.reduction("allreduce", be, arr, op, prescale, postscale,
                                       algorithm, inplace)))
        except Exception as exc:
            self._refused("allreduce", name, exc)
            raise
        return self._submit("allreduce", name, spec, arr, x if inplace else None, None,
                            self._ready(be, arr, stream, inplace))

    def grouped_allreduce(self, xs: Any, op: Any, name: Any,
                          prescale: Any, postscale: Any, algorithm: Any,
                          inplace: bool, stream: Any = None) -> Handle:
        """Queue one allreduce of every array of ``xs``, fused (one collective per dtype)."""
        try:
            if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
                raise ArgumentError(f"rank {self.rank}: grouped_allreduce needs a list of "
                                    f"arrays, got {type(xs).__name__}")
            what = "grouped_allreduce_" if inplace else "grouped_allreduce"
            entries = []
            for x in xs:
                be, arr = self._checks.array(x, what, inplace)
                entries.append(Entry(arr, be, arr.dtype, x if inplace else None))
            arrays = tuple((e.backend, e.dtype, e.array.shape) for e in entries)
            key = ("grouped_allreduce", arrays, op, prescale, postscale, algorithm, inplace)
            spec = self._known_spec(key) or self._new_spec(key, lambda: self._group_spec(
                entries, op, prescale, postscale, algorithm, inplace))
        except Exception as exc:
            self._refused("grouped_allreduce", name, exc)
            raise
        ready = self._ready(entries[0].backend, entries[0].array, stream,
                            inplace) if entries else None
        return self._submit("grouped_allreduce", name, spec, None, None, entries, ready)

    def allgather(self, x: Any, name: Any, algorithm: Any, stream: Any = None,
                  out: Any = None) -> Handle:
        """Queue an allgather of ``x`` (axis 0 may differ between ranks), into ``out``
        if given (its rows are part of what the ranks agree on)."""
        try:
            be, arr = self._checks.array(x, "allgather_async", False)
            rows = None
            if out is not None:  # checked here; the run writes into it through its own view
                rows = self._checks.rows(out)
                self._checks.out(be, out, (rows, *arr.shape[1:]), arr.dtype, "allgather_async")
            key = ("allgather", be, arr.dtype, (None, *arr.shape[1:]), algorithm, rows)
            spec = self._known_spec(key) or self._new_spec(
                key, lambda: self._spec(self._checks.allgather(be, arr, algorithm), rows))
        except Exception as exc:
            self._refused("allgather", name, exc)
            raise
        return self._submit("allgather", name, spec, arr, out, None,
                            self._ready(be, arr, stream, out is not None))

    def broadcast(self, x: Any, root: Any, name: Any, algorithm: Any,
                  inplace: bool, stream: Any = None) -> Handle:
        """Queue a broadcast of the root's ``x`` (into ``x`` itself if ``inplace``)."""
        what = "broadcast_async_" if inplace else "broadcast_async"
        try:
            be, arr = self._checks.array(x, what, inplace)
            key = ("broadcast", be, arr.dtype, arr.shape, root, algorithm, inplace)
            spec = self._known_spec(key) or self._new_spec(key, lambda: self._spec(
                self._checks.broadcast(be, arr, root, algorithm, inplace)))
        except Exception as exc:
            self._refused("broadcast", name, exc)
            raise
        return self._submit("broadcast", name, spec, arr, x if inplace else None, None,
                            self._ready(be, arr, stream, inplace))

    def reduce_scatter(self, x: Any, op: Any, name: Any, prescale: Any,
                       postscale: Any, algorithm: Any, stream: Any = None) -> Handle:
        """Queue a reduce-scatter of ``x`` (this rank gets its block of axis 0)."""
        try:
            be, arr = self._checks.array(x, "reduce_scatter_async", False)
            key = ("reduce_scatter", be, arr.dtype, arr.shape, op, prescale, postscale,
                   algorithm)
            spec = self._known_spec(key) or self._new_spec(key, lambda: self._spec(
                self._checks.reduction("reduce_scatter", be, arr, op, prescale, postscale,
                                       algorithm)))
        except Exception as exc:
            self._refused("reduce_scatter", name, exc)
            raise
        return self._submit("reduce_scatter", name, spec, arr, None, None,
                            self._ready(be, arr, stream, False))

    def _ready(self, be: ArrayBackend, arr: Any, stream: Any,
               own: bool) -> tuple[Any, Any] | None:
        """For a device array, an event recorded now on the stream ``stream`` names
        (None: the current one) of its device, and the stream where the operation will
        run: the engine's own stream of the device where it writes only into memory the
        caller gave (``own``: in place, or into ``out=``), so that it overlaps the
        caller's later work, else the producer's stream, whose memory pool its results
        come from (their memory is then reused in that stream's order, never under a
        later reader). ``None`` for host arrays."""
        if not be.is_device:
            return None
        producer = be.stream(arr, stream)
        return be.record(arr, producer), self._own_stream(be, arr) if own else producer

    def _own_stream(self, be: ArrayBackend, arr: Any) -> Any:
        """The engine's stream of ``arr``'s device, made on first use: one per engine, so
        that collectives of two communicators never queue behind each other (two NCCL
        kernels in different orders on two ranks would wait for each other forever)."""
        key = (be.name, be.device_id(arr))
        stream = self._streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._streams.setdefault(key, be.new_stream(arr))
        return stream

    def _spec(self, call: Call, out_rows: int | None = None) -> Spec:
        """The spec of a checked call of one array: its agreed text (with the rows of an
        allgather's ``out=``) and fusion key."""
        op = call.op.value if call.op is not None else None
        described = describe((call.collective, op, call.dtype, call.shape, call.prescale,
                              call.postscale, call.algorithm, call.root, call.backend.name))
        if out_rows is not None:
            described += f" into {out_rows} rows"
        fusion = fusion_key(call.backend.name, call.dtype, op, call.prescale, call.postscale,
                            call.algorithm) if call.collective == "allreduce" else ""
        return Spec(call.collective, described, call, fusion=fusion)

    def _group_spec(self, entries: list[Entry], op: Any, prescale: Any,
                    postscale: Any, algorithm: Any, inplace: bool) -> Spec:
        """The checked spec of a grouped allreduce of arrays like ``entries``'."""
        calls = [self._checks.reduction("allreduce", e.backend, e.array, op, prescale,
                                        postscale, algorithm, inplace) for e in entries]
        if not calls:  # nothing will run (_submit finishes it), but the arguments count
            rop = parse_op(op)
            pre, post = self._checks.factors(prescale, postscale)
            return Spec("allreduce", describe(("grouped_allreduce", rop.value, None, (), pre,
                                               post, None, 0, NUMPY.name)), None, grouped=True)
        first = calls[0]
        rop = first.op or ReduceOp.SUM
        arrays = tuple((c.dtype, c.shape) for c in calls)
        described = describe(("grouped_allreduce", rop.value, None, arrays, first.prescale,
                              first.postscale, first.algorithm, 0, first.backend.name))
        return Spec("allreduce", described, first, grouped=True)

    def _refused(self, kind: str, name: Any, exc: Exception) -> None:
        """This rank refused its next ``kind`` submission (named ``name``) with ``exc``:
        announce the refusal in its place, so that the other ranks' submissions of that
        name fail with :class:`~mpitrain.MismatchError` (naming this rank and ``exc``)
        instead of waiting for this rank's forever."""
        if name is None:
            name, serial = self._generated(kind)  # the name this submission would have had
        elif isinstance(name, str) and name:
            serial = -1
        else:
            return  # no name to announce: the other ranks' stall detection reports it
        if self.size == 1:
            return
        text = f"{exc}".replace("\n", " ")
        spec = Spec(REFUSED, f"{REFUSED} on rank {self.rank}: {type(exc).__name__}: {text}",
                    None)
        refusal = Request(name, spec, None, None, self._waiters, serial, None, [])
        with self._lock:
            if self._closed is not None or name in self._in_flight:
                return
            self._incoming.append(refusal)
            self._wake()

    def refuse(self, kind: str, name: Any, exc: Exception) -> None:
        """Announce, as :meth:`_refused` does, that a caller above the engine (a framework
        adapter's own argument checks) refused this rank's next ``kind`` submission
        (named ``name``; ``None`` takes the next unnamed one) with ``exc``."""
        self._refused(kind, name, exc)

    def _known_spec(self, key: tuple[Any, ...]) -> Spec | None:
        """The spec kept for ``key``, if any (none for unhashable arguments)."""
        try:
            return self._specs.get(key)
        except TypeError:
            return None

    def _new_spec(self, key: tuple[Any, ...], build: Callable[[], Spec]) -> Spec:
        """Build (checking the arguments: misuse raises here) and keep the spec of ``key``."""
        spec = build()
        if len(self._specs) >= _SPEC_CACHE_SIZE:
            self._specs.clear()
        with contextlib.suppress(TypeError):  # an unhashable argument that passed: not kept
            self._specs[key] = spec
        return spec

    def _submit(self, what: str, name: Any, spec: Spec, array: Any, output: Any,
                entries: list[Entry] | None = None,
                ready: tuple[Any, Any] | None = None) -> Handle:
        # The request is made before taking the lock (the counter's next() is atomic).
        # Only a given name is tracked, so only its handle has one to release.
        event, stream = ready if ready is not None else (None, None)
        if name is None:  # generated names are unique: never tracked
            generated, serial = self._generated(what)
            request = Request(generated, spec, array, output, self._waiters,
                              serial, None, entries, event, stream)  # generated_name()
        elif isinstance(name, str) and name:
            request = Request(name, spec, array, output, self._waiters, -1,
                              self._release_name, entries, event, stream)
        else:
            raise ArgumentError(f"rank {self.rank}: name must be a non-empty string, "
                                f"got {name!r}")
        with self._lock:
            if self._closed is not None:
                self._check_open()
            if self._join is not None:
                raise ArgumentError(
                    f"rank {self.rank}: cannot submit {request.name!r}: this rank is in "
                    "join(), which lets no new operation in until every rank has joined; "
                    "submit it before join() or after it returns")
            if name is not None and name in self._in_flight:
                raise ArgumentError(
                    f"rank {self.rank}: an async operation named {name!r} is already in "
                    "flight; wait for its handle before submitting that name again, or "
                    "give this one another name")
            if entries is not None and not entries:  # an empty group: nothing to move
                complete_all([request])
                return request
            if name is not None:
                self._in_flight.add(name)
            self._incoming.append(request)
            if not self._batches and not getattr(self._unrung, "on", False):
                self._wake(settle=True)
        return request

    def meet(self, what: Any, name: Any = None) -> Handle:
        """Submit a meeting point: it moves nothing and is done once every rank has
        submitted it, after the collectives agreed in the same cycle have run. Every
        rank must submit it with the same ``what`` (a text naming the caller's own
        collective, which it is the signature of), or they all get
        :class:`~mpitrain.MismatchError`. In an ordered engine it takes its place in the
        order of the other submissions, so that a caller that runs a collective of its
        own (MPI's) after it meets the other ranks where they are: a rank in another
        collective fails at once instead of waiting for this one."""
        key = (MEET, what)
        spec = self._known_spec(key)
        if spec is None:
            spec = self._new_spec(key, lambda: Spec(MEET, f"{what}", None))
        self._met = True
        return self._submit(MEET, name, spec, _NOTHING, None)

    def _generated(self, kind: str) -> tuple[str, int]:
        """The name and serial of this rank's next unnamed submission of ``kind``:
        ``<kind>.noname.<n>`` from the kind's counter, or in an ordered engine
        ``collective.noname.<n>`` from the calls' (:data:`CALL_SERIALS`)."""
        if not self.ordered:
            serial = next(self._counters[kind])
            return f"{kind}{NONAME}{serial}", serial
        local = self._call
        serials = getattr(local, "serials", None)
        if serials is None:
            serials = count(next(self._counters[ORDERED]) * CALL_SERIALS)
            if getattr(local, "on", False):
                local.serials = serials
        serial = next(serials)
        return f"{ORDERED}{NONAME}{serial}", serial

    def call(self) -> CallBlock:
        """A block (``with engine.call():``) whose unnamed submissions are one call of an
        ordered engine (:attr:`ordered`): they take consecutive serials of one block of
        :data:`CALL_SERIALS`, so every rank's next call starts at the same serial
        whatever this one submitted. Nested blocks belong to the outer one; a block
        is its thread's (another thread's submissions meanwhile are calls of their own)."""
        return CallBlock(self)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the submissions made inside the block until it ends, so that they reach
        one cycle together (one negotiation, fused as far as the threshold allows)
        instead of trickling into the cycles the progress thread would start at the
        first of them. A caller that waits on a handle inside the block runs the cycle
        itself (nothing is held from it), so waiting there cannot hang."""
        with self._lock:
            self._batches += 1
        try:
            yield
        finally:
            with self._cond:
                self._batches -= 1
                if not self._batches and self._incoming:
                    self._wake()

    def waited(self) -> WaitedBlock:
        """A block (``with engine.waited():``) whose submissions by this thread do not
        ring the progress thread's doorbell: the caller promises to wait for them as
        soon as the block ends, and its ``wait()`` runs their cycle itself
        (:meth:`_drive`), as it would have anyway. On a rank whose threads share one
        core, the woken thread took the core from the caller in the middle of its work
        between submitting and waiting (a blocking ``torch.distributed`` call's); a
        block that raises rings, so that what it submitted is not left to a wait that
        never comes. Nested blocks belong to the outer one."""
        return WaitedBlock(self)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise CommunicationError(f"rank {self.rank}: cannot start an async operation: the "
                                     f"engine {self._closed}")

    # -- control ----------------------------------------------------------------------
    def join(self) -> int:
        """Wait until every rank has called ``join()``, serving the other ranks'
        operations meanwhile, and return the rank that joined last (the same on every
        rank; of ranks that joined in the same cycle, the highest).

        While this rank is in ``join()``, an operation that every other rank not in
        ``join()`` has submitted runs with this rank taking part with stand-in arrays:
        the identity of the op for reductions (zeros for Sum and Average, which still
        divides by the full size), no rows for an allgather, a receive buffer for a
        broadcast; a broadcast from a root in ``join()`` fails on the ranks that
        submitted it.

        Raises:
            ArgumentError: another thread of this rank is already in ``join()``.
            CommunicationError: a rank stopped its engine without joining, or the
                engine failed.
        """
        handle = Request(JOIN, Spec(JOIN, JOIN, None), None, None,
                         self._waiters, -1, None, [])
        with self._cond:
            self._check_open()
            if self._join is not None:
                raise ArgumentError(f"rank {self.rank}: join() is already in progress on "
                                    "another thread of this rank")
            self._join = handle
            self._wake()
        return int(handle.wait())

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the engine (collective): finish or fail what is in flight, end the thread.

        Returns:
            False if the thread was still running after ``timeout`` seconds.
        """
        with self._cond:
            self._stopping = True
            self._closed = self._closed or "has been shut down"
            self._wake()
        self._worker.join(timeout)
        if self._worker.is_alive():
            return False
        if not self._freed:
            self._freed = True
            self.dispatcher.free()
        _LIVE.discard(self)
        return True

    def snapshot(self) -> EngineStats:
        """A copy of the counters."""
        return dataclasses.replace(self.stats)

    # -- progress thread --------------------------------------------------------------
    def _loop(self) -> None:
        progressed = True
        try:
            while not self._finished:
                with self._cond:
                    if not self._has_work():
                        # a waiting caller may have taken the work we were woken for
                        while not self._has_work() and not self._finished:
                            self._sleep(-1.0)
                    elif not progressed and not (self._incoming and not self._batches):
                        self._sleep(self._cycle_seconds())
                with self._cycling:  # a waiting caller may be running a cycle
                    # never an empty cycle: every rank would have to match it
                    if not self._finished:
                        progressed = self._step(False) if self._has_work() else True
                if self._due:
                    self._call_back()
        except BaseException as exc:  # a bug or an MPI failure: fail everything, never hang
            self._abort(exc)
            self._call_back()
        finally:
            tl = timeline.current()
            if tl is not None:
                tl.flush()

    def _has_work(self, driving: bool = False) -> bool:
        """Whether a cycle has something to do; the progress thread (not ``driving``)
        leaves submissions held by :meth:`batch` alone."""
        return bool((self._incoming and (driving or not self._batches)) or self._pending) \
            or self._stopping or self._join is not None

    def _sleep(self, timeout: float) -> None:
        """Sleep on the doorbell until :meth:`_wake` or ``timeout`` seconds (< 0: no
        limit); called and returns holding ``_cond``, which it lets go meanwhile (a
        ring after the release makes the sleep return at once)."""
        self._cond.release()
        try:
            self._bell.sleep(timeout, SUBMIT_SETTLE_S)
        finally:
            self._cond.acquire()

    def _wake(self, settle: bool = False) -> None:
        """Wake the progress thread, or make its next sleep return at once (hold
        ``_cond``). ``settle``: a new submission, which the caller may be about to wait
        for and so run on its own thread (:meth:`_drive`): the thread then waits
        :data:`SUBMIT_SETTLE_S` before it takes the GIL, and sleeps on if the caller took
        the work (:meth:`_step`) meanwhile."""
        self._bell.ring(settle)

    def _drive(self, handle: Handle) -> None:
        """Run cycles on the thread of a caller blocked in ``handle.wait()``.

        The caller would only sleep until the progress thread had run them; running
        them here saves the two thread switches of that hand-over (with the GIL, each
        costs tens of microseconds). Returns when the handle is done, when a cycle
        moved nothing (other ranks have not submitted yet), or when another thread is
        running a cycle. Whatever is left (requests other ranks have not submitted
        yet, new submissions) goes back to the progress thread, woken if asleep: the
        caller may not wait again, and other ranks' cycles need this rank's.
        """
        ran = False
        try:
            while not handle.done and not self._finished:
                if not self._cycling.acquire(blocking=False):
                    return
                try:
                    if handle.done or self._finished or not self._has_work(True):
                        return
                    ran = True
                    if not self._step(True):
                        return
                except BaseException as exc:  # as in the progress thread: fail everything
                    self._abort(exc)
                    return
                finally:
                    self._cycling.release()
        finally:
            if self._due:
                self._call_back()
            if ran:
                with self._cond:
                    if self._has_work():
                        self._wake()

    def _step(self, driving: bool) -> bool:
        """Take the new submissions (unless a :meth:`batch` holds them from the progress
        thread) and run one cycle."""
        with self._cond:
            stopping = self._stopping
            if driving or stopping or not self._batches:
                incoming, self._incoming = self._incoming, []
                if driving and incoming:
                    self._bell.taken()
            else:
                incoming = []
            joining = self._join is not None
        return self._cycle(incoming, stopping, joining)

    def _cycle(self, incoming: list[Request], stopping: bool, joining: bool = False) -> bool:
        """Run one cycle (``joining``: this rank is in ``join()``); True if anything
        moved (on any rank)."""
        self.stats.cycles += 1
        self._running = incoming  # before the exchange, so that _abort sees them if it fails
        agreement = self._negotiator.exchange(incoming, stopping,
                                              self.settings.fusion_threshold, joining)
        self.joined = [] if agreement.all_joined else agreement.joined
        agreed_at = time.perf_counter()
        tl = timeline.current()
        if agreement.same:  # all of them, in submission order
            runnable = incoming
            ready = incoming
        else:
            pending, mismatched = self._pending, agreement.mismatched
            for request in incoming:
                pending[request.name] = request
            if agreement.missing:
                ready, runnable = self._joined_ready(agreement)
            else:
                ready = [pending.pop(name) for name in agreement.ready]
                runnable = []
            for request in ready:
                if request.name in mismatched:
                    request.error = MismatchError(self._mismatch(request.name,
                                                                 mismatched[request.name]))
                    self._finish([request])
                elif not agreement.missing:
                    runnable.append(request)
        if tl is not None:
            for request in ready:
                tl.span(self.lane, self.lane_name, request.name, "QUEUE",
                        request.submitted_at, agreed_at)
        met: list[Request] = []
        if self._met and any(r.spec.kind == MEET for r in runnable):
            met = [r for r in runnable if r.spec.kind == MEET]
            runnable = [r for r in runnable if r.spec.kind != MEET]
        buckets = plan_buckets(runnable, agreement.threshold)
        if (buckets or agreement.news) and log.isEnabledFor(logging.DEBUG):
            self._log_cycle(len(ready), buckets, agreement.threshold)
        for number, bucket in enumerate(buckets):
            self._run(bucket, number, tl)
        if met:  # after the collectives that came before them
            self._finish(met)
        if agreement.abandoned:
            self._give_up(agreement)
        if self._join is not None:
            self._join_progress(agreement)
        if agreement.all_stopped:
            for request in list(self._pending.values()):
                missing = self._negotiator.waiting_for(request.name)
                request.error = CommunicationError(
                    f"rank {self.rank}: the async engine was shut down before rank(s) "
                    f"{missing} submitted {request.name!r}; every rank must submit each async "
                    "operation before shutdown")
                self._finish([request])
            self._pending.clear()
            self._finished = True
        self._running = []
        if tl is not None:
            tl.flush()
        return agreement.news or bool(agreement.ready) or agreement.all_joined

    def _log_cycle(self, ready: int, buckets: list[Bucket], threshold: int) -> None:
        """Log (DEBUG) what a cycle agreed on, its fusion buckets and the operations that
        wait for other ranks, the first time a cycle of that kind runs (a training loop's
        steps repeat a few kinds of cycle: each is logged once; the record is cleared
        after :data:`LOGGED_CYCLES` kinds)."""
        layout = tuple((len(b.items), b.nbytes) for b in buckets)
        waiting = sorted(self._pending)
        shape = (ready, layout, threshold, tuple(waiting))
        if shape in self._logged_cycles:
            return
        if len(self._logged_cycles) >= LOGGED_CYCLES:
            self._logged_cycles.clear()
        self._logged_cycles.add(shape)
        cycle = self._negotiator.cycle
        shown = ", ".join(f"{n} op(s) in {b} B" for n, b in layout[:8])
        log.debug("mpitrain rank %d: engine cycle %d: %d operation(s) agreed by every rank; "
                  "%d bucket(s) (fusion threshold %d B)%s%s", self.rank, cycle, ready,
                  len(layout), threshold, ": " if shown else "", shown
                  + (", ..." if len(layout) > 8 else ""))
        if waiting:
            log.debug("mpitrain rank %d: engine cycle %d: %d operation(s) wait for other "
                      "ranks: %s", self.rank, cycle, len(waiting), "; ".join(
                          f"{name!r} not yet submitted by rank(s) "
                          f"{self._negotiator.waiting_for(name)}" for name in waiting[:8]))

    def _joined_ready(self, agreement: Agreement) -> tuple[list[Request], list[Request]]:
        """The ready requests of a cycle in which ranks in ``join()`` stand in for names
        they never submitted (:attr:`Agreement.missing`): this rank's own ready requests,
        and the runnable ones in ``ready`` order, stand-ins included, the same on every
        rank. The ranks tell each other what each missing name they submitted is
        (:data:`Blueprint`; the lowest such rank's word counts)."""
        pending, missing, mismatched = self._pending, agreement.missing, agreement.mismatched
        serves = self.join_serves
        mine = {name: _blueprint(pending[name], serves) for name in missing
                if name not in mismatched and name in pending}
        blueprints: dict[str, Blueprint | None] = {}
        for theirs in self._negotiator.share(mine):
            for name, blueprint in theirs.items():
                blueprints.setdefault(name, blueprint)
        ready: list[Request] = []
        runnable: list[Request] = []
        for name in agreement.ready:
            request = pending.pop(name, None)
            blueprint = blueprints.get(name)
            if request is None and self.rank in missing.get(name, ()):
                self._pass_generated(name)
            if request is not None:
                ready.append(request)
                if name in mismatched:
                    continue
                if request.spec.kind == REFUSED:  # its caller has had the error
                    request.error = ArgumentError(request.spec.signature)
                    self._finish([request])
                elif request.spec.kind == MEET and name in missing:
                    request.error = CommunicationError(
                        f"rank {self.rank}: the ranks cannot meet for {request.spec.signature} "
                        f"({name!r}) while ranks {missing[name]} are in join(), where they "
                        "take part in async collectives only; call it before any rank "
                        "joins or after join() returns")
                    self._finish([request])
                elif blueprint is not None and not blueprint[10]:
                    request.error = CommunicationError(
                        f"rank {self.rank}: the {blueprint[0]} {name!r} cannot run while "
                        f"ranks {missing[name]} are in join(): ranks in join() take part "
                        f"in {', '.join(sorted(self.join_serves)) or 'nothing'} only here. "
                        "Finish the other collectives before any rank joins (for "
                        "DistributedOptimizer with sparse gradients: sparse_as_dense=True)")
                    self._finish([request])
                elif blueprint is not None and blueprint[0] == "broadcast" \
                        and blueprint[5] in missing.get(name, ()):
                    request.error = CommunicationError(
                        f"rank {self.rank}: the broadcast {name!r} has root {blueprint[5]}, "
                        f"which is in join() and never submitted it: a rank in join() "
                        "has no data to send. Broadcast from a rank that has not joined, "
                        "or submit the broadcast on the root before it joins")
                    self._finish([request])
                else:
                    runnable.append(request)
            elif blueprint is not None and blueprint[10] and not (
                    blueprint[0] == "broadcast" and blueprint[5] in missing[name]):
                runnable.append(self._stand_in(name, blueprint))
        return ready, runnable

    def _pass_generated(self, name: str) -> None:
        """This rank, in ``join()``, never submitted ``name`` (it stands in for it, or sees
        it fail): if it is a generated name (``<kind>.noname.<n>``), this rank's counter
        of that kind (or of an ordered engine's calls) moves past ``n`` as the
        submitters' did, so that the ranks' next unnamed operations have the same names
        again. (The caller's thread submits
        nothing while this rank is in ``join()``.)"""
        kind, sep, serial = name.partition(NONAME)
        if not (sep and serial.isdigit()):
            return
        passed = int(serial) // CALL_SERIALS if kind == ORDERED and self.ordered \
            else int(serial)
        with self._lock:
            mine = next(self._counters[kind])
            self._counters[kind] = count(max(mine, passed + 1))

    def _stand_in(self, name: str, blueprint: Blueprint) -> Request:
        """The request with which this rank, in ``join()``, takes part in the operation
        ``name`` that it never submitted: arrays of the op's identity (no rows for an
        allgather), with the spec the submitters' arguments give."""
        kind, op, pre, inplace, grouped, arrays = (blueprint[0], blueprint[1], blueprint[2],
                                                   blueprint[6], blueprint[7], blueprint[9])
        be = backend_named(blueprint[8])
        rop = ReduceOp(op)
        made = []
        for dtype, shape in arrays:
            if kind == "allgather":
                shape = (0, *shape[1:])
            dims = tuple(int(d or 0) for d in shape)
            flat = be.empty(int(np.prod(dims, dtype=np.int64)), dtype)
            flat.fill(identity(rop, dtype, pre))
            made.append(flat.reshape(dims))
        key = ("stand-in", *blueprint[:9], tuple(arrays))
        spec = self._known_spec(key)
        if spec is None:
            spec = self._new_spec(key, lambda: self._stand_in_spec(blueprint, be, made))
        if grouped:
            entries = [Entry(a, be, a.dtype, a if inplace else None) for a in made]
            return Request(name, spec, None, None, self._waiters, -1, None, entries)
        return Request(name, spec, made[0], made[0] if inplace else None, self._waiters)

    def _stand_in_spec(self, blueprint: Blueprint, be: ArrayBackend, made: list[Any]) -> Spec:
        """The spec of a stand-in (:meth:`_stand_in`): built by the same checks as the
        submitters' specs, so that it fuses and runs the same way."""
        kind, op, pre, post, algorithm, root, inplace, grouped, _, _, _ = blueprint
        if grouped:
            entries = [Entry(a, be, a.dtype) for a in made]
            return self._group_spec(entries, op, pre, post, algorithm, inplace)
        if kind == "allgather":
            return self._spec(self._checks.allgather(be, made[0], algorithm))
        if kind == "broadcast":
            return self._spec(self._checks.broadcast(be, made[0], root, algorithm, inplace))
        return self._spec(self._checks.reduction(kind, be, made[0], op, pre, post, algorithm,
                                                 inplace))

    def _join_progress(self, agreement: Agreement) -> None:
        """Finish this rank's ``join()`` once every rank is in it (with the last rank to
        join), or fail it if a rank stopped its engine without joining."""
        handle = self._join
        if handle is None:
            return
        if agreement.all_joined:
            handle.output = agreement.last_joined
        else:
            gone = [r for r in agreement.stopped if r not in agreement.joined]
            if not gone:
                return
            handle.error = CommunicationError(
                f"rank {self.rank}: join() can never finish: rank(s) {gone} stopped their "
                "async engine (mpitrain.shutdown(), or the end of the program) without "
                "calling join(); every rank must call join()")
        handle.entries = None
        with self._cond:
            self._join = None
        complete_all([handle])  # not an operation: not counted in the stats
        self._waiters.notify()

    def _run(self, bucket: Bucket, number: int, tl: timeline.Timeline | None) -> None:
        error: BaseException | None = None
        phases = []
        try:
            phases = self._runner.run(bucket, tl is not None)
        except Exception as exc:  # e.g. an MPI error: every request of the bucket gets it
            error = exc
        self.stats.collectives += 1
        self.stats.bytes += bucket.nbytes
        if len(bucket.items) > 1:
            self.stats.fused += len(bucket.items)
        if tl is not None:
            args = {"bucket": f"{self.stats.cycles}.{number}", "tensors": len(bucket.items),
                    "bytes": bucket.nbytes}
            for request in bucket.requests:
                for phase, start, end in phases:
                    tl.span(self.lane, self.lane_name, request.name, phase, start, end, args)
        done = []
        for request, _ in bucket.items:
            if error is not None and request.error is None:
                request.error = error
            request.unfinished -= 1
            if not request.unfinished:
                done.append(request)
        self._finish(done)

    def _give_up(self, agreement: Agreement) -> None:
        """Fail this rank's requests that the ranks gave up (:attr:`Agreement.abandoned`):
        :class:`~mpitrain.StallError` for a stall, else CommunicationError."""
        pending = self._pending
        for name, why in agreement.abandoned.items():
            request = pending.pop(name, None)
            if request is None:
                continue  # this rank never submitted it
            error = StallError if name in agreement.stalled else \
                MismatchError if name in agreement.disagreed else CommunicationError
            request.error = error(f"rank {self.rank}: {why}")
            self._finish([request])

    def _release_name(self, name: str) -> None:
        """The operation named ``name`` is done: the name may be submitted again."""
        with self._cond:
            self._in_flight.discard(name)

    def _finish(self, requests: list[Request]) -> None:
        """Hand out the requests' results (or errors); their callbacks are called after
        the cycle (:meth:`_call_back`)."""
        self.stats.operations += len(requests)
        release_names(requests)  # first: a caller that sees one done may submit its name
        complete_all(requests)
        self._waiters.notify()
        due = self._waiters.take_callbacks(requests)
        if due:
            with self._lock:
                self._due.extend(due)

    def _call_back(self) -> None:
        """Call the callbacks of the handles finished so far, outside any cycle."""
        while self._due:
            with self._lock:
                due, self._due = self._due, []
            for fn, handle in due:
                try:
                    fn(handle)
                except Exception:
                    log.exception("mpitrain: a callback of the async operation %r raised",
                                  handle.name)

    def _abort(self, exc: BaseException) -> None:
        self._finished = True
        with self._cond:
            self._closed = f"failed: {exc!r}"
            self._wake()  # the progress thread may be asleep: let it end
            doomed = list(self._pending.values()) + self._incoming + [
                r for r in self._running if not r.done and r.name not in self._pending]
            if self._join is not None:
                doomed.append(self._join)
                self._join = None
            self._pending.clear()
            self._incoming = []
        for request in doomed:
            if isinstance(exc, StallError):  # keeps its class: wait() raises StallError
                error: Exception = StallError(f"rank {self.rank}: {request.name!r} was in "
                                              f"flight when the async engine stalled: {exc}")
            else:
                error = CommunicationError(f"rank {self.rank}: the async engine failed while "
                                           f"{request.name!r} was in flight: {exc!r}")
            error.__cause__ = exc
            request.error = error
            self._finish([request])

    def _mismatch(self, name: str, signatures: Signatures) -> str:
        refused = [(r, sig) for r, sig in sorted(signatures.items()) if sig.startswith(REFUSED)]
        if refused:
            return (f"rank {self.rank}: the async operation {name!r} is given up on every rank: "
                    + "; ".join(f"its submission was {sig}" for _, sig in refused)
                    + ". Fix that rank's arguments; the other ranks' submissions cannot run "
                    "without it")
        ranks = sorted(signatures)
        first = signatures[ranks[0]]
        other = next(r for r in ranks if signatures[r] != first)
        call = ordered_call(name)
        if call >= 0:
            return (f"rank {self.rank}: the ranks' collective calls disagree at call {call} of "
                    f"this group ({name!r}): rank {ranks[0]} called {first}, rank {other} "
                    f"called {signatures[other]}; every rank must make the same collective "
                    "calls in the same order, with the same kind, op, dtype and shape")
        return (f"rank {self.rank}: ranks submitted the async operation {name!r} with "
                f"different arguments: rank {ranks[0]} submitted {first}, rank {other} submitted "
                f"{signatures[other]}; every rank must submit a name with the same kind, op, "
                "dtype, shape, scaling and algorithm")

    def _cycle_seconds(self) -> float:
        return self.settings.cycle_time_ms / 1000.0


class WaitedBlock:
    """The context manager of :meth:`Engine.waited` (a class: every blocking call of the
    adapters enters one, and a generator's costs about a microsecond more)."""

    __slots__ = ("engine", "outer")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.outer = False

    def __enter__(self) -> None:
        local = self.engine._unrung
        self.outer = getattr(local, "on", False)
        local.on = True

    def __exit__(self, kind: object, *exc: object) -> None:
        if self.outer:
            return  # the outer block decides
        engine = self.engine
        engine._unrung.on = False
        if kind is not None:
            with engine._cond:
                if engine._incoming and not engine._batches:
                    engine._wake()


class CallBlock:
    """The context manager of :meth:`Engine.call` (a class: the adapters enter one per
    collective, and a generator's costs about a microsecond more)."""

    __slots__ = ("engine", "outer")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.outer = False

    def __enter__(self) -> None:
        local = self.engine._call
        self.outer = getattr(local, "on", False)
        local.on = True

    def __exit__(self, *exc: object) -> None:
        if not self.outer:
            local = self.engine._call
            local.on = False
            local.serials = None


def describe(key: tuple[Any, ...]) -> str:
    """What every rank's submission of a name must agree on, as text (also shown when
    ranks disagree): ``allreduce sum float32[4, 5] prescale=1.0 postscale=1.0
    algorithm=auto``, with ``on cupy`` (the backend) for device arrays: host and device
    buffers may take different algorithms, so the ranks must agree on it too."""
    kind, op, dtype, shape, prescale, postscale, algorithm, root, backend = key
    words = [kind] if op is None else [kind, op]
    if kind == "broadcast":
        words.append(f"root={root}")
    if dtype is None:  # a group: (dtype, shape) of each array
        words.append("[" + ", ".join(_array_text(d, s) for d, s in shape) + "]")
    else:
        words.append(_array_text(dtype, shape))
    if op is not None:
        words += [f"prescale={prescale!r}", f"postscale={postscale!r}"]
    words.append(f"algorithm={algorithm or 'default'}")
    if backend != NUMPY.name:
        words.append(f"on {backend}")
    return " ".join(words)


def _blueprint(request: Request, serves: frozenset[str]) -> Blueprint | None:
    """What a rank in ``join()`` needs to stand in for ``request`` (``None`` for a
    refused submission or a meeting point: nothing runs), given the kinds ranks in
    ``join()`` take part in (``serves``)."""
    spec = request.spec
    if spec.kind in (REFUSED, MEET):
        return None
    arrays: list[tuple[Any, tuple[int | None, ...]]]
    if request.entries is not None:
        arrays = [(e.dtype, tuple(e.array.shape)) for e in request.entries]
    else:
        arrays = [(spec.dtype, tuple(request.array.shape))]
    return (spec.kind, spec.op.value, spec.prescale, spec.postscale, spec.algorithm,
            spec.root, spec.inplace, spec.grouped, spec.backend.name, arrays,
            spec.kind in serves)


def identity(op: ReduceOp, dtype: Any, prescale: float = 1.0) -> Any:
    """The value a rank in ``join()`` contributes to a reduction by ``op`` of ``dtype``
    scaled by ``prescale`` first: after scaling, the identity of ``op`` (0 for Sum,
    Average and Adasum, 1 for Product, the largest value for Min, the smallest for Max),
    exactly for floating-point types (for Product up to rounding) and for integers with
    ``prescale`` 1, so that the result is that of the other ranks."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM) or prescale == 0.0:
        return 0
    kind = np.dtype(dtype).kind
    if op is ReduceOp.PRODUCT:
        return 1 if prescale == 1.0 or kind in "biu" else 1.0 / prescale
    high = (op is ReduceOp.MIN) == (prescale > 0.0)  # a negative factor swaps the ends
    if kind == "b":
        return high
    if kind in "iu":
        info = np.iinfo(dtype)
        return info.max if high else info.min
    return np.inf if high else -np.inf


def _array_text(dtype: Any, shape: tuple[int | None, ...]) -> str:
    return f"{dtype}[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


@atexit.register
def _stop_live_engines() -> None:
    """At interpreter exit, stop engines the program did not stop (bounded wait), in the
    order they were started, which is the same on every rank (stopping is collective)."""
    for engine in sorted(_LIVE, key=lambda e: e.lane):
        engine.stop(EXIT_TIMEOUT_S)
