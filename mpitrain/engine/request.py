"""What the engine queues: a :class:`Request` (one named submission of a :class:`Spec`),
the :class:`Entry` arrays of a grouped request, and the :class:`Handle` the caller
waits on.

A :class:`Spec` is everything that is the same for every submission with the same
arguments (kind, op, dtype, shape, scaling, algorithm, root): it is checked and
described once and then shared, so a submission only adds its name and its arrays.
A request is created on the caller's thread, then owned by the engine until it
finishes; it is itself the handle the caller holds (a subclass), so one object per
submission holds the arrays until then, and the result afterwards. A request of one
array is also the entry that the fusion buckets pack (``array``, ``output``,
``nbytes``, ``backend``); a grouped request has one :class:`Entry` per
array.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from ..backends import NUMPY, ArrayBackend
from ..dispatch import Call
from ..ops import ReduceOp


class Waiters:
    """The callers blocked in :meth:`Handle.wait` on one engine's handles: how many
    there are, what one may do before it blocks, and the condition they block on.

    Args:
        helper: called with the handle by a caller about to block on it (the engine
            runs its cycles on the caller's thread); ``None``: just block.
    """

    def __init__(self, helper: Callable[[Handle], None] | None = None) -> None:
        self.blocked = 0
        self.helper = helper
        self._cond = threading.Condition()

    def wait(self, handle: Handle) -> None:
        """Block until ``handle`` is done, counted as a blocked caller meanwhile."""
        cond = self._cond
        with cond:
            self.blocked += 1
        try:
            if self.helper is not None:
                self.helper(handle)
            with cond:
                while not handle._done:
                    cond.wait()
        finally:
            with cond:
                self.blocked -= 1

    def none_blocked(self) -> bool:
        """True while no caller is blocked: the process's threads have work of their own
        (a barrier of the engine's collectives then sleeps rather than spins while it
        waits long: :attr:`~mpitrain.comm.shm.SharedMemory.others_busy`)."""
        return self.blocked == 0

    def notify(self) -> None:
        """Wake the blocked callers: handles have become done (call after setting them)."""
        with self._cond:
            self._cond.notify_all()

    def add_callback(self, handle: Handle, fn: Callable[[Handle], None]) -> bool:
        """Keep ``fn`` for when ``handle`` is done; False if its callbacks have been taken
        already (it is done: call ``fn`` yourself)."""
        with self._cond:
            if handle._callbacks is None:
                return False
            handle._callbacks.append(fn)
            return True

    def take_callbacks(self, handles: list[Request]) -> list[tuple[Callable[[Handle], None],
                                                                    Handle]]:
        """The callbacks of finished ``handles``, each once; later ones are called at once
        by :meth:`Handle.add_done_callback`."""
        due: list[tuple[Callable[[Handle], None], Handle]] = []
        with self._cond:
            for handle in handles:
                callbacks, handle._callbacks = handle._callbacks, None
                if callbacks:
                    due.extend((fn, handle) for fn in callbacks)
        return due


class Handle:
    """A collective in flight: ``wait()`` for its result, ``test()`` to poll it.

    A given name stays in flight until its operation is done (or failed); then it may
    be submitted again, whether or not the handle was waited on.

    Handles are made by the async calls (each is the engine's :class:`Request`).

    Attributes:
        name: the operation's name (given, or ``"<kind>.noname.<n>"``).
        submitted_at: ``time.perf_counter()`` when it was submitted.
        started_at: when its collective began (``None`` before that).
        finished_at: when its result was ready (``None`` before that).
        error: why the operation failed (what ``wait()`` raises), else ``None``.
    """

    __slots__ = ("_callbacks", "_done", "_result", "_waiters", "error",
                 "finished_at", "name", "started_at", "submitted_at")
    name: str
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    _waiters: Waiters
    _done: bool
    _result: Any
    _callbacks: list[Callable[[Handle], None]] | None  # None once they have been taken
    error: BaseException | None

    def wait(self) -> Any:
        """Block until the operation is done and return its result (idempotent).

        Raises the operation's error (e.g. :class:`~mpitrain.MismatchError`) instead,
        on every rank, as often as it is called.
        """
        if not self._done:
            self._waiters.wait(self)
        if self.error is not None:
            raise self.error
        return self._result

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` once the operation is done: on the thread that finished it,
        after the engine's cycle (so ``fn`` may submit and wait), or at once, on this
        thread, if it is done already. An exception ``fn`` raises is logged, not raised.
        ``fn`` should be quick: the next cycle waits for it."""
        if not self._waiters.add_callback(self, fn):
            fn(self)

    def test(self) -> bool:
        """True once the operation is done (its result or error is ready); never blocks.

        While it is not done, this call lets go of the GIL for a moment: the engine's
        progress thread needs the GIL to run, and a loop that does nothing but poll
        (``while not h.test(): pass``) held it from that thread for whole switch
        intervals (5 ms each), so each small operation it waited on took milliseconds.
        """
        if self._done:
            return True
        time.sleep(0)
        return False

    @property
    def done(self) -> bool:
        """Whether the operation is done, as :meth:`test` says, but without letting go
        of the GIL (the engine reads it inside its cycle)."""
        return self._done

    def __repr__(self) -> str:
        state = "pending" if not self._done else "failed" if self.error is not None else "done"
        return f"<mpitrain.Handle {self.name!r} {state}>"


class Spec:
    """What every rank's submission of a name must agree on, and how it runs.

    One spec serves every submission with the same arguments (the engine keeps them
    by those arguments), so its checks and texts are made once.

    Attributes:
        kind: ``allreduce`` (grouped ones too), ``allgather``, ``broadcast`` or
            ``reduce_scatter`` (or the engine's own ``refused`` and ``join``).
        signature: the agreed text (kind, op, dtype, shape, scaling, algorithm, root);
            it doubles as the error message when ranks disagree.
        call: the checked call (:class:`~mpitrain.dispatch.Call`) that runs it: of the
            first array for a group; ``None`` for the engine's own kinds.
        fusion: allreduces of one array with equal fusion keys may share a buffer
            (``""`` for everything else).
        grouped: a grouped allreduce (several arrays).
        backend, dtype, shape, op, prescale, postscale, algorithm, root, inplace: the
            call's (``shape`` is ``None`` for a group).
    """

    __slots__ = ("algorithm", "backend", "call", "dtype", "fusion", "grouped", "inplace",
                 "kind", "op", "postscale", "prescale", "root", "shape", "signature")

    def __init__(self, kind: str, signature: str, call: Call | None, grouped: bool = False,
                 fusion: str = "") -> None:
        self.kind, self.signature, self.call, self.grouped = kind, signature, call, grouped
        self.fusion = fusion
        if call is None:
            self.backend: ArrayBackend = NUMPY
            self.dtype: np.dtype[Any] | None = None
            self.shape: tuple[int | None, ...] | None = None
            self.op: ReduceOp = ReduceOp.SUM
            self.prescale, self.postscale = 1.0, 1.0
            self.algorithm: str | None = None
            self.root, self.inplace = 0, False
            return
        self.backend, self.dtype, self.op = call.backend, call.dtype, call.op or ReduceOp.SUM
        self.shape = None if grouped else call.shape
        self.prescale, self.postscale = call.prescale, call.postscale
        self.algorithm, self.root, self.inplace = call.algorithm, call.root, call.inplace


class Entry:
    """One array of a grouped request.

    Attributes:
        array: the caller's array: the input, and the output of an in-place operation.
        backend: the array library of ``array``.
        dtype: its element type.
        output: the result once computed (the caller's object for in-place operations).
        nbytes: size in bytes.
    """

    __slots__ = ("array", "backend", "dtype", "nbytes", "output")

    def __init__(self, array: Any, backend: ArrayBackend, dtype: np.dtype[Any],
                 output: Any = None) -> None:
        self.array, self.backend, self.dtype, self.output = array, backend, dtype, output
        self.nbytes: int = array.size * dtype.itemsize


class Request(Handle):
    """One named submission of a :class:`Spec`: what every rank must submit under
    ``name``.

    The engine's record of the operation is also the :class:`Handle` the caller waits
    on (one object per submission); it holds the arrays until the operation is done.
    A request of one array (``array``; ``entries`` is ``None``) is its own entry; a
    grouped request has ``entries``, one per array. ``serial`` is the ``n`` of a
    generated name (``<kind>.noname.<n>``), -1 for a name the caller gave. For device
    arrays, ``ready`` is the event recorded at submission on the stream that produced
    them (the engine waits for it before it reads them), and ``stream`` the stream the
    operation runs on (``Engine._ready``).
    """

    __slots__ = ("_release", "array", "entries", "nbytes", "output", "ready", "serial",
                 "spec", "stream", "unfinished")
    _release: Callable[[str], None] | None  # frees a given name once the operation is done

    def __init__(self, name: str, spec: Spec, array: Any, output: Any, waiters: Waiters,
                 serial: int = -1, release: Callable[[str], None] | None = None,
                 entries: list[Entry] | None = None, ready: Any = None,
                 stream: Any = None) -> None:
        # the handle's part
        self.name = name
        self._waiters = waiters
        self.submitted_at = time.perf_counter()
        self.started_at = None
        self.finished_at = None
        self._done = False
        self._result = None
        self._callbacks = []
        self.error = None
        # the operation's part
        self._release = release
        self.spec, self.serial, self.entries = spec, serial, entries
        self.array, self.output = array, output
        self.ready = ready  # device arrays: an event after the work that produced them
        self.stream = stream  # ... and the stream where the operation runs
        if entries is None:
            self.nbytes = array.nbytes
            self.unfinished = 1  # entries whose bucket has not run yet
        else:
            self.nbytes = 0
            self.unfinished = len(entries)

    @property
    def backend(self) -> ArrayBackend:
        """The array library of the request's (first) array."""
        return self.spec.backend


def release_names(requests: list[Request]) -> None:
    """Let the names given to these finished requests be submitted again (as Horovod
    frees a name once its operation is done, whether or not its handle was waited on).
    Called without the engine's lock, which the release takes, and before the requests
    are marked done, so that a caller who sees one done finds its name free."""
    for request in requests:
        release, request._release = request._release, None
        if release is not None:
            release(request.name)


def complete_all(requests: list[Request]) -> None:
    """Mark the requests done, each with its result (the output, or the list of outputs
    of a group) or with its ``error`` if one was set. The arrays are let go; the result
    is kept. The caller of this wakes blocked waiters (:meth:`Waiters.notify`).

    One loop for all of them: the engine finishes a whole fusion bucket at once.
    """
    now = time.perf_counter()
    for request in requests:
        if request.error is None:
            entries = request.entries
            request._result = request.output if entries is None else [e.output for e in entries]
        request.finished_at = now
        request.entries = None
        request.array = request.output = request.ready = request.stream = None
        request._done = True
