"""The user-facing communicator: a facade over a dispatcher and an async engine.

A :class:`Communicator` wraps any MPI intracommunicator. Its blocking collectives
go to its :class:`~mpitrain.dispatch.Dispatcher` (argument checks, algorithm choice,
validation, plans, scaling, on a private duplicate of the communicator); its
asynchronous ones go to an :class:`~mpitrain.engine.Engine`, created (collectively)
on first use, which owns a dispatcher of its own on another duplicate. Naming follows
Horovod: ``op`` is out of place, ``op_`` in place, ``op_async``/``op_async_`` return a
:class:`~mpitrain.engine.Handle`.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterable, Sequence

from mpi4py import MPI

from .comm.topology import Topology
from .config import AT_CREATION, Settings
from .dispatch import Dispatcher
from .engine import JOIN_SERVES_ALL, Engine, EngineStats, Handle
from .errors import ArgumentError, CommunicationError
from .ops import ReduceOp

Array = Any


class Communicator:
    """Collectives over the ranks of an MPI intracommunicator.

    Args:
        comm: any intracommunicator (``MPI.COMM_WORLD``, a split, ...). mpitrain
            duplicates it, so its messages never interfere with the caller's.
        check: validate every call across ranks (default: ``MPITRAIN_CHECK``, on).
        shared_memory: use shared-memory windows when every rank is on one node
            (default: ``MPITRAIN_SHM``, on).
        settings: every other setting (default: the ``MPITRAIN_*`` variables now, see
            :class:`~mpitrain.config.Settings`); ``check`` and ``shared_memory`` win over
            it. Read once: a variable changed later reaches the communicator only
            through :meth:`configure`.
        ordered: every rank makes its unnamed async calls in one order, whatever their
            kinds (as torch.distributed requires of a process group's collectives):
            they are then numbered from one counter, ``"collective.noname.<n>"``, so
            ranks whose ``n``-th unnamed calls are of different kinds (an allreduce on
            one, an allgather on another) get :class:`~mpitrain.MismatchError` naming
            both instead of waiting for each other until the stall timeout. Off: one
            counter per kind (below).

    Every method is collective: all ranks of the communicator must call it, in the
    same order, with agreeing arguments (checked unless ``check`` is off). A
    communicator is not thread-safe: call it from one thread at a time. Asynchronous
    calls may be submitted in different orders on different ranks when they are
    named: an operation runs once every rank has submitted its name. Unnamed
    operations are named ``"<kind>.noname.<n>"`` from a per-kind counter, so ranks
    that submit unnamed operations of a kind in the same order agree. Do not modify
    an async input (or read an in-place output) until its handle is done.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, *, check: bool | None = None,
                 shared_memory: bool | None = None, settings: Settings | None = None,
                 ordered: bool = False) -> None:
        if settings is None:
            settings = Settings.from_environment(check=check, shm=shared_memory)
        else:
            settings = settings.changed(**{k: v for k, v in (("check", check),
                                                             ("shm", shared_memory))
                                           if v is not None})
        self.dispatcher = Dispatcher(MPI.COMM_WORLD if comm is None else comm, settings)
        self.mpi_comm: MPI.Intracomm = self.dispatcher.mpi_comm
        self._engine: Engine | None = None
        self._join_serves = JOIN_SERVES_ALL
        self.ordered = ordered
        """Unnamed async calls are numbered across kinds (the ``ordered`` argument)."""

    # -- identity ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self.dispatcher.rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.dispatcher.size

    @property
    def topology(self) -> Topology:
        """The node split of the communicator."""
        return self.dispatcher.topology

    @property
    def local_rank(self) -> int:
        """Rank among the ranks of this node."""
        return self.topology.local_rank

    @property
    def local_size(self) -> int:
        """Number of ranks on this node."""
        return self.topology.local_size

    @property
    def cross_rank(self) -> int:
        """Index of this rank's node (nodes are numbered by their lowest rank)."""
        return self.topology.cross_rank

    @property
    def cross_size(self) -> int:
        """Number of nodes."""
        return self.topology.cross_size

    @property
    def shared_memory(self) -> bool:
        """True if the ranks share memory windows (one node, ``MPITRAIN_SHM`` on)."""
        return self.dispatcher.shm is not None

    @property
    def cuda_policy(self) -> str:
        """How device buffers reach MPI on this communicator: ``"cuda-aware"`` (device
        pointers) or ``"staged"`` (pinned host memory); see :mod:`mpitrain.dispatch.policy`."""
        return self.dispatcher.device_policy.name

    def device_links(self, x: Any) -> str:
        """Which device-to-device links (CUDA IPC, NCCL) carry device buffers like ``x``
        on this communicator, and why the others do not, as one line (see
        :mod:`mpitrain.comm.links`). Collective the first time for a kind of buffer,
        as that kind's first collective is: every rank calls it."""
        from .backends import backend_for

        be = backend_for(x)
        if not be.is_device:
            return "host buffers: no device links"
        if self.size == 1:
            return "one rank: no device links"
        return self.dispatcher.links.probe(be, "device_links").describe()

    @property
    def settings(self) -> Settings:
        """The settings this communicator runs under (read when it was created, or set
        by :meth:`configure`)."""
        return self.dispatcher.settings

    def configure(self, settings: Settings | None = None, **changes: Any) -> Settings:
        """Run the later calls under other settings (collective).

        ``comm.configure(segment_bytes="64K", algorithm="ring")`` changes the named
        settings (the fields of :class:`~mpitrain.config.Settings`; a text is read as
        the variable's value would be); ``comm.configure(saved)`` puts a whole
        :class:`~mpitrain.config.Settings` back; ``comm.configure()`` reads the
        ``MPITRAIN_*`` variables again. This is how a setting changed at run time (in a
        test, after ``mpitrain-tune``) reaches a communicator: nothing reads the
        environment per call. Those fixed at creation
        (:data:`~mpitrain.config.AT_CREATION`: shared memory, stall limits) raise
        :class:`~mpitrain.ArgumentError`; create a new communicator for them.

        Every rank must call it with the same settings where they must agree
        (:data:`~mpitrain.config.AGREED`), else :class:`~mpitrain.MismatchError` on
        every rank and nothing changes. Cached plans are dropped; a running async
        engine is stopped first (what every rank submitted finishes, the rest fails)
        and the next async call starts one with the new settings.

        Returns:
            The settings in force before the call.
        """
        before = self.settings
        if settings is None:
            if changes:
                settings = before.changed(**changes)
            else:
                kept = {name: getattr(before, name) for name in AT_CREATION}
                settings = Settings.from_environment(**kept)
        elif changes:
            settings = settings.changed(**changes)
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
        self.dispatcher.configure(settings)
        return before

    def algorithms(self, collective: str) -> list[str]:
        """The algorithms this communicator can run for ``collective`` on host buffers."""
        return self.dispatcher.algorithms(collective)

    def __repr__(self) -> str:
        return (f"<mpitrain.Communicator rank {self.rank}/{self.size}, local "
                f"{self.local_rank}/{self.local_size}, cross {self.cross_rank}/{self.cross_size}>")

    # -- blocking collectives ----------------------------------------------------------
    def allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, *,
                  algorithm: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, out: Array | None = None,
                  name: str | None = None, stream: Any = None) -> Array:
        """Reduce ``x`` elementwise over all ranks and return the result on every rank.

        Args:
            x: the array to reduce: numpy, cupy or any CUDA array (torch tensor, ...);
                any contiguity (non-contiguous input is copied).
            op: ``Sum``, ``Average``, ``Min``, ``Max``, ``Product`` or its name.
            algorithm: ``"auto"`` (default, from ``MPITRAIN_ALGORITHM``), one of
                ``mpitrain.algorithms.ALGORITHMS["allreduce"]`` (``"ring"``, ``"shm"``,
                ...), or ``"mpi"`` (the MPI library's own ``MPI_Allreduce``).
            prescale_factor: multiply each rank's input by this before reducing.
            postscale_factor: multiply the result by this (``Average`` adds ``1/size``).
            out: optional array of ``x``'s shape and dtype that receives the result.
            stream: for device arrays, the CUDA stream to work on (default: current);
                ignored for numpy.
            name: optional name of the tensor; validated like the other arguments.

        Returns:
            A new array (or ``out``) with the reduction; a CuPy array on ``x``'s device
            for device input.
        """
        if self._engine is not None and self._engine.joined:
            self._joined_error("allreduce")
        return self.dispatcher.allreduce(x, op, algorithm, prescale_factor, postscale_factor,
                                         out, name, stream=stream)

    def allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, *,
                   algorithm: str | None = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, name: str | None = None,
                   stream: Any = None) -> Array:
        """In-place :meth:`allreduce`: ``x`` is overwritten with the result and returned.

        A non-contiguous ``x`` is reduced through a contiguous copy written back. A
        torch CUDA tensor is written in place through a zero-copy CuPy view.
        """
        if self._engine is not None and self._engine.joined:
            self._joined_error("allreduce_")
        return self.dispatcher.allreduce_(x, op, algorithm, prescale_factor, postscale_factor,
                                          name, stream=stream)

    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, *,
                       algorithm: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, name: str | None = None,
                       out: Array | None = None, stream: Any = None) -> Array:
        """Reduce ``x`` over ranks and return this rank's block of axis 0.

        Blocks are those of ``np.array_split(x, size)``: with ``d`` rows, the first
        ``d % size`` ranks get ``d // size + 1`` rows, the others ``d // size``.

        Args:
            x: array with at least one dimension, same shape on every rank.
            op, algorithm, prescale_factor, postscale_factor, name, stream: as for
                :meth:`allreduce`.
            out: optional C-contiguous array of shape ``(rows of this rank,) +
                x.shape[1:]`` and ``x``'s dtype that receives the block (no allocation).

        Returns:
            ``out``, or a new array of shape ``(rows of this rank,) + x.shape[1:]``.
        """
        if self._engine is not None and self._engine.joined:
            self._joined_error("reduce_scatter")
        return self.dispatcher.reduce_scatter(x, op, algorithm, prescale_factor,
                                              postscale_factor, name, out=out, stream=stream)

    def allgather(self, x: Array, *, algorithm: str | None = None, name: str | None = None,
                  out: Array | None = None, stream: Any = None) -> Array:
        """Concatenate every rank's ``x`` along axis 0.

        Axis 0 may differ between ranks; the other axes and the dtype must agree (a
        disagreement raises :class:`~mpitrain.MismatchError` on every rank). The row
        counts travel in the validation exchange, which allgather always makes.
        ``stream`` is as for :meth:`allreduce`. ``out``: optional C-contiguous array of
        shape ``(sum of every rank's rows,) + x.shape[1:]`` and ``x``'s dtype that
        receives the result (no allocation); every rank passes one, or none does.

        Returns:
            ``out``, or a new array of shape ``(sum of every rank's rows,) + x.shape[1:]``.
        """
        if self._engine is not None and self._engine.joined:
            self._joined_error("allgather")
        return self.dispatcher.allgather(x, algorithm, name, out=out, stream=stream)

    def broadcast(self, x: Array, root: int = 0, *, algorithm: str | None = None,
                  name: str | None = None, stream: Any = None) -> Array:
        """Return a copy of the root's ``x`` on every rank.

        On other ranks ``x`` only gives the shape and dtype (like Horovod). ``stream``
        is as for :meth:`allreduce`.
        """
        if self._engine is not None and self._engine.joined:
            self._joined_error("broadcast")
        return self.dispatcher.broadcast(x, root, algorithm, name, stream=stream)

    def broadcast_(self, x: Array, root: int = 0, *, algorithm: str | None = None,
                   name: str | None = None, stream: Any = None) -> Array:
        """Overwrite ``x`` on every rank with the root's ``x``; returns ``x``."""
        if self._engine is not None and self._engine.joined:
            self._joined_error("broadcast_")
        return self.dispatcher.broadcast_(x, root, algorithm, name, stream=stream)

    def barrier(self) -> None:
        """Block until every rank has called :meth:`barrier` (on an ``ordered``
        communicator, and after the async operations submitted before it have run on
        every rank: :meth:`rendezvous`)."""
        if self._engine is not None and self._engine.joined:
            self._joined_error("barrier")
        if self.ordered:
            self._meet("barrier")
        else:
            self.dispatcher.barrier()

    def rendezvous(self, what: str) -> None:
        """A barrier counted as the collective ``what``: validated against the other
        ranks' calls (a rank in another collective gets MismatchError), watched by the
        stall inspector; for adapters that run MPI's own collectives after it. On an
        ``ordered`` communicator it is a meeting point of the async engine
        (:meth:`~mpitrain.engine.Engine.meet`), in the order of the unnamed async
        calls: a rank whose async call stands where another's ``what`` does gets
        MismatchError at once, on every rank, naming both."""
        if self.ordered:
            self._meet(what)
        else:
            self.dispatcher.rendezvous(what)

    def _meet(self, what: str) -> None:
        """Submit a meeting point of the async engine and wait for it (this thread runs
        its cycle)."""
        engine = self.engine()
        with engine.waited():
            handle = engine.meet(what)
        handle.wait()

    def check_root(self, root: Any) -> None:
        """Raise :class:`~mpitrain.ArgumentError` if ``root`` is not a rank of this
        communicator (the check of every rooted collective's ``root``)."""
        self.dispatcher.checks.root(root)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return the root's ``obj`` (any picklable object) on every rank."""
        if self._engine is not None and self._engine.joined:
            self._joined_error("broadcast_object")
        return self.dispatcher.broadcast_object(obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's ``obj``, in rank order."""
        if self._engine is not None and self._engine.joined:
            self._joined_error("allgather_object")
        return self.dispatcher.allgather_object(obj)

    def _joined_error(self, what: str) -> None:
        """Refuse a blocking collective while some rank is in :meth:`join`: a rank in
        ``join()`` serves only async operations, so the call could never finish."""
        engine = self.engine()
        raise CommunicationError(
            f"rank {self.rank}: blocking {what} called while rank(s) {engine.joined} are in "
            "join(), where they take part in async operations only; use the async variant "
            f"({what.rstrip('_')}_async, then wait()), or call it after join() returns")

    def join(self) -> int:
        """Wait until every rank has called ``join()``; return the rank that joined last.

        For uneven data: a rank that runs out of batches calls ``join()`` and, until
        every rank has, takes part in the async operations the other ranks submit
        (contributing the op's identity to reductions, no rows to allgathers).
        Collective; starts the async engine if need be.

        Raises:
            CommunicationError: a rank ended without joining, or the engine failed.
        """
        return self.engine().join()

    @property
    def join_serves(self) -> frozenset[str]:
        """The kinds of async operation that ranks in :meth:`join` take part in: all of
        ``allreduce`` (grouped ones included), ``reduce_scatter``, ``allgather`` and
        ``broadcast`` by default. An operation of a kind left out, submitted while some
        ranks are in ``join()``, fails with :class:`~mpitrain.CommunicationError` on the
        ranks that submitted it (``mpitrain.torch`` keeps ``allreduce`` only, as
        Horovod). Set it to the same value on every rank."""
        return self._join_serves

    @join_serves.setter
    def join_serves(self, kinds: Iterable[str]) -> None:
        serves = frozenset(kinds)
        unknown = sorted(serves - JOIN_SERVES_ALL)
        if unknown:
            raise ArgumentError(f"rank {self.rank}: join_serves: unknown kinds {unknown}; "
                                f"choose from {sorted(JOIN_SERVES_ALL)}")
        self._join_serves = serves
        if self._engine is not None:
            self._engine.join_serves = serves

    # -- asynchronous collectives ------------------------------------------------------
    def allreduce_async(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        name: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, algorithm: str | None = None,
                        stream: Any = None) -> Handle:
        """Start an allreduce of ``x``; ``wait()`` returns a new array with the result.

        Arguments are those of :meth:`allreduce`, plus ``name`` (see the class
        documentation). Small allreduces with the same op, dtype, scaling and algorithm
        are fused (``MPITRAIN_FUSION_THRESHOLD``). For device arrays, ``stream`` is the
        stream whose work produces ``x`` (default: the current one): the engine reads
        ``x`` once that work is done, and the result is complete when the handle is
        (every async call takes ``stream=`` alike).
        """
        return self.engine().allreduce(x, op, name, prescale_factor, postscale_factor,
                                       algorithm, False, stream)

    def allreduce_async_(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                         name: str | None = None, prescale_factor: float = 1.0,
                         postscale_factor: float = 1.0, algorithm: str | None = None,
                         stream: Any = None) -> Handle:
        """Start an in-place allreduce of ``x``; ``wait()`` returns ``x``, reduced."""
        return self.engine().allreduce(x, op, name, prescale_factor, postscale_factor,
                                       algorithm, True, stream)

    def grouped_allreduce_async(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                                *, name: str | None = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                algorithm: str | None = None, stream: Any = None) -> Handle:
        """Start one fused allreduce of every array of ``xs`` (one collective per dtype,
        whatever the fusion threshold); ``wait()`` returns the list of new arrays."""
        return self.engine().grouped_allreduce(xs, op, name, prescale_factor, postscale_factor,
                                               algorithm, False, stream)

    def grouped_allreduce_async_(self, xs: Sequence[Any],
                                 op: ReduceOp | str = ReduceOp.SUM, *,
                                 name: str | None = None, prescale_factor: float = 1.0,
                                 postscale_factor: float = 1.0,
                                 algorithm: str | None = None, stream: Any = None) -> Handle:
        """In-place :meth:`grouped_allreduce_async`; ``wait()`` returns ``xs`` as a list."""
        return self.engine().grouped_allreduce(xs, op, name, prescale_factor, postscale_factor,
                                               algorithm, True, stream)

    def grouped_allreduce(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM, *,
                          name: str | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0,
                          algorithm: str | None = None) -> list[Any]:
        """Allreduce every array of ``xs`` in one fused collective; returns new arrays."""
        return self.grouped_allreduce_async(xs, op, name=name, prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor,
                                            algorithm=algorithm).wait()

    def grouped_allreduce_(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM, *,
                           name: str | None = None, prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0,
                           algorithm: str | None = None) -> list[Any]:
        """In-place :meth:`grouped_allreduce`; returns ``xs`` as a list."""
        return self.grouped_allreduce_async_(xs, op, name=name,
                                             prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor,
                                             algorithm=algorithm).wait()

    def allgather_async(self, x: Any, *, name: str | None = None,
                        algorithm: str | None = None, stream: Any = None,
                        out: Any = None) -> Handle:
        """Start :meth:`allgather`; ``wait()`` returns the result (``out``, if given: as
        for :meth:`allgather`; its row count must be the same on every rank)."""
        return self.engine().allgather(x, name, algorithm, stream, out)

    def broadcast_async(self, x: Any, root: int = 0, *, name: str | None = None,
                        algorithm: str | None = None, stream: Any = None) -> Handle:
        """Start :meth:`broadcast`; ``wait()`` returns a new array."""
        return self.engine().broadcast(x, root, name, algorithm, False, stream)

    def broadcast_async_(self, x: Any, root: int = 0, *, name: str | None = None,
                         algorithm: str | None = None, stream: Any = None) -> Handle:
        """Start an in-place broadcast from ``root``; ``wait()`` returns ``x``."""
        return self.engine().broadcast(x, root, name, algorithm, True, stream)

    def reduce_scatter_async(self, x: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, algorithm: str | None = None,
                             stream: Any = None) -> Handle:
        """Start :meth:`reduce_scatter`; ``wait()`` returns this rank's block."""
        return self.engine().reduce_scatter(x, op, name, prescale_factor, postscale_factor,
                                            algorithm, stream)

    @staticmethod
    def synchronize(handle: Handle) -> Any:
        """Wait for ``handle`` and return its result (Horovod's name for ``handle.wait()``)."""
        return handle.wait()

    @staticmethod
    def poll(handle: Handle) -> bool:
        """True once ``handle`` is done; never blocks (``handle.test()``)."""
        return handle.test()

    def batch(self) -> ContextManager[None]:
        """A block whose async submissions reach the engine together.

        ``with comm.batch(): hs = [comm.allreduce_async_(x) for x in xs]`` hands the
        whole list to one negotiation cycle when the block ends, where they fuse as
        far as ``MPITRAIN_FUSION_THRESHOLD`` allows; without it the engine starts a
        cycle at the first submission, and the rest trickle into later ones. Waiting
        on a handle inside the block is allowed (the waiting thread runs the cycle).
        Starts the async engine if need be (collective then).
        """
        return self.engine().batch()

    def waited(self) -> ContextManager[None]:
        """A block whose async submissions this thread waits for as soon as it ends: the
        waiting thread runs their cycle, so they do not wake the engine's progress
        thread (which costs a thread switch on a rank with one core). The
        torch.distributed backend's blocking calls submit in one. Starts the async
        engine if need be (collective then)."""
        return self.engine().waited()

    def call(self) -> ContextManager[None]:
        """A block whose unnamed async submissions are one call: on an ``ordered``
        communicator the next call's names are then the same on every rank, however many
        this one submitted on each (:meth:`~mpitrain.engine.Engine.call`); else it
        changes nothing. The torch.distributed backend makes each collective one.
        Starts the async engine if need be (collective then)."""
        return self.engine().call()

    def async_stats(self) -> EngineStats:
        """Counters of the async engine (cycles, collectives, fused arrays, ...)."""
        return self.engine().snapshot()

    @property
    def engine_started(self) -> bool:
        """True once an async call has started the engine (and :meth:`free` has not
        stopped it)."""
        return self._engine is not None

    def engine(self) -> Engine:
        """The async engine of this communicator, started (collectively) on first use."""
        engine = self._engine
        if engine is None:
            d = self.dispatcher
            # Starting the engine takes several collectives that cannot be interrupted
            # (communicator duplicates, shared memory); meet the other ranks first, in a
            # collective that the stall inspector watches and the timeout interrupts, so
            # that a rank that never makes an async call is reported instead of hanging
            # this one inside MPI. A second meeting confirms the first: a rank whose
            # first one timed out (while a late rank's arrival completed it for the late
            # rank) never comes to the second, so the late rank times out there too
            # instead of entering the engine's collectives alone.
            d.rendezvous("the async engine's start")
            d.rendezvous("the async engine's start (confirmation)")
            # the engine's own dispatcher runs under this one's settings (shared memory
            # only if this one has it)
            engine = self._engine = Engine(d.mpi_comm, d.settings.changed(
                shm=d.settings.shm and d.shm is not None), self.ordered)
            engine.join_serves = self._join_serves
        return engine

    # -- lifetime ----------------------------------------------------------------------
    def free(self) -> None:
        """Release the communicator's private MPI resources (collective).

        Stops the async engine first: operations every rank submitted are finished,
        the others fail.
        """
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
        self.dispatcher.free()
