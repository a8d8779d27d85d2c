"""What the engine queues: a :class:`Request` (one named operation) of :class:`Entry`
arrays, and the :class:`Handle` the caller waits on.

A request is created and checked on the caller's thread, then owned by the engine
until it finishes; it is itself the handle the caller holds (a subclass), so one
object per submission holds the arrays until then, and the result afterwards.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from ..backends import ArrayBackend
from ..ops import ReduceOp


class Waiters:
    """How many callers are blocked in :meth:`Handle.wait` on one engine's handles,
    and what a blocked caller may do meanwhile.

    Args:
        helper: called with the handle by a caller about to block on it (the engine
            runs its cycles on the caller's thread); ``None``: just block.
    """

    def __init__(self, helper: Callable[[Handle], None] | None = None) -> None:
        self.blocked = 0
        self.helper = helper
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """Count ``n`` more (or fewer) blocked callers."""
        with self._lock:
            self.blocked += n


class Handle:
    """A collective in flight: ``wait()`` for its result, ``test()`` to poll it.

    A given name stays in flight until the caller has seen its operation finish
    (``wait()`` returned or raised, or ``test()`` returned True); only then may the
    name be submitted again.

    Handles are made by the async calls (each is the engine's :class:`Request`).

    Attributes:
        name: the operation's name (given, or ``"<kind>.noname.<n>"``).
        submitted_at: ``time.perf_counter()`` when it was submitted.
        started_at: when its collective began (``None`` before that).
        finished_at: when its result was ready (``None`` before that).
        error: why the operation failed (what ``wait()`` raises), else ``None``.
    """

    __slots__ = ("_done", "_release", "_result", "_unfinished", "_waiters", "error",
                 "finished_at", "name", "started_at", "submitted_at")
    name: str
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    _waiters: Waiters | None
    _release: Callable[[str], None] | None  # frees the name once the caller saw the result
    _done: bool
    _unfinished: threading.Lock  # held from creation until the result is set
    _result: Any
    error: BaseException | None

    def wait(self) -> Any:
        """Block until the operation is done and return its result (idempotent).

        Raises the operation's error (e.g. :class:`~mpitrain.MismatchError`) instead,
        on every rank, as often as it is called.
        """
        if not self._done:
            waiters = self._waiters
            if waiters is not None:
                waiters.add(1)
            try:
                if waiters is not None and waiters.helper is not None:
                    waiters.helper(self)
                with self._unfinished:
                    pass
            finally:
                if waiters is not None:
                    waiters.add(-1)
        self._observed()
        if self.error is not None:
            raise self.error
        return self._result

    def test(self) -> bool:
        """True once the operation is done (its result or error is ready); never blocks."""
        if self._done:
            self._observed()
            return True
        return False

    def _observed(self) -> None:
        """The caller has seen the operation done: its name may be submitted again."""
        release, self._release = self._release, None
        if release is not None:
            release(self.name)

    @property
    def done(self) -> bool:
        """Same as :meth:`test`."""
        return self._done

    def __repr__(self) -> str:
        state = "pending" if not self._done else "failed" if self.error is not None else "done"
        return f"<mpitrain.Handle {self.name!r} {state}>"


class Entry:
    """One array of a request.

    Attributes:
        array: the caller's array: the input, and the output of an in-place operation.
        backend: the array library of ``array``.
        dtype: its element type.
        output: the result once computed (the caller's object for in-place operations).
        count: number of elements.
        nbytes: size in bytes.
    """

    __slots__ = ("array", "backend", "count", "dtype", "nbytes", "output")

    def __init__(self, array: Any, backend: ArrayBackend, dtype: np.dtype[Any],
                 output: Any = None) -> None:
        self.array, self.backend, self.dtype, self.output = array, backend, dtype, output
        self.count: int = array.size
        self.nbytes: int = self.count * dtype.itemsize


class Request(Handle):
    """One named operation: what every rank must submit under ``name``.

    The engine's record of the operation is also the :class:`Handle` the caller waits
    on (one object per submission); it holds the arrays until the operation is done.
    ``signature`` is the text every rank's submission of ``name`` must agree on (kind,
    op, dtype, shape, scaling, algorithm, root); it doubles as the error message when
    ranks disagree. A grouped allreduce is one request of several entries.
    """

    __slots__ = ("agreed_at", "algorithm", "entries", "fusion", "given", "grouped",
                 "inplace", "kind", "op", "postscale", "prescale", "root", "signature",
                 "unfinished")

    def __init__(self, name: str, kind: str, signature: str, entries: list[Entry],
                 op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0, postscale: float = 1.0,
                 algorithm: str | None = None, root: int = 0, inplace: bool = False,
                 grouped: bool = False, fusion: str = "", given: bool = True,
                 waiters: Waiters | None = None,
                 release: Callable[[str], None] | None = None) -> None:
        # the handle's part
        self.name = name
        self._waiters = waiters
        self._release = release
        self.submitted_at = time.perf_counter()
        self.started_at = None
        self.finished_at = None
        self._done = False
        self._unfinished = lock = threading.Lock()
        lock.acquire()
        self._result = None
        self.error = None
        # the operation's part
        self.kind, self.signature, self.entries = kind, signature, entries
        self.op, self.prescale, self.postscale = op, prescale, postscale
        self.algorithm, self.root, self.inplace, self.grouped = algorithm, root, inplace, grouped
        self.fusion = fusion  # allreduces with equal fusion keys may share a buffer
        self.given = given  # the caller named it (a generated name never repeats)
        self.agreed_at = 0.0  # when every rank had submitted it
        self.unfinished = len(entries)  # entries whose bucket has not run yet

    def complete(self, now: float | None = None) -> None:
        """Hand the caller the result (the output, or the list of outputs of a group),
        or the ``error`` if one was set, and wake its ``wait()``. The arrays are let go;
        the result is kept."""
        if self.error is None:
            entries = self.entries
            self._result = [e.output for e in entries] if self.grouped else entries[0].output
        self.finished_at = time.perf_counter() if now is None else now
        self.entries = []
        self._done = True
        self._unfinished.release()
