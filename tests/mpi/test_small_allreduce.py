"""The small-allreduce fast path (mpitrain.dispatch.fastpath): same results, same checks.

Calls with default arguments on small numpy arrays take a plan cached per (dtype,
shape, op); these tests make sure they do, that the plan follows changes of dtype,
shape, op and configuration, that its results match numpy for every dtype and op, and
that ranks that disagree still raise MismatchError on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import (
    DTYPES,
    assert_equal_all_ranks,
    crafted,
    expect_last_rank_mismatch,
    fast_plan,
    ops_for,
    reference,
)
from mpi4py import MPI

import mpitrain as mt
from mpitrain.dispatch.dispatcher import SLOT_BYTES
from mpitrain.dispatch.fastpath import SmallAllreduce
from mpitrain.dtypes import BFLOAT16

CASES = [(d, o) for d in DTYPES for o in ops_for(d)]


def fast(comm: mt.Communicator, x: np.ndarray[Any, Any], op: Any = mt.Sum) -> SmallAllreduce:
    """The fast-path plan of ``x`` with ``op``; fails the test if there is none."""
    return fast_plan(comm, comm.dispatcher.small_allreduce(x, op), x)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_every_dtype_and_op_matches_numpy(comm: mt.Communicator, dtype: str,
                                          op: mt.ReduceOp) -> None:
    n, r = comm.size, comm.rank
    for count in sorted({0, 1, max(n - 1, 0), 1001}):
        expected = reference(n, count, dtype, op)
        x = crafted(r, count, dtype, op)
        before = x.copy()
        fast(comm, x, op)
        assert_equal_all_ranks(comm, comm.allreduce(x, op=op), expected, f"allreduce n={count}")
        assert_equal_all_ranks(comm, x, before, "allreduce must not modify its input")
        assert_equal_all_ranks(comm, comm.allreduce(x, op=op.value), expected, "op by name")
        out = np.full_like(x, 7)
        assert comm.allreduce(x, op=op, out=out) is out
        assert_equal_all_ranks(comm, out, expected, f"allreduce out= n={count}")
        z = crafted(r, count, dtype, op)
        assert comm.allreduce_(z, op=op) is z
        assert_equal_all_ranks(comm, z, expected, f"allreduce_ n={count}")


HALVES = ["float16"] + (["bfloat16"] if BFLOAT16 is not None else [])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("op", [mt.Sum, mt.Average, mt.Product, mt.Max],
                         ids=lambda o: o.value)
def test_16_bit_floats_round_as_numpy(comm: mt.Communicator, dtype: str,
                                      op: mt.ReduceOp) -> None:
    """Values that do not reduce exactly: the fast path's compiled 16-bit reduction
    (hostcopy.reduce16) rounds every step as numpy's ufunc in rank order, bit for bit."""
    n = comm.size
    inputs = [np.random.default_rng(q).standard_normal(1001).astype(dtype) for q in range(n)]
    ufunc = {mt.Sum: np.add, mt.Average: np.add, mt.Product: np.multiply,
             mt.Max: np.maximum}[op]
    expected = inputs[0]
    for other in inputs[1:]:
        expected = ufunc(expected, other)
    if op is mt.Average:
        expected = np.multiply(expected, 1.0 / n).astype(dtype)
    x = inputs[comm.rank]
    fast(comm, x, op)
    got = comm.allreduce(x, op=op)
    assert_equal_all_ranks(comm, got.view(np.uint16), expected.view(np.uint16),
                           f"{dtype} {op.value}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(), (3, 4), (2, 1, 5)])
def test_shapes_and_strides(comm: mt.Communicator, shape: tuple[int, ...]) -> None:
    n, r = comm.size, comm.rank
    x = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + r
    expected = np.arange(x.size, dtype=np.float64).reshape(shape) * n + n * (n - 1) / 2
    fast(comm, x)
    y = comm.allreduce(x)
    assert isinstance(y, np.ndarray) and y.shape == shape
    assert_equal_all_ranks(comm, y, expected, f"shape {shape}")
    avg = comm.allreduce(x, op=mt.Average)
    assert_equal_all_ranks(comm, avg, expected / n, f"average {shape}")
    # a strided view, in place: the result lands in the caller's view
    base = np.zeros((6, 4), np.int32)
    view = base[::2, 1:3]
    view[...] = r + 1
    assert comm.allreduce_(view) is view
    assert_equal_all_ranks(comm, base[::2, 1:3], np.full((3, 2), n * (n + 1) // 2, np.int32),
                           "strided in place")
    assert_equal_all_ranks(comm, base[1::2], np.zeros((3, 4), np.int32), "rows not in the view")


@pytest.mark.mpi(min_size=1)
def test_plans_follow_dtype_shape_op_and_configuration(comm: mt.Communicator,
                                                       configure: Callable[..., Any]) -> None:
    d = comm.dispatcher
    a = np.ones(8, np.float32)
    plan = fast(comm, a)
    assert d.small_allreduce(a, mt.Sum) is plan  # cached
    assert d.small_allreduce(np.ones(9, np.float32), mt.Sum) is not plan
    assert d.small_allreduce(np.ones(8, np.float64), mt.Sum) is not plan
    assert d.small_allreduce(np.ones((2, 4), np.float32), mt.Sum) is not plan
    assert d.small_allreduce(a, mt.Max) is not plan
    auto = d.small_allreduce(a, mt.Sum, "auto")  # algorithm="auto": a plan of its own
    assert auto is not None and auto is not plan and auto.sig == plan.sig
    assert d.small_allreduce(a, mt.Sum, "auto") is auto
    assert_equal_all_ranks(comm, comm.allreduce(a, algorithm="auto"), a * comm.size, "auto")
    if comm.size > 1:
        assert plan.sig is not None
        assert d.small_allreduce(a, mt.Sum, "ring") is None  # asked for: general path
        saved = configure(check=False)
        unchecked = fast(comm, a)
        assert unchecked is not plan and unchecked.sig is None
        assert_equal_all_ranks(comm, comm.allreduce(a), a * comm.size, "unchecked")
        configure(algorithm="ring")  # not the shm algorithm: general path
        assert d.small_allreduce(a, mt.Sum) is None
        assert_equal_all_ranks(comm, comm.allreduce(a), a * comm.size, "ring")
        configure(algorithm="auto", segment_bytes=16)  # 32 bytes do not fit a 16-byte slot
        assert d.small_allreduce(a, mt.Sum) is None
        assert_equal_all_ranks(comm, comm.allreduce(a), a * comm.size, "segmented")
        configure(saved)
        again = fast(comm, a)
        assert again is not plan and again.sig == plan.sig  # planned again, same checks
    big = np.ones(SLOT_BYTES // 4 + 1, np.float32)  # over a slot
    assert (d.small_allreduce(big, mt.Sum) is None) == (comm.size > 1)
    assert d.small_allreduce(a, mt.Adasum) is None
    assert_equal_all_ranks(comm, comm.allreduce(big), big * comm.size, "over a slot")


@pytest.mark.mpi(min_size=1)
def test_counted_like_every_collective(comm: mt.Communicator) -> None:
    """The stall inspector and the exit guard read the transport's count and name."""
    t = comm.dispatcher.transport
    x = np.ones(4, np.float32)
    fast(comm, x)
    seq = t.seq
    comm.allreduce(x)
    comm.allreduce_(x)
    comm.barrier()
    grew = 3 if comm.size > 1 else 0
    assert t.seq == seq + grew and (comm.size == 1 or t.current == "barrier")


@pytest.mark.mpi(min_size=1)
def test_bad_arguments_take_the_general_path(comm: mt.Communicator) -> None:
    x = np.ones(4, np.float32)
    with pytest.raises(mt.ArgumentError, match="read-only"):
        ro = np.ones(4, np.float32)
        ro.flags.writeable = False
        comm.allreduce_(ro)
    with pytest.raises(mt.ArgumentError, match="out= must be a float32"):
        comm.allreduce(x, out=np.empty(5, np.float32))
    with pytest.raises(mt.ArgumentError, match="op"):
        comm.allreduce(x, op="median")
    with pytest.raises(mt.DtypeError):
        comm.allreduce(np.ones(4, bool))
    with pytest.raises(mt.ArgumentError, match="nope"):
        comm.allreduce(x, algorithm="nope")
    assert_equal_all_ranks(comm, comm.allreduce(x), x * comm.size, "after bad arguments")


MISMATCHES: dict[str, tuple[Callable[[mt.Communicator, bool], Any], str]] = {
    "dtype": (lambda c, odd: c.allreduce(np.ones(4, np.float64 if odd else np.float32)),
              r"rank {last} sent float64\[4\], rank 0 sent float32\[4\]"),
    "count": (lambda c, odd: c.allreduce(np.ones(4 + odd, np.float32)),
              r"rank {last} sent float32\[5\], rank 0 sent float32\[4\]"),
    "op": (lambda c, odd: c.allreduce_(np.ones(4), op=mt.Min if odd else mt.Sum),
           r"rank {last} sent op min, rank 0 sent op sum"),
    "name (general path)": (lambda c, odd: c.allreduce(np.ones(4), name="w" if odd else None),
                            r"rank {last} sent name 'w', rank 0 sent name none"),
    "algorithm": (lambda c, odd: c.allreduce(np.ones(4), algorithm="ring" if odd else "auto"),
                  r"rank {last} sent algorithm ring, rank 0 sent algorithm shm"),
    "barrier": (lambda c, odd: c.barrier() if odd else c.allreduce(np.ones(4)),
                r"rank {last} called barrier, rank 0 called allreduce"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_raises_on_every_rank(comm: mt.Communicator, case: str) -> None:
    call, pattern = MISMATCHES[case]
    expect_last_rank_mismatch(comm, call, pattern.format(last=comm.size - 1))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("in_step", [False, True], ids=["free", "in-step"])
def test_the_latency_benchmark_checks_its_results(comm: mt.Communicator,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  in_step: bool) -> None:
    """Every variant and size prints its line with no wrong element; with ``--in-step``
    the ranks meet at a barrier before every block (and only then)."""
    from benchmarks import latency

    met: list[tuple[bool, int]] = []  # per group: meets at MPI barriers, and how often
    real = latency.interleaved

    def watched(cases: Any, blocks: int, iters: int, meet: Any) -> Any:
        count = [0]

        def counted() -> None:
            count[0] += 1
            meet()

        result = real(cases, blocks, iters, counted)
        met.append((meet == MPI.COMM_WORLD.Barrier, count[0] // len(cases)))
        return result

    monkeypatch.setattr(latency, "interleaved", watched)
    flags = ["--in-step"] if in_step else []
    assert latency.main(["--sizes", "4,64", "--blocks", "2", "--iters", "3", *flags]) == 0
    assert met == [(in_step, 2)] * 3  # both sizes, the barriers: before each of 2 blocks
    printed = capsys.readouterr().out
    if comm.rank == 0:
        assert ("the ranks meeting before each" in printed) == in_step
        lines = [line for line in printed.splitlines() if not line.startswith("#")]
        assert [line.split(" us ")[0].rsplit(None, 1)[0] for line in lines] == [
            f"{impl} {n} B" for n in (4, 64) for impl in
            ("mpitrain allreduce", "mpitrain allreduce_", "mpitrain allreduce_async",
             "MPI Allreduce")] + [
            "mpitrain barrier", "MPI Barrier"]
        assert all(line.endswith("#wrong 0") for line in lines), printed
        assert "# Out of bounds values : 0 OK" in printed


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("method", ["allreduce", "allreduce_", "allreduce_async"])
def test_the_latency_benchmark_fails_on_a_wrong_sum(comm: mt.Communicator,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str],
                                                    method: str) -> None:
    """A result off by one in one element, once per block on the last rank: the
    variant counts it and the run exits with 1 on every rank."""
    from benchmarks import latency

    real = getattr(mt.Communicator, method)
    calls = [0]

    def off_by_one(self: mt.Communicator, x: Any, *args: Any, **kwargs: Any) -> Any:
        y = real(self, x, *args, **kwargs)
        calls[0] += 1
        if self.rank == self.size - 1 and calls[0] % 3 == 0:
            (y.wait() if method == "allreduce_async" else y)[-1] += 1  # (a handle's result)
        return y

    monkeypatch.setattr(mt.Communicator, method, off_by_one)
    assert latency.main(["--sizes", "64", "--blocks", "2", "--iters", "3"]) == 1
    printed = capsys.readouterr().out
    if comm.rank == 0:
        wrong = {line.split(" us ")[0].rsplit(None, 1)[0]: line.rsplit(None, 1)[-1]
                 for line in printed.splitlines() if "#wrong" in line}
        assert wrong[f"mpitrain {method} 64 B"] == "2", printed  # one per block
        assert {v for k, v in wrong.items() if k != f"mpitrain {method} 64 B"} == {"0"}
        assert "FAILED" in printed


def _hvd_allreduce() -> tuple[Any, str, Callable[[Any, Any], None]]:
    """What ``--hvd`` times: the module and name of the call, and how to spoil a result
    of it (the returned tensor)."""
    import mpitrain.torch as hvd

    def spoil(result: Any, tensor: Any) -> None:
        result[-1] += 1
    return hvd, "allreduce", spoil


def _dist_all_reduce() -> tuple[Any, str, Callable[[Any, Any], None]]:
    """What ``--dist`` times: torch.distributed's in-place all_reduce."""
    import torch.distributed as dist

    def spoil(result: Any, tensor: Any) -> None:
        tensor[-1] += 1
    return dist, "all_reduce", spoil


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("flag", "row", "timed"), [
    ("--hvd", "mpitrain.torch allreduce", _hvd_allreduce),
    ("--dist", "torch.distributed all_reduce", _dist_all_reduce)], ids=["hvd", "dist"])
def test_the_latency_benchmark_times_and_checks_the_torch_adapters(
        comm: mt.Communicator, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, flag: str, row: str,
        timed: Callable[[], tuple[Any, str, Callable[[Any, Any], None]]]) -> None:
    """``--hvd`` adds mpitrain.torch's ``hvd.allreduce``, ``--dist``
    ``torch.distributed.all_reduce`` over the mpitrain backend, per size, before the
    native call, checked like the others: right sums give ``#wrong 0``; one element off
    by one on the last rank, once per block, is counted and fails the run on every
    rank."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from benchmarks import latency

    module, name, spoil = timed()
    made_here = not dist.is_initialized()  # --dist makes the default group if none
    try:
        assert latency.main(["--sizes", "4,64", "--blocks", "2", "--iters", "3", flag]) == 0
        printed = capsys.readouterr().out
        if comm.rank == 0:
            names = [line.split(" us ")[0].rsplit(None, 1)[0] for line in printed.splitlines()
                     if "#wrong" in line]
            assert names[:5] == ["mpitrain allreduce 4 B", "mpitrain allreduce_ 4 B",
                                 "mpitrain allreduce_async 4 B", f"{row} 4 B",
                                 "MPI Allreduce 4 B"], printed
            assert f"{row} 64 B" in names
            assert all(line.endswith("#wrong 0") for line in printed.splitlines()
                       if "#wrong" in line), printed

        real = getattr(module, name)
        calls = [0]

        def off_by_one(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            result = real(tensor, *args, **kwargs)
            calls[0] += 1
            if comm.rank == comm.size - 1 and calls[0] % 3 == 0:
                spoil(result, tensor)
            return result

        monkeypatch.setattr(module, name, off_by_one)
        assert latency.main(["--sizes", "64", "--blocks", "2", "--iters", "3", flag]) == 1
        printed = capsys.readouterr().out
        if comm.rank == 0:
            wrong = {line.split(" us ")[0].rsplit(None, 1)[0]: line.rsplit(None, 1)[-1]
                     for line in printed.splitlines() if "#wrong" in line}
            assert wrong[f"{row} 64 B"] == "2", printed  # one per block
            assert "FAILED" in printed
    finally:
        if made_here and dist.is_initialized():
            dist.destroy_process_group()
