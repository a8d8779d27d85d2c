"""The ``ipc`` algorithms on the fake GPU's fake CUDA IPC (``tests/fake_device.py``).

The fake's memory is host shared memory that the other ranks map as CUDA IPC maps a
GPU's: handles name an allocation (arrays are carved out of larger ones), a process
cannot open its own, a freed allocation's address goes to the next one with a new
identity. Its streams run work late and in random orders, so a rank that publishes a
buffer before its stream has written it, or reads a peer's before the peer's stream
has, gets poison bytes. Each test runs in both modes of the algorithms: every rank on
"one device" (rank 0 does the device work) and each rank on "own devices" (each its
part), the fake device's identity set per rank before a new communicator's first call.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import numpy as np
import pytest
from fake_device import FakeBackend, FakeDeviceArray, fake_backend, to_device
from helpers import assert_all_ranks, assert_equal_all_ranks, crafted, ops_for, reference

import mpitrain as mt

DTYPES = ["float32", "bfloat16", "float16", "float64", "int8", "uint16", "int64", "complex64"]
CASES = [(d, o) for d in DTYPES for o in ops_for(d)]


def host(arr: Any) -> np.ndarray[Any, Any]:
    """A fake device array's contents (the collective has synchronized its stream)."""
    assert isinstance(arr, FakeDeviceArray), f"expected a device array, got {type(arr)}"
    return np.asarray(arr).view(np.ndarray)


def seed(comm: mt.Communicator, *salt: object) -> int:
    """A seed that differs by rank and by test case."""
    return comm.rank * 7919 + sum(ord(c) for c in "".join(map(str, salt)))


MODES = ["one device", "own devices"]


@pytest.fixture
def ipc_comm(comm: mt.Communicator) -> Iterator[mt.Communicator]:
    """A new communicator (a fresh device layout and fresh mappings) over every rank."""
    c = mt.Communicator(comm.mpi_comm)
    try:
        yield c
    finally:
        c.free()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """Every rank on one device, or each on its own."""
    return str(request.param)


@contextlib.contextmanager
def devices(c: mt.Communicator, mode: str, *salt: object) -> Iterator[FakeBackend]:
    """A fake backend whose device is shared by every rank or each rank's own (set
    before ``c``'s first device call, which finds the layout)."""
    with fake_backend(seed(c, mode, *salt)) as be:
        if mode == "own devices":
            be.fake.identity = f"fake-gpu:{c.rank}"
        yield be


def maps(c: mt.Communicator, mode: str) -> bool:
    """True if this rank maps its peers' buffers in ``mode`` (on one device only rank 0,
    which does the device work)."""
    return mode == "own devices" or c.rank == 0


def mappings(backend: FakeBackend) -> tuple[int, int]:
    """Handles the fake device has opened and closed so far."""
    return backend.fake.opened, backend.fake.closed


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_allreduce(ipc_comm: mt.Communicator, mode: str, dtype: str, op: mt.ReduceOp) -> None:
    comm = ipc_comm
    with devices(comm, mode, "ar", dtype, op):
        for count in sorted({0, 1, max(comm.size - 1, 0), 1001, 4099}):
            expected = reference(comm.size, count, dtype, op)
            x = to_device(crafted(comm.rank, count, dtype, op))
            y = comm.allreduce(x, op=op, algorithm="ipc")
            assert_equal_all_ranks(comm, host(y), expected, f"ipc allreduce n={count}")
            assert_equal_all_ranks(comm, host(x), crafted(comm.rank, count, dtype, op),
                                   "the input after an out-of-place allreduce")
            assert comm.allreduce_(x, op=op, algorithm="ipc") is x
            assert_equal_all_ranks(comm, host(x), expected, f"ipc allreduce_ n={count}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "complex128"])
def test_scaled_allreduce(ipc_comm: mt.Communicator, mode: str, dtype: str) -> None:
    """prescale and postscale (fused into the last reduction) and Average."""
    comm = ipc_comm
    with devices(comm, mode, "scaled", dtype):
        x = to_device(crafted(comm.rank, 999, dtype, mt.Sum))
        y = comm.allreduce(x, op=mt.Sum, algorithm="ipc", prescale_factor=2.0,
                           postscale_factor=0.5)
        assert_equal_all_ranks(comm, host(y), reference(comm.size, 999, dtype, mt.Sum),
                               "ipc allreduce scaled by 2 then 0.5")
        z = comm.allreduce(x, op=mt.Average, algorithm="ipc")
        assert_equal_all_ranks(comm, host(z), reference(comm.size, 999, dtype, mt.Average),
                               "ipc Average")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype,op", [("float32", mt.Sum), ("bfloat16", mt.Max),
                                      ("int16", mt.Product), ("float64", mt.Average)])
def test_reduce_scatter(ipc_comm: mt.Communicator, mode: str, dtype: str,
                        op: mt.ReduceOp) -> None:
    comm = ipc_comm
    with devices(comm, mode, "rs", dtype, op):
        for rows in sorted({0, 1, comm.size, 2 * comm.size + 1, 840}):
            x = to_device(crafted(comm.rank, rows * 3, dtype, op).reshape(rows, 3))
            y = comm.reduce_scatter(x, op=op, algorithm="ipc")
            full = reference(comm.size, rows * 3, dtype, op).reshape(rows, 3)
            assert_equal_all_ranks(comm, host(y), np.array_split(full, comm.size)[comm.rank],
                                   f"ipc reduce_scatter rows={rows}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "uint8", "complex128"])
def test_allgather(ipc_comm: mt.Communicator, mode: str, dtype: str) -> None:
    """Uneven blocks, some empty."""
    comm = ipc_comm
    with devices(comm, mode, "ag", dtype):
        for base in (0, 1, 3, 700):
            def block(r: int, base: int = base) -> np.ndarray[Any, Any]:
                return crafted(r, max(base - r, 0) * 2, dtype, mt.Sum).reshape(-1, 2)

            y = comm.allgather(to_device(block(comm.rank)), algorithm="ipc")
            assert_equal_all_ranks(comm, host(y),
                                   np.concatenate([block(r) for r in range(comm.size)]),
                                   f"ipc allgather base={base}")


@pytest.mark.mpi(min_size=2)
def test_auto_takes_ipc_on_one_node(ipc_comm: mt.Communicator, mode: str) -> None:
    """On one node, with buffers the device can share, ``auto`` runs ``ipc`` for the
    three collectives (and maps each peer buffer once)."""
    c = ipc_comm
    with devices(c, mode, "auto") as be:
        x = to_device(crafted(c.rank, 5000, "float32", mt.Sum))
        before = mappings(be)
        c.allreduce(x)
        d = c.dispatcher
        layout = d.links.layout(be)
        assert layout is not None and layout.ipc and not layout.nccl, layout
        for collective in ("allreduce", "reduce_scatter", "allgather"):
            assert d.algorithm(collective, None, 20000, be, np.dtype("float32")) == "ipc"
        # src and out of every peer mapped once (they share one fake allocation: once)
        opened = mappings(be)[0] - before[0]
        assert_all_ranks(c, (c.size - 1 <= opened <= 2 * (c.size - 1)) if maps(c, mode)
                         else opened == 0, f"{opened} handles mapped in mode {mode}")


@pytest.mark.mpi(min_size=2)
def test_mappings_are_cached(ipc_comm: mt.Communicator, mode: str) -> None:
    """Calls on the same buffers map nothing new: a peer's allocation is opened once."""
    c = ipc_comm
    with devices(c, mode, "cache") as be:
        x = to_device(crafted(c.rank, 3000, "float32", mt.Sum))
        out = be.empty(3000, np.float32)
        c.allreduce(x, out=out, algorithm="ipc")
        first = mappings(be)
        for _ in range(5):
            c.allreduce(x, out=out, algorithm="ipc")
            assert_equal_all_ranks(c, host(out), reference(c.size, 3000, "float32", mt.Sum),
                                   "repeated ipc allreduce")
        assert_all_ranks(c, mappings(be) == first, f"{first} then {mappings(be)}")


@pytest.mark.mpi(min_size=2)
def test_a_reused_address_gets_a_new_mapping(ipc_comm: mt.Communicator, mode: str) -> None:
    """A peer frees an allocation and gets a new one at the same address: its new handle
    is mapped and the old mapping, which still shows the freed memory, is closed. (A
    cache keyed by address alone would read the old bytes.)"""
    c = ipc_comm
    big = 300_000  # its own fake allocation (above a quarter of ALLOCATION_BYTES)
    bases: set[int] = set()
    with devices(c, mode, "reuse") as be:
        for step in range(3):
            x = to_device(crafted(c.rank + step, big, "float32", mt.Sum))
            c.allreduce_(x, algorithm="ipc")
            expected = sum(crafted(r + step, big, "float32", mt.Sum) for r in range(c.size))
            assert_equal_all_ranks(c, host(x), expected, f"ipc allreduce_ step {step}")
            bases.add(be.fake.export(x).base)
            del x
            gc.collect()  # the allocation goes: its address is the next one's
            c.barrier()
        assert len(bases) == 1
        opened, closed = mappings(be)
        peers = c.size - 1 if maps(c, mode) else 0
        assert_all_ranks(c, (opened, closed) == (3 * peers, 2 * peers),
                         f"opened {opened}, closed {closed} in mode {mode}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("private", ["one rank", "every rank"])
def test_memory_that_cannot_be_shared_falls_back(ipc_comm: mt.Communicator, mode: str,
                                                  private: str) -> None:
    """Buffers outside the device's shareable memory (a stream-ordered pool's, another
    library's) on some rank: every rank runs the fallback algorithm instead, and the
    results are right."""
    c = ipc_comm
    with devices(c, mode, "private", private) as be:
        values = crafted(c.rank, 2001, "float32", mt.Sum)
        unshared = private == "every rank" or c.rank == c.size - 1
        x = np.array(values).view(FakeDeviceArray) if unshared else to_device(values)
        before = mappings(be)
        y = c.allreduce(x, algorithm="ipc")
        assert_equal_all_ranks(c, host(y), reference(c.size, 2001, "float32", mt.Sum),
                               f"ipc allreduce, unshareable memory on {private}")
        rs = c.reduce_scatter(x, algorithm="ipc")
        full = reference(c.size, 2001, "float32", mt.Sum)
        assert_equal_all_ranks(c, host(rs), np.array_split(full, c.size)[c.rank],
                               "ipc reduce_scatter fallback")
        ag = c.allgather(x, algorithm="ipc")
        assert_equal_all_ranks(c, host(ag), np.concatenate(
            [crafted(r, 2001, "float32", mt.Sum) for r in range(c.size)]), "ipc allgather")
        assert_all_ranks(c, mappings(be) == before or not unshared,
                         f"a rank mapped handles in a fallen-back call: {mappings(be)}")


@pytest.mark.mpi(min_size=2)
def test_without_the_link_ipc_is_refused(ipc_comm: mt.Communicator) -> None:
    """``MPITRAIN_DEVICE_LINKS=none``: ``auto`` runs no ipc, and asking for it raises on
    every rank, saying why."""
    c = ipc_comm
    c.configure(device_links="none")
    with fake_backend(seed(c, "none")) as be:
        x = to_device(crafted(c.rank, 100, "float32", mt.Sum))
        y = c.allreduce(x)
        assert_equal_all_ranks(c, host(y), reference(c.size, 100, "float32", mt.Sum), "auto")
        assert c.dispatcher.algorithm("allreduce", None, 400, be, np.dtype("float32")) != "ipc"
        with pytest.raises(mt.ArgumentError, match="ipc allreduce cannot run here"):
            c.allreduce(x, algorithm="ipc")


def test_a_process_cannot_open_its_own_handle() -> None:
    """As with CUDA IPC: the fake refuses to map a handle of its own process."""
    with fake_backend(1) as be:
        x = to_device(np.arange(10, dtype=np.float32))
        export = be.fake.export(x[3:])
        assert export is not None and export.offset == 12
        with pytest.raises(RuntimeError, match="its own"):
            be.fake.open(export.handle)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("failing", ["one rank", "every rank"])
def test_a_rank_that_cannot_map_makes_every_rank_raise(ipc_comm: mt.Communicator, mode: str,
                                                       failing: str) -> None:
    """A rank whose mapping fails still meets the others at the barrier: every rank
    raises MpitrainError naming the collective (none hangs), and the communicator goes
    on working."""
    c = ipc_comm
    with devices(c, mode, "fail", failing) as be:
        x = to_device(crafted(c.rank, 1000, "float32", mt.Sum))
        first_mapper = 0
        fails = maps(c, mode) and (failing == "every rank" or c.rank == first_mapper)

        def refuse(handle: bytes) -> Any:
            raise RuntimeError("fake cudaIpcOpenMemHandle: out of resources")

        if fails:
            be.fake.open = refuse  # type: ignore[method-assign]
        with pytest.raises(mt.MpitrainError, match="the ipc allreduce failed"):
            c.allreduce(x, algorithm="ipc")
        if fails:
            del be.fake.open  # the class's own again
        y = c.allreduce(x, algorithm="ipc")
        assert_equal_all_ranks(c, host(y), reference(c.size, 1000, "float32", mt.Sum),
                               "an ipc allreduce after a failed one")
