"""The device links' verdicts (:class:`mpitrain.comm.links.Layout`), what mpitrain asks of
NCCL (:mod:`mpitrain.comm.nccl`), and the fake NCCL of ``tests/fake_nccl.py`` on one
process (its communicators over ``MPI.COMM_SELF``): that it refuses what NCCL refuses,
defers grouped calls to ``groupEnd`` and runs its work late, on the stream.
"""

from __future__ import annotations

import gc
from typing import Any, Iterator

import numpy as np
import pytest
from fake_device import FakeBackend, fake_backend, to_device
from fake_nccl import (
    DTYPES,
    INVALID_ARGUMENT,
    INVALID_USAGE,
    UNHANDLED_CUDA_ERROR,
    FakeNccl,
    NcclError,
    fake_nccl,
)
from mpi4py import MPI

from mpitrain.comm import nccl
from mpitrain.comm.links import Layout
from mpitrain.comm.nccl import NcclLink, pointer, reduces
from mpitrain.comm.transport import Transport
from mpitrain.dtypes import BFLOAT16, SUPPORTED_DTYPES
from mpitrain.ops import ReduceOp

NCCL_DTYPES = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "bfloat16"}
"""What NCCL reduces (no int16, uint16, complex or bool)."""
NCCL_OPS = {ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX}


# -- Layout ------------------------------------------------------------------------------
def test_layout_of_own_devices() -> None:
    layout = Layout(("gpu:0", "gpu:1", "gpu:2"), ipc=True, nccl=True, shared=False)
    assert layout.runnable("ipc") and layout.runnable("nccl")
    assert layout.preferred("ipc") and layout.preferred("nccl")
    assert layout.describe() == "device links ipc+nccl (3 ranks on 3 devices)"


def test_layout_of_a_shared_device() -> None:
    """NCCL between ranks of one GPU runs when named, but auto never takes it."""
    layout = Layout(("gpu:0", "gpu:0"), ipc=True, nccl=True, shared=True)
    assert layout.runnable("nccl") and not layout.preferred("nccl")
    assert layout.runnable("ipc") and layout.preferred("ipc")
    assert layout.describe() == "device links ipc+nccl (2 ranks on one device)"


def test_layout_without_links_says_why() -> None:
    why = "ipc: ranks on several nodes or shared memory off; nccl: cupy.cuda.nccl missing"
    layout = Layout(("gpu:0", "gpu:0", "gpu:1"), ipc=False, nccl=False, shared=True, why=why)
    for link in ("ipc", "nccl"):
        assert not layout.runnable(link) and not layout.preferred(link)
    assert layout.describe() == f"device links none (3 ranks on 2 devices; {why})"
    only_nccl = Layout(("a", "b"), ipc=False, nccl=True, shared=False, why="ipc: no P2P")
    assert only_nccl.describe() == "device links nccl (2 ranks on 2 devices; ipc: no P2P)"
    assert only_nccl.preferred("nccl") and not only_nccl.preferred("ipc")


# -- what mpitrain asks of NCCL ----------------------------------------------------------
@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    """A fake GPU for the test."""
    with fake_backend(seed=11) as be:
        yield be


@pytest.fixture
def fake(backend: FakeBackend) -> Iterator[FakeNccl]:
    """The fake NCCL, installed as ``cupy.cuda.nccl`` for the test."""
    with fake_nccl(backend) as module:
        yield module


def test_without_nccl_nothing_reduces() -> None:
    """Here CuPy is missing (or on a GPU machine, present): ``reduces`` follows module()."""
    nccl.nccl_version.cache_clear()
    present = nccl.module() is not None
    assert (nccl.nccl_version() is not None) == present
    assert reduces(np.dtype(np.float32), ReduceOp.SUM) == present


def test_install_and_restore(backend: FakeBackend) -> None:
    before = nccl.nccl_version()
    with fake_nccl(backend, version=21903) as fake:
        assert nccl.module() is fake
        assert nccl.nccl_version() == 21903
    assert nccl.nccl_version() == before
    assert nccl.module() is not fake


@pytest.mark.parametrize("dtype", [str(d) for d in SUPPORTED_DTYPES] + ["bool"])
def test_reduces_what_nccl_has(fake: FakeNccl, dtype: str) -> None:
    for op in ReduceOp:
        want = dtype in NCCL_DTYPES and op in NCCL_OPS
        assert reduces(np.dtype(dtype), op) == want, f"reduces({dtype}, {op})"


@pytest.mark.skipif(BFLOAT16 is None, reason="needs ml_dtypes")
def test_no_bfloat16_before_nccl_2_10(backend: FakeBackend) -> None:
    """CuPy names NCCL_BFLOAT16 whatever NCCL it loads; NCCL 2.8 refuses it."""
    assert BFLOAT16 is not None
    with fake_nccl(backend, version=20804) as fake:
        assert hasattr(fake, "NCCL_BFLOAT16")
        assert not reduces(BFLOAT16, ReduceOp.SUM)
        assert reduces(np.dtype(np.float16), ReduceOp.SUM)
    with fake_nccl(backend, version=21003):
        assert reduces(BFLOAT16, ReduceOp.SUM)


@pytest.fixture
def link(backend: FakeBackend, fake: FakeNccl) -> Iterator[NcclLink]:
    """An NCCL link over ``MPI.COMM_SELF`` on the fake device."""
    transport = Transport(MPI.COMM_SELF)
    link = NcclLink(transport, backend.fake)
    yield link
    link.free()
    transport.free()


def test_dtype_and_op_numbers(link: NcclLink, fake: FakeNccl) -> None:
    """Each dtype NCCL reduces maps to the NCCL type of its own width and kind."""
    for name in NCCL_DTYPES:
        dt = np.dtype(name)
        assert DTYPES[link.dtype(dt)] == dt, f"{name} -> {link.dtype(dt)}"
    assert [link.op(o) for o in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN)] \
        == [fake.NCCL_SUM, fake.NCCL_PROD, fake.NCCL_MAX, fake.NCCL_MIN] == [0, 1, 2, 3]


def test_link_makes_one_communicator(link: NcclLink, fake: FakeNccl) -> None:
    comm = link.communicator()
    assert link.communicator() is comm
    assert fake.unique_ids == 1 and fake.communicators == [comm]
    assert comm.size() == 1 and comm.rank_id() == 0
    link.free()
    assert fake.destroyed == 1
    with pytest.raises(NcclError, match=r"NCCL_ERROR_INVALID_ARGUMENT.*destroyed"):
        comm.rank_id()


# -- the fake, as NCCL ---------------------------------------------------------------------
def test_work_runs_late_on_the_stream(backend: FakeBackend, link: NcclLink) -> None:
    comm, device = link.communicator(), backend.fake
    x = to_device(np.arange(10, dtype=np.float32))
    out = backend.empty(10, np.float32)
    stream = device.new_stream()
    comm.allReduce(pointer(x), pointer(out), 10, link.dtype(x.dtype), link.op(ReduceOp.SUM),
                   stream)
    assert len(stream.queue) == 1 and not device.default.queue
    np.copyto(x.view(np.ndarray), 7)  # written before the "kernel" runs: it reads this
    stream.synchronize()
    assert (out.view(np.ndarray) == 7).all()


def test_group_defers_calls_to_group_end(backend: FakeBackend, link: NcclLink,
                                         fake: FakeNccl) -> None:
    comm, stream = link.communicator(), backend.fake.default
    x = to_device(np.arange(6, dtype=np.int32))
    out = backend.empty(6, np.int32)
    fake.groupStart()
    fake.groupStart()  # nested: the outermost groupEnd launches
    comm.reduce(pointer(x[:3]), pointer(out[:3]), 3, fake.NCCL_INT32, fake.NCCL_SUM, 0, stream)
    comm.broadcast(pointer(x[3:]), pointer(out[3:]), 3, fake.NCCL_INT32, 0, stream)
    fake.groupEnd()
    assert not stream.queue and fake.launches == [], "a grouped call ran before groupEnd"
    fake.groupEnd()
    assert len(stream.queue) == 1 and fake.groups == 1
    assert fake.launches == [("reduce", 3), ("broadcast", 3)]
    stream.synchronize()
    assert (out.view(np.ndarray) == np.arange(6)).all()
    with pytest.raises(NcclError, match="NCCL_ERROR_INVALID_USAGE"):
        fake.groupEnd()


def test_a_failed_call_fails_its_group(backend: FakeBackend, link: NcclLink,
                                       fake: FakeNccl) -> None:
    comm, stream = link.communicator(), backend.fake.default
    x = to_device(np.arange(4, dtype=np.float64))
    fake.groupStart()
    comm.allReduce(pointer(x), pointer(x), 4, fake.NCCL_FLOAT64, fake.NCCL_SUM, stream)
    with pytest.raises(NcclError) as bad:
        comm.broadcast(pointer(x), pointer(x), 4, fake.NCCL_FLOAT64, 3, stream)  # no rank 3
    assert bad.value.status == INVALID_ARGUMENT
    with pytest.raises(NcclError, match="a call of the group failed") as end:
        fake.groupEnd()
    assert end.value.status == INVALID_ARGUMENT
    assert not stream.queue and fake.launches == []


def test_refuses_what_nccl_refuses(backend: FakeBackend, link: NcclLink,
                                   fake: FakeNccl) -> None:
    comm, device = link.communicator(), backend.fake
    stream = device.default
    x = to_device(np.arange(64, dtype=np.float32))
    p, f32, add = pointer(x), fake.NCCL_FLOAT32, fake.NCCL_SUM
    with pytest.raises(OverflowError):
        comm.allReduce(p, p, -1, f32, add, stream)
    with pytest.raises(TypeError):
        comm.allReduce(p, p, 2.0, f32, add, stream)
    bad: list[tuple[str, Any]] = [
        ("datatype 10 (no such NCCL type)", lambda: comm.allReduce(p, p, 4, 10, add, stream)),
        ("op 5", lambda: comm.allReduce(p, p, 4, f32, 5, stream)),
        ("null pointer", lambda: comm.allReduce(0, p, 4, f32, add, stream)),
        ("host memory", lambda: comm.allReduce(np.zeros(4, np.float32).ctypes.data, p, 4, f32,
                                               add, stream)),
        ("past the allocation", lambda: comm.allGather(p, p, 1 << 30, f32, stream)),
        ("overlap", lambda: comm.allReduce(p, p + 4, 8, f32, add, stream)),
        ("allGather not in place", lambda: comm.allGather(p + 4, p, 2, f32, stream)),
        ("root 1 of 1", lambda: comm.reduce(p, p, 4, f32, add, 1, stream)),
        ("another device's stream", lambda: comm.allReduce(
            p, p, 4, f32, add, fake_device_stream())),
        ("a stream handle", lambda: comm.allReduce(p, p, 4, f32, add, 12345)),
    ]
    for what, call in bad:
        with pytest.raises(NcclError) as error:
            call()
        assert error.value.status == INVALID_ARGUMENT, what
        assert str(error.value).startswith("NCCL_ERROR_INVALID_ARGUMENT: invalid argument")
    comm.allGather(p + 4 * 0, p, 4, f32, stream)  # rank 0's block: in place
    comm.reduceScatter(p, p, 4, f32, add, stream)
    comm.allReduce(p, p, 0, f32, add, stream)  # count 0: nothing runs
    assert [k for k, _ in fake.launches] == ["allGather", "reduceScatter"]
    stream.synchronize()
    assert not stream.queue


def fake_device_stream() -> Any:
    """A stream of another fake device."""
    from fake_device import FakeDevice

    return FakeDevice(seed=1).new_stream()


def test_bfloat16_refused_before_nccl_2_10(backend: FakeBackend) -> None:
    transport = Transport(MPI.COMM_SELF)
    try:
        with fake_nccl(backend, version=20804) as fake:
            link = NcclLink(transport, backend.fake)
            comm = link.communicator()
            x = backend.empty(4, np.uint16)
            with pytest.raises(NcclError, match="invalid datatype 9"):
                comm.allReduce(pointer(x), pointer(x), 4, fake.NCCL_BFLOAT16, fake.NCCL_SUM,
                               backend.fake.default)
            with pytest.raises(NcclError, match="invalid reduction operation 4"):
                comm.allReduce(pointer(x), pointer(x), 4, fake.NCCL_FLOAT16, fake.NCCL_AVG,
                               backend.fake.default)
            link.free()
    finally:
        transport.free()


def test_freed_buffer_is_caught(backend: FakeBackend, link: NcclLink, fake: FakeNccl) -> None:
    """A buffer freed before the kernel that uses it runs (here: its own allocation)."""
    comm, stream = link.communicator(), backend.fake.default
    big = backend.empty(1 << 17, np.float32)  # 512 KiB: an allocation of its own
    keep = backend.empty(1 << 17, np.float32)
    comm.allReduce(pointer(big), pointer(keep), big.size, fake.NCCL_FLOAT32, fake.NCCL_MAX,
                   stream)
    del big
    gc.collect()
    with pytest.raises(NcclError, match="freed before its kernel ran") as error:
        stream.synchronize()
    assert error.value.status == UNHANDLED_CUDA_ERROR
    with pytest.raises(NcclError, match="failed earlier"):
        comm.allReduce(pointer(keep), pointer(keep), 1, fake.NCCL_FLOAT32, fake.NCCL_MAX,
                       stream)


def test_destroy_runs_the_queued_work(backend: FakeBackend, link: NcclLink,
                                      fake: FakeNccl) -> None:
    comm = link.communicator()
    x = to_device(np.arange(5, dtype=np.int64))
    out = backend.empty(5, np.int64)
    comm.allGather(pointer(x), pointer(out), 5, fake.NCCL_INT64, backend.fake.default)
    assert comm.pending == 1
    link.free()
    assert comm.pending == 0 and (out.view(np.ndarray) == np.arange(5)).all()


def test_unique_id_and_arguments(fake: FakeNccl) -> None:
    uid = fake.get_unique_id()
    assert isinstance(uid, tuple) and len(uid) == 128
    assert all(-128 <= c <= 127 for c in uid)
    assert fake.get_unique_id() != uid and fake.unique_ids == 2
    with pytest.raises(TypeError):
        fake.NcclCommunicator(1, list(uid), 0)
    with pytest.raises(NcclError) as error:
        fake.NcclCommunicator(1, uid, 1)
    assert error.value.status == INVALID_ARGUMENT
    with pytest.raises(NcclError, match="did not come from"):
        fake.NcclCommunicator(1, (0,) * 128, 0)
    comm = fake.NcclCommunicator(1, uid, 0)
    comm.destroy()
    comm.destroy()  # again: nothing
    assert fake.destroyed == 1
    assert INVALID_USAGE == 5 and INVALID_ARGUMENT == 4


@pytest.mark.skipif(BFLOAT16 is None, reason="needs ml_dtypes")
def test_pointer_of_every_dtype(backend: FakeBackend) -> None:
    """The address of a fake device array of any dtype (numpy cannot export a bfloat16
    buffer, so ``arr.data`` must not be asked)."""
    for dt in SUPPORTED_DTYPES:
        x = backend.empty(3, dt)
        assert pointer(x) == x.ctypes.data, str(dt)
        assert pointer(x[1:]) == x.ctypes.data + dt.itemsize, str(dt)


def test_nccl_init_failure_names_the_rank(link: NcclLink, fake: FakeNccl,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An NCCL communicator that cannot be made raises CommunicationError with NCCL's
    error, this rank, its device and NCCL_HOSTID (and is tried again at the next call)."""
    from mpitrain.errors import CommunicationError

    def refuse(ndev: Any, commId: Any, rank: Any) -> Any:
        raise NcclError(INVALID_USAGE, "Duplicate GPU detected")

    monkeypatch.setenv("NCCL_HOSTID", "host-7")
    with monkeypatch.context() as patch:
        patch.setattr(fake, "NcclCommunicator", refuse)
        with pytest.raises(CommunicationError, match=r"rank 0: NCCL could not make a "
                           r"communicator of 1 ranks \(this rank on device fake-gpu:0, "
                           r"NCCL_HOSTID host-7\): NCCL_ERROR_INVALID_USAGE"):
            link.communicator()
    assert link.communicator() is fake.communicators[0]
    assert fake.unique_ids == 2
