"""The dispatcher: from a collective call to a plan run on the private communicator.

A :class:`Dispatcher` owns one private duplicate of an MPI communicator (its
:class:`~mpitrain.comm.transport.Transport`), the node's shared memory, the
:class:`~mpitrain.comm.validation.Validator` and a cache of plans. For each call it

1. checks the arguments locally (dtype, op, ``out``, ``root``) into a
   :class:`~.checks.Call` (:class:`~.checks.Checks`, shared with the async engine);
2. picks the algorithm: the requested one, else the selection table (:meth:`algorithm`);
3. validates the call across ranks with its :class:`~mpitrain.comm.validation.Signature`
   (unless checking is off);
4. fetches, or builds once, the algorithm's :class:`~mpitrain.algorithms.base.Plan`
   for this shape through the buffer kind's transfer policy (:mod:`.policy`);
5. runs it and applies ``prescale_factor``/``postscale_factor`` (``Average`` is ``Sum``
   then a postscale of ``1/size``).

:meth:`execute` runs a checked call (steps 2-5); :meth:`run_plan` is the one place
where a call is validated and its plan run. The blocking methods of
:class:`~mpitrain.Communicator` are the public methods here (small host calls first try
the fast path of :mod:`.fastpath`); the async engine owns a dispatcher of its own,
checks each submission with the same :class:`~.checks.Checks`, and runs what every rank
submitted through :meth:`run_small` (the fast path's plans), else :meth:`execute` (or
:meth:`allreduce_flat` for a fusion bucket); that dispatcher does not validate
(``validates=False``): the engine's negotiation has compared the submissions.

Everything the dispatcher reads of the configuration is in its
:class:`~mpitrain.config.Settings` (read once per communicator; :meth:`configure`
replaces it).

Device arrays (CuPy, torch CUDA tensors, ...) take the same path: every collective
accepts ``stream=`` (default: the current stream), runs on that stream and the
array's device, and synchronizes the stream before MPI touches the data and before
returning (:meth:`~mpitrain.backends.base.ArrayBackend.scope`).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from .. import algorithms
from ..algorithms import Plan, PlanRequest
from ..algorithms.chunks import bounds_from_counts, split_bounds
from ..algorithms.pieces import Pieces
from ..backends import NUMPY, ArrayBackend, hostcopy
from ..comm import objects
from ..comm import shm as shared
from ..comm.inspector import StallLimits
from ..comm.links import DeviceLinks, Layout
from ..comm.topology import Topology
from ..comm.transport import Transport
from ..comm.validation import NO_PAYLOAD, Signature, Validator, signature
from ..config import AT_CREATION, SETTING_OF, Settings
from ..dtypes import check_dtype, dtype_name
from ..errors import ArgumentError, MismatchError, MpitrainError
from ..ops import ReduceOp, parse_op
from .checks import Call, Checks
from .fastpath import SmallAllgather, SmallAllreduce, SmallCall, SmallReduceScatter, fits_out
from .policy import HOST, TransferPolicy, device_policy
from .selection import Table

Array = Any
log = logging.getLogger("mpitrain")
PLAN_CACHE_SIZE = 32
"""Plans kept per dispatcher (least recently used first out)."""
SMALL_CACHE_SIZE = 64
"""Small-call plans (:mod:`.fastpath`) kept per dispatcher and kind (all dropped when full)."""
SLOT_BYTES = 512 << 10
"""Shared-memory slot per rank: calls up to this size ride the validation exchange
(a slot copies a block in and every rank's out with one barrier, where the stripes
need two; BENCHMARKS.md shows where it wins)."""
ARENA_BYTES = 8 << 20
"""Shared-memory arena per rank for the stripes of large shm collectives."""
BARRIER = signature("barrier")
"""The signature of every barrier."""
_Small = TypeVar("_Small", bound=SmallCall)


def _variable(name: str) -> str:
    """The variable of a setting (``tuning rules``: the tuning file's)."""
    setting = SETTING_OF.get(name)
    return setting.name if setting is not None else "MPITRAIN_TUNING_FILE contents"


def _shown(name: str, value: Any) -> str:
    """A setting's value as a disagreement names it (rules: how many)."""
    return f"{len(value)} rules" if name == "tuning rules" else repr(value)


def row_size(shape: tuple[int, ...]) -> int:
    """Elements per row of axis 0."""
    row = 1
    for d in shape[1:]:
        row *= int(d)
    return row


def _prescaled(be: ArrayBackend, src: Array | Pieces, out: Array | Pieces,
               dt: np.dtype[Any], factor: float) -> Array | Pieces:
    """``src * factor`` where the allreduce into ``out`` will read it, each element
    read and written once: in place, a fusion bucket's
    :class:`~mpitrain.algorithms.pieces.Pieces` are scaled where they are (the result
    overwrites them anyway); otherwise ``src`` is scaled into ``out``, or into a new
    flat buffer where ``out`` is pieces that share memory (scaled where they are, an
    element held by two pieces would be scaled twice)."""
    if not isinstance(src, Pieces):
        be.scale_into(out, src, factor)
        return out
    if src is out and not src.overlapping():
        for piece in src.arrays:
            be.scale(piece, factor)
        return src
    flat = be.empty(src.size, dt) if isinstance(out, Pieces) else out
    for piece, start in zip(src.arrays, src.starts):
        be.scale_into(flat[start:start + piece.size], piece, factor)
    return flat


class Dispatcher:
    """Argument checks, algorithm choice, validation, plans and scaling over one
    private duplicate of ``comm`` (collective to create).

    Args:
        comm: any intracommunicator; the dispatcher duplicates it.
        settings: the communicator's settings (validation, shared memory, stall limits,
            algorithm, segments, ...), read once; the ranks must agree on those of
            :data:`~mpitrain.config.AGREED` (compared here: MismatchError on every rank).
        validates: compare each call across ranks (the signature in the exchange that
            opens it; allgather always, the others where checking is on). ``False`` for
            a caller that compares the calls itself before they run (the async engine's
            negotiation): no call carries a signature then, on any path.
    """

    def __init__(self, comm: MPI.Intracomm, settings: Settings, validates: bool = True) -> None:
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise ArgumentError(f"mpitrain.Communicator needs an MPI intracommunicator, got "
                                f"{comm!r}")
        stall = StallLimits.of(settings)
        self.transport = Transport(comm, stall, settings.elastic)
        self.mpi_comm: MPI.Intracomm = self.transport.comm
        self.rank, self.size = self.transport.rank, self.transport.size
        self.topology = Topology.detect(self.mpi_comm, stall, settings.elastic)
        # Not under ULFM: a rank that dies is only noticed by MPI calls, never by a
        # shared-memory barrier, which would wait for it forever.
        self.shm = shared.create(self.mpi_comm, self.topology.local_size == self.size,
                                 settings.shm and not settings.elastic, SLOT_BYTES, ARENA_BYTES,
                                 settings.single_copy)
        if self.shm is not None:
            self.transport.watch(self.shm)
        self.validator = Validator(self.transport, self.shm)
        self.validates = validates
        self.links = DeviceLinks(self.transport, self.topology, self.shm, settings.device_links)
        self.checks = Checks(self.rank, self.size, self._check_algorithm)
        self._plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        # (collective, buffer, device layout) -> (runnable, preferred by auto)
        self._available: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self._choices: dict[tuple[Any, ...], str] = {}
        # (collective, requested, buffer, dtype, algorithm) of the choices logged
        self._logged: set[tuple[Any, ...]] = set()
        # per kind: (dtype, shape, op, algorithm) -> the plan, or None (the general path)
        self._small: dict[tuple[Any, ...], SmallAllreduce | None] = {}
        self._small_rs: dict[tuple[Any, ...], SmallReduceScatter | None] = {}
        self._small_ag: dict[tuple[Any, ...], SmallAllgather | None] = {}
        self.settings = settings
        self.table = Table.load(settings.tuning_file)
        self.device_policy = device_policy(settings)
        self._agree(settings, self.table)
        if log.isEnabledFor(logging.DEBUG):
            shm = self.shm
            log.debug("mpitrain rank %d: a communicator of %d rank(s) on %d node(s): shared "
                      "memory %s, single-copy %s, validation %s, algorithm %s, tuning file "
                      "%s", self.rank, self.size, self.topology.node_count,
                      "on" if shm is not None else "off",
                      "on" if shm is not None and shm.single_copy else
                      f"off ({shm.single_copy_reason if shm is not None else 'no shared memory'})",
                      "on" if settings.check else "off", settings.algorithm,
                      settings.tuning_file or "none")

    def configure(self, settings: Settings) -> None:
        """Run every later call under ``settings`` (collective: the ranks must agree on
        :data:`~mpitrain.config.AGREED`; the tuning file is read again). Cached plans
        and choices are dropped.

        Raises:
            ArgumentError: ``settings`` changes one fixed at creation
                (:data:`~mpitrain.config.AT_CREATION`).
            MismatchError: on every rank, if the ranks' settings disagree.
        """
        fixed = [name for name in AT_CREATION
                 if getattr(settings, name) != getattr(self.settings, name)]
        table = Table.load(settings.tuning_file)
        self._agree(settings, table, refused=", ".join(fixed))
        if fixed:
            raise ArgumentError(
                f"rank {self.rank}: {', '.join(fixed)} cannot change on a communicator "
                "(read when it is created); create a new mpitrain.Communicator with them")
        self.settings, self.table = settings, table
        self.device_policy = device_policy(settings)
        if settings.device_links != self.links.allowed:
            self.links.free()
            self.links = DeviceLinks(self.transport, self.topology, self.shm,
                                     settings.device_links)
        for cache in (self._plans, self._available, self._choices, self._logged, self._small,
                      self._small_rs, self._small_ag):
            cache.clear()

    def _agree(self, settings: Settings, table: Table, refused: str = "") -> None:
        """Compare the settings that must agree (and the tuning rules, and whether this
        rank refuses the change: ``refused``) across ranks; MismatchError on every rank
        naming the first difference. Every rank raises or none does."""
        if self.size == 1:
            return
        self.transport.begin("settings agreement")
        mine = ((*settings.agreed(), ("tuning rules", table.rules)), refused)
        every = objects.allgather_object(self.transport, mine)
        if any(r for _, r in every):
            if refused:
                return  # this rank raises ArgumentError itself
            ranks = [r for r, (_, why) in enumerate(every) if why]
            raise MismatchError(f"rank {self.rank}: configure() failed on rank(s) {ranks}, "
                                f"which cannot change {every[ranks[0]][1]} (fixed when a "
                                "communicator is created); no rank's settings changed")
        for i, (name, value) in enumerate(mine[0]):
            values = [theirs[0][i][1] for theirs in every]
            if any(v != value for v in values):
                shown = "; ".join(f"rank {r}: {_shown(name, v)}" for r, v in enumerate(values))
                raise MismatchError(
                    f"rank {self.rank}: the ranks of this communicator disagree on the "
                    f"setting {name} ({shown}); every rank must run with the same "
                    f"{_variable(name)} (or pass the same value to Communicator.configure)")

    @property
    def checking(self) -> bool:
        """Whether calls are validated (``MPITRAIN_CHECK``, or the communicator's
        ``check=``, on a dispatcher that :attr:`validates`)."""
        return self.validates and self.settings.check

    # -- algorithm choice --------------------------------------------------------------
    def algorithms(self, collective: str) -> list[str]:
        """The algorithms this dispatcher can run for ``collective`` on host buffers."""
        if collective not in algorithms.ALGORITHMS:
            raise ArgumentError(f"unknown collective {collective!r}; use one of "
                                f"{', '.join(algorithms.ALGORITHMS)}")
        return list(self._available_for(collective, NUMPY)[0])

    def _available_for(self, collective: str,
                       be: ArrayBackend) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The algorithms that can run ``collective`` on ``be``'s buffers here, and those
        of them that ``auto`` may choose. Before the device layout is known (the first
        device call finds it) the device-only ones count as runnable."""
        layout = self.links.layout(be) if be.is_device else None
        key = (collective, be.name, layout)
        found = self._available.get(key)
        if found is None:
            found = self._available[key] = self._runnable(collective, be, layout)
        return found

    def _runnable(self, collective: str, be: ArrayBackend,
                  layout: Layout | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        shm_ok = self.shm is not None
        peers_ok = shm_ok and self.shm is not None and self.shm.single_copy and be is NUMPY
        plans = algorithms.REGISTRY[collective]
        runnable, preferred = [], []
        for name in algorithms.ALGORITHMS[collective]:
            plan = plans[name]
            if (plan.needs_shared_memory and not shm_ok) or (plan.host_only and be.is_device) \
                    or (plan.needs_single_copy and not peers_ok) \
                    or (plan.device_only and not be.is_device):
                continue
            if plan.device_only and layout is not None and not layout.runnable(plan.link):
                continue
            runnable.append(name)
            if not plan.device_only or layout is None or layout.preferred(plan.link):
                preferred.append(name)
        return tuple(runnable), tuple(preferred)

    def _check_algorithm(self, collective: str, name: str, be: ArrayBackend,
                         dt: np.dtype[Any]) -> None:
        """Raise unless this dispatcher can run the algorithm ``name`` for such a call
        (local: never finds the device layout)."""
        self.algorithm(collective, name, 0, be, dt, probe=False)

    def algorithm(self, collective: str, requested: str | None, nbytes: int,
                  be: ArrayBackend, dt: np.dtype[Any], probe: bool = True) -> str:
        """The algorithm of a call: the requested one, or the selection table's choice.

        A name from ``MPITRAIN_ALGORITHM`` that this collective (or this dispatcher)
        cannot run falls back to the table; a name passed as ``algorithm=`` raises.
        Memoized: the same arguments always give the same name. The first device call
        finds the device layout (collective, :meth:`DeviceLinks.probe`) unless ``probe``
        is False (a local check).
        """
        layout = None
        if be.is_device and self.size > 1:
            layout = self.links.layout(be)
            if layout is None and probe:
                layout = self.links.probe(be, collective)
                log.debug("mpitrain rank %d: %s", self.rank, layout.describe())
        key = (collective, requested, nbytes, dt, be.name, layout)
        choice = self._choices.get(key)
        if choice is None:
            name = requested or self.settings.algorithm
            choice = self._choose(collective, name.lower(), requested is None, nbytes, be, dt)
            if len(self._choices) >= 1024:
                self._choices.clear()
            self._choices[key] = choice
            if log.isEnabledFor(logging.DEBUG):
                self._log_choice(collective, requested, nbytes, be, dt, choice)
        return choice

    def _log_choice(self, collective: str, requested: str | None, nbytes: int,
                    be: ArrayBackend, dt: np.dtype[Any], choice: str) -> None:
        """Log (DEBUG) the algorithm chosen for a kind of call the first time it is
        chosen for that kind: once per new choice, not per call or size."""
        kind = (collective, requested, be.name, dt, choice)
        if kind in self._logged:
            return
        self._logged.add(kind)
        name = (requested or self.settings.algorithm).lower()
        why = ("algorithm=" if requested and name == choice else
               "MPITRAIN_ALGORITHM" if name == choice else
               f"the selection table ({self.size} ranks on {self.topology.node_count} "
               f"node(s)" + (f"; {name!r} cannot run here)" if name != "auto" else ")"))
        policy = self.device_policy.name if be.is_device else HOST.name
        log.debug("mpitrain rank %d: %s of %d B of %s on %s buffers: algorithm %s, chosen by "
                  "%s; transfer policy %s", self.rank, collective, nbytes, dtype_name(dt),
                  be.name, choice, why, policy)

    def _choose(self, collective: str, name: str, from_env: bool, nbytes: int,
                be: ArrayBackend, dt: np.dtype[Any]) -> str:
        available, preferred = self._available_for(collective, be)
        if name in available or (self.size == 1 and name in algorithms.ALGORITHMS[collective]):
            return name
        if name == "auto" or (from_env and name in algorithms.KNOWN):
            return self.table.select(collective, nbytes, self.size, be.name, preferred,
                                     dtype_name(dt), self.topology.node_count)
        if name in algorithms.ALGORITHMS[collective]:
            raise ArgumentError(f"rank {self.rank}: the {name} {collective} "
                                f"{self._why_not(collective, name, be)}; use algorithm='auto'")
        raise ArgumentError(f"rank {self.rank}: unknown {collective} algorithm "
                            f"{name!r}; use one of auto, {', '.join(available)}")

    def _why_not(self, collective: str, name: str, be: ArrayBackend) -> str:
        """Why the algorithm ``name`` is not runnable for ``be``'s buffers (a phrase that
        follows its name)."""
        plan = algorithms.REGISTRY[collective][name]
        if plan.device_only and not be.is_device:
            return "runs on device buffers only"
        if plan.device_only:
            layout = self.links.layout(be)
            return "cannot run here: " + (layout.why if layout is not None else "no device link")
        if plan.host_only and be.is_device:
            return "runs on host (numpy) buffers only"
        return "needs every rank on one node with shared memory" + \
            (" and single-copy reads (MPITRAIN_SINGLE_COPY)" if plan.needs_single_copy else "")

    def takes_pieces(self, algorithm: str | None, nbytes: int, be: ArrayBackend,
                     dt: np.dtype[Any]) -> bool:
        """True if an allreduce of ``nbytes`` runs an algorithm that reads and writes
        :class:`~mpitrain.algorithms.pieces.Pieces`: a fusion bucket may then go to
        :meth:`allreduce_flat` unpacked."""
        if self.size == 1:
            return False
        name = self.algorithm("allreduce", algorithm, nbytes, be, dt)
        return algorithms.REGISTRY["allreduce"][name].takes_pieces

    # -- checked calls -----------------------------------------------------------------
    def execute(self, call: Call, arr: Array, *, out: Array | None = None,
                name: str | None = None, stream: Any = None) -> Array:
        """Run a checked call (:class:`~.checks.Call`) on ``arr``, the array of its input
        (for an in-place call, the one to write into), inside the backend's stream scope.

        The one entry point of every blocking call's general path and of every
        operation the async engine runs alone (a fused bucket goes to
        :meth:`allreduce_flat`). ``out``: an array to write the result into (checked
        here; allreduce, reduce_scatter, allgather). The call is compared across ranks
        first where the dispatcher :attr:`validates`.

        Returns:
            The result: ``arr`` in place (or ``out``), else a new array.
        """
        with call.backend.scope(arr, stream):
            if call.collective == "allreduce":
                return self._allreduce(call, arr, out, name)
            if call.collective == "reduce_scatter":
                return self._reduce_scatter(call, arr, out, name)
            if call.collective == "allgather":
                return self._allgather(call, arr, out, name)
            return self._broadcast(call, arr, name)

    # -- allreduce ---------------------------------------------------------------------
    def allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, algorithm: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  out: Array | None = None, name: str | None = None, *,
                  stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.allreduce`."""
        if (type(x) is np.ndarray and name is None
                and (algorithm is None or type(algorithm) is str)
                and prescale_factor == 1.0 and postscale_factor == 1.0
                and (type(op) is ReduceOp or type(op) is str)):
            result = self._fast_allreduce(x, op, algorithm, out)
            if result is not None:
                return result
        be, arr = self.checks.array(x, "allreduce", False)
        call = self.checks.reduction("allreduce", be, arr, op, prescale_factor,
                                     postscale_factor, algorithm)
        return self.execute(call, arr, out=out, name=name, stream=stream)

    def allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                   algorithm: str | None = None, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, name: str | None = None, *,
                   stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.allreduce_`."""
        if (type(x) is np.ndarray and name is None
                and (algorithm is None or type(algorithm) is str)
                and prescale_factor == 1.0 and postscale_factor == 1.0
                and (type(op) is ReduceOp or type(op) is str)
                and self._fast_allreduce(x, op, algorithm, x) is not None):
            return x
        be, arr = self.checks.array(x, "allreduce_", True)
        call = self.checks.reduction("allreduce", be, arr, op, prescale_factor,
                                     postscale_factor, algorithm, inplace=True)
        self.execute(call, arr, name=name, stream=stream)
        return x

    def _fast_allreduce(self, x: np.ndarray[Any, Any], op: ReduceOp | str,
                        algorithm: str | None, out: Array | None) -> Array | None:
        """An allreduce of ``x`` on its fast-path plan, into ``out`` (``None``: a new
        array; ``x``: in place); ``None`` where the plan does not take the call."""
        key = (x.dtype, x.shape, op, algorithm)
        small = self._small[key] if key in self._small else \
            self.small_allreduce(x, op, algorithm)
        if small is None:
            return None
        if out is x:
            return small.allreduce(x, x) if x.flags.writeable else None
        if out is None or fits_out(out, x.shape, x.dtype):
            return small.allreduce(x, out)
        return None

    def small_allreduce(self, x: np.ndarray[Any, Any], op: ReduceOp | str,
                        algorithm: str | None = None) -> SmallAllreduce | None:
        """The fast-path plan (:mod:`.fastpath`) of an allreduce of ``x`` with ``op``,
        ``algorithm`` (as requested: ``None``, ``"auto"`` or a name) and otherwise default
        arguments, made on first use; ``None`` if the call needs the general path."""
        return self._small_plan(self._small, SmallAllreduce, x, op, algorithm)

    def _small_plan(self, cache: dict[tuple[Any, ...], _Small | None], kind: type[_Small],
                    x: np.ndarray[Any, Any], op: ReduceOp | str | None,
                    algorithm: str | None) -> _Small | None:
        """The plan of ``kind`` for the call in ``cache``, else a new one (remembered,
        ``None`` included)."""
        key = (x.dtype, x.shape, op, algorithm)
        if key in cache:
            return cache[key]
        small = self._plan_small(kind, x, op, algorithm)
        if len(cache) >= SMALL_CACHE_SIZE:
            cache.clear()
        cache[key] = small
        return small

    def _plan_small(self, kind: type[_Small], x: np.ndarray[Any, Any], op: ReduceOp | str | None,
                    algorithm: str | None) -> _Small | None:
        """A new fast-path plan of ``kind`` (:mod:`.fastpath`) for ``x``, or ``None`` where
        the call needs the general path (which also raises for invalid input).

        A reduction needs an ``op``; an allgather (``op`` ``None``) is chosen by its
        gathered size, as if every rank sent ``x``'s rows, and is validated wherever the
        dispatcher :attr:`validates` (the general path's rule)."""
        if x.ndim < kind.min_ndim:
            return None
        try:
            if op is None:
                rop = None
                dt = check_dtype(x.dtype, rank=self.rank)
                total = x.size * self.size * dt.itemsize
            else:
                rop = op if type(op) is ReduceOp else parse_op(op)
                if rop is ReduceOp.ADASUM:
                    return None
                dt = self.checks.reducible(x, rop)
                total = x.size * dt.itemsize
            alg = self.algorithm(kind.collective, algorithm, total, NUMPY, dt)
        except MpitrainError:
            return None
        shape = tuple(x.shape)
        if self.size == 1:
            return kind(self.transport, None, self.validator, dt, shape, rop, None)
        shm, segment = self.shm, self.settings.segment_bytes
        if alg != "shm" or shm is None or x.size * dt.itemsize > shm.slot_bytes or \
                (segment and total > segment):
            return None
        if rop is None:
            # the general path's signature: the trailing shape and the requested name
            if shm.single_copy and self.table.may_select("allgather", "single_copy"):
                return None  # a table that may pick it needs every rank's block address
            sig: Signature | None = signature(
                kind.collective, "", dtype_name(dt), shape[1:], True, -1, 1.0, 1.0, "",
                (algorithm or self.settings.algorithm).lower()) if self.validates else None
        else:
            sig = signature(kind.collective, rop.value, dtype_name(dt), shape or (x.size,),
                            False, -1, 1.0, 1.0, "", alg) if self.checking else None
        return kind(self.transport, shm, self.validator, dt, shape, rop, sig)

    def _allreduce(self, call: Call, arr: Array, out: Array | None,
                   name: str | None) -> Array:
        be, dt, op = call.backend, call.dtype, call.op
        assert op is not None
        if call.inplace:
            work = be.ascontiguous(arr)
            flat = be.flat(work)
            self.allreduce_flat(be, flat, flat, dt, op, call.algorithm, call.prescale,
                                call.postscale, name, arr.shape)
            if work is not arr:
                be.copy_into(arr, work)
            return arr
        if out is None:
            result = be.empty_like(arr) if be.is_contiguous(arr) else be.empty(arr.size, dt) \
                .reshape(arr.shape)
        else:
            result = self.checks.out(be, out, arr.shape, dt, "allreduce")
        src = be.ascontiguous(arr)
        self.allreduce_flat(be, be.flat(src), be.flat(result), dt, op, call.algorithm,
                            call.prescale, call.postscale, name, arr.shape)
        return result if out is None else out

    def allreduce_flat(self, be: ArrayBackend, src: Array, out: Array, dt: np.dtype[Any],
                       op: ReduceOp, algorithm: str | None, prescale: float,
                       postscale: float, name: str | None = None,
                       shape: tuple[int, ...] | None = None) -> str:
        """Allreduce of flat contiguous arrays of a checked call (the entry point of
        fused buffers too, which may be :class:`~mpitrain.algorithms.pieces.Pieces`
        where :meth:`takes_pieces` says so).

        ``name`` and ``shape`` (default: the flat shape) only enter validation, which
        runs where checking is on (:attr:`checking`).

        Returns:
            The name of the algorithm that ran.
        """
        n = self.size
        scale = postscale / n if op is ReduceOp.AVERAGE else postscale
        if prescale != 1.0:
            src = _prescaled(be, src, out, dt, prescale)
        count = src.size
        if op is ReduceOp.ADASUM:
            alg = algorithms.ADASUM
        else:
            alg = self.algorithm("allreduce", algorithm, count * dt.itemsize, be, dt)
        if n == 1:
            be.scale_into(out, src, scale)
        else:
            self.transport.begin("allreduce")
            sig = signature("allreduce", op.value, dtype_name(dt), shape or (count,), False, -1,
                            prescale, postscale, name or "", alg) \
                if self.checking else None
            self.run_plan("allreduce", alg, be, dt, op.reduction, (count,), 0, sig, src, out,
                          scale)
        return alg

    # -- reduce-scatter ----------------------------------------------------------------
    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                       algorithm: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, name: str | None = None, *,
                       out: Array | None = None, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.reduce_scatter`."""
        if (type(x) is np.ndarray and name is None and stream is None
                and (algorithm is None or type(algorithm) is str)
                and prescale_factor == 1.0 and postscale_factor == 1.0
                and (type(op) is ReduceOp or type(op) is str)):
            result = self._fast_reduce_scatter(x, op, algorithm, out)
            if result is not None:
                return result
        be, arr = self.checks.array(x, "reduce_scatter", False)
        call = self.checks.reduction("reduce_scatter", be, arr, op, prescale_factor,
                                     postscale_factor, algorithm)
        return self.execute(call, arr, out=out, name=name, stream=stream)

    def _fast_reduce_scatter(self, x: np.ndarray[Any, Any], op: ReduceOp | str,
                             algorithm: str | None, out: Array | None) -> Array | None:
        """A reduce-scatter of ``x`` on its fast-path plan, into ``out`` (``None``: a
        new array); ``None`` where the plan does not take the call."""
        key = (x.dtype, x.shape, op, algorithm)
        small = self._small_rs[key] if key in self._small_rs else \
            self.small_reduce_scatter(x, op, algorithm)
        if small is None or (out is not None and not fits_out(out, small.out_shape, x.dtype)):
            return None
        return small.reduce_scatter(x, out)

    def small_reduce_scatter(self, x: np.ndarray[Any, Any], op: ReduceOp | str,
                             algorithm: str | None = None) -> SmallReduceScatter | None:
        """The fast-path plan (:mod:`.fastpath`) of a reduce-scatter of ``x`` with ``op``
        and ``algorithm`` (as requested) and otherwise default arguments, made on first
        use; ``None`` if the call needs the general path."""
        return self._small_plan(self._small_rs, SmallReduceScatter, x, op, algorithm)

    def _reduce_scatter(self, call: Call, arr: Array, out: Array | None,
                        name: str | None) -> Array:
        be, dt, rop = call.backend, call.dtype, call.op
        assert rop is not None
        row = row_size(arr.shape)
        n, count = self.size, arr.size
        rows, extra = divmod(arr.shape[0], n)
        mine = rows + (self.rank < extra)
        shape = (mine, *tuple(arr.shape[1:]))
        result = be.empty(mine * row, dt) if out is None else \
            be.flat(self.checks.out(be, out, shape, dt, "reduce_scatter"))
        src = be.flat(be.ascontiguous(arr))
        prescale, postscale = call.prescale, call.postscale
        scale = postscale / n if rop is ReduceOp.AVERAGE else postscale
        if prescale != 1.0:
            scaled = be.empty(src.size, dt)
            be.scale_into(scaled, src, prescale)
            src = scaled
        alg = self.algorithm("reduce_scatter", call.algorithm, count * dt.itemsize, be, dt)
        if n == 1:
            be.scale_into(result, src, scale)
        else:
            self.transport.begin("reduce_scatter")
            sig = signature("reduce_scatter", rop.value, dtype_name(dt), arr.shape, False, -1,
                            prescale, postscale, name or "", alg) \
                if self.checking else None
            self.run_plan("reduce_scatter", alg, be, dt, rop.reduction, (count, row), 0, sig,
                          src, result, scale)
        return result.reshape(shape) if out is None else out

    # -- allgather ---------------------------------------------------------------------
    def allgather(self, x: Array, algorithm: str | None = None, name: str | None = None, *,
                  out: Array | None = None, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.allgather`."""
        if (type(x) is np.ndarray and name is None and stream is None
                and (algorithm is None or type(algorithm) is str)):
            result = self._fast_allgather(x, algorithm, out)
            if result is not None:
                return result
        be, arr = self.checks.array(x, "allgather", False)
        call = self.checks.allgather(be, arr, algorithm)
        return self.execute(call, arr, out=out, name=name, stream=stream)

    def _fast_allgather(self, x: np.ndarray[Any, Any], algorithm: str | None,
                        out: Array | None) -> Array | None:
        """An allgather of ``x`` on its fast-path plan, into ``out`` (``None``: a new
        array); ``None`` where the plan does not take the call. Where the ranks' rows
        turn out not to be the plan's, the call finishes from the same exchange."""
        key = (x.dtype, x.shape, None, algorithm)
        small = self._small_ag[key] if key in self._small_ag else \
            self.small_allgather(x, algorithm)
        if small is None or (out is not None and not fits_out(out, small.out_shape, x.dtype)):
            return None
        result = small.allgather(x, out)
        if result is not None:
            return result
        total = -1 if out is None else small.out_shape[0]
        return self._gathered(NUMPY, np.ascontiguousarray(x).reshape(-1), small.shape[1:],
                              small.dtype, algorithm, out, total)

    def run_small(self, call: Call, arr: Array, out: Array | None = None) -> Array | None:
        """Run a checked call (as :meth:`execute` would) on its fast-path plan
        (:mod:`.fastpath`), where it has one: a numpy array, no scaling, and what the
        plan needs (a small array on one node, ...); ``None`` where it has none (nothing
        has run: :meth:`execute` runs the call). For a caller whose calls come checked
        already, the async engine: the blocking methods find their plans before the
        checks.

        Returns:
            The result, as :meth:`execute` returns it.
        """
        if type(arr) is not np.ndarray or call.prescale != 1.0 or call.postscale != 1.0:
            return None
        collective, op = call.collective, call.op
        if collective == "allreduce" and op is not None:
            return self._fast_allreduce(arr, op, call.algorithm, arr if call.inplace else None)
        if collective == "reduce_scatter" and op is not None:
            return self._fast_reduce_scatter(arr, op, call.algorithm, out)
        if collective == "allgather":
            return self._fast_allgather(arr, call.algorithm, out)
        return None

    def small_allgather(self, x: np.ndarray[Any, Any],
                        algorithm: str | None = None) -> SmallAllgather | None:
        """The fast-path plan (:mod:`.fastpath`) of an allgather of ``x`` with
        ``algorithm`` (as requested) and otherwise default arguments, made on first use;
        ``None`` if the call needs the general path."""
        return self._small_plan(self._small_ag, SmallAllgather, x, None, algorithm)

    def _allgather(self, call: Call, arr: Array, out: Array | None,
                   name: str | None) -> Array:
        be, dt, algorithm = call.backend, call.dtype, call.algorithm
        if arr.ndim == 0:
            arr = arr.reshape(1)
        block = be.flat(be.ascontiguous(arr))
        trailing = tuple(arr.shape[1:])
        total = -1  # the rows of out=, which every rank must agree on
        target = None  # out= as the backend's array
        if out is not None:
            total = self.checks.rows(out)
            target = self.checks.out(be, out, (total, *trailing), dt, "allgather")
        if self.size == 1:
            self.algorithm("allgather", algorithm, block.size * dt.itemsize, be, dt)
            if out is None:
                return be.ascontiguous(arr).copy()
            self.checks.gathered_rows(total, (arr.shape[0],), trailing)
            be.copy_into(target, arr)
            return out
        requested = (algorithm or self.settings.algorithm).lower()
        self.transport.begin("allgather")
        # With out=, its row count joins the agreed shape: ranks that disagree fail
        # together here, and ranks that agree all check it against the gathered rows.
        # The exchange runs either way: it carries every rank's row count.
        agreed = trailing if out is None else (total, *trailing)
        sig = signature("allgather", "", dtype_name(dt), agreed, True, -1, 1.0, 1.0, name or "",
                        requested) if self.validates else None
        # a small block rides the exchange in this rank's shared-memory slot, where the
        # call would run shm if every rank sent as many rows (ShmAllgather reads the
        # slots only if every rank's block is there)
        payload = self.shm.offer(be.as_bytes(block)) \
            if self.shm is not None and be is NUMPY and self.algorithm(
                "allgather", algorithm, block.size * dt.itemsize * self.size, be, dt) == "shm" \
            else NO_PAYLOAD
        # where the others may read the block, if the call may run single_copy
        address = hostcopy.address(block) \
            if self.shm is not None and self.shm.single_copy and be is NUMPY and (
                requested == "single_copy"
                or self.table.may_select("allgather", "single_copy")) else 0
        self.validator.exchange(sig, rows=arr.shape[0], payload=payload, address=address)
        result = self._gathered(be, block, trailing, dt, algorithm, target, total)
        return result if out is None else out

    def _gathered(self, be: ArrayBackend, block: Array, trailing: tuple[int, ...],
                  dt: np.dtype[Any], algorithm: str | None, out: Array | None,
                  total: int) -> Array:
        """The rest of an allgather once its exchange has run: every rank's rows from the
        headers, the algorithm for the gathered size, and its plan (``block``: this
        rank's flat block; ``total``: the rows of ``out=``, else -1)."""
        rows = self.validator.rows()
        row = row_size((1, *trailing))
        counts = tuple(r * row for r in rows)
        if out is not None:  # total and rows are the same on every rank: all raise
            self.checks.gathered_rows(total, rows, trailing)
        result = be.empty(sum(counts), dt) if out is None else be.flat(out)
        alg = self.algorithm("allgather", algorithm, sum(counts) * dt.itemsize, be, dt)
        self.run_plan("allgather", alg, be, dt, None, counts, 0, None, block, result)
        return result.reshape((sum(rows), *trailing)) if out is None else out

    # -- broadcast ---------------------------------------------------------------------
    def broadcast(self, x: Array, root: int = 0, algorithm: str | None = None,
                  name: str | None = None, *, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.broadcast`."""
        be, arr = self.checks.array(x, "broadcast", False)
        call = self.checks.broadcast(be, arr, root, algorithm)
        return self.execute(call, arr, name=name, stream=stream)

    def broadcast_(self, x: Array, root: int = 0, algorithm: str | None = None,
                   name: str | None = None, *, stream: Any = None) -> Array:
        """See :meth:`mpitrain.Communicator.broadcast_`."""
        be, arr = self.checks.array(x, "broadcast_", True)
        call = self.checks.broadcast(be, arr, root, algorithm, inplace=True)
        self.execute(call, arr, name=name, stream=stream)
        return x

    def _broadcast(self, call: Call, arr: Array, name: str | None) -> Array:
        be, dt = call.backend, call.dtype
        if call.inplace:
            buf = be.ascontiguous(arr)
        else:
            buf = be.empty(arr.size, dt).reshape(arr.shape)
            if self.rank == call.root:
                be.copy_into(buf, arr)
        count = buf.size
        alg = self.algorithm("broadcast", call.algorithm, count * dt.itemsize, be, dt)
        if self.size > 1:
            self.transport.begin("broadcast")
            sig = signature("broadcast", "", dtype_name(dt), buf.shape, False, call.root, 1.0,
                            1.0, name or "", alg) if self.checking else None
            flat = be.flat(buf)
            self.run_plan("broadcast", alg, be, dt, None, (count,), call.root, sig, flat, flat)
        if call.inplace and buf is not arr:
            be.copy_into(arr, buf)
        return arr if call.inplace else buf

    # -- objects and synchronisation ---------------------------------------------------
    def barrier(self) -> None:
        """See :meth:`mpitrain.Communicator.barrier`."""
        self.rendezvous("barrier", BARRIER)

    def rendezvous(self, collective: str, sig: Signature | None = None) -> None:
        """A barrier counted as ``collective``: validated against the other ranks' calls
        (a rank in another collective gets MismatchError), watched by the stall
        inspector, interruptible at the stall timeout like every collective.

        ``sig`` is ``signature(collective)``, when the caller has it at hand.
        """
        if self.size == 1:
            return
        self.transport.begin(collective)
        checking = self.checking
        if checking or self.shm is not None:  # the exchange is itself a barrier
            self.validator.meet((sig or signature(collective)) if checking else None)
        else:
            self.transport.barrier()

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """See :meth:`mpitrain.Communicator.broadcast_object`."""
        self.checks.root(root)
        self.transport.begin("broadcast_object")
        if self.size > 1 and self.checking:
            self.validator.check(signature("broadcast_object", root=int(root)))
        return objects.broadcast_object(self.transport, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """See :meth:`mpitrain.Communicator.allgather_object`."""
        self.transport.begin("allgather_object")
        if self.size > 1 and self.checking:
            self.validator.check(signature("allgather_object"))
        return objects.allgather_object(self.transport, obj)

    def free(self) -> None:
        """Release the private communicator, shared memory and plans (collective)."""
        self._plans.clear()
        self.links.free()
        if self.shm is not None:
            self.shm.free()
            self.shm = None
        self.topology.free()
        self.transport.free()

    # -- plans -------------------------------------------------------------------------
    def run_plan(self, collective: str, name: str, be: ArrayBackend, dt: np.dtype[Any],
                 op: ReduceOp | None, shape: tuple[int, ...], root: int, sig: Signature | None,
                 src: Array, out: Array, postscale: float = 1.0) -> None:
        """Validate the call (``sig``; ``None``: not here), run its plan, postscale ``out``.

        The one place where data moves: the plan of ``name`` for this call's ``shape``
        key (allreduce and broadcast: ``(count,)``; reduce_scatter: ``(count, row)``;
        allgather: every rank's element count).
        """
        plan = self.plan(collective, name, be, dt, op, shape, root)
        if plan.fuses_check:
            plan.run(src, out, sig, postscale)
        else:
            if sig is not None:
                self.validator.check(sig)
            plan.run(src, out, None, postscale)
        if not plan.fuses_postscale:
            be.scale(out, postscale)

    def _fallback_plan(self, policy: TransferPolicy, collective: str,
                       request: PlanRequest) -> Plan:
        """The plan of what ``auto`` chooses for ``request`` among the algorithms that
        are not device-only (where a device link cannot carry a call)."""
        be, dt = request.backend, request.dtype
        plans = algorithms.REGISTRY[collective]
        choices = tuple(a for a in self._available_for(collective, be)[1]
                        if not plans[a].device_only)
        name = self.table.select(collective, request.count * dt.itemsize, self.size, be.name,
                                 choices, dtype_name(dt), self.topology.node_count)
        return policy.build(collective, name, request)

    def plan(self, collective: str, name: str, be: ArrayBackend, dt: np.dtype[Any],
             op: ReduceOp | None, shape: tuple[int, ...], root: int = 0) -> Plan:
        """The cached plan of ``name`` for this call's shape, built on first use."""
        policy = self.device_policy if be.is_device else HOST
        key = (collective, name, be.name, be.device_id(), dt, op, shape, root)
        plan = self._plans.get(key)
        if plan is None:
            if collective == "allgather":
                chunks = bounds_from_counts(list(shape))
            else:
                chunks = split_bounds(shape[0], self.size, shape[1] if len(shape) > 1 else 1)
            settings = self.settings
            request = PlanRequest(self.transport, self.topology, be, dt, op, tuple(chunks), root,
                                  settings.segment_bytes, self.shm, self.validator,
                                  self.table.select, settings.inter_segment_bytes,
                                  settings.cross_ranks)
            plans = algorithms.REGISTRY[collective]
            if name in plans and plans[name].device_only:
                fallback = functools.partial(self._fallback_plan, policy, collective, request)
                plan = algorithms.build(collective, name, replace(request, links=self.links,
                                                                  fallback=fallback))
            else:
                plan = policy.build(collective, name, request)
            self._plans[key] = plan
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan
