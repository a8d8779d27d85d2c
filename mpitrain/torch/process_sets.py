"""Horovod's process sets: collectives over a subset of the ranks.

A :class:`ProcessSet` names ranks of the global set (the ranks of :func:`init
<mpitrain.torch.init>`, numbered as ``hvd.rank()`` numbers them). Registering it
(:func:`add_process_set`, or ``hvd.init(process_sets=[...])``) is collective over every
rank: the ranks agree on the set (all-gathered, so bad or differing input raises on
every rank), get its id, and its members build a :class:`~mpitrain.Communicator` over
a split of the global communicator, with its own dispatcher and async engine, so the
operations of different sets never mix. A collective called with ``process_set=`` runs
on that communicator; on a rank outside the set it raises at once (the members do not
wait for that rank, so nothing hangs). :func:`remove_process_set` frees the
communicator and invalidates the object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mpi4py import MPI

from .. import session
from ..communicator import Communicator
from ..errors import ArgumentError, MismatchError


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Args:
        ranks_or_comm: ranks of the global set (kept sorted, as Horovod keeps them), or
            an mpi4py communicator whose members form the set (``MPI.COMM_NULL`` on the
            ranks outside it, as ``Comm.Split`` with ``MPI.UNDEFINED`` gives them).

    The set is usable once registered (:func:`add_process_set` or
    ``hvd.init(process_sets=[...])``): ``process_set_id`` is then its id, and
    :meth:`size`, :meth:`rank`, :meth:`included` answer; before (and after
    :func:`remove_process_set`) they return ``None``. Values are checked when the set is
    registered, on every rank at once.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Comm) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: MPI.Comm | None = None
        self.ranks: list[int] | None = None
        self._given: Any = None  # what was passed, when it is not a list of ints
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            given = list(ranks_or_comm)
        except TypeError:
            self._given = ranks_or_comm
            return
        if all(isinstance(r, int) and not isinstance(r, bool) for r in given):
            self.ranks = sorted(given)
        else:
            self._given = given

    def size(self) -> int | None:
        """Number of ranks in the set; ``None`` while it is not registered."""
        return None if self.process_set_id is None or self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set, ``-1`` outside it; ``None`` while the set
        is not registered."""
        if self.process_set_id is None or self.ranks is None:
            return None
        me = session.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """True if this process is in the set; ``None`` while it is not registered."""
        position = self.rank()
        return None if position is None else position >= 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        if self.ranks is None or other.ranks is None:
            return self is other
        return self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks)) if self.ranks is not None else id(self)

    def __repr__(self) -> str:
        ranks = self.ranks if self.ranks is not None or self._given is None else self._given
        comm = "" if self.mpi_comm is None else f", mpi_comm={self.mpi_comm!r}"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks}{comm})"


global_process_set = ProcessSet([])
"""The set of every rank (id 0); its ``ranks`` are filled in by ``hvd.init``."""
global_process_set.process_set_id = 0


@dataclass
class _Registered:
    """A registered set: its object, and on its members its communicator."""

    process_set: ProcessSet
    comm: Communicator | None  # None on the ranks outside the set
    control: MPI.Intracomm | None = None  # a duplicate for the adapter's own exchanges


JOIN_SERVES = frozenset({"allreduce"})
"""What ranks in ``hvd.join()`` take part in, as in Horovod: allreduces (grouped ones
too). An allgather, broadcast or reducescatter submitted while a rank is in ``join()``
fails on the ranks that submitted it."""

_registry: dict[int, _Registered] = {}
_last_id = 0
_outside: tuple[int, ...] | None = None  # init(comm=[...]) on a rank not in the list


def _here() -> str:
    return f"rank {MPI.COMM_WORLD.Get_rank()} of MPI_COMM_WORLD"


def global_communicator() -> Communicator:
    """The communicator of the global set (``hvd.init``'s).

    Raises:
        ArgumentError: ``hvd.init(comm=[...])`` left this rank out.
        NotInitializedError: ``hvd.init`` was not called.
    """
    if _outside is not None:
        raise ArgumentError(f"{_here()} is not in hvd.init(comm={list(_outside)}), so it takes "
                            "no part in Horovod's collectives; call them only on those ranks, "
                            "or include this rank in init(comm=...)")
    comm = session.default_communicator()
    if comm.join_serves is not JOIN_SERVES:  # set again after an elastic reset
        comm.join_serves = JOIN_SERVES
    return comm


def communicator(process_set: ProcessSet | None) -> Communicator:
    """The communicator of ``process_set`` (``None``: the global set) on this rank.

    Raises:
        ArgumentError: the set is not registered, was removed, or does not include
            this rank.
    """
    if process_set is None or process_set is global_process_set:
        return global_communicator()
    if not isinstance(process_set, ProcessSet):
        raise ArgumentError(f"{_here()}: process_set= must be an hvd.ProcessSet, got "
                            f"{type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id == 0:
        return global_communicator()
    entry = _registry.get(set_id) if set_id is not None else None
    if entry is None:
        raise ArgumentError(f"rank {session.rank()}: {process_set!r} is not registered (never "
                            "added, or removed by hvd.remove_process_set, or registered before "
                            "hvd.shutdown); register it with hvd.add_process_set(...) or "
                            "hvd.init(process_sets=[...]) on every rank first")
    if entry.comm is None:
        raise ArgumentError(f"rank {session.rank()} is not in process set {set_id} (ranks "
                            f"{process_set.ranks}) and cannot take part in its collectives; "
                            "call them only where process_set.included() is True")
    return entry.comm


def control(process_set: ProcessSet) -> MPI.Intracomm:
    """A private duplicate of a registered (non-global) set's communicator, created
    (collectively over the set) on first use."""
    comm = communicator(process_set)
    entry = _registry[process_set.process_set_id]  # type: ignore[index]
    if entry.control is None:
        entry.control = comm.mpi_comm.Dup()
    return entry.control


def global_rank(process_set: ProcessSet | None, set_rank: int) -> int:
    """The global rank of the ``set_rank``-th member of ``process_set``."""
    if process_set is None or process_set.process_set_id == 0:
        return set_rank
    assert process_set.ranks is not None
    return process_set.ranks[set_rank]


def set_rank(process_set: ProcessSet | None, root_rank: int, what: str) -> int:
    """The rank within ``process_set`` of the global rank ``root_rank``.

    Raises:
        ArgumentError: ``root_rank`` is not a member of the set.
    """
    communicator(process_set)  # raises outside the set
    if process_set is None or process_set.process_set_id == 0:
        return root_rank
    ranks = process_set.ranks or []
    if root_rank not in ranks:
        raise ArgumentError(f"rank {session.rank()}: {what} root_rank={root_rank} is not in "
                            f"process set {process_set.process_set_id} (ranks {ranks}); "
                            "root_rank is a global rank (hvd.rank() numbering): pass one of "
                            f"{ranks}")
    return ranks.index(root_rank)


# -- registration ---------------------------------------------------------------------
def _proposal(process_set: ProcessSet, world: Communicator) -> tuple[str, Any]:
    """This rank's view of the set's ranks: ``("ranks", [...])`` (given as a list),
    ``("comm", [...])`` (a communicator's members), ``("outside", None)`` (this rank's
    ``MPI.COMM_NULL``), or ``("error", message)``."""
    if process_set.mpi_comm is not None:
        comm = process_set.mpi_comm
        if comm == MPI.COMM_NULL:
            return "outside", None
        if not isinstance(comm, MPI.Intracomm):
            return "error", f"ProcessSet(comm) needs an intracommunicator, got {comm!r}"
        group, global_group = comm.Get_group(), world.mpi_comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), global_group)
        finally:
            group.Free()
            global_group.Free()
        if any(r == MPI.UNDEFINED for r in ranks):
            return "error", "ProcessSet(comm): the communicator has ranks outside hvd.init's"
        return "comm", sorted(int(r) for r in ranks)
    if process_set.ranks is None:
        return "error", (f"ProcessSet ranks must be a list of ints, got "
                         f"{process_set._given!r}")
    ranks = process_set.ranks
    if not ranks:
        return "error", "a process set needs at least one rank, got []"
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    if repeated:
        return "error", f"ProcessSet ranks {ranks} repeat {repeated}; list each rank once"
    wrong = [r for r in ranks if not 0 <= r < world.size]
    if wrong:
        return "error", (f"ProcessSet ranks {ranks}: {wrong} out of range; ranks are 0.."
                         f"{world.size - 1} (hvd.rank() numbering)")
    return "ranks", list(ranks)


def _agree(proposals: list[tuple[str, Any]], process_set: ProcessSet) -> list[int]:
    """The ranks every rank proposed, or the error every rank raises."""
    for r, (kind, value) in enumerate(proposals):
        if kind == "error":
            raise ArgumentError(f"hvd.add_process_set on rank {r}: {value}")
    views = {tuple(value) for kind, value in proposals if kind in ("ranks", "comm")}
    if len(views) != 1:
        shown = {r: value for r, (_, value) in enumerate(proposals)}
        raise MismatchError(f"hvd.add_process_set: the ranks disagree on the set ({shown}); "
                            "every rank must pass the same ranks (or its member's communicator "
                            "/ MPI.COMM_NULL), in the same order of calls")
    ranks = list(views.pop())
    misplaced = [r for r, (kind, _) in enumerate(proposals)
                 if (kind == "outside" and r in ranks) or (kind == "comm" and r not in ranks)]
    if misplaced:
        raise MismatchError(f"hvd.add_process_set: {process_set!r} resolves to ranks {ranks}, "
                            f"but ranks {misplaced} passed a communicator that disagrees (a "
                            "member with MPI.COMM_NULL or an outsider with a communicator); "
                            "build the set from one communicator shared by its members")
    return ranks


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective: every rank calls it, with the same set).

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered :class:`ProcessSet` (``process_set`` itself when it is one).

    Raises:
        ArgumentError: a set with the same ranks is registered already (Horovod's
            ``ValueError``), or the ranks are empty, repeated or out of range; on every
            rank.
        MismatchError: the ranks passed different sets.
    """
    global _last_id
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = global_communicator()
    ranks = _agree(world.allgather_object(_proposal(process_set, world)), process_set)
    if ranks == list(range(world.size)):
        raise ArgumentError(f"hvd.add_process_set: ranks {ranks} are the global process set "
                            "(id 0), which is always registered; use hvd.global_process_set")
    for set_id, entry in _registry.items():
        if entry.process_set.ranks == ranks:
            raise ArgumentError(f"hvd.add_process_set: a process set with ranks {ranks} is "
                                f"registered already (id {set_id}); use that one, or remove "
                                "it first with hvd.remove_process_set")
    member = world.rank in ranks
    split = world.mpi_comm.Split(0 if member else MPI.UNDEFINED, world.rank)
    try:
        comm = Communicator(split) if member else None  # type: ignore[arg-type]
        if comm is not None:
            comm.join_serves = JOIN_SERVES
            comm.engine()  # started here, as the global set's (see initialize)
    finally:
        if split != MPI.COMM_NULL:
            split.Free()
    _last_id += 1
    process_set.ranks = ranks
    process_set.process_set_id = _last_id
    _registry[_last_id] = _Registered(process_set, comm)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicator (collective over every rank).

    Returns:
        True once removed (the object is invalidated: its ``process_set_id`` is
        ``None``); False for the global set, which cannot be removed.

    Raises:
        ArgumentError: the set is not registered (never added, or removed already).
        MismatchError: the ranks passed different sets.
    """
    world = global_communicator()
    set_id = process_set.process_set_id if isinstance(process_set, ProcessSet) else None
    known = set_id is not None and (set_id == 0 or set_id in _registry)
    views = world.allgather_object(set_id if known else None)
    if any(v is None for v in views):
        unknown = [r for r, v in enumerate(views) if v is None]
        raise ArgumentError(f"hvd.remove_process_set: {process_set!r} is not registered on ranks "
                            f"{unknown} (never added, or removed already); pass a set that "
                            "hvd.add_process_set returned")
    if len(set(views)) != 1:
        raise MismatchError(f"hvd.remove_process_set: the ranks passed different sets (ids "
                            f"{views}); every rank must remove the same set")
    if set_id == 0:
        return False
    _free(_registry.pop(set_id))  # type: ignore[arg-type]
    return True


def _free(entry: _Registered) -> None:
    """Free a set's communicators (collective over its members) and invalidate it."""
    if entry.control is not None:
        entry.control.Free()
    if entry.comm is not None:
        entry.comm.free()
    entry.process_set.process_set_id = None


def initialize(comm: Sequence[int] | MPI.Intracomm | None) -> None:
    """``hvd.init``'s communicator: ``None`` (COMM_WORLD), a communicator, or a list
    of ranks of COMM_WORLD, whose members run Horovod on a communicator of their own
    (the others only record that they are outside)."""
    global _outside
    if _outside is not None:
        return
    if session.is_initialized():
        pass
    elif comm is None or isinstance(comm, MPI.Comm):
        session.init(comm)
    else:
        ranks = ProcessSet(comm).ranks
        world = MPI.COMM_WORLD.Get_size()
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
            raise ArgumentError(f"{_here()}: hvd.init(comm={comm!r}) needs distinct ranks of "
                                f"MPI_COMM_WORLD (0..{world - 1})")
        if MPI.COMM_WORLD.Get_rank() not in ranks:
            _outside = tuple(ranks)
            return
        world_group = MPI.COMM_WORLD.Get_group()
        group = world_group.Incl(ranks)
        sub = MPI.COMM_WORLD.Create_group(group)
        group.Free()
        world_group.Free()
        try:
            session.init(sub)
        finally:
            sub.Free()
    global_process_set.ranks = list(range(session.size()))
    # The async engine starts here, as Horovod's background thread starts in hvd.init:
    # started on a rank's first async call instead, its start (collective) would meet
    # whatever another rank calls meanwhile, e.g. a barrier, and fail as a mismatch.
    session.default_communicator().engine()


def outside() -> bool:
    """True if ``hvd.init(comm=[...])`` left this rank out."""
    return _outside is not None


def register(process_sets: Sequence[ProcessSet] | str | None) -> None:
    """Register ``hvd.init``'s ``process_sets`` that are not registered yet, in order.

    ``"dynamic"`` (Horovod's switch for adding sets after ``init``) is accepted: sets can
    always be added and removed here.
    """
    if process_sets is None or process_sets == "dynamic" or _outside is not None:
        return
    if isinstance(process_sets, (str, ProcessSet)):
        raise ArgumentError(f"hvd.init(process_sets=...) takes a list of hvd.ProcessSet or "
                            f"'dynamic', got {process_sets!r}")
    for ps in process_sets:
        if isinstance(ps, ProcessSet) and ps.process_set_id is not None:
            continue
        add_process_set(ps)


def clear() -> None:
    """Free every registered set (in id order, as every rank does) and forget
    ``init(comm=[...])``; before the global communicator is shut down."""
    global _outside, _last_id
    for set_id in sorted(_registry):
        _free(_registry.pop(set_id))
    _outside, _last_id = None, 0
    global_process_set.ranks = []
