"""Every collective on device buffers against a numpy reference computed on the host.

The matrix runs on two devices: a real GPU through CuPy (skipped without CuPy and a
CUDA device; ranks of a node share its GPUs, ``local_rank % count``), and the fake GPU
of ``tests/fake_device.py`` everywhere, whose streams run late and out of order and
whose sends complete only when matched (``MPI_Issend``), so that missing
synchronization and waits on a peer's receive show on a machine without a GPU (the
fake's messages are smaller: its "kernels" are numpy calls queued in Python). Each
test runs under the staged policy and the CUDA-aware one (on a real GPU only when this
MPI library is CUDA-aware; the fake's memory is host memory, which any MPI reads).
Inputs are the crafted values of ``tests/helpers.py``: their reductions are exact in
every dtype, so results compare with ``==``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import pytest
from fake_device import FakeBackend, FakeDeviceArray, fake_backend, to_device
from gpu import cupy, occupy_default_stream, use_local_device
from helpers import DTYPES, assert_all_ranks, assert_equal_all_ranks, crafted, ops_for, reference

import mpitrain as mt
from mpitrain.algorithms import ALGORITHMS as ALGORITHMS_OF
from mpitrain.backends import backend_for
from mpitrain.backends.cuda_aware import detected

LINKS = ["ipc", "nccl"]
ALGORITHMS = ["auto", "ring", "mpi", *LINKS]
CASES = [(d, o) for d in DTYPES for o in ops_for(d)]


class CupyArrays:
    """Arrays on this rank's GPU."""

    name = "cupy"
    big = 1_000_003  # elements of the largest allreduce (a 4 MiB float32 buffer)

    def __init__(self, device: int) -> None:
        self.device = device

    def put(self, host: np.ndarray[Any, Any]) -> Any:
        """A device copy of ``host``."""
        return cupy.asarray(host)

    def get(self, arr: Any) -> np.ndarray[Any, Any]:
        """A result's host copy, after checking that it is a CuPy array on our GPU."""
        assert isinstance(arr, cupy.ndarray), f"expected a cupy array, got {type(arr)}"
        assert arr.device.id == self.device, \
            f"result on GPU {arr.device.id}, input on GPU {self.device}"
        return np.asarray(cupy.asnumpy(arr))

    def side_stream(self) -> Any:
        """A stream that does not synchronize with the default one."""
        return cupy.cuda.Stream(non_blocking=True)

    def produced_on(self, stream: Any, host: np.ndarray[Any, Any], factor: float) -> Any:
        """``host * factor`` computed by a kernel queued on ``stream``."""
        with stream:
            return cupy.asarray(host) * factor


class FakeArrays:
    """Arrays on the fake GPU of ``fake_device.py``."""

    name = "fake"
    big = 40_009  # above the default segment size of small types, far above eager

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def put(self, host: np.ndarray[Any, Any]) -> Any:
        """A device copy of ``host`` (ready at once)."""
        return to_device(host)

    def get(self, arr: Any) -> np.ndarray[Any, Any]:
        """A result's contents, after checking that it is a fake device array."""
        assert isinstance(arr, FakeDeviceArray), f"expected a device array, got {type(arr)}"
        return np.asarray(arr).view(np.ndarray)

    def side_stream(self) -> Any:
        """A new fake stream."""
        return self.backend.fake.new_stream()

    def produced_on(self, stream: Any, host: np.ndarray[Any, Any], factor: float) -> Any:
        """``host * factor`` computed by "kernels" queued on ``stream`` (run late)."""
        be = self.backend
        with stream:
            out = be.empty(host.size, host.dtype)
            be.copy_into(out, host)
            be.scale(out, factor)
        return out


Arrays = Any  # CupyArrays or FakeArrays
FAKE_DIRECT_DTYPES = ("int8", "float16", "float32", "bfloat16", "int64", "complex128")
"""The dtypes of the CUDA-aware policy on the fake GPU (its transport hands buffers to MPI
as they are, the same for every dtype; the staged policy takes every dtype), to keep
make test short."""
PARAMS = [pytest.param(("fake", "staged"), id="fake-staged"),
          pytest.param(("fake", "cuda-aware"), id="fake-cuda-aware"),
          pytest.param(("cupy", "staged"), id="cupy-staged",
                       marks=pytest.mark.skipif(cupy is None, reason="no GPU here")),
          pytest.param(("cupy", "cuda-aware"), id="cupy-cuda-aware", marks=pytest.mark.skipif(
              cupy is None or not detected().aware, reason="no CUDA-aware MPI on a GPU here"))]


@pytest.fixture(params=PARAMS)
def dev(request: pytest.FixtureRequest, comm: mt.Communicator,
        configure: Callable[..., Any]) -> Iterator[Arrays]:
    """The device under test and its policy (staged or CUDA-aware)."""
    kind, policy = request.param
    dtype = getattr(request.node, "callspec", None) and request.node.callspec.params.get("dtype")
    if kind == "fake" and policy == "cuda-aware" and dtype and dtype not in FAKE_DIRECT_DTYPES:
        pytest.skip(f"the fake GPU's CUDA-aware policy runs {', '.join(FAKE_DIRECT_DTYPES)}")
    if comm.cuda_policy != policy:  # (the same on every rank) no replanning when it is
        configure(cuda_aware=policy == "cuda-aware")
    assert comm.cuda_policy == policy
    if kind == "cupy":
        yield CupyArrays(use_local_device(comm.local_rank))
        return
    with fake_backend(comm.rank * 7919 + sum(map(ord, request.node.name))) as backend:
        yield FakeArrays(backend)


def runs_here(comm: mt.Communicator, dev: Arrays, algorithm: str) -> None:
    """Skip a device-link algorithm on the fake GPU (tests/mpi/test_ipc.py and
    test_nccl.py run it there, with its fakes) and where this layout cannot run it."""
    if algorithm not in LINKS or comm.size == 1:
        return
    if dev.name == "fake":
        pytest.skip(f"{algorithm} on the fake GPU: tests/mpi/test_{algorithm}.py")
    x = dev.put(np.zeros(1, np.float32))
    line = comm.device_links(x)
    layout = comm.dispatcher.links.layout(backend_for(x))
    if layout is None or not layout.runnable(algorithm):
        pytest.skip(f"{algorithm} cannot run here: {line}")


def counts(size: int, big: int) -> list[int]:
    """0, 1, fewer than ranks, not divisible by 2..5, and ``big``."""
    return sorted({0, 1, max(size - 1, 0), 1001, big})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_allreduce(comm: mt.Communicator, dev: Arrays, algorithm: str, dtype: str,
                   op: mt.ReduceOp) -> None:
    runs_here(comm, dev, algorithm)
    for count in counts(comm.size, dev.big):
        expected = reference(comm.size, count, dtype, op)
        x = dev.put(crafted(comm.rank, count, dtype, op))
        y = comm.allreduce(x, op=op, algorithm=algorithm)
        assert_equal_all_ranks(comm, dev.get(y), expected, f"allreduce {algorithm} n={count}")
        assert comm.allreduce_(x, op=op, algorithm=algorithm) is x
        assert_equal_all_ranks(comm, dev.get(x), expected, f"allreduce_ {algorithm} n={count}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_reduce_scatter(comm: mt.Communicator, dev: Arrays, algorithm: str, dtype: str,
                        op: mt.ReduceOp) -> None:
    runs_here(comm, dev, algorithm)
    for rows in sorted({1, comm.size, 2 * comm.size + 1, dev.big // 4}):
        full = reference(comm.size, rows * 4, dtype, op).reshape(rows, 4)
        x = dev.put(crafted(comm.rank, rows * 4, dtype, op)).reshape(rows, 4)
        got = comm.reduce_scatter(x, op=op, algorithm=algorithm)
        assert_equal_all_ranks(comm, dev.get(got), np.array_split(full, comm.size)[comm.rank],
                               f"reduce_scatter {algorithm} rows={rows}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_and_broadcast(comm: mt.Communicator, dev: Arrays, algorithm: str,
                                 dtype: str) -> None:
    runs_here(comm, dev, algorithm)
    for rows in (0, 1, 1001, dev.big // 3):
        mine = rows + comm.rank % 2
        x = dev.put(crafted(comm.rank, mine * 3, dtype, mt.Sum)).reshape(mine, 3)
        want = np.concatenate([crafted(r, (rows + r % 2) * 3, dtype, mt.Sum)
                               for r in range(comm.size)]).reshape(-1, 3)
        assert_equal_all_ranks(comm, dev.get(comm.allgather(x, algorithm=algorithm)), want,
                               f"allgather {algorithm} rows={rows}")
    if algorithm not in ALGORITHMS_OF["broadcast"] and algorithm != "auto":
        return  # broadcast has MPI's, shm and nccl
    root = comm.size - 1
    for count in (1, dev.big):
        b = dev.put(crafted(comm.rank, count, dtype, mt.Sum))
        want = crafted(root, count, dtype, mt.Sum)
        assert_equal_all_ranks(comm, dev.get(comm.broadcast(b, root=root, algorithm=algorithm)),
                               want, "broadcast")
        comm.broadcast_(b, root=root, algorithm=algorithm)
        assert_equal_all_ranks(comm, dev.get(b), want, "broadcast_")


@pytest.mark.mpi(min_size=1)
def test_scaling_streams_and_pipeline(comm: mt.Communicator, dev: Arrays,
                                      configure: Callable[..., Any]) -> None:
    configure(segment_bytes="4K", staging_slots=2)
    stream = dev.side_stream()
    n = 100_003 if dev.name == "cupy" else 20_011
    x = dev.produced_on(stream, crafted(comm.rank, n, "float32", mt.Sum), 2.0)
    y = comm.allreduce(x, op=mt.Average, algorithm="ring", prescale_factor=0.5,
                       postscale_factor=3.0, stream=stream)
    want = reference(comm.size, n, "float32", mt.Sum) * 3.0 / comm.size
    assert_all_ranks(comm, bool(np.allclose(dev.get(y), want, rtol=1e-6)),
                     "scaled allreduce on a side stream")
    ints = dev.put(crafted(comm.rank, n, "int32", mt.Sum))
    got = comm.allreduce(ints, algorithm="ring", postscale_factor=0.25)
    want_ints = np.floor(reference(comm.size, n, "int32", mt.Sum) * 0.25).astype(np.int32)
    assert_equal_all_ranks(comm, dev.get(got), want_ints, "integer postscale")
    square = dev.put(crafted(comm.rank, 64, "float64", mt.Sum)).reshape(8, 8)
    view = square.T
    assert comm.allreduce_(view) is view
    assert_equal_all_ranks(comm, dev.get(square),
                           reference(comm.size, 64, "float64", mt.Sum).reshape(8, 8),
                           "allreduce_ of a transposed device view")


@pytest.mark.mpi(min_size=1)
def test_async_operations_do_not_wait_for_later_work_on_the_default_stream(
        comm: mt.Communicator, dev: Arrays) -> None:
    """Async operations finish while a kernel queued on the default stream after their
    submission still runs: an in-place allreduce of an array made on the default stream
    (a DDP bucket, an ``hvd.DistributedOptimizer`` gradient: on the engine's own
    stream), and an allreduce and an allgather made on a side stream (on that stream)."""
    if dev.name != "cupy":
        pytest.skip("on the fake GPU: tests/mpi/test_device_path.py::"
                    "test_async_operations_run_on_the_streams_the_rule_gives")
    n = 100_003
    side = dev.side_stream()
    xs = [dev.produced_on(side, crafted(comm.rank + i, n, "float32", mt.Sum), 1.0)
          for i in range(3)]
    grads = [dev.put(crafted(comm.rank + 3 + i, n, "float32", mt.Sum)) for i in range(2)]
    comm.allreduce_async(xs[0], stream=side).wait()  # plans, pinned slots, opened handles
    comm.allgather_async(xs[0], stream=side).wait()
    comm.allreduce_async_(grads[0]).wait()
    side.synchronize()
    comm.barrier()
    bucket = comm.allreduce_async_(grads[1])  # then the rest of the backward pass:
    busy = occupy_default_stream(3.0)
    bucket.wait()
    reduced = comm.allreduce_async(xs[1], stream=side).wait()
    gathered = comm.allgather_async(xs[2], stream=side).wait()
    overlapped = not busy.done
    busy.synchronize()
    assert_all_ranks(comm, overlapped, "async operations waited for the default stream's "
                     "later kernel")
    for got, i in ((grads[1], 4), (reduced, 1)):
        want = sum(crafted(r + i, n, "float32", mt.Sum) for r in range(comm.size))
        assert_equal_all_ranks(comm, dev.get(got), want, f"allreduce #{i}")
    rows = np.stack([crafted(r + 2, n, "float32", mt.Sum) for r in range(comm.size)])
    assert_equal_all_ranks(comm, dev.get(gathered).reshape(rows.shape), rows,
                           "allgather on a side stream")


@pytest.mark.mpi(min_size=1)
def test_torch_cuda_tensors(comm: mt.Communicator, dev: Arrays) -> None:
    """torch CUDA tensors in and out of place (on the fake GPU: tests/mpi/test_torch_*.py,
    through the torch_device fixture)."""
    if dev.name != "cupy":
        pytest.skip("CUDA tensors need a GPU")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        host = crafted(comm.rank, 1001, dtype, mt.Sum)
        t = torch.tensor(host.astype(np.float32), device=f"cuda:{dev.device}").to(torch_dtype)
        expected = reference(comm.size, 1001, dtype, mt.Sum)
        out = comm.allreduce(t)
        assert_equal_all_ranks(comm, dev.get(out), expected, f"torch {dtype}")
        assert comm.allreduce_(t) is t  # written in place through the DLPack view
        back = t.float().cpu().numpy().astype(expected.dtype)
        assert_equal_all_ranks(comm, back, expected, f"torch {dtype} in place")
