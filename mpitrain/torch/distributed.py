"""``torch.distributed`` over mpitrain: the process-group backend ``"mpitrain"``.

``import mpitrain.torch`` registers it, so that a script started by ``mpirun``::

    import torch.distributed as dist
    import mpitrain.torch  # noqa: F401  (registers the "mpitrain" backend)

    dist.init_process_group("mpitrain")

gets a process group over the MPI job, whatever torch builds on it:
``DistributedDataParallel`` (its communication hooks included), FSDP2's
``fully_shard``, ``DeviceMesh``, ``torch.distributed.pipelining``, and every
collective of ``torch.distributed``.

**Rendezvous.** torch reaches a backend only through a store, found by the
``init_method``: ``"mpitrain://"`` takes the rank and the world size from MPI and puts a
``TCPStore`` on rank 0 whose address rank 0 broadcasts over MPI. ``env://`` (torch's
default, so also no ``init_method`` at all) takes that way too when ``MASTER_ADDR`` is not
set, as under a plain ``mpirun``; with ``MASTER_ADDR`` and ``MASTER_PORT`` set (torchrun,
``mpitrain-run``) torch's own rendezvous runs. Either way the ranks of the default group
must be those of ``MPI.COMM_WORLD``.

**Collectives.** Reductions, gathers and broadcasts (``all_reduce`` with every op but the
bitwise ones, ``reduce``, ``broadcast``, ``all_gather`` and ``all_gather_into_tensor``,
``reduce_scatter`` and ``reduce_scatter_tensor``, their coalesced forms) run through the
async engine of a :class:`~mpitrain.Communicator` of the group's ranks: negotiated
(ranks whose calls disagree get :class:`~mpitrain.MismatchError` on every rank),
fused, and run on mpitrain's algorithms; a sparse ``all_reduce`` (``SUM``, ``AVG``) is
two allgathers there, of the indices and of the values. ``async_op=True`` returns a
:class:`~torch.distributed.Work` whose ``get_future()`` completes on a thread of
mpitrain's (:class:`_Completer`); a blocking call waits for it. The bitwise reductions, ``gather``,
``scatter``, ``all_to_all`` and ``all_to_all_single`` run MPI's own collectives on the
group's own duplicate communicator after a rendezvous named by the call and one
exchange of every rank's arguments (so that an error on one rank is an error on every
rank, and a rank that skips one is reported by the stall inspector like any other);
point-to-point messages go
through MPI on another duplicate, with torch's tags. Device tensors go to the engine as
they are (CUDA, through the GPU backend); MPI's own collectives and point-to-point
messages carry host copies of them.

**One order of calls.** The group's communicator is ``ordered``: it counts the
group's collective calls over every kind (each is one :meth:`~mpitrain.Communicator.call`,
:func:`one_call`), and the rendezvous before MPI's own collectives, like ``barrier``, is
a meeting point of the engine in that count. Ranks whose ``k``-th calls differ (an
``all_reduce`` on one rank, an ``all_gather`` or a ``barrier`` on another) all get
:class:`~mpitrain.MismatchError` at once, naming both, and the next call works.

**Time limits.** The group's communicator takes ``init_process_group``'s ``timeout`` as
its stall timeout (unless ``MPITRAIN_STALL_TIMEOUT_S`` is set): a collective that some
rank never calls raises :class:`~mpitrain.StallError` after it on the ranks that wait, and
the stall inspector names the missing ranks from ``MPITRAIN_STALL_WARNING_S`` (60 s) on.
Waits for point-to-point messages are watched alike (a receive whose message never
comes raises StallError naming the peer and the tag).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, ContextManager, TypeVar, cast
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import config
from ..comm.inspector import StallLimits
from ..comm.transport import Transport
from ..communicator import Communicator
from ..config import Settings
from ..engine import Handle
from ..errors import ArgumentError, DtypeError, MismatchError, UnsupportedError
from ..ops import ReduceOp
from ..parallel.pending import Pending
from ..parallel.refusal import agreed, refusing
from .eager import eager_methods
from .sparse import SPARSE_OPS, prepare_sparse_allreduce, start_sparse_allreduce
from .tensors import as_buffer, from_buffer, producer_stream

torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
log = logging.getLogger("mpitrain")

BACKEND = "mpitrain"
"""The name to pass to ``torch.distributed.init_process_group``."""
DEVICE_TYPES = ("cpu", "cuda")
"""The device types the backend is registered for."""
SCHEME = "mpitrain"
"""The ``init_method`` scheme of the MPI rendezvous: ``"mpitrain://"``."""
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
"""Variables an MPI launcher sets on its ranks (Open MPI, Hydra, PMIx)."""
_BITWISE = {"BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}
_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVERAGE, "PRODUCT": ReduceOp.PRODUCT,
        "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX, "PREMUL_SUM": ReduceOp.SUM}


# -- rendezvous ------------------------------------------------------------------------
def mpi_rendezvous(url: str, timeout: datetime.timedelta = dist.default_pg_timeout,
                   **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """The ``mpitrain://`` rendezvous: this process's rank and the world size from
    ``MPI.COMM_WORLD``, and a ``TCPStore`` on rank 0 (a free port, its address
    broadcast over MPI). A ``rank`` or ``world_size`` given to ``init_process_group``
    must be MPI's."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    query = parse_qs(urlparse(url).query)
    for name, ours in (("rank", rank), ("world_size", size)):
        given = int(query.get(name, ["-1"])[0])
        if given not in (-1, ours):
            raise ArgumentError(f"rank {rank}: init_process_group got {name}={given}, but MPI "
                                f"gives this process {name}={ours}; leave {name} out (the "
                                f"{SCHEME} rendezvous takes it from MPI)")
    address = None
    store: dist.Store | None = None
    if rank == 0:
        store = dist.TCPStore(socket.gethostname(), 0, size, True, timeout=timeout,
                              wait_for_workers=False)
        address = (socket.gethostname(), store.port)
    host, port = world.bcast(address, root=0)
    if store is None:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    yield store, rank, size
    raise RuntimeError(f"the {SCHEME}:// rendezvous cannot run twice in one process")


_env_handler = torch_rendezvous._rendezvous_handlers.get("env")


def _env_or_mpi(url: str, **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """``env://``: torch's own where ``MASTER_ADDR`` is set, else :func:`mpi_rendezvous`
    (a plain ``mpirun``, or one process on its own)."""
    if os.environ.get("MASTER_ADDR") or _env_handler is None:
        if _env_handler is None:
            raise RuntimeError("torch has no env:// rendezvous to fall back on")
        return _env_handler(url, **kwargs)
    return mpi_rendezvous(url, **kwargs)


def launched_by_mpi() -> bool:
    """True if an MPI launcher started this process."""
    return any(os.environ.get(name) for name in MPI_LAUNCHER_VARIABLES)


# -- ops and tensors --------------------------------------------------------------------
_RED_OP_TYPE = type(dist.ReduceOp.SUM)
_REDUCTIONS: dict[Any, tuple[ReduceOp | None, float, Any]] = {}
""":func:`reduction` of torch's ops without a parameter, by their ``RedOpType`` (every
collective asks; filled below)."""


def _op_name(op: Any) -> str:
    """The name of torch's reduction ``op`` (``"SUM"``, ``"PREMUL_SUM"``)."""
    kind = getattr(op, "op", op)
    return str(getattr(kind, "name", str(kind))).rsplit(".", 1)[-1]


def reduction(op: Any) -> tuple[ReduceOp | None, float, Any]:
    """mpitrain's op for torch's ``op``, the factor of a ``PREMUL_SUM``, and MPI's op of
    a bitwise reduction (which mpitrain's op is then ``None``)."""
    kind = getattr(op, "op", op)
    known = _REDUCTIONS.get(kind) if type(kind) is _RED_OP_TYPE else None
    if known is not None:
        return known
    name = _op_name(op)
    if name in _BITWISE:
        return None, 1.0, _BITWISE[name]
    if name not in _OPS:
        raise UnsupportedError(f"the {BACKEND} backend has no reduction {name}")
    if name == "PREMUL_SUM":  # its factor is the op's own
        value = op.factor
        return _OPS[name], float(value.item() if isinstance(value, torch.Tensor) else value), None
    return _OPS[name], 1.0, None


_REDUCTIONS.update({getattr(dist.ReduceOp, name): reduction(getattr(dist.ReduceOp, name))
                    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")})


_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN,
             ReduceOp.MIN: ReduceOp.MIN, ReduceOp.MAX: ReduceOp.MAX}
"""The reduction of bool tensors (as uint8 0/1) for each op they take: a sum is a
logical or (any rank's True), a product a logical and, as gloo and NCCL reduce them."""


def _reducible(t: torch.Tensor, op: ReduceOp, what: str,
               factor: float = 1.0) -> tuple[torch.Tensor, ReduceOp]:
    """The tensor to reduce and the op to reduce it with: a bool tensor as uint8 (same
    memory) with its op of :data:`_BOOL_OPS`; other tensors and ``op`` as they are."""
    if t.dtype != torch.bool:
        return t, op
    reduced = _BOOL_OPS.get(op)
    if reduced is None or factor != 1.0:
        raise DtypeError(f"{what} of bool tensors takes SUM (a logical or), PRODUCT (a "
                         f"logical and), MIN, MAX, BAND, BOR or BXOR, not "
                         f"{'PREMUL_SUM' if factor != 1.0 else op!r}; cast with "
                         ".to(torch.float32) to average")
    return t.view(torch.uint8), reduced


def _bytes_of_bool(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 (same memory), to move its bytes; others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _contiguous_view(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ArgumentError(f"{what} needs contiguous tensors, got one of strides "
                            f"{tuple(t.stride())}; pass tensor.contiguous()")
    return t


def _bytes(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """``t``'s bytes in host memory, for MPI's own calls: a view of a contiguous CPU
    tensor's own memory, else a copy (see :func:`_store`)."""
    host = t.detach().to("cpu").contiguous()
    return host.reshape(-1).view(torch.uint8).numpy()


def _receiving(t: torch.Tensor, nbytes: int,
               sending: np.ndarray[Any, Any] | None = None) -> np.ndarray[Any, Any]:
    """Where MPI should write ``nbytes`` bytes meant for ``t``: ``t``'s own memory where
    it is a contiguous CPU tensor of exactly that size that does not overlap the bytes
    ``sending`` (MPI forbids aliased buffers; then :func:`_store` has nothing to do), else
    a new array that :func:`_store` copies in (and checks the size of)."""
    if t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() == nbytes:
        own = _bytes(t)
        if sending is None or not np.may_share_memory(own, sending):
            return own
    return np.empty(nbytes, np.uint8)


BYTE_COUNT_LIMIT = 1 << 31
"""Where a count or offset in bytes of MPI's own ``all_to_all``, ``gather`` or
``scatter`` reaches this, they count rows or elements instead (MPI's counts and offsets
are C ints)."""


def _fits(counts: list[int], limit: int) -> bool:
    """Whether ``counts`` and their offsets (the sums before each) are all below
    ``limit``."""
    return max(counts, default=0) < limit and sum(counts) - (counts[-1] if counts else 0) < limit


def _units(counts: list[int], unit: int, rank: int, what: str) -> tuple[list[int], list[int]]:
    """Byte ``counts`` (multiples of ``unit``) as counts and offsets in units, for a
    buffer whose counts in bytes do not fit MPI's C ints; ArgumentError where those do
    not fit either."""
    units = [c // unit for c in counts]
    if not _fits(units, 1 << 31):
        raise ArgumentError(f"rank {rank}: {what} of {sum(counts)} bytes in units of {unit} "
                            "bytes passes MPI's counts and offsets (C ints); split it into "
                            "several calls")
    return units, [int(x) for x in np.cumsum([0, *units[:-1]])]


@contextlib.contextmanager
def _unit_type(unit: int) -> Iterator[MPI.Datatype]:
    """An MPI datatype of ``unit`` contiguous bytes, freed afterwards."""
    kind = MPI.BYTE.Create_contiguous(unit).Commit()
    try:
        yield kind
    finally:
        kind.Free()


PIECE_BYTES = 1 << 30
"""The largest message of a point-to-point send: a tensor of this size or more goes in
several (MPI's counts are C ints, and Open MPI refuses a message of 2 GiB or more)."""


def _pieces(data: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    """``data`` (bytes) cut into the messages that carry it: itself where it is smaller
    than :data:`PIECE_BYTES`, else pieces of that size and the rest (possibly empty).
    Receiver and sender cut alike; where their sizes differ and one is in pieces, the
    size check refuses the receive, but messages of the same tag after it may be taken
    by its pieces."""
    if data.size < PIECE_BYTES:
        return [data]
    whole = data.size - data.size % PIECE_BYTES
    return [data[i:i + PIECE_BYTES] for i in range(0, whole, PIECE_BYTES)] + [data[whole:]]


def _check_received(rank: int, what: str, got: int, expected: int) -> None:
    """Refuse a message of another size than the tensor it was received into (MPI
    fills a larger tensor in part and says nothing)."""
    if got != expected:
        raise ArgumentError(f"rank {rank}: {what}: received {got} bytes into a tensor part "
                            f"of {expected} bytes; send and receive tensors of the same "
                            "size (and dtype)")


def _store(t: torch.Tensor, data: np.ndarray[Any, Any]) -> None:
    """Put bytes ``data`` into ``t`` (nothing to do where ``data`` is ``t``'s own memory,
    from :func:`_bytes`)."""
    nbytes = t.numel() * t.element_size()
    if data.size != nbytes:
        raise ArgumentError(f"a tensor of {nbytes} bytes cannot take {data.size} bytes")
    if nbytes == 0 or (t.device.type == "cpu" and t.is_contiguous()
                       and data.ctypes.data == t.data_ptr()):
        return
    source = torch.from_numpy(np.ascontiguousarray(data)).view(t.dtype).reshape(t.shape)
    with torch.no_grad():
        t.copy_(source)


def _check_rooted(comm: Any, root: int, what: str, mine: list[torch.Tensor], mine_is: str,
                  lists: list[list[torch.Tensor]], lists_are: str) -> None:
    """The argument checks of gather and scatter: a valid root, one tensor of this rank,
    and at the root one list of a tensor per rank."""
    comm.check_root(root)
    if len(mine) != 1:
        raise ArgumentError(f"rank {comm.rank}: {what} takes one {mine_is} tensor")
    if comm.rank == root and (len(lists) != 1 or len(lists[0]) != comm.size):
        raise ArgumentError(f"rank {comm.rank}: {what}'s root needs a list of {comm.size} "
                            f"{lists_are} tensors")


_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)},
                      key=str))
"""torch's dtypes, sorted by name: one order on every rank, whatever each imported
before (a dtype's index is its code in :func:`_sized`'s header)."""


_ALIGN = 16
"""The header and each rank's bytes in :func:`_sized`'s layout start at a multiple of
this (the widest dtype's size), so that each is viewed as its dtype without a copy."""


def _header_bytes(size: int) -> int:
    """The bytes of :func:`_sized`'s header in a group of ``size`` ranks, padded."""
    return -(-8 * (2 + size) // _ALIGN) * _ALIGN


def _sized(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``t``'s bytes after a header of int64 words: their count, ``t``'s dtype (its
    index in :data:`_DTYPES`) and the element count this rank expects of each rank
    (``sizes``), header and bytes each padded to :data:`_ALIGN`, for an ``all_gather``
    of tensors of different sizes (read back by :func:`_unsized`)."""
    data = t.detach().reshape(-1).view(torch.uint8)
    header = torch.zeros(_header_bytes(len(sizes)) // 8, dtype=torch.int64)
    header[:2 + len(sizes)] = torch.tensor([data.numel(), _DTYPES.index(t.dtype), *sizes])
    pad = torch.zeros(-data.numel() % _ALIGN, dtype=torch.uint8, device=t.device)
    return torch.cat([header.view(torch.uint8).to(t.device), data, pad])


def _unsized(gathered: torch.Tensor, dtype: torch.dtype, rank: int,
             size: int) -> list[torch.Tensor]:
    """Each rank's tensor of ``gathered`` (every rank's :func:`_sized` bytes, in rank
    order), as ``dtype``; a :class:`~mpitrain.MismatchError` on every rank where the
    ranks sent other dtypes, or a rank expected other sizes than were sent."""
    pos, blocks, headers = 0, [], []
    for _ in range(size):
        header = gathered[pos:pos + 8 * (2 + size)].cpu().view(torch.int64).tolist()
        start = pos + _header_bytes(size)
        blocks.append(gathered[start:start + header[0]])
        headers.append(header)
        pos = start + header[0] + -header[0] % _ALIGN
    dtypes = [_DTYPES[h[1]] for h in headers]
    if any(d != dtypes[0] for d in dtypes):
        raise MismatchError(f"rank {rank}: all_gather needs the same dtype on every rank, "
                            f"got {', '.join(f'rank {q} {d}' for q, d in enumerate(dtypes))}")
    sent = [h[0] // dtype.itemsize for h in headers]
    for q, h in enumerate(headers):
        if h[2:] != sent:
            raise MismatchError(f"rank {rank}: all_gather: rank {q}'s output tensors have "
                                f"{h[2:]} elements, but the ranks sent {sent}")
    return [b.view(dtype) for b in blocks]


# -- work ---------------------------------------------------------------------------------
@eager_methods("_source_rank")
class Work(dist.Work):
    """A collective in flight: ``wait()`` (raises the operation's error),
    ``is_completed()``, ``get_future()`` (its value: the output tensors; it completes on
    a thread of mpitrain's, as torch's futures complete on a backend's, see
    :class:`_Completer`).

    Args:
        pending: the engine handles and what finishes the operation (copies into the
            output tensors, device copies back).
        outputs: the tensors the operation writes: the future's value.
    """

    def __init__(self, pending: Pending, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._pending, self._outputs = pending, outputs
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._sender = -1  # recv_anysource's sender

    def _source_rank(self) -> int:
        """The group rank a receive from any source got its message from."""
        return self._sender

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Block until done (the stall timeout bounds the wait); raise its error.

        With a ``timeout`` (torch's default, 0, is none), raise
        ``torch.distributed.DistBackendError`` if the operation has not finished by
        then; it stays in flight, and a later ``wait()`` finishes it.
        """
        seconds = timeout.total_seconds() if timeout else 0.0
        if seconds > 0:
            _until_done(self._pending, seconds)
        self._pending.wait()
        return True

    def is_completed(self) -> bool:
        """True once done, outputs written (never blocks)."""
        if not self._pending.done():
            return False
        with contextlib.suppress(Exception):  # done: finishes at once (the copies, once)
            self._pending.wait()
        return True

    def is_success(self) -> bool:
        """True once done without an error."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The operation's error, once done; else ``None``."""
        if not self._pending.done():
            return None
        try:
            self._pending.wait()
        except Exception as exc:
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        """The output tensors."""
        return self._outputs

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future of the output tensors, completed (or failed) when the operation is."""
        with self._lock:
            if self._future is not None:
                return self._future
            future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
            self._future = future

        def complete() -> None:
            try:
                self._pending.wait()
            except Exception as exc:
                future.set_exception(exc)  # type: ignore[arg-type]
                return
            future.set_result(self._outputs)

        if self._pending.finished:  # done already: complete it here, on the caller's thread
            complete()
        else:
            self._pending.add_done_callback(lambda _: _COMPLETER.submit(complete))
        return future


class _Completer:
    """Completes the futures of Work off the engine's thread, each on a thread that is
    not running another completion.

    Setting a torch future's result runs its callbacks (``then``) on the thread that
    sets it, and a callback may wait for another collective: DDP's PowerSGD hook calls
    ``dist.all_reduce(...).get_future().wait()`` inside one. Run on the engine's thread,
    that wait could never end (the engine runs the collective it waits for), and run on
    one thread of its own, the second future's completion would queue behind the
    first's. So each completion takes an idle thread, or a new one where every thread
    is busy: the threads grow to the deepest nesting of waiting callbacks (one, two),
    and stay.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one count per thread back at the queue
        self._names = itertools.count(1)

    def submit(self, complete: Callable[[], None]) -> None:
        """Run ``complete()`` on an idle completion thread (or a new one)."""
        self._queue.put(complete)
        if not self._idle.acquire(blocking=False):
            threading.Thread(target=self._serve, daemon=True,
                             name=f"mpitrain-futures-{next(self._names)}").start()

    def _serve(self) -> None:
        while True:
            complete = self._queue.get()
            try:
                complete()
            except BaseException:  # (torch keeps a callback's error in its future)
                log.exception("mpitrain: completing a torch.distributed future failed")
            self._idle.release()


_COMPLETER = _Completer()


def _until_done(pending: Pending, seconds: float) -> None:
    """Return once ``pending`` is done; raise DistBackendError after ``seconds``."""
    deadline, pause = time.monotonic() + seconds, 1e-5
    while not pending.done():
        if time.monotonic() >= deadline:
            raise dist.DistBackendError(
                f"rank {MPI.COMM_WORLD.Get_rank()}: the operation did not finish within "
                f"Work.wait's timeout of {seconds:g} s; it is still in flight: wait() "
                "again to finish it (the group's timeout ends it if a rank never takes "
                "part)")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def _together(works: list[Work], outputs: list[torch.Tensor]) -> Work:
    """One Work over ``works``: done when every one is, its value ``outputs``."""
    return Work(Pending([h for w in works for h in w._pending.handles],
                        lambda: [w.wait() for w in works]), outputs)


def _done(outputs: list[torch.Tensor], finish: Callable[[], Any] | None = None) -> Work:
    """A Work that is done already (its ``finish`` runs at once, raising here)."""
    pending = Pending([], finish or (lambda: None))
    pending.wait()
    return Work(pending, outputs)


class _MpiRequests:
    """MPI requests of point-to-point messages, as an engine handle looks to
    :class:`~mpitrain.parallel.pending.Pending` (``wait``, ``test``, a callback when
    done: on the waiting thread). ``wait`` waits through the group's point-to-point
    transport, as ``what``: the stall inspector reports a wait past
    ``MPITRAIN_STALL_WARNING_S``, and one past the group's timeout raises
    :class:`~mpitrain.StallError`."""

    def __init__(self, transport: Transport, what: str, requests: list[MPI.Request]) -> None:
        self.transport, self.what, self.requests = transport, what, requests
        self.statuses = [MPI.Status() for _ in requests]  # the received sizes
        self._done = False
        self._callbacks: list[Callable[[Any], None]] = []

    def wait(self) -> None:
        if not self._done:
            self.transport.begin(self.what)
            # tests between yields, as MPI's own wait polls: no sleep, so a pipeline
            # stage that waits long for its neighbour wakes the moment data arrives
            self.transport.block(self._test)
        self._fire()

    def test(self) -> bool:
        if not self._done and self._test():
            self._fire()
        return self._done

    def _test(self) -> bool:
        try:
            return self.transport.testall(self.requests, self.statuses)
        except MPI.Exception as exc:
            classes = {exc.Get_error_class(), *(MPI.Get_error_class(status.Get_error())
                                                for status in self.statuses)}
            if MPI.ERR_TRUNCATE not in classes:
                raise
            raise ArgumentError(f"rank {self.transport.rank}: {self.what}: the message is "
                                "larger than the tensor it is received into; send and "
                                "receive tensors of the same size") from None

    def _fire(self) -> None:
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)


# -- the process group --------------------------------------------------------------------
_Method = TypeVar("_Method", bound=Callable[..., Any])


def one_call(method: _Method) -> _Method:
    """A collective of the group that submits to the async engine: what it submits is one
    call (:meth:`~mpitrain.Communicator.call`). The group's communicator numbers unnamed
    submissions across kinds (``ordered``), so ranks in different collectives get
    MismatchError at once; as one call, one that submits more on one rank than on
    another (a sparse ``all_reduce`` against a dense one) leaves the next collective's
    numbers the same on every rank, and the group goes on working."""
    @functools.wraps(method)
    def run(self: ProcessGroupMpitrain, *args: Any, **kwargs: Any) -> Work:
        with self.comm.call():
            result: Work = method(self, *args, **kwargs)
            return result
    return cast(_Method, run)


@eager_methods("_get_backend", "_device_types", "_allgather_base", "_reduce_scatter_base")
class ProcessGroupMpitrain(dist.ProcessGroup):
    """A torch process group whose collectives run on mpitrain.

    Args:
        comm: the mpitrain communicator of the group's ranks.
        name: torch's name of the group (``group_id``; DeviceMesh looks groups up by it).
        owned: the MPI communicator under ``comm`` where it is the group's own (made
            for it, freed by :meth:`shutdown`); ``None`` for ``COMM_WORLD``.
    """

    def __init__(self, comm: Communicator, name: str,
                 owned: MPI.Intracomm | None = None) -> None:
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]
        self._name = name
        self._owned, self._freed = owned, False
        self.comm = comm
        self.control = comm.mpi_comm.Dup()  # MPI's own collectives, their checks
        settings = comm.settings
        # point-to-point messages, torch's tags; waits watched like collectives
        self.p2p = Transport(comm.mpi_comm, StallLimits.of(settings), settings.elastic)

    def getBackendName(self) -> str:
        """``"mpitrain"``."""
        return BACKEND

    def shutdown(self) -> None:
        """Release the group's MPI resources (collective over the group; torch calls it
        from ``destroy_process_group``): the communicator, its async engine's thread
        and shared memory, the duplicates, and the group's own MPI communicator where
        :func:`create` made one. Operations every rank submitted finish first."""
        if self._freed:
            return
        self._freed = True
        self.comm.free()
        self.p2p.free()
        self.control.Free()
        if self._owned is not None:
            self._owned.Free()

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """torch's name of the group."""
        return self._name

    # -- what torch asks of a group's backends --------------------------------------------
    # torch creates a backend written in C++ per device type and asks the group for it;
    # a group written in Python is its own backend, for the device types it serves.
    supports_splitting = False
    """``split_group`` (which needs a backend that splits communicators) is refused by
    torch; groups are made with ``new_group``, as DeviceMesh does then."""
    supports_time_estimate = False
    """Inductor's estimate of a collective's time asks for it (NCCL's)."""

    def _get_backend(self, device: torch.device) -> ProcessGroupMpitrain:  # type: ignore[override]
        """The backend of ``device``: this group, for each device type it was registered
        for. ``init_process_group(device_id=...)`` asks for it and failed without it."""
        if torch.device(device).type not in DEVICE_TYPES:
            raise RuntimeError(f"No backend type associated with device type "
                               f"{torch.device(device).type}: the {BACKEND} backend serves "
                               f"{', '.join(DEVICE_TYPES)}")
        return self

    @property
    def bound_device_id(self) -> torch.device | None:
        """None: a group of this backend is bound to no device. torch binds the default
        group to ``init_process_group``'s ``device_id`` to connect NCCL eagerly and to
        split groups from it (``split_group``, which DeviceMesh then uses); neither
        applies here, so the binding is dropped (the tensors' own devices are used)."""
        return None

    @bound_device_id.setter
    def bound_device_id(self, device: torch.device | None) -> None:
        pass

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices whose tensors the group's collectives take: the CPU, and CUDA
        where torch has a GPU. torch reads it (``broadcast_from_rank0`` state dicts,
        ``torch.distributed.checkpoint.async_save``, the object collectives' device)
        and learns it from the C++ backends registered in a group, of which a group
        written in Python has none: without it those calls failed."""
        cuda = [torch.device("cuda")] if torch.cuda.is_available() else []
        return [torch.device("cpu"), *cuda]

    def __repr__(self) -> str:
        return f"<ProcessGroupMpitrain rank {self.comm.rank} of {self.comm.size}>"

    # -- reductions --------------------------------------------------------------------
    @one_call
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """``all_reduce`` of each tensor, in place."""
        op, factor, bitwise = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(
                tensors, op if factor == 1.0 and op in SPARSE_OPS else None, opts)
        if bitwise is not None:
            return self._bitwise(tensors, bitwise, "all_reduce")
        assert op is not None
        with self._submitting(opts):
            return self._allreduce(tensors, op, factor)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: ReduceOp | None,
                          opts: Any) -> Work:
        """``all_reduce`` of sparse COO tensors, ``SUM`` or ``AVG`` (``op`` ``None``: another
        op, refused), as gloo takes them (DDP's sparse gradients): an allgather of each one's
        indices and one of its values (:mod:`mpitrain.torch.sparse`); the result is
        written into the tensor (its non-zeros become the result's, coalesced)."""
        comm = self.comm
        with refusing(comm, "allgather", *[None] * (2 * len(tensors))):
            if op is None:
                given = _op_name(_opt(opts, "reduceOp", None))
                raise ArgumentError(f"rank {comm.rank}: all_reduce of sparse tensors takes "
                                    f"SUM or AVG, not {given}; densify the tensor "
                                    "(to_dense()) for other ops")
            prepared = [prepare_sparse_allreduce(t, op, comm.rank) for t in tensors]
        with self._submitting(opts):
            started = [start_sparse_allreduce(comm, p, None) for p in prepared]

        def finish() -> None:
            for t, (_, result) in zip(tensors, started):
                reduced = result()
                with torch.no_grad():
                    t.copy_(reduced)
        return Work(Pending([h for handles, _ in started for h in handles], finish), tensors)

    def _submitting(self, opts: Any) -> ContextManager[None]:
        """Where a call's engine submissions are made: torch waits for the Work of a
        blocking call (``opts.asyncOp`` False) at once, so they need not wake the
        engine's thread (:meth:`~mpitrain.Communicator.waited`)."""
        if _opt(opts, "asyncOp", True) is False:
            return self.comm.waited()
        return contextlib.nullcontext()

    def _allreduce(self, tensors: list[torch.Tensor], op: ReduceOp, factor: float) -> Work:
        """The engine's in-place allreduce of each tensor (scaled by ``factor`` first)."""
        handles = self._each("allreduce", tensors, op, factor,
                             lambda b, t, o: self.comm.allreduce_async_(
                                 b, o, prescale_factor=factor, stream=producer_stream(t)))
        return Work(Pending(handles, lambda: _wait_all(handles)), tensors)

    def _each(self, kind: str, tensors: list[torch.Tensor], op: ReduceOp, factor: float,
              submit: Callable[[Any, torch.Tensor, ReduceOp], Handle],
              check: Callable[[], None] | None = None, what: str | None = None
              ) -> list[Handle]:
        """Submit ``kind`` (an engine kind) of each tensor, ``submit(buffer, tensor,
        op)`` (``op`` as a bool tensor is reduced: :func:`_reducible`), once ``check()``
        has passed and every tensor is checked and viewed (for the collective ``what``,
        ``kind`` by default): an error there is announced as the refusal of each
        submission, so the other ranks fail too."""
        with refusing(self.comm, kind, *[None] * len(tensors)):
            if check is not None:
                check()
            work = [_reducible(t, op, what or kind, factor) for t in tensors]
            buffers = [as_buffer(t) for t, _ in work]
        return [submit(b, t, o) for b, (t, o) in zip(buffers, work)]

    @one_call
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """One fused ``all_reduce`` of every tensor (one collective per dtype)."""
        op, factor, bitwise = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        if bitwise is not None:
            return self._bitwise(tensors, bitwise, "all_reduce_coalesced")
        assert op is not None
        if len({t.dtype == torch.bool for t in tensors}) > 1:  # a bool tensor's sum is an or
            with self._submitting(opts):
                return self._allreduce(tensors, op, factor)
        comm = self.comm
        with refusing(comm, "grouped_allreduce", None):
            work = [_reducible(t, op, "all_reduce", factor) for t in tensors]
            buffers = [as_buffer(t) for t, _ in work]
        with self._submitting(opts):
            handle = comm.grouped_allreduce_async_(
                buffers, work[0][1] if work else op, prescale_factor=factor,
                stream=producer_stream(work[0][0]) if work else None)
        return Work(Pending([handle], handle.wait), tensors)

    @one_call
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """``reduce`` to ``rootRank``: the root's tensors get the result, the others'
        stay as they were (reduced through copies)."""
        root = _opt(opts, "rootRank", 0)
        op, factor, bitwise = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        self.comm.check_root(root)
        sources = tensors if self.comm.rank == root else [t.clone() for t in tensors]
        if bitwise is not None:
            return self._bitwise(sources, bitwise, "reduce", tensors)
        assert op is not None
        with self._submitting(opts):
            inner = self._allreduce(sources, op, factor)
        return Work(inner._pending, tensors)

    @one_call
    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> Work:
        """``reduce_scatter``: ``outputs[i]`` gets the reduction of every rank's
        ``input_lists[i][rank]``. Inputs of different sizes (rank ``q``'s output sized
        as ``input_lists[i][q]``, which torch allows) are reduced one by one
        (:meth:`_reduce_scatter_uneven`)."""
        op, factor, bitwise = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        if any(len({t.numel() for t in inputs}) > 1 for inputs in input_lists):
            with self._submitting(opts):
                return self._reduce_scatter_uneven(outputs, input_lists, op, factor, bitwise)
        comm = self.comm
        with refusing(comm, "reduce_scatter", *[None] * len(outputs)):
            if bitwise is not None:
                raise UnsupportedError("reduce_scatter with a bitwise op: use all_reduce")
            stacked = []
            for output, inputs in zip(outputs, input_lists):
                if len(inputs) != comm.size or any(t.numel() != output.numel() for t in inputs):
                    raise ArgumentError(f"rank {comm.rank}: reduce_scatter needs {comm.size} "
                                        f"input tensors of {output.numel()} elements each")
                stacked.append(torch.stack([t.reshape(-1) for t in inputs]))
        with self._submitting(opts):
            return self._reduce_scatter_rows(outputs, stacked, op, factor)

    def _reduce_scatter_uneven(self, outputs: list[torch.Tensor],
                               input_lists: list[list[torch.Tensor]], op: ReduceOp | None,
                               factor: float, bitwise: Any) -> Work:
        """``reduce_scatter`` of inputs of different sizes: one out-of-place allreduce of
        each input (fused by the engine, and each checked across ranks for its shape and
        dtype, so ranks that size them otherwise fail every rank), this rank's result
        copied into its output."""
        comm = self.comm

        def check() -> None:
            if bitwise is not None or op is None:
                raise UnsupportedError("reduce_scatter with a bitwise op: use all_reduce")
            for output, inputs in zip(outputs, input_lists):
                if len(inputs) != comm.size or inputs[comm.rank].numel() != output.numel():
                    raise ArgumentError(
                        f"rank {comm.rank}: reduce_scatter needs {comm.size} input tensors, "
                        f"the one of rank {comm.rank} of the output's {output.numel()} "
                        f"elements, got {[t.numel() for t in inputs]}")
        # (op None, a bitwise op: check() refuses the call before op is used)
        handles = self._each("allreduce", [t for inputs in input_lists for t in inputs],
                             op or ReduceOp.SUM, factor,
                             lambda b, t, o: comm.allreduce_async(
                                 b, o, prescale_factor=factor, stream=producer_stream(t)),
                             check, "reduce_scatter")

        def finish() -> None:
            _wait_all(handles)
            for i, output in enumerate(outputs):
                block = from_buffer(handles[i * comm.size + comm.rank].wait())
                with torch.no_grad():
                    target = output.view(torch.uint8) if output.dtype == torch.bool else output
                    target.copy_(block.reshape(target.shape))
        return Work(Pending(handles, finish), outputs)

    @one_call
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Work:
        """``reduce_scatter_tensor``: ``output`` gets this rank's ``1/size`` of ``input``."""
        op, factor, bitwise = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        comm = self.comm
        with refusing(comm, "reduce_scatter", None):
            if bitwise is not None:
                raise UnsupportedError("reduce_scatter_tensor with a bitwise op: use all_reduce")
            if input.numel() != output.numel() * comm.size:
                raise ArgumentError(f"rank {comm.rank}: reduce_scatter_tensor needs an input of "
                                    f"size x {output.numel()} = {output.numel() * comm.size} "
                                    f"elements, got {input.numel()}")
            rows = _contiguous_view(input, "reduce_scatter_tensor").reshape(comm.size, -1)
        with self._submitting(opts):
            return self._reduce_scatter_rows([output], [rows], op, factor)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # (torch < 2.12)

    @one_call
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """``reduce_scatter_tensor`` of each pair, together."""
        return _together([self.reduce_scatter_single(o, i, opts)
                          for o, i in zip(outputs, inputs)], outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def _reduce_scatter_rows(self, outputs: list[torch.Tensor], rows: list[torch.Tensor],
                             op: ReduceOp | None, factor: float) -> Work:
        """Reduce-scatter each ``(size, n)`` tensor of ``rows`` into its output (row
        ``rank``)."""
        assert op is not None  # (the callers refuse the bitwise ops)
        handles = self._each("reduce_scatter", rows, op, factor,
                             lambda b, r, o: self.comm.reduce_scatter_async(
                                 b, o, prescale_factor=factor, stream=producer_stream(r)))

        def finish() -> None:
            for output, handle in zip(outputs, handles):
                block = from_buffer(handle.wait())
                with torch.no_grad():
                    target = output.view(torch.uint8) if output.dtype == torch.bool else output
                    target.copy_(block.reshape(target.shape))
        return Work(Pending(handles, finish), outputs)

    # -- gathers and broadcasts --------------------------------------------------------
    @one_call
    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Work:
        """``all_gather``: ``output_lists[i][r]`` gets rank ``r``'s ``inputs[i]``. Outputs
        of other sizes than the input (ranks sending tensors of different sizes, which
        torch's ``all_gather`` allows) gather through :func:`_sized`."""
        return self._allgather(output_lists, inputs, opts)

    def _allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                   opts: Any, by_rank: bool = False) -> Work:
        """:meth:`allgather`; ``by_rank``: ``output_lists[r][i]`` gets rank ``r``'s
        ``inputs[i]`` (``all_gather_coalesced``'s order) instead."""
        comm = self.comm
        with refusing(comm, "allgather", *[None] * len(inputs)):
            if by_rank:
                if len(output_lists) != comm.size or any(len(outs) != len(inputs)
                                                         for outs in output_lists):
                    raise ArgumentError(
                        f"rank {comm.rank}: all_gather_coalesced needs {comm.size} output "
                        f"lists (one per rank) of {len(inputs)} tensors (one per input), "
                        f"got {[len(outs) for outs in output_lists]}")
                output_lists = [list(outs) for outs in zip(*output_lists)]
            buffers, uneven = [], []
            for outputs, t in zip(output_lists, inputs):
                if len(outputs) != comm.size or any(o.dtype != t.dtype for o in outputs):
                    raise ArgumentError(f"rank {comm.rank}: all_gather needs {comm.size} output "
                                        f"tensors of the input's dtype, {t.dtype}")
                sizes = [o.numel() for o in outputs]
                uneven.append(any(n != t.numel() for n in sizes))
                buffers.append(as_buffer(_sized(t, sizes) if uneven[-1] else
                                         _bytes_of_bool(t).reshape(1, -1)))
        with self._submitting(opts):
            handles = [comm.allgather_async(b, stream=producer_stream(t))
                       for b, t in zip(buffers, inputs)]

        def finish() -> None:
            for outputs, handle, t, odd in zip(output_lists, handles, inputs, uneven):
                gathered = from_buffer(handle.wait())
                blocks = (_unsized(gathered, t.dtype, comm.rank, comm.size) if odd else
                          list(gathered))
                with torch.no_grad():
                    for o, block in zip(outputs, blocks):
                        target = o.view(torch.uint8) if o.dtype == torch.bool else o
                        target.copy_(block.reshape(target.shape))
        return Work(Pending(handles, finish), [o for outs in output_lists for o in outs])

    @one_call
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> Work:
        """``all_gather_into_tensor``: ``output`` holds every rank's ``input`` in rank
        order (written in place: no copy out)."""
        comm = self.comm
        with refusing(comm, "allgather", None):
            if output.numel() != input.numel() * comm.size:
                raise ArgumentError(f"rank {comm.rank}: all_gather_into_tensor needs an output "
                                    f"of size x {input.numel()} = {input.numel() * comm.size} "
                                    f"elements, got {output.numel()}")
            buffer = as_buffer(_bytes_of_bool(input).reshape(1, -1))
            out = as_buffer(_bytes_of_bool(_contiguous_view(output, "all_gather_into_tensor"))
                            .view(comm.size, -1))
        with self._submitting(opts):
            handle = comm.allgather_async(buffer, stream=producer_stream(input), out=out)
        return Work(Pending([handle], handle.wait), [output])

    _allgather_base = all_gather_single  # (torch < 2.12)

    @one_call
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """``all_gather_into_tensor`` of each pair, together."""
        return _together([self.all_gather_single(o, i, opts)
                          for o, i in zip(outputs, inputs)], outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    @one_call
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """``all_gather_coalesced``: ``output_lists[r][i]`` gets rank ``r``'s
        ``inputs[i]`` (one list per rank, unlike :meth:`allgather`'s one per input)."""
        return self._allgather(output_lists, inputs, opts, by_rank=True)

    @one_call
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """``broadcast`` from ``rootRank``, in place."""
        root = _opt(opts, "rootRank", 0)
        comm = self.comm
        with refusing(comm, "broadcast", *[None] * len(tensors)):
            buffers = [as_buffer(_bytes_of_bool(t)) for t in tensors]
        with self._submitting(opts):
            handles = [comm.broadcast_async_(b, root=root, stream=producer_stream(t))
                       for b, t in zip(buffers, tensors)]
        return Work(Pending(handles, lambda: _wait_all(handles)), tensors)

    # -- MPI's own collectives ---------------------------------------------------------
    def _agree(self, what: str, prepare: Callable[[], tuple[Any, Any]]) -> tuple[Any, list[Any]]:
        """Every rank's ``prepare`` part, or the error of a rank whose checks failed on
        every rank (:func:`~mpitrain.parallel.refusal.agreed`: a watched rendezvous, then
        one allgather on the control communicator, where MPI's own collective follows
        once every rank is known to be in it)."""
        return agreed(self.comm, self.control.allgather, self.comm.rank, what, prepare)

    def _bitwise(self, tensors: list[torch.Tensor], op: Any, what: str,
                 outputs: list[torch.Tensor] | None = None) -> Work:
        """A bitwise all-reduce (MPI's own, of the bytes: AND, OR and XOR act bit by
        bit, whatever the integer width) of integer or bool tensors."""
        def prepare() -> tuple[list[np.ndarray[Any, Any]], Any]:
            bad = [str(t.dtype) for t in tensors if t.is_floating_point() or t.is_complex()]
            if bad:
                raise DtypeError(f"{what} with a bitwise op takes integer or bool tensors, "
                                 f"got {', '.join(bad)}")
            return [_bytes(t) for t in tensors], [(str(t.dtype), tuple(t.shape))
                                                  for t in tensors]

        data, parts = self._agree(what, prepare)
        _same_everywhere(parts, self.comm.rank, what)
        for t, d in zip(tensors, data):
            self.control.Allreduce(MPI.IN_PLACE, d, op=op)
            _store(t, d)
        return _done(outputs if outputs is not None else tensors)

    def gather(self, output_lists: list[list[torch.Tensor]],  # type: ignore[override]
               inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """``gather`` to ``rootRank``."""
        root = _opt(opts, "rootRank", 0)
        comm = self.comm

        def prepare() -> tuple[Any, Any]:
            _check_rooted(comm, root, "gather", inputs, "input", output_lists, "output")
            data = _bytes(inputs[0])
            return data, (str(inputs[0].dtype), data.size)

        data, parts = self._agree("gather", prepare)
        _same_everywhere([p[0] for p in parts], comm.rank, "gather")
        counts = [p[1] for p in parts]
        received = np.empty(sum(counts) if comm.rank == root else 0, np.uint8)
        unit = inputs[0].element_size()
        if _fits(counts, BYTE_COUNT_LIMIT):
            self.control.Gatherv(data, [received, counts] if comm.rank == root else None,
                                 root=root)
        else:  # counts in elements (MPI's counts are C ints)
            with _unit_type(unit) as kind:
                into = _units(counts, unit, comm.rank, "gather")
                self.control.Gatherv([data, data.size // unit, kind],
                                     [received, into, kind] if comm.rank == root else None,
                                     root=root)
        if comm.rank != root:
            return _done([])
        offsets = np.cumsum([0, *counts])
        for r, out in enumerate(output_lists[0]):
            _store(out, received[offsets[r]:offsets[r + 1]])
        return _done(output_lists[0])

    def scatter(self, outputs: list[torch.Tensor],  # type: ignore[override]
                input_lists: list[list[torch.Tensor]], opts: Any = None) -> Work:
        """``scatter`` from ``rootRank``: every rank's output must have the size of the
        root's input for it."""
        root = _opt(opts, "rootRank", 0)
        comm = self.comm

        def prepare() -> tuple[Any, Any]:
            _check_rooted(comm, root, "scatter", outputs, "output", input_lists, "input")
            pieces = [_bytes(t) for t in input_lists[0]] if comm.rank == root else None
            sizes = None if pieces is None else [p.size for p in pieces]
            nbytes = outputs[0].numel() * outputs[0].element_size()
            return pieces, (str(outputs[0].dtype), nbytes, sizes)

        pieces, parts = self._agree("scatter", prepare)
        _same_everywhere([p[0] for p in parts], comm.rank, "scatter")
        counts = [p[1] for p in parts]
        if parts[root][2] != counts:
            raise MismatchError(f"rank {comm.rank}: scatter's root (rank {root}) has input "
                                f"tensors of {parts[root][2]} bytes for outputs of {counts}")
        mine = _receiving(outputs[0], counts[comm.rank])
        whole = np.concatenate(pieces) if pieces is not None else None
        unit = outputs[0].element_size()
        if _fits(counts, BYTE_COUNT_LIMIT):
            self.control.Scatterv([whole, counts] if whole is not None else None, mine,
                                  root=root)
        else:  # counts in elements (MPI's counts are C ints)
            with _unit_type(unit) as kind:
                out_of = _units(counts, unit, comm.rank, "scatter")
                self.control.Scatterv([whole, out_of, kind] if whole is not None else None,
                                      [mine, mine.size // unit, kind], root=root)
        _store(outputs[0], mine)
        return _done(outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> Work:
        """``all_to_all_single``, uneven splits included (rows of dim 0)."""
        n, rank = self.comm.size, self.comm.rank

        def splits(sizes: list[int] | None, t: torch.Tensor, what: str) -> list[int]:
            rows = t.shape[0] if t.dim() else t.numel()
            if not sizes:
                if rows % n:
                    raise ArgumentError(f"rank {rank}: all_to_all_single: the {what} has "
                                        f"{rows} rows, not divisible by {n} ranks; pass "
                                        "split sizes")
                return [rows // n] * n
            if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
                raise ArgumentError(f"rank {rank}: all_to_all_single: {what} splits "
                                    f"{list(sizes)} must be {n} sizes summing to its {rows} rows")
            return [int(x) for x in sizes]

        def prepare() -> tuple[Any, Any]:
            send_rows = splits(input_split_sizes, input, "input")
            recv_rows = splits(output_split_sizes, output, "output")
            rows = input.shape[0] if input.dim() else input.numel()
            row = input.numel() * input.element_size() // rows if rows else 0
            return (send_rows, recv_rows, row), (str(input.dtype), tuple(input.shape[1:]),
                                                 send_rows, recv_rows)

        (send_rows, recv_rows, row), parts = self._agree("all_to_all_single", prepare)
        _same_everywhere([p[:2] for p in parts], rank, "all_to_all_single")
        _pairs_agree([p[2] for p in parts], [p[3] for p in parts], rank,
                     "all_to_all_single", "rows")
        send = _bytes(input)
        received = _receiving(output, sum(recv_rows) * row, send)
        self._alltoallv(send, [r * row for r in send_rows], received,
                        [r * row for r in recv_rows], row)
        _store(output, received)
        return _done([output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # (torch before 2.12)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> Work:
        """``all_to_all``: ``outputs[r]`` gets rank ``r``'s ``inputs[rank]``."""
        n, rank = self.comm.size, self.comm.rank

        def prepare() -> tuple[Any, Any]:
            if len(inputs) != n or len(outputs) != n:
                raise ArgumentError(f"rank {rank}: all_to_all needs {n} input and {n} output "
                                    "tensors")
            sizes = [t.numel() * t.element_size() for t in inputs]
            expected = [o.numel() * o.element_size() for o in outputs]
            return sizes, (str(inputs[0].dtype), sizes, expected)

        sizes, parts = self._agree("all_to_all", prepare)
        _same_everywhere([p[0] for p in parts], rank, "all_to_all")
        _pairs_agree([p[1] for p in parts], [p[2] for p in parts], rank, "all_to_all", "bytes")
        expected = parts[rank][2]
        received = np.empty(sum(expected), np.uint8)
        self._alltoallv(np.concatenate([_bytes(t) for t in inputs]), sizes, received, expected,
                        inputs[0].element_size())
        offsets = np.cumsum([0, *expected])
        for r, o in enumerate(outputs):
            _store(o, received[offsets[r]:offsets[r + 1]])
        return _done(outputs)

    def _alltoallv(self, send: np.ndarray[Any, Any], send_bytes: list[int],
                   received: np.ndarray[Any, Any], recv_bytes: list[int], unit: int) -> None:
        """MPI's alltoallv of the bytes ``send`` into ``received``, ``send_bytes[r]`` to
        rank ``r`` and ``recv_bytes[r]`` from it, every count a multiple of ``unit``
        bytes. MPI's counts and offsets are C ints: where a count or an offset in bytes
        reaches :data:`BYTE_COUNT_LIMIT`, they count units (a datatype of ``unit``
        bytes) instead."""
        if _fits(send_bytes, BYTE_COUNT_LIMIT) and _fits(recv_bytes, BYTE_COUNT_LIMIT):
            self.control.Alltoallv([send, send_bytes], [received, recv_bytes])
            return
        rank = self.comm.rank
        with _unit_type(unit) as kind:
            self.control.Alltoallv(
                [send, _units(send_bytes, unit, rank, "all_to_all's send"), kind],
                [received, _units(recv_bytes, unit, rank, "all_to_all's receive"), kind])

    # -- synchronisation, point to point -----------------------------------------------
    def barrier(self, opts: Any = None) -> Work:
        """Every rank has called ``barrier``."""
        self.comm.barrier()
        return _done([])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        """Send each tensor to group rank ``dst`` (MPI; host copies of device tensors), in
        messages of at most :data:`PIECE_BYTES`."""
        data = [_bytes(t) for t in tensors]
        comm = self.p2p.comm
        requests = _MpiRequests(self.p2p, f"send to rank {dst} (tag {tag})",
                                [comm.Isend(p, dst, tag) for d in data for p in _pieces(d)])

        def finish() -> list[np.ndarray[Any, Any]]:
            requests.wait()
            return data  # (kept alive until sent)
        return Work(Pending([requests], finish), tensors)  # type: ignore[list-item]

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        """Receive each tensor from group rank ``src``."""
        data = [_bytes(t) for t in tensors]
        pieces = [p for d in data for p in _pieces(d)]
        comm = self.p2p.comm
        what = f"recv from rank {src} (tag {tag})"
        requests = _MpiRequests(self.p2p, what, [comm.Irecv(p, src, tag) for p in pieces])

        def finish() -> None:
            requests.wait()
            for piece, status in zip(pieces, requests.statuses):
                _check_received(self.comm.rank, what, status.Get_count(MPI.BYTE), piece.size)
            for t, d in zip(tensors, data):
                _store(t, d)
        return Work(Pending([requests], finish), tensors)  # type: ignore[list-item]

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        """Receive each tensor from any rank (one message each, or its pieces from that
        rank; blocking): the Work's ``_source_rank()`` is the rank the first came from."""
        sources = []
        for t in tensors:
            data = _bytes(t)
            source = -1
            for piece in _pieces(data):
                if source < 0:  # the first piece from any rank, the others from that one
                    message, source, size = self._probe(MPI.ANY_SOURCE, tag)
                else:
                    message, _, size = self._probe(source, tag)
                what = f"recv from any rank (tag {tag}), sent by rank {source}"
                if size != piece.size:
                    message.Recv(np.empty(size, np.uint8))  # (taken off the queue)
                _check_received(self.comm.rank, what, size, piece.size)
                message.Recv(piece)
            _store(t, data)
            sources.append(source)
        work = _done(tensors)
        work._sender = sources[0] if sources else -1
        return work

    def _probe(self, source: int, tag: int) -> tuple[MPI.Message, int, int]:
        """The next message of ``tag`` from ``source`` (``MPI.ANY_SOURCE``: any rank),
        matched (not received yet), its sender and its size in bytes; the wait is
        watched like a collective's."""
        p2p, status, found = self.p2p, MPI.Status(), []

        def arrived() -> bool:
            message = p2p.comm.Improbe(source, tag, status)
            if message is not None:
                found.append(message)
            return message is not None

        sender = "any rank" if source == MPI.ANY_SOURCE else f"rank {source}"
        p2p.begin(f"recv from {sender} (tag {tag})")
        p2p.block(arrived)
        return found[0], status.Get_source(), status.Get_count(MPI.BYTE)


def _opt(opts: Any, name: str, default: Any) -> Any:
    return getattr(opts, name, default) if opts is not None else default


def _wait_all(handles: list[Handle]) -> None:
    for handle in handles:
        handle.wait()


def _pairs_agree(sends: list[list[int]], receives: list[list[int]], rank: int, what: str,
                 unit: str) -> None:
    """Raise on every rank (the lists are every rank's) unless what each rank sends to
    each rank is what that rank expects from it."""
    n = len(sends)
    for s in range(n):
        for r in range(n):
            if sends[s][r] != receives[r][s]:
                raise MismatchError(f"rank {rank}: {what}: rank {s} sends {sends[s][r]} {unit} "
                                    f"to rank {r}, which expects {receives[r][s]}; the split "
                                    "sizes must match on both sides")


def _same_everywhere(parts: list[Any], rank: int, what: str) -> None:
    """Raise on every rank (``parts`` are every rank's) if they differ."""
    if any(p != parts[0] for p in parts):
        other = next(r for r, p in enumerate(parts) if p != parts[0])
        raise MismatchError(f"rank {rank}: {what} needs the same dtype (and trailing shape) on "
                            f"every rank: rank 0 passed {parts[0]}, rank {other} {parts[other]}")


# -- the backend --------------------------------------------------------------------------
def _settings(timeout: datetime.timedelta | None) -> Settings:
    """The communicator settings of a group: the environment's, with torch's timeout as
    the stall timeout unless ``MPITRAIN_STALL_TIMEOUT_S`` is set."""
    if timeout is None or os.environ.get(config.STALL_TIMEOUT_S.name):
        return Settings.from_environment()
    return Settings.from_environment(stall_timeout_s=timeout.total_seconds())


def create(options: Any, backend_options: Any = None) -> ProcessGroupMpitrain:
    """torch's creator of the backend (``register_backend(..., extended_api=True)``): a
    group over ``MPI.COMM_WORLD`` for the default group, over the ranks of
    ``global_ranks_in_group`` for the others (collective over the group's ranks)."""
    comm, owned = group_communicator(options)
    # ordered: torch's rule (every rank makes the same calls in the same order) lets the
    # group count its calls across kinds, so ranks in different collectives fail at once
    mpitrain_comm = Communicator(comm, settings=_settings(options.timeout), ordered=True)
    return ProcessGroupMpitrain(mpitrain_comm, str(options.group_id),
                                owned=comm if owned else None)


def group_communicator(options: Any) -> tuple[MPI.Intracomm, bool]:
    """The MPI communicator of the group that torch's backend ``options`` describe, and
    whether it is a new one (which the group frees): ``MPI.COMM_WORLD`` for the default
    group, whose rank and size must be MPI's, else one made over the group's
    ``global_ranks_in_group`` (collective over them)."""
    world = MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group)
    if not ranks:
        if options.group_size != world.Get_size() or options.group_rank != world.Get_rank():
            raise ArgumentError(
                f"the {BACKEND} backend runs over the processes of an MPI job, but torch "
                f"has this process as rank {options.group_rank} of {options.group_size} and "
                f"MPI as rank {world.Get_rank()} of {world.Get_size()}; start the script "
                "with mpirun (or mpitrain-run) and leave rank and world_size to MPI")
        return world, False
    group = world.Get_group().Incl(ranks)
    comm = world.Create_group(group)
    group.Free()
    return comm, True


_registered = False


def register() -> None:
    """Register the backend and the rendezvous with torch (once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=list(DEVICE_TYPES))
    handlers = torch_rendezvous._rendezvous_handlers
    if SCHEME not in handlers:
        dist.register_rendezvous_handler(SCHEME, mpi_rendezvous)
    if _env_handler is not None and handlers.get("env") is _env_handler:
        handlers["env"] = _env_or_mpi


__all__ = ["BACKEND", "SCHEME", "ProcessGroupMpitrain", "Work", "create", "mpi_rendezvous",
           "reduction", "register"]
