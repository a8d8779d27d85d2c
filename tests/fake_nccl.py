"""A fake of ``cupy.cuda.nccl`` on the fake GPU of ``fake_device.py``, moving data with MPI.

mpitrain reaches NCCL through :func:`mpitrain.comm.nccl.module`; :func:`fake_nccl`
makes that return a :class:`FakeNccl` for a block, so the ``nccl`` algorithms run on a
machine without a GPU. The fake implements the calls mpitrain makes, with CuPy's
signatures: ``get_version``, ``get_unique_id``, ``NcclCommunicator(ndev, commId,
rank)`` and its ``allReduce``, ``reduceScatter``, ``allGather``, ``broadcast``,
``reduce``, ``rank_id``, ``size`` and ``destroy``, ``groupStart``/``groupEnd``, the
``NCCL_*`` constants CuPy has (no ``NCCL_INT16``, ``NCCL_BOOL`` or complex types:
NCCL has none) and ``NcclError`` (the message starts as CuPy's:
``NCCL_ERROR_INVALID_USAGE: invalid usage``).

How it behaves like NCCL (so that it catches what NCCL would):

* Buffers are addresses (``int``) of fake device memory; a call checks that each one it
  uses lies in a live allocation of the fake device's heap and, at run time, that the
  allocation is still the same (not freed before the "kernel" ran), and reads and writes
  the bytes through ctypes views of those addresses.
* A call queues its work on the fake stream it is given (``stream.enqueue``) and returns
  at once; the work runs when the fake device gets to it, late and in random orders
  across streams, as NCCL kernels do. It reads the send buffer then, not at the call.
* ``NcclCommunicator`` is collective over its ``ndev`` ranks, wherever they are in
  ``MPI.COMM_WORLD``: as NCCL's bootstrap does through the address in the unique id,
  each rank sends its rank to the process that made the id (by point-to-point messages
  on ``COMM_WORLD``, with a tag drawn from the id's random nonce), which answers with every rank's
  world rank; the ranks then make an MPI communicator of their own with
  ``MPI_Comm_create_group`` (collective only over them), on which the data moves. So
  communicators over some of the world's ranks work, several at once. Unlike NCCL, the
  process that called ``get_unique_id`` must itself join the communicator.
* Two ranks on one device (the fake device's ``identity``) and one host
  (``NCCL_HOSTID``, else the host name, when the communicator is made) make every rank
  raise ``NCCL_ERROR_INVALID_USAGE``, as NCCL's "Duplicate GPU detected".
* Arguments are checked as NCCL and CuPy's Cython signatures do: a negative count
  raises ``OverflowError`` and a non-integer ``TypeError``; an unknown datatype or op,
  ``NCCL_BFLOAT16`` or ``NCCL_AVG`` before NCCL 2.10, a root out of range, a null or
  invalid pointer, a stream of another device raise ``NCCL_ERROR_INVALID_ARGUMENT``. A
  call of count 0 does nothing, as in NCCL. Stricter than NCCL (which computes garbage
  instead): send and receive buffers that overlap other than in NCCL's in-place forms
  are refused with ``NCCL_ERROR_INVALID_ARGUMENT``.
* Between ``groupStart`` and ``groupEnd`` calls are checked but only recorded; the
  outermost ``groupEnd`` queues them (in call order, as one piece of work, which waits
  for every stream the group's calls name, and which all those streams then wait for). A
  call of the group that raised makes ``groupEnd`` raise too, and nothing is queued.
* When the work runs, the ranks first compare what each queued (launch number, call,
  count, datatype, op, root): ranks that queued different calls, or ran them in
  different orders, raise ``NCCL_ERROR_INVALID_USAGE`` (NCCL would hang or corrupt
  data). A rank that waits longer than :attr:`FakeNccl.timeout_s` for the others raises
  ``NCCL_ERROR_SYSTEM_ERROR`` instead of hanging; a communicator that failed refuses
  every later call.
* ``destroy`` first lets the device run the communicator's queued work (NCCL's
  ``ncclCommDestroy`` finalizes, flushing it), then frees the MPI communicator; later
  calls raise ``NCCL_ERROR_INVALID_ARGUMENT``.

Reductions run in rank order with numpy (ml_dtypes for bfloat16), in the buffer's
dtype; ``NCCL_AVG`` multiplies each input by ``1/ndev`` before the sum for floats and
divides the sum, truncating, for integers. The fake counts what it did
(:attr:`FakeNccl.unique_ids`, :attr:`FakeNccl.communicators`, :attr:`FakeNccl.launches`,
:attr:`FakeNccl.groups`) for the tests to check which path a call took.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pytest
from fake_device import FakeBackend, FakeDevice, FakeStream
from mpi4py import MPI

from mpitrain.dtypes import BFLOAT16

VERSION = 21805
"""The NCCL version the fake reports by default (2.18.5: ``major * 10000 + minor * 100
+ patch``, NCCL's numbering since 2.9)."""
BFLOAT16_SINCE = 21000
"""``ncclBfloat16`` and ``ncclAvg`` came with NCCL 2.10."""
UNIQUE_ID_BYTES = 128
_MAGIC = b"FAKENCCL"
_TAG_BASE = 0x6E00
"""The least tag of a communicator's check-in messages (each draws its tag from its
unique id, up to MPI's ``TAG_UB``: two communicators made at once rarely share one)."""

SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, \
    INVALID_USAGE = range(6)
_ERRORS = {SUCCESS: ("NCCL_ERROR_SUCCESS", "no error"),
           UNHANDLED_CUDA_ERROR: ("NCCL_ERROR_UNHANDLED_CUDA_ERROR", "unhandled cuda error"),
           SYSTEM_ERROR: ("NCCL_ERROR_SYSTEM_ERROR", "unhandled system error"),
           INTERNAL_ERROR: ("NCCL_ERROR_INTERNAL_ERROR", "internal error"),
           INVALID_ARGUMENT: ("NCCL_ERROR_INVALID_ARGUMENT", "invalid argument"),
           INVALID_USAGE: ("NCCL_ERROR_INVALID_USAGE", "invalid usage")}

DTYPES: dict[int, np.dtype[Any]] = {
    0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
    3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
    6: np.dtype(np.float16), 7: np.dtype(np.float32), 8: np.dtype(np.float64),
    **({9: BFLOAT16} if BFLOAT16 is not None else {})}
"""NCCL's datatypes by number, as numpy dtypes."""
_OPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
           "avg": np.add}
_KINDS = {"allReduce": 1, "reduceScatter": 2, "allGather": 3, "broadcast": 4, "reduce": 5}
_KIND_NAMES = {code: name for name, code in _KINDS.items()}


class NcclError(RuntimeError):
    """An NCCL error, as CuPy raises it (``status``: NCCL's ``ncclResult_t``), with what
    the fake saw in ``detail``."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status, self.detail = status, detail
        name, text = _ERRORS[status]
        super().__init__(f"{name}: {text}" + (f" ({detail})" if detail else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.status, self.detail)


def _integer(value: Any, what: str, unsigned: bool = False) -> int:
    """``value`` as Cython's ``int``/``size_t`` argument conversion takes it."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: an integer is required, got {type(value).__name__}") \
            from None
    if unsigned and number < 0:
        raise OverflowError(f"{what}: can't convert negative value to size_t ({number})")
    return number


@dataclass
class _Region:
    """Bytes of fake device memory a call uses: where, and the allocation they lie in
    (its start and its entry in the heap's ``live`` table, which names the allocation by
    its handle: to see at run time that it was not freed meanwhile)."""

    ptr: int
    nbytes: int
    start: int
    allocation: tuple[Any, ...]

    def overlaps(self, other: _Region) -> bool:
        """True if the two regions share a byte."""
        return self.ptr < other.ptr + other.nbytes and other.ptr < self.ptr + self.nbytes


@dataclass
class _Call:
    """One NCCL call, checked and waiting to run (``seq``: its launch number on its
    communicator, set when it is queued)."""

    comm: FakeCommunicator
    kind: str
    count: int
    datatype: int
    op: int
    root: int
    stream: FakeStream
    send: _Region | None
    recv: _Region | None
    seq: int = -1

    def header(self) -> np.ndarray[Any, Any]:
        """What every rank must have queued alike."""
        return np.array([self.seq, _KINDS[self.kind], self.count, self.datatype, self.op,
                         self.root], np.int64)


def _shown(header: np.ndarray[Any, Any]) -> str:
    """A header for a message."""
    seq, kind, count, datatype, op, root = (int(v) for v in header)
    return (f"#{seq} {_KIND_NAMES.get(kind, kind)}(count={count}, datatype={datatype}, "
            f"op={op}, root={root})")


@dataclass
class _GroupState:
    """One thread's ``groupStart`` nesting, the calls recorded and the first error."""

    depth: int = 0
    calls: list[_Call] = field(default_factory=list)
    error: NcclError | None = None


class FakeCommunicator:
    """``NcclCommunicator`` of the fake (see the module documentation): made by
    :meth:`FakeNccl.NcclCommunicator`, collective over its ``ndev`` ranks."""

    def __init__(self, module: FakeNccl, ndev: Any, commId: Any, rank: Any) -> None:
        ndev, rank = _integer(ndev, "ndev"), _integer(rank, "rank")
        if not isinstance(commId, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got "
                            f"{type(commId).__name__})")
        assert len(commId) == UNIQUE_ID_BYTES, f"a unique id has {UNIQUE_ID_BYTES} bytes"
        self.module, self.device = module, module.device
        self.ndev, self.rank = ndev, rank
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.pending = 0  # calls queued whose work has not run yet
        self.failed: NcclError | None = None
        self._launched = 0
        self._abandoned: list[Any] = []  # requests left pending by a timeout
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, f"world rank {self.world_rank}: invalid rank "
                                              f"requested: {rank}/{ndev}")
        raw = bytes(c % 256 for c in commId)
        if not raw.startswith(_MAGIC):
            raise NcclError(INVALID_ARGUMENT, f"world rank {self.world_rank}: the unique id "
                                              "did not come from this fake's get_unique_id")
        creator, nonce = struct.unpack_from("<iq", raw, len(_MAGIC))
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
        self.tag = _TAG_BASE + nonce % (tag_ub - _TAG_BASE - 1)
        self.mpi: MPI.Intracomm | None = self._join(creator, nonce)
        self._check_devices()
        module.communicators.append(self)

    # -- making it -----------------------------------------------------------------------
    def _join(self, creator: int, nonce: int) -> MPI.Intracomm:
        """Check in with the id's creator, learn every rank's world rank, and make the
        MPI communicator of the ranks (in NCCL rank order)."""
        world, me = MPI.COMM_WORLD, self.world_rank
        if not 0 <= creator < world.Get_size():
            raise NcclError(INVALID_ARGUMENT, f"world rank {me}: the unique id names world "
                                              f"rank {creator}, outside COMM_WORLD")
        hello = np.array([nonce, self.rank, self.ndev, me], np.int64)
        sent = world.Isend(hello, dest=creator, tag=self.tag)
        reply = np.empty(self.ndev + 1, np.int64)
        answer = world.Irecv(reply, source=creator, tag=self.tag + 1)
        if me == creator:
            self._answer(world, nonce)
        self._wait(answer, f"the answer of world rank {creator}, which made the unique id "
                           "(it must join the communicator too)")
        self._wait(sent, "the id's creator to take this rank's check-in")
        if reply[0] != SUCCESS:
            raise NcclError(int(reply[0]), f"world rank {me}, NCCL rank {self.rank}: the "
                                           f"ranks checking in disagree (see world rank "
                                           f"{creator}'s error)")
        ranks = [int(r) for r in reply[1:]]
        everyone = world.Get_group()
        members = everyone.Incl(ranks)
        try:
            comm = world.Create_group(members, self.tag)
        finally:
            members.Free()
            everyone.Free()
        assert comm.Get_rank() == self.rank and comm.Get_size() == self.ndev
        return comm

    def _answer(self, world: MPI.Intracomm, nonce: int) -> None:
        """As the id's creator: take ``ndev`` check-ins and answer each with every rank's
        world rank, or an error status if they disagree."""
        hellos: list[tuple[int, int, int, int]] = []
        for _ in range(self.ndev):
            hello = np.empty(4, np.int64)
            self._wait(world.Irecv(hello, source=MPI.ANY_SOURCE, tag=self.tag),
                       f"{self.ndev - len(hellos)} more rank(s) to check in")
            hellos.append((int(hello[0]), int(hello[1]), int(hello[2]), int(hello[3])))
        problems = [f"world rank {w} checked in with another id" for n, _, _, w in hellos
                    if n != nonce]
        problems += [f"world rank {w} says {d} ranks, not {self.ndev}"
                     for _, _, d, w in hellos if d != self.ndev]
        ranks = sorted(r for _, r, _, _ in hellos)
        if ranks != list(range(self.ndev)):
            problems.append(f"ranks {ranks} checked in, not 0..{self.ndev - 1} once each")
        world_ranks = {r: w for _, r, _, w in hellos}
        status = INTERNAL_ERROR if problems else SUCCESS
        sends = []
        for _, _, ndev, w in hellos:
            reply = np.full(ndev + 1, -1, np.int64)
            reply[0] = status
            if not problems:
                reply[1:] = [world_ranks[r] for r in range(ndev)]
            sends.append((world.Isend(reply, dest=w, tag=self.tag + 1), reply))
        for request, _ in sends:
            self._wait(request, "a rank to take its answer")
        if problems:
            raise NcclError(INTERNAL_ERROR, f"world rank {self.world_rank} (the unique id's "
                                            f"creator): {'; '.join(problems)}")

    def _check_devices(self) -> None:
        """NCCL's duplicate GPU check: no two ranks on one device of one host."""
        assert self.mpi is not None
        host = os.environ.get("NCCL_HOSTID") or socket.gethostname()
        every = self.mpi.allgather((host, str(self.device.identity)))
        for r, place in enumerate(every):
            if place in every[:r]:
                other = every.index(place)
                self.mpi.Free()
                self.mpi = None
                raise NcclError(INVALID_USAGE, f"NCCL rank {self.rank}: Duplicate GPU "
                                               f"detected: rank {other} and rank {r} both on "
                                               f"device {place[1]!r} of host {place[0]!r}")

    # -- the calls -----------------------------------------------------------------------
    def allReduce(self, sendbuf: Any, recvbuf: Any, count: Any, datatype: Any, op: Any,
                  stream: Any) -> None:
        """``ncclAllReduce``: ``recvbuf`` = the reduction of every rank's ``sendbuf``
        (``count`` elements; the same buffer: in place)."""
        with self.module.checking():
            n, dt, rop, s = self._common(count, datatype, op, stream)
            send = self._region(sendbuf, n * dt.itemsize, "sendbuf", n)
            recv = self._region(recvbuf, n * dt.itemsize, "recvbuf", n)
            self._no_overlap(send, recv, 0, "allReduce")
            self._submit(_Call(self, "allReduce", n, datatype, rop, -1, s, send, recv))

    def reduceScatter(self, sendbuf: Any, recvbuf: Any, recvcount: Any, datatype: Any,
                      op: Any, stream: Any) -> None:
        """``ncclReduceScatter``: ``recvbuf`` (``recvcount`` elements) = this rank's block
        of the reduction of every rank's ``sendbuf`` (``ndev * recvcount``); in place
        where ``recvbuf`` is this rank's block of ``sendbuf``."""
        with self.module.checking():
            n, dt, rop, s = self._common(recvcount, datatype, op, stream)
            block = n * dt.itemsize
            send = self._region(sendbuf, block * self.ndev, "sendbuf", n)
            recv = self._region(recvbuf, block, "recvbuf", n)
            self._no_overlap(recv, send, self.rank * block, "reduceScatter")
            self._submit(_Call(self, "reduceScatter", n, datatype, rop, -1, s, send, recv))

    def allGather(self, sendbuf: Any, recvbuf: Any, count: Any, datatype: Any,
                  stream: Any) -> None:
        """``ncclAllGather``: every rank's ``sendbuf`` (``count`` elements) in rank order
        into ``recvbuf``; in place where ``sendbuf`` is this rank's block of it."""
        with self.module.checking():
            n, dt, _, s = self._common(count, datatype, None, stream)
            block = n * dt.itemsize
            send = self._region(sendbuf, block, "sendbuf", n)
            recv = self._region(recvbuf, block * self.ndev, "recvbuf", n)
            self._no_overlap(send, recv, self.rank * block, "allGather")
            self._submit(_Call(self, "allGather", n, datatype, -1, -1, s, send, recv))

    def broadcast(self, sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any,
                  stream: Any) -> None:
        """``ncclBroadcast``: the root's ``sendbuff`` into every rank's ``recvbuff``
        (``sendbuff`` is read on the root only; the same buffer: in place)."""
        with self.module.checking():
            n, dt, _, s = self._common(count, datatype, None, stream)
            root = self._root(root)
            recv = self._region(recvbuff, n * dt.itemsize, "recvbuff", n)
            send = None
            if self.rank == root:
                send = self._region(sendbuff, n * dt.itemsize, "sendbuff", n)
                self._no_overlap(send, recv, 0, "broadcast")
            self._submit(_Call(self, "broadcast", n, datatype, -1, root, s, send, recv))

    def reduce(self, sendbuf: Any, recvbuf: Any, count: Any, datatype: Any, op: Any,
               root: Any, stream: Any) -> None:
        """``ncclReduce``: the reduction of every rank's ``sendbuf`` into the root's
        ``recvbuf`` (read on the root only; the same buffer: in place)."""
        with self.module.checking():
            n, dt, rop, s = self._common(count, datatype, op, stream)
            root = self._root(root)
            send = self._region(sendbuf, n * dt.itemsize, "sendbuf", n)
            recv = None
            if self.rank == root:
                recv = self._region(recvbuf, n * dt.itemsize, "recvbuf", n)
                self._no_overlap(send, recv, 0, "reduce")
            self._submit(_Call(self, "reduce", n, datatype, rop, root, s, send, recv))

    def rank_id(self) -> int:
        """This rank's NCCL rank."""
        self._usable()
        return self.rank

    def size(self) -> int:
        """The number of ranks."""
        self._usable()
        return self.ndev

    def destroy(self) -> None:
        """Run this communicator's queued work, then free it (a second call does
        nothing)."""
        if self.mpi is None:
            return
        if self.pending:
            self.device.run_until(lambda: self.pending == 0)
        self.mpi.Free()
        self.mpi = None
        self.module.destroyed += 1

    # -- argument checks ---------------------------------------------------------------
    def _usable(self) -> None:
        if self.mpi is None:
            raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: the communicator was "
                                              "destroyed")
        if self.failed is not None:
            raise NcclError(self.failed.status, f"NCCL rank {self.rank}: the communicator "
                                                f"failed earlier: {self.failed}")

    def _common(self, count: Any, datatype: Any, op: Any,
                stream: Any) -> tuple[int, np.dtype[Any], int, FakeStream]:
        """Check what every call has: the communicator, count, datatype, op, stream."""
        self._usable()
        n = _integer(count, "count", unsigned=True)
        code = _integer(datatype, "datatype")
        version = self.module.version
        if code not in DTYPES or (code == 9 and version < BFLOAT16_SINCE):
            raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: invalid datatype "
                                              f"{code} (NCCL {version})")
        rop = -1
        if op is not None:
            rop = _integer(op, "op")
            if rop not in _OPS or (rop == 4 and version < BFLOAT16_SINCE):
                raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: invalid reduction "
                                                  f"operation {rop} (NCCL {version})")
        if isinstance(stream, int) and not isinstance(stream, bool) and stream == 0:
            stream = self.device.default
        if not isinstance(stream, FakeStream) or stream.device is not self.device:
            raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: {stream!r} is not a "
                                              "stream of this communicator's device")
        return n, DTYPES[code], rop, stream

    def _root(self, root: Any) -> int:
        value = _integer(root, "root")
        if not 0 <= value < self.ndev:
            raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: invalid root {value} "
                                              f"(root should be in the 0..{self.ndev - 1} "
                                              "range)")
        return value

    def _region(self, ptr: Any, nbytes: int, what: str, count: int) -> _Region | None:
        """The allocation that holds ``nbytes`` at ``ptr`` (None for a call of count 0,
        which touches no memory)."""
        address = _integer(ptr, what)
        if count == 0:
            return None
        if address == 0:
            raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: {what} is a null "
                                              "pointer")
        for start, allocation in list(self.device.heap.live.items()):
            if start <= address and address + nbytes <= start + allocation[0]:  # its size
                return _Region(address, nbytes, start, tuple(allocation))
        raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: {what} {address:#x} + "
                                          f"{nbytes} bytes is not in one allocation of the "
                                          "device's memory")

    def _no_overlap(self, a: _Region | None, b: _Region | None, offset: int,
                    call: str) -> None:
        """Refuse buffers that overlap, unless ``a`` starts ``offset`` bytes into ``b``
        (NCCL's in-place form of ``call``)."""
        if a is None or b is None or not a.overlaps(b) or a.ptr == b.ptr + offset:
            return
        raise NcclError(INVALID_ARGUMENT, f"NCCL rank {self.rank}: {call} buffers "
                                          f"{a.ptr:#x}+{a.nbytes} and {b.ptr:#x}+{b.nbytes} "
                                          "overlap, and not in the in-place form")

    def _submit(self, call: _Call) -> None:
        if call.count == 0:
            return  # NCCL returns at once: no work, no launch
        self.module.submit(call)

    # -- running -----------------------------------------------------------------------
    def _fail(self, error: NcclError) -> NcclError:
        self.failed = self.failed or error
        return error

    def _wait(self, request: Any, what: str) -> None:
        """Wait for an MPI request, at most the module's timeout."""
        deadline = time.monotonic() + self.module.timeout_s
        spins = 0
        while not request.Test():
            spins += 1
            if spins < 1000:
                continue
            if time.monotonic() > deadline:
                self._abandoned.append(request)  # it keeps its buffers alive
                raise self._fail(NcclError(SYSTEM_ERROR, f"world rank {self.world_rank}, "
                                                         f"NCCL rank {self.rank}: waited "
                                                         f"{self.module.timeout_s:g} s for "
                                                         f"{what}"))
            time.sleep(0.0002)

    def _bytes(self, region: _Region | None, call: _Call) -> np.ndarray[Any, Any]:
        """The bytes of a region, if its allocation is still the one the call saw."""
        assert region is not None
        live = self.device.heap.live.get(region.start)
        if live is None or tuple(live) != region.allocation:
            raise self._fail(NcclError(UNHANDLED_CUDA_ERROR, f"NCCL rank {self.rank}: "
                                                             f"{call.kind} #{call.seq}: its "
                                                             f"buffer {region.ptr:#x} was "
                                                             "freed before its kernel ran"))
        memory = (ctypes.c_uint8 * region.nbytes).from_address(region.ptr)
        return np.ctypeslib.as_array(memory)

    def run(self, call: _Call) -> None:
        """Run a queued call (the device's work, collective over the ranks)."""
        self._usable()
        assert self.mpi is not None
        mpi, n = self.mpi, self.ndev
        header = call.header()
        every = np.empty((n, header.size), np.int64)
        self._wait(mpi.Iallgather(header, every), f"the other ranks to run {_shown(header)}")
        if (every != header).any():
            shown = "; ".join(f"rank {r}: {_shown(h)}" for r, h in enumerate(every))
            raise self._fail(NcclError(INVALID_USAGE, f"NCCL rank {self.rank}: the ranks "
                                                      f"queued different calls: {shown}"))
        what = f"the other ranks' data of {_shown(header)}"
        if call.kind == "allReduce":
            send = self._bytes(call.send, call)
            gathered = np.empty((n, send.size), np.uint8)
            self._wait(mpi.Iallgather(send, gathered), what)
            self._bytes(call.recv, call)[:] = self._reduced(gathered, call)
        elif call.kind == "reduceScatter":
            send = self._bytes(call.send, call)
            gathered = np.empty((n, send.size // n), np.uint8)
            self._wait(mpi.Ialltoall(send, gathered), what)
            self._bytes(call.recv, call)[:] = self._reduced(gathered, call)
        elif call.kind == "allGather":
            send = self._bytes(call.send, call).copy()  # in place: inside recvbuf
            self._wait(mpi.Iallgather(send, self._bytes(call.recv, call)), what)
        elif call.kind == "broadcast":
            recv = self._bytes(call.recv, call)
            if call.send is not None and call.send.ptr != recv.ctypes.data:  # the root
                recv[:] = self._bytes(call.send, call)
            self._wait(mpi.Ibcast(recv, call.root), what)
        else:  # reduce
            send = self._bytes(call.send, call)
            mine = self.rank == call.root
            gathered = np.empty((n, send.size) if mine else 0, np.uint8)
            self._wait(mpi.Igather(send, gathered if mine else None, call.root), what)
            if mine:
                self._bytes(call.recv, call)[:] = self._reduced(gathered, call)

    def _reduced(self, rows: np.ndarray[Any, Any], call: _Call) -> np.ndarray[Any, Any]:
        """The reduction of every rank's bytes (one row each), in rank order, as bytes."""
        dt = DTYPES[call.datatype]
        values = rows.view(dt)
        name = _OPS[call.op]
        ufunc = _UFUNCS[name]
        n = values.shape[0]
        premul = name == "avg" and (dt.kind == "f" or dt == BFLOAT16)
        factor = np.array(1.0 / n).astype(dt)
        acc = values[0] * factor if premul else values[0].copy()
        for r in range(1, n):
            ufunc(acc, values[r] * factor if premul else values[r], out=acc)
        if name == "avg" and not premul:  # integers: the sum divided, truncating
            acc = np.where(acc < 0, -(-acc // n), acc // n).astype(dt)
        return np.ascontiguousarray(acc).view(np.uint8)


class FakeNccl:
    """The fake ``cupy.cuda.nccl`` of one fake device (see the module documentation).

    Args:
        device: the fake GPU (what is "current" when a communicator is made).
        version: what ``get_version`` returns (below 21000: no bfloat16, no avg).
        timeout_s: the longest a rank waits for the others (default
            ``FAKE_NCCL_TIMEOUT_S``, else 60 s).
    """

    available = True
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
    NCCL_INT8 = NCCL_CHAR = 0
    NCCL_UINT8 = 1
    NCCL_INT32 = NCCL_INT = 2
    NCCL_UINT32 = 3
    NCCL_INT64 = 4
    NCCL_UINT64 = 5
    NCCL_FLOAT16 = NCCL_HALF = 6
    NCCL_FLOAT32 = NCCL_FLOAT = 7
    NCCL_FLOAT64 = NCCL_DOUBLE = 8
    NCCL_BFLOAT16 = 9
    NcclError = NcclError

    def __init__(self, device: FakeDevice, version: int = VERSION,
                 timeout_s: float | None = None) -> None:
        self.device, self.version = device, version
        self.timeout_s = float(os.environ.get("FAKE_NCCL_TIMEOUT_S", "60")) \
            if timeout_s is None else timeout_s
        self.unique_ids = 0
        """``get_unique_id`` calls in this process."""
        self.communicators: list[FakeCommunicator] = []
        """Every communicator made in this process."""
        self.destroyed = 0
        """Communicators destroyed."""
        self.launches: list[tuple[str, int]] = []
        """``(call, count)`` of every call queued on a stream (count 0: none)."""
        self.groups = 0
        """Groups that queued calls at their ``groupEnd``."""
        self._group = threading.local()

    def get_version(self) -> int:
        """The fake NCCL's version number."""
        return self.version

    def get_build_version(self) -> int:
        """The version CuPy was built with (the same)."""
        return self.version

    def get_unique_id(self) -> tuple[int, ...]:
        """A new unique id: 128 signed chars naming this world rank and a random nonce."""
        self.unique_ids += 1
        nonce = int.from_bytes(os.urandom(8), "little") >> 2
        raw = _MAGIC + struct.pack("<iq", MPI.COMM_WORLD.Get_rank(), nonce)
        raw = raw.ljust(UNIQUE_ID_BYTES, b"\0")
        return tuple(b - 256 if b > 127 else b for b in raw)

    def NcclCommunicator(self, ndev: Any, commId: Any, rank: Any) -> FakeCommunicator:
        """``ncclCommInitRank`` (collective over the ``ndev`` ranks)."""
        return FakeCommunicator(self, ndev, commId, rank)

    def _state(self) -> _GroupState:
        state = getattr(self._group, "state", None)
        if state is None:
            state = self._group.state = _GroupState()
        return state

    def groupStart(self) -> None:
        """Start recording calls (nested groups end at the outermost ``groupEnd``)."""
        self._state().depth += 1

    def groupEnd(self) -> None:
        """End a group: the outermost one queues the calls recorded, or raises the
        error of one that failed."""
        state = self._state()
        if state.depth == 0:
            raise NcclError(INVALID_USAGE, "groupEnd: not in a group call (no groupStart)")
        state.depth -= 1
        if state.depth:
            return
        calls, error = state.calls, state.error
        state.calls, state.error = [], None
        if error is not None:
            raise NcclError(error.status, f"groupEnd: a call of the group failed ({error}); "
                                          f"none of its {len(calls)} other call(s) ran")
        if calls:
            self.groups += 1
            self._launch(calls)

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Inside a group, remember the first error a call raises (``groupEnd``
        raises it too)."""
        try:
            yield
        except NcclError as exc:
            state = self._state()
            if state.depth and state.error is None:
                state.error = exc
            raise

    def submit(self, call: _Call) -> None:
        """Queue a checked call, or record it until ``groupEnd``."""
        state = self._state()
        if state.depth:
            state.calls.append(call)
        else:
            self._launch([call])

    def _launch(self, calls: list[_Call]) -> None:
        """Queue calls as one piece of work on the first one's stream, ordered after
        (and before) the work of every stream they name."""
        for call in calls:
            call.seq = call.comm._launched
            call.comm._launched += 1
            call.comm.pending += 1
            self.launches.append((call.kind, call.count))
        main = calls[0].stream
        others = list({id(c.stream): c.stream for c in calls if c.stream is not main}.values())
        for stream in others:
            before = self.device.new_event()
            before.record(stream)
            main.wait_event(before)

        def work() -> None:
            try:
                for call in calls:
                    call.comm.run(call)
            finally:
                for call in calls:
                    call.comm.pending -= 1

        main.enqueue(work)
        if others:
            after = self.device.new_event()
            after.record(main)
            for stream in others:
                stream.wait_event(after)

    def close(self) -> None:
        """Destroy the communicators left (local: their work has run)."""
        for comm in self.communicators:
            if comm.mpi is not None and comm.pending == 0:
                comm.destroy()


@contextlib.contextmanager
def fake_nccl(backend: FakeBackend, version: int = VERSION,
              timeout_s: float | None = None) -> Iterator[FakeNccl]:
    """For the block, :func:`mpitrain.comm.nccl.module` returns a :class:`FakeNccl` on
    ``backend``'s fake device (its cached version forgotten on entry and exit); the
    communicators left are destroyed on exit."""
    from mpitrain.comm import nccl

    fake = FakeNccl(backend.fake, version, timeout_s)

    def module() -> FakeNccl:
        return fake

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(nccl, "module", module)
            nccl.nccl_version.cache_clear()
            try:
                yield fake
            finally:
                fake.close()
    finally:
        nccl.nccl_version.cache_clear()
