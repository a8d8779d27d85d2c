"""Operations in flight as a framework adapter sees them: :class:`Pending` and the
integer handles of Horovod's API (:class:`HandleTable`).

An adapter-level operation may submit several engine operations (a grouped allgather,
a sparse allreduce's indices and values) and turn their results into its own output
(a tensor, scaled, copied into the caller's buffers). :class:`Pending` holds the
engine handles and that last step (``finish``): :meth:`Pending.wait` waits for every
handle, then runs ``finish`` once; :meth:`Pending.add_done_callback` calls back when
every handle is done, on the engine's thread (the torch.distributed backend completes
its futures there). Both torch adapters keep their operations in this one form.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

from ..engine import Handle
from ..errors import ArgumentError

Finish = Callable[[], Any]
"""Runs once every handle of a :class:`Pending` is done; returns the operation's output
(it may call ``handle.wait()`` again: a done handle returns its result at once)."""


class Pending:
    """One adapter-level operation in flight: its engine ``handles`` (none for an
    operation that is done already) and ``finish``, which makes its output from theirs.

    Thread-safe: ``finish`` runs once, on whichever thread first sees every handle done.
    """

    def __init__(self, handles: list[Handle], finish: Finish) -> None:
        self.handles = handles
        self._finish: Finish | None = finish
        self._lock = threading.Lock()
        self._output: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once every handle is done (never blocks; while not, it lets go of the GIL
        for a moment, as :meth:`~mpitrain.engine.Handle.test` does, for callers that
        poll)."""
        return all(h.test() for h in self.handles)

    @property
    def finished(self) -> bool:
        """Whether every handle is done, as :meth:`done` says, but without letting go of
        the GIL: for a caller that asks once and goes on (letting go would hand the GIL
        to the engine's thread, in mid-cycle, for up to a switch interval)."""
        return all(h.done for h in self.handles)

    def wait(self) -> Any:
        """Wait for every handle and return the output (raising the operation's error,
        as often as it is called)."""
        for handle in self.handles:
            try:
                handle.wait()
            except BaseException:
                break  # finish() raises it (it waits on the handles too), once for all
        return self._result()

    def _result(self) -> Any:
        with self._lock:
            finish, self._finish = self._finish, None
            if finish is not None:
                try:
                    self._output = finish()
                except BaseException as exc:
                    self._error = exc
        if self._error is not None:
            raise self._error
        return self._output

    def add_done_callback(self, fn: Callable[[Pending], None]) -> None:
        """Call ``fn(self)`` once every handle is done (see
        :meth:`mpitrain.engine.Handle.add_done_callback`: on the engine's thread, after
        its cycle; at once if all are done already)."""
        left = [len(self.handles)]
        lock = threading.Lock()
        if not self.handles:
            fn(self)
            return

        def one_done(_: Handle) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)

        for handle in self.handles:
            handle.add_done_callback(one_done)


class HandleTable:
    """Horovod's integer handles: each async call registers its :class:`Pending` and
    returns a number; ``poll`` and ``synchronize`` take the number.

    Args:
        rank: this rank (named in the error for a number never given out).
        kept: synchronized handles whose outputs stay reachable (weakly) by number.
    """

    def __init__(self, rank: Callable[[], int], kept: int = 1024) -> None:
        self._rank = rank
        self._kept = kept
        self._lock = threading.Lock()
        self._ops: dict[int, Pending] = {}
        self._issued = 0  # the last number given out
        self._finished: OrderedDict[int, Callable[[], Any]] = OrderedDict()

    def register(self, pending: Pending) -> int:
        """Keep ``pending``; its number."""
        with self._lock:
            self._issued += 1
            self._ops[self._issued] = pending
            return self._issued

    def clear(self) -> None:
        """Forget every operation and number (a new session starts from 1 again)."""
        with self._lock:
            self._ops.clear()
            self._finished.clear()

    def _lookup(self, handle: int) -> Pending | None:
        """The operation of ``handle`` in flight; ``None`` if it was already synchronized."""
        with self._lock:
            op = self._ops.get(handle)
            issued = self._issued
        if op is None and not (isinstance(handle, int) and 0 < handle <= issued):
            raise ArgumentError(f"rank {self._rank()}: {handle!r} is not a handle returned by "
                                f"an async call of this module (handles are 1..{issued}); "
                                "pass the value that allreduce_async() and the like returned")
        return op

    def poll(self, handle: int) -> bool:
        """True once the operation of ``handle`` is done (never blocks); True after
        :meth:`synchronize` too."""
        op = self._lookup(handle)
        return op is None or op.done()

    def synchronize(self, handle: int) -> Any:
        """Wait for the operation of ``handle`` and return its output.

        A handle that was already synchronized returns the same output again, as long
        as the output is still referenced elsewhere (for the last ``kept`` handles);
        else ``None``, which is what Horovod returns for such a handle.

        Raises:
            ArgumentError: ``handle`` was never returned by an async call here.
            CommunicationError: the operation failed across ranks.
        """
        with self._lock:
            op = self._ops.pop(handle, None)
            getter = self._finished.get(handle) if op is None else None
        if op is None:
            self._lookup(handle)  # raises for a handle never given out
            return None if getter is None else getter()
        result = op.wait()
        with self._lock:
            self._finished[handle] = _weakly(result)
            if len(self._finished) > self._kept:
                self._finished.popitem(last=False)
        return result


def _weakly(result: Any) -> Callable[[], Any]:
    """A getter of ``result`` that keeps it alive no longer than its other owners do."""
    if isinstance(result, (list, tuple)):
        refs = [weakref.ref(r) for r in result]
        kind = type(result)

        def items() -> Any:
            alive = [r() for r in refs]
            return None if any(a is None for a in alive) else kind(alive)
        return items
    if result is None:
        return lambda: None
    return weakref.ref(result)
