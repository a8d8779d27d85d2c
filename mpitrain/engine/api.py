"""The asynchronous methods of :class:`~mpitrain.Communicator`.

:class:`AsyncCollectives` is the part of the communicator's interface that goes
through the async engine; every method delegates to the communicator's
:class:`~.engine.Engine`, created (collectively) on first use. Naming follows
Horovod: ``op_async`` is out of place, ``op_async_`` in place; each returns a
:class:`~.request.Handle`.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..ops import ReduceOp
from .engine import Engine, EngineStats
from .request import Handle


class AsyncCollectives:
    """Asynchronous collectives, tensor fusion and grouped allreduce.

    Every call is collective in the same sense as the blocking calls, except that
    ranks may submit differently *named* operations in different orders: an
    operation runs once every rank has submitted its name. Unnamed operations are
    named ``"<kind>.noname.<n>"`` from a per-kind counter, so ranks that submit
    unnamed operations of a kind in the same order agree.

    Do not modify an input (or read an in-place output) until its handle is done.
    """

    _engine: Engine | None = None

    def allreduce_async(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, name: str | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        algorithm: str | None = None) -> Handle:
        """Start an allreduce of ``x``; ``wait()`` returns a new array with the result.

        Arguments are those of :meth:`~mpitrain.Communicator.allreduce`, plus ``name``
        (see the class documentation). Small allreduces with the same op, dtype,
        scaling and algorithm are fused (``MPITRAIN_FUSION_THRESHOLD``).
        """
        return self._async_engine().allreduce(x, op, name, prescale_factor, postscale_factor,
                                              algorithm, False)

    def allreduce_async_(self, x: Any, op: ReduceOp | str = ReduceOp.SUM,
                         name: str | None = None, prescale_factor: float = 1.0,
                         postscale_factor: float = 1.0, algorithm: str | None = None) -> Handle:
        """Start an in-place allreduce of ``x``; ``wait()`` returns ``x``, reduced."""
        return self._async_engine().allreduce(x, op, name, prescale_factor, postscale_factor,
                                              algorithm, True)

    def grouped_allreduce_async(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                                name: str | None = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                algorithm: str | None = None) -> Handle:
        """Start one fused allreduce of every array of ``xs`` (one collective per dtype,
        whatever the fusion threshold); ``wait()`` returns the list of new arrays."""
        return self._async_engine().grouped_allreduce(xs, op, name, prescale_factor,
                                                      postscale_factor, algorithm, False)

    def grouped_allreduce_async_(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                                 name: str | None = None, prescale_factor: float = 1.0,
                                 postscale_factor: float = 1.0,
                                 algorithm: str | None = None) -> Handle:
        """In-place :meth:`grouped_allreduce_async`; ``wait()`` returns ``xs`` as a list."""
        return self._async_engine().grouped_allreduce(xs, op, name, prescale_factor,
                                                      postscale_factor, algorithm, True)

    def grouped_allreduce(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                          name: str | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, algorithm: str | None = None) -> list[Any]:
        """Allreduce every array of ``xs`` in one fused collective; returns new arrays."""
        return self.grouped_allreduce_async(xs, op, name, prescale_factor, postscale_factor,
                                            algorithm).wait()

    def grouped_allreduce_(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                           name: str | None = None, prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0,
                           algorithm: str | None = None) -> list[Any]:
        """In-place :meth:`grouped_allreduce`; returns ``xs`` as a list."""
        return self.grouped_allreduce_async_(xs, op, name, prescale_factor, postscale_factor,
                                             algorithm).wait()

    def allgather_async(self, x: Any, name: str | None = None,
                        algorithm: str | None = None) -> Handle:
        """Start :meth:`~mpitrain.Communicator.allgather`; ``wait()`` returns the result."""
        return self._async_engine().allgather(x, name, algorithm)

    def broadcast_async(self, x: Any, root: int = 0, name: str | None = None,
                        algorithm: str | None = None) -> Handle:
        """Start :meth:`~mpitrain.Communicator.broadcast`; ``wait()`` returns a new array."""
        return self._async_engine().broadcast(x, root, name, algorithm, False)

    def broadcast_async_(self, x: Any, root: int = 0, name: str | None = None,
                         algorithm: str | None = None) -> Handle:
        """Start an in-place broadcast from ``root``; ``wait()`` returns ``x``."""
        return self._async_engine().broadcast(x, root, name, algorithm, True)

    def reduce_scatter_async(self, x: Any, op: ReduceOp | str = ReduceOp.SUM,
                             name: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             algorithm: str | None = None) -> Handle:
        """Start :meth:`~mpitrain.Communicator.reduce_scatter`; ``wait()`` returns this
        rank's block."""
        return self._async_engine().reduce_scatter(x, op, name, prescale_factor,
                                                   postscale_factor, algorithm)

    @staticmethod
    def synchronize(handle: Handle) -> Any:
        """Wait for ``handle`` and return its result (Horovod's name for ``handle.wait()``)."""
        return handle.wait()

    @staticmethod
    def poll(handle: Handle) -> bool:
        """True once ``handle`` is done; never blocks (``handle.test()``)."""
        return handle.test()

    def async_stats(self) -> EngineStats:
        """Counters of the async engine (cycles, collectives, fused arrays, ...)."""
        return self._async_engine().snapshot()

    def _async_engine(self) -> Engine:
        engine = self._engine
        if engine is None:
            engine = self._engine = Engine(self)  # type: ignore[arg-type]
        return engine

    def _stop_async_engine(self) -> None:
        """Stop the engine if it was started (collective over the ranks that started it)."""
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
