"""Every collective on GPU buffers against a numpy reference computed on the host.

Skipped without CuPy and a CUDA device. Ranks of a node share its GPUs
(``local_rank % count``). Each test runs under the staged policy, and under the
CUDA-aware one too when this MPI library is CUDA-aware. Inputs are the crafted
values of ``tests/helpers.py``: their reductions are exact in every dtype, so
results compare with ``==``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gpu import cupy, requires_gpu, use_local_device
from helpers import DTYPES, assert_all_ranks, assert_equal_all_ranks, crafted, ops_for, reference

import mpitrain as mt
from mpitrain.backends.cuda_aware import detected

pytestmark = requires_gpu

POLICIES = ["staged"] + (["cuda-aware"] if cupy is not None and detected().aware else [])
ALGORITHMS = ["auto", "ring", "mpi"]
CASES = [(d, o) for d in DTYPES for o in ops_for(d)]


def counts(size: int) -> list[int]:
    """0, 1, fewer than ranks, not divisible by 2..5, and ~1e6."""
    return sorted({0, 1, max(size - 1, 0), 1001, 1_000_003})


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest, comm: mt.Communicator,
           env: pytest.MonkeyPatch) -> int:
    """The device policy under test; returns this rank's GPU."""
    env.setenv("MPITRAIN_CUDA_AWARE", "1" if request.param == "cuda-aware" else "0")
    assert comm.cuda_policy == request.param
    return use_local_device(comm.local_rank)


def on_host(arr: Any, device: int) -> np.ndarray[Any, Any]:
    """A result's host copy, after checking it is a CuPy array on ``device``."""
    assert isinstance(arr, cupy.ndarray), f"expected a cupy array, got {type(arr)}"
    assert arr.device.id == device, f"result on GPU {arr.device.id}, input on GPU {device}"
    return np.asarray(cupy.asnumpy(arr))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_allreduce(comm: mt.Communicator, policy: int, algorithm: str, dtype: str,
                   op: mt.ReduceOp) -> None:
    for count in counts(comm.size):
        expected = reference(comm.size, count, dtype, op)
        x = cupy.asarray(crafted(comm.rank, count, dtype, op))
        y = comm.allreduce(x, op=op, algorithm=algorithm)
        assert_equal_all_ranks(comm, on_host(y, policy), expected,
                               f"allreduce {algorithm} n={count}")
        assert comm.allreduce_(x, op=op, algorithm=algorithm) is x
        assert_equal_all_ranks(comm, on_host(x, policy), expected,
                               f"allreduce_ {algorithm} n={count}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["auto", "ring", "mpi"])
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_reduce_scatter(comm: mt.Communicator, policy: int, algorithm: str, dtype: str,
                        op: mt.ReduceOp) -> None:
    for rows in sorted({1, comm.size, 2 * comm.size + 1, 250_001}):
        full = reference(comm.size, rows * 4, dtype, op).reshape(rows, 4)
        x = cupy.asarray(crafted(comm.rank, rows * 4, dtype, op)).reshape(rows, 4)
        got = comm.reduce_scatter(x, op=op, algorithm=algorithm)
        assert_equal_all_ranks(comm, on_host(got, policy),
                               np.array_split(full, comm.size)[comm.rank],
                               f"reduce_scatter {algorithm} rows={rows}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["auto", "ring", "mpi"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_and_broadcast(comm: mt.Communicator, policy: int, algorithm: str,
                                 dtype: str) -> None:
    for rows in (0, 1, 1001, 300_007):
        mine = rows + comm.rank % 2
        x = cupy.asarray(crafted(comm.rank, mine * 3, dtype, mt.Sum)).reshape(mine, 3)
        want = np.concatenate([crafted(r, (rows + r % 2) * 3, dtype, mt.Sum)
                               for r in range(comm.size)]).reshape(-1, 3)
        assert_equal_all_ranks(comm, on_host(comm.allgather(x, algorithm=algorithm), policy),
                               want, f"allgather {algorithm} rows={rows}")
    if algorithm == "ring":
        return  # broadcast has MPI's algorithm only
    root = comm.size - 1
    for count in (1, 1_000_003):
        b = cupy.asarray(crafted(comm.rank, count, dtype, mt.Sum))
        want = crafted(root, count, dtype, mt.Sum)
        assert_equal_all_ranks(comm, on_host(comm.broadcast(b, root=root, algorithm=algorithm),
                                             policy), want, "broadcast")
        comm.broadcast_(b, root=root, algorithm=algorithm)
        assert_equal_all_ranks(comm, on_host(b, policy), want, "broadcast_")


@pytest.mark.mpi(min_size=1)
def test_scaling_streams_and_pipeline(comm: mt.Communicator, policy: int,
                                      env: pytest.MonkeyPatch) -> None:
    env.setenv("MPITRAIN_SEGMENT_BYTES", "4K")
    env.setenv("MPITRAIN_STAGING_SLOTS", "2")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the input is produced by a kernel on the side stream
        x = cupy.asarray(crafted(comm.rank, 100_003, "float32", mt.Sum)) * 2
    y = comm.allreduce(x, op=mt.Average, algorithm="ring", prescale_factor=0.5,
                       postscale_factor=3.0, stream=stream)
    want = reference(comm.size, 100_003, "float32", mt.Sum) * 3.0 / comm.size
    assert_all_ranks(comm, bool(np.allclose(on_host(y, policy), want, rtol=1e-6)),
                     "scaled allreduce on a side stream")
    ints = cupy.asarray(crafted(comm.rank, 100_003, "int32", mt.Sum))
    got = comm.allreduce(ints, algorithm="ring", postscale_factor=0.25)
    want_ints = np.floor(reference(comm.size, 100_003, "int32", mt.Sum) * 0.25).astype(np.int32)
    assert_equal_all_ranks(comm, on_host(got, policy), want_ints, "integer postscale")
    square = cupy.asarray(crafted(comm.rank, 64, "float64", mt.Sum)).reshape(8, 8)
    view = square.T
    assert comm.allreduce_(view) is view
    assert_equal_all_ranks(comm, on_host(square, policy),
                           reference(comm.size, 64, "float64", mt.Sum).reshape(8, 8),
                           "allreduce_ of a transposed device view")


@pytest.mark.mpi(min_size=1)
def test_torch_cuda_tensors(comm: mt.Communicator, policy: int) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        host = crafted(comm.rank, 1001, dtype, mt.Sum)
        t = torch.tensor(host.astype(np.float32), device=f"cuda:{policy}").to(torch_dtype)
        expected = reference(comm.size, 1001, dtype, mt.Sum)
        out = comm.allreduce(t)
        assert_equal_all_ranks(comm, on_host(out, policy), expected, f"torch {dtype}")
        assert comm.allreduce_(t) is t  # written in place through the DLPack view
        back = t.float().cpu().numpy().astype(expected.dtype)
        assert_equal_all_ranks(comm, back, expected, f"torch {dtype} in place")
