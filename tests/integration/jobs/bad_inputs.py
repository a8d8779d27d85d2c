"""The bad-input catalogue: misuse that must end in the documented error on every rank.

Usage: bad_inputs.py OUT_DIR

Every case runs on every rank, one after the other, in one job. A case is a function
of (context, rank, size) that calls collectives, some ranks differently from the
others; :data:`CASES` says what each rank must then see: the exception class (None:
no error) and a pattern its message must match, or a result check. After every case
the job runs one allreduce, on the same communicator if the case leaves it usable,
else on a new one, and records whether it gave the right answer. Each rank writes
``OUT_DIR/rank<r>.json``: case -> {error, message, seconds, next_ok, ok, why}.

Stalls use a communicator created with ``MPITRAIN_STALL_TIMEOUT_S=1``; the default one
keeps the defaults (no timeout), so a case that hangs there is a bug the test sees as
a job killed at its timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

STALL_TIMEOUT_S = "1"


@dataclass(frozen=True)
class Case:
    """One misuse and what every rank must see.

    Attributes:
        name: the case id.
        run: ``run(ctx, rank, size)``; may raise.
        expect: ``expect(rank, size)`` -> (exception class name or None, message regex).
        usable: the communicator stays usable (the next collective uses it).
        stall: the case runs on a communicator with a 1 s stall timeout.
        validation: the case needs cross-rank validation (MismatchError).
    """

    name: str
    run: Callable[[Any, int, int], Any]
    expect: Callable[[int, int], tuple[str | None, str]]
    usable: bool = True
    stall: bool = False
    validation: bool = False


def everywhere(error: str | None, pattern: str = "") -> Callable[[int, int], tuple[Any, str]]:
    """The same outcome on every rank."""
    return lambda rank, size: (error, pattern)


def last_differs(rank: int, size: int) -> bool:
    return rank == size - 1


def mismatch(pattern: str) -> Callable[[int, int], tuple[str, str]]:
    """MismatchError on every rank; ``{last}`` in ``pattern`` is the last rank."""
    return lambda rank, size: ("MismatchError", pattern.format(last=size - 1))


def stalled_except(idle: Callable[[int, int], bool], idle_error: str | None = None,
                   idle_pattern: str = "", pattern: str = "") -> Callable[[int, int], Any]:
    """StallError on the waiting ranks, ``idle_error`` on the ranks that did not call."""
    def expect(rank: int, size: int) -> tuple[str | None, str]:
        if idle(rank, size):
            return idle_error, idle_pattern
        return "StallError", pattern.format(last=size - 1)
    return expect


# -- the cases ------------------------------------------------------------------------
def _x(n: int = 1024, dtype: Any = np.float32) -> np.ndarray:
    return np.arange(n, dtype=dtype)


def dtype_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(dtype=np.float64 if last_differs(rank, size) else np.float32))


def count_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(1025 if last_differs(rank, size) else 1024))


def shape_mismatch(ctx: Any, rank: int, size: int) -> Any:
    x = _x()
    return ctx.comm.allreduce(x.reshape(32, 32) if last_differs(rank, size) else x)


def zero_size_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(0 if last_differs(rank, size) else 1024))


def op_mismatch(ctx: Any, rank: int, size: int) -> Any:
    mt = ctx.mt
    return ctx.comm.allreduce(_x(), op=mt.Max if last_differs(rank, size) else mt.Sum)


def scaling_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(), prescale_factor=2.0 if last_differs(rank, size) else 1.0)


def name_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(), name="bias" if last_differs(rank, size) else "weight")


def algorithm_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(), algorithm="mpi" if last_differs(rank, size) else "ring")


def root_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.broadcast(_x(), root=1 if last_differs(rank, size) else 0)


def different_collectives(ctx: Any, rank: int, size: int) -> Any:
    if last_differs(rank, size):
        return ctx.comm.broadcast(_x(), root=0)
    return ctx.comm.allreduce(_x())


def reduce_scatter_shape_mismatch(ctx: Any, rank: int, size: int) -> Any:
    rows = 13 if last_differs(rank, size) else 12
    return ctx.comm.reduce_scatter(np.ones((rows, 4), np.float32))


def allgather_dtype_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allgather(np.zeros((2, 3), np.float64 if last_differs(rank, size)
                                       else np.float32))


def allgather_trailing_mismatch(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allgather(np.zeros((2, 4 if last_differs(rank, size) else 3), np.int32))


def missing_rank(ctx: Any, rank: int, size: int) -> Any:
    if not last_differs(rank, size):
        return ctx.stall_comm().allreduce(_x(), algorithm="ring")
    return None


def missing_rank_native(ctx: Any, rank: int, size: int) -> Any:
    if not last_differs(rank, size):
        return ctx.stall_comm().allreduce(_x(8), algorithm="mpi")
    return None


def missing_rank_barrier(ctx: Any, rank: int, size: int) -> Any:
    if rank != 0:
        return ctx.stall_comm().barrier()
    return None


def call_after_stall(ctx: Any, rank: int, size: int) -> Any:
    comm = ctx.stall_comm()
    if not last_differs(rank, size):
        with contextlib.suppress(ctx.mt.StallError):
            comm.allreduce(_x())
        started = time.monotonic()
        try:
            comm.allreduce(_x())
        finally:
            ctx.after_stall_s = time.monotonic() - started
    return None


def wrong_out_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    out = np.empty(1023 if rank == 0 else 1024, np.float32)
    return ctx.stall_comm().allreduce(_x(), out=out, algorithm="ring")


def read_only_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    x = _x()
    x.flags.writeable = rank != 0
    return ctx.stall_comm().allreduce_(x, algorithm="ring")


def unknown_op_everywhere(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(), op="median")


def bool_dtype_everywhere(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(np.ones(4, bool))


def complex_max_everywhere(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(np.ones(4, np.complex64), op=ctx.mt.Max)


def bad_root_everywhere(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.broadcast(_x(), root=size)


def noncontiguous_out_everywhere(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce(_x(), out=np.empty(2048, np.float32)[::2])


def unpicklable_on_root(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.broadcast_object((lambda: None) if rank == 0 else None, root=0)


def nan_inf_propagate(ctx: Any, rank: int, size: int) -> Any:
    """NaN and +-Inf reach every rank, alike under every algorithm and op."""
    mt = ctx.mt
    x = np.arange(1.0, 7.0)
    if rank == 0:
        x[0], x[2] = np.nan, np.inf
    if rank == 1:
        x[1], x[3], x[4] = np.nan, -np.inf, np.inf
    wrong = []
    for op in (mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product):
        ref = np.stack([_nan_input(r) for r in range(size)])
        want = {mt.Sum: ref.sum(0), mt.Average: ref.sum(0) / size, mt.Min: ref.min(0),
                mt.Max: ref.max(0), mt.Product: ref.prod(0)}[op]
        for algorithm in ("ring", "mpi"):
            for dtype in (np.float64, np.float32, np.float16):
                got = ctx.comm.allreduce(x.astype(dtype), op=op, algorithm=algorithm)
                if not np.array_equal(got, want.astype(dtype), equal_nan=True):
                    wrong.append(f"{op} {algorithm} {np.dtype(dtype)}: {got} != {want}")
    if wrong:
        raise AssertionError("; ".join(wrong))
    return None


def _nan_input(rank: int) -> np.ndarray:
    x = np.arange(1.0, 7.0)
    if rank == 0:
        x[0], x[2] = np.nan, np.inf
    if rank == 1:
        x[1], x[3], x[4] = np.nan, -np.inf, np.inf
    return x


# -- async (the engine) ---------------------------------------------------------------
def _started(comm: Any) -> Any:
    """``comm`` with its engine started (every rank has made one async call)."""
    comm.allreduce_async(np.ones(2), name="start").wait()
    return comm


def async_dtype_mismatch(ctx: Any, rank: int, size: int) -> Any:
    x = _x(dtype=np.float64 if last_differs(rank, size) else np.float32)
    return ctx.comm.allreduce_async(x, name="grad.a").wait()


def async_shape_mismatch(ctx: Any, rank: int, size: int) -> Any:
    x = _x()
    return ctx.comm.allreduce_async(x.reshape(32, 32) if last_differs(rank, size) else x,
                                    name="grad.s").wait()


def async_op_mismatch(ctx: Any, rank: int, size: int) -> Any:
    op = ctx.mt.Max if last_differs(rank, size) else ctx.mt.Sum
    return ctx.comm.allreduce_async(_x(), op=op).wait()


def async_bad_op_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.allreduce_async(_x(), op="median" if last_differs(rank, size) else "sum",
                                    name="grad.op").wait()


def async_unnamed_bad_dtype_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    x = np.ones(4, bool) if last_differs(rank, size) else np.ones(4, np.float32)
    return ctx.comm.allreduce_async(x).wait()


def async_read_only_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    x = _x()
    x.flags.writeable = rank != 0
    return ctx.comm.allreduce_async_(x, name="grad.ro").wait()


def async_bad_root_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    return ctx.comm.broadcast_async(_x(), root=size if last_differs(rank, size) else 0,
                                    name="bcast.root").wait()


def async_allgather_trailing_mismatch(ctx: Any, rank: int, size: int) -> Any:
    x = np.zeros((2, 4 if last_differs(rank, size) else 3), np.int32)
    return ctx.comm.allgather_async(x, name="gather.t").wait()


def async_duplicate_name(ctx: Any, rank: int, size: int) -> Any:
    first = ctx.comm.allreduce_async(_x(), name="dup")
    try:
        return ctx.comm.allreduce_async(_x(), name="dup").wait()
    finally:
        first.wait()


def async_zero_size(ctx: Any, rank: int, size: int) -> Any:
    got = ctx.comm.allreduce_async(np.zeros((0, 3), np.float32), name="empty").wait()
    if got.shape != (0, 3):
        raise AssertionError(f"shape {got.shape}")


def async_nan_inf_propagate(ctx: Any, rank: int, size: int) -> Any:
    x = _nan_input(rank)
    want = np.stack([_nan_input(r) for r in range(size)]).sum(0)
    got = ctx.comm.allreduce_async(x, name="nan").wait()
    if not np.array_equal(got, want, equal_nan=True):
        raise AssertionError(f"{got} != {want}")


def async_missing_rank(ctx: Any, rank: int, size: int) -> Any:
    comm = _started(ctx.stall_comm())
    if not last_differs(rank, size):
        return comm.allreduce_async(_x(), name="grad.w").wait()
    return None


def async_engine_never_started_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    if not last_differs(rank, size):
        return ctx.stall_comm().allreduce_async(_x(), name="grad.w").wait()
    return None


def async_different_names(ctx: Any, rank: int, size: int) -> Any:
    comm = _started(ctx.stall_comm())
    return comm.allreduce_async(_x(), name="bias" if last_differs(rank, size) else "weight"
                                ).wait()


def async_blocking_mixed(ctx: Any, rank: int, size: int) -> Any:
    """The last rank waits on an async call while the others make a blocking one."""
    comm = _started(ctx.stall_comm())
    if last_differs(rank, size):
        return comm.allreduce_async(_x(), name="grad.m").wait()
    return comm.allreduce(_x())


def async_engine_stopped_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    """The last rank frees its communicator (stopping its engine) while the others wait
    on an operation it never submitted."""
    own = _started(ctx.mt.Communicator(ctx.world))
    try:
        if not last_differs(rank, size):
            return own.allreduce_async(_x(), name="orphan").wait()
        return None
    finally:
        own.free()


def async_broadcast_from_joined_root(ctx: Any, rank: int, size: int) -> Any:
    """Rank 0 calls join() (uneven data); the others broadcast from it, which has no
    data to send."""
    comm = _started(ctx.comm)
    try:
        if rank != 0:
            return comm.broadcast_async(_x(), root=0, name="from.joined").wait()
        return None
    finally:
        comm.join()


# -- torch (mpitrain.torch, on the default communicator) -------------------------------
def torch_dtype_mismatch(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    dtype = torch.float64 if last_differs(rank, size) else torch.float32
    return hvd.allreduce(torch.ones(5, dtype=dtype), name="t.dtype")


def torch_shape_mismatch(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    return hvd.allreduce(torch.ones(6 if last_differs(rank, size) else 5), name="t.shape")


def torch_meta_tensor_everywhere(ctx: Any, rank: int, size: int) -> Any:
    import torch

    return ctx.hvd().allreduce(torch.empty(4, device="meta"), name="t.meta")


def _on_last(bad: Any, good: Any, rank: int, size: int) -> Any:
    return bad if last_differs(rank, size) else good


def torch_unknown_op_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    return hvd.allreduce(torch.ones(5), op=_on_last("median", hvd.Sum, rank, size))


def torch_average_and_op_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    average = _on_last(True, None, rank, size)
    return hvd.synchronize(hvd.allreduce_async(torch.ones(5), average=average, op=hvd.Sum,
                                               name="t.avg"))


def torch_bool_dtype_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    return hvd.allreduce(torch.ones(5, dtype=_on_last(torch.bool, torch.float32, rank, size)))


def torch_meta_tensor_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    return hvd.allreduce_(torch.empty(5, device=_on_last("meta", "cpu", rank, size)).fill_(1))


def torch_bad_prescale_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()  # an integer tensor: the adapter scales it itself
    return hvd.allreduce(torch.ones(5, dtype=torch.int32), op=hvd.Sum, name="t.scale",
                         prescale_factor=_on_last("two", 2, rank, size))


def torch_broadcast_bad_root_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    return ctx.hvd().broadcast(torch.ones(5), root_rank=_on_last(size, 0, rank, size))


def torch_grouped_bad_member_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    second = torch.empty(3, device=_on_last("meta", "cpu", rank, size)).fill_(1)
    return hvd.grouped_allreduce([torch.ones(5), second])


def torch_grouped_allgather_bad_member_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    second = torch.ones(3, dtype=_on_last(torch.bool, torch.int32, rank, size))
    return hvd.synchronize(hvd.grouped_allgather_async(
        [torch.ones(2), second, torch.ones(4)], name="t.gather"))


def torch_grouped_reducescatter_bad_op_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    return hvd.synchronize(hvd.grouped_reducescatter_async(
        [torch.ones(size, 2), torch.ones(size)], op=_on_last("median", hvd.Sum, rank, size)))


def torch_allgather_meta_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    return hvd.allgather(torch.empty(2, 3, device=_on_last("meta", "cpu", rank, size)))


def torch_sparse_dense_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    sparse = torch.eye(4).to_sparse()
    return hvd.synchronize(hvd.sparse_allreduce_async(
        _on_last(sparse.to_dense(), sparse, rank, size), op=hvd.Sum))


def torch_alltoall_bad_splits_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    splits = [1] * size
    if last_differs(rank, size):
        splits[0] = 2  # sums to size + 1 rows
    return hvd.alltoall(torch.ones(size, 2), splits=splits)


def torch_broadcast_object_bad_root_on_one_rank(ctx: Any, rank: int, size: int) -> Any:
    return ctx.hvd().broadcast_object({"step": 1}, root_rank=_on_last(size, 0, rank, size))


def torch_alltoall_beside_broadcast_object(ctx: Any, rank: int, size: int) -> Any:
    import torch

    hvd = ctx.hvd()
    if last_differs(rank, size):
        return hvd.broadcast_object({"step": 1})
    return hvd.alltoall(torch.ones(size, 2))


def refused_on_last(error: str, pattern: str) -> Callable[[int, int], tuple[str, str]]:
    """``error`` on the last rank, which refused the call; MismatchError naming it on
    the others."""
    return lambda rank, size: ((error, pattern) if last_differs(rank, size) else
                               ("MismatchError", f"refused on rank {size - 1}: {error}"))


TORCH_REFUSALS = [
    Case("torch_unknown_op_on_one_rank", torch_unknown_op_on_one_rank,
         refused_on_last("ArgumentError", "unknown reduction op 'median'")),
    Case("torch_average_and_op_on_one_rank", torch_average_and_op_on_one_rank,
         refused_on_last("ArgumentError", "op parameter supersedes average")),
    Case("torch_bool_dtype_on_one_rank", torch_bool_dtype_on_one_rank,
         refused_on_last("DtypeError", r"dtype torch\.bool is not supported")),
    Case("torch_meta_tensor_on_one_rank", torch_meta_tensor_on_one_rank,
         refused_on_last("DtypeError", "meta tensors need an mpitrain GPU backend")),
    Case("torch_bad_prescale_on_one_rank", torch_bad_prescale_on_one_rank,
         refused_on_last("ArgumentError", "prescale_factor and postscale_factor must be "
                         "numbers, got 'two'")),
    Case("torch_broadcast_bad_root_on_one_rank", torch_broadcast_bad_root_on_one_rank,
         refused_on_last("ArgumentError", r"root=\d+ is not a rank")),
    Case("torch_grouped_bad_member_on_one_rank", torch_grouped_bad_member_on_one_rank,
         refused_on_last("DtypeError", "meta tensors")),
    Case("torch_grouped_allgather_bad_member_on_one_rank",
         torch_grouped_allgather_bad_member_on_one_rank,
         refused_on_last("DtypeError", r"dtype torch\.bool is not supported")),
    Case("torch_grouped_reducescatter_bad_op_on_one_rank",
         torch_grouped_reducescatter_bad_op_on_one_rank,
         refused_on_last("ArgumentError", "unknown reduction op 'median'")),
    Case("torch_allgather_meta_on_one_rank", torch_allgather_meta_on_one_rank,
         refused_on_last("DtypeError", "meta tensors")),
    Case("torch_sparse_dense_on_one_rank", torch_sparse_dense_on_one_rank,
         refused_on_last("ArgumentError", "needs a sparse COO tensor")),
    Case("torch_alltoall_bad_splits_on_one_rank", torch_alltoall_bad_splits_on_one_rank,
         refused_on_last("ArgumentError", "splits must be")),
    Case("torch_broadcast_object_bad_root_on_one_rank",
         torch_broadcast_object_bad_root_on_one_rank,
         refused_on_last("ArgumentError", r"root=\d+ is not a rank")),
    Case("torch_alltoall_beside_broadcast_object", torch_alltoall_beside_broadcast_object,
         mismatch(r"(?=.*rank 0 called alltoall)(?=.*ranks? [0-9, ]*{last} called "
                  r"broadcast_object)")),
]
"""Misuse on one rank that the torch adapter catches before the engine sees the call."""

ONE_RANK_OUT = stalled_except(lambda r, s: r == 0, "ArgumentError", r"out= must be a",
                              r"rank 0 has not called it")

CASES = [
    Case("dtype_mismatch", dtype_mismatch,
         mismatch(r"rank {last} sent float64\[1024\], rank 0 sent float32\[1024\]"),
         validation=True),
    Case("count_mismatch", count_mismatch, mismatch(r"rank {last} sent float32\[1025\]"),
         validation=True),
    Case("shape_mismatch", shape_mismatch, mismatch(r"rank {last} sent float32\[32, 32\]"),
         validation=True),
    Case("zero_size_on_one_rank", zero_size_on_one_rank,
         mismatch(r"rank {last} sent float32\[0\]"), validation=True),
    Case("op_mismatch", op_mismatch, mismatch(r"rank {last} sent op max, rank 0 sent op sum"),
         validation=True),
    Case("scaling_mismatch", scaling_mismatch, mismatch(r"prescale 2"), validation=True),
    Case("name_mismatch", name_mismatch, mismatch(r"'bias'.*'weight'"), validation=True),
    Case("algorithm_mismatch", algorithm_mismatch, mismatch(r"algorithm"), validation=True),
    Case("root_mismatch", root_mismatch, mismatch(r"rank {last} sent root 1, rank 0 sent root 0"),
         validation=True),
    Case("different_collectives", different_collectives,
         mismatch(r"rank {last} called broadcast, rank 0 called allreduce"), validation=True),
    Case("reduce_scatter_shape_mismatch", reduce_scatter_shape_mismatch,
         mismatch(r"rank {last} sent float32\[13, 4\]"), validation=True),
    Case("allgather_dtype_mismatch", allgather_dtype_mismatch,
         mismatch(r"rank {last} sent float64\[\*, 3\]")),
    Case("allgather_trailing_mismatch", allgather_trailing_mismatch,
         mismatch(r"rank {last} sent int32\[\*, 4\]")),
    Case("missing_rank", missing_rank,
         stalled_except(last_differs, pattern=r"allreduce .*rank {last} has not called it"),
         usable=False, stall=True),
    Case("missing_rank_native", missing_rank_native,
         stalled_except(last_differs, pattern=r"allreduce .*rank {last} has not called it"),
         usable=False, stall=True),
    Case("missing_rank_barrier", missing_rank_barrier,
         stalled_except(lambda r, s: r == 0, pattern=r"barrier .*rank 0 has not called it"),
         usable=False, stall=True),
    Case("call_after_stall", call_after_stall,
         stalled_except(last_differs, pattern=r"earlier stall left unusable"),
         usable=False, stall=True),
    Case("wrong_out_on_one_rank", wrong_out_on_one_rank, ONE_RANK_OUT, usable=False,
         stall=True),
    Case("read_only_on_one_rank", read_only_on_one_rank,
         stalled_except(lambda r, s: r == 0, "ArgumentError", "read-only",
                        r"rank 0 has not called it"), usable=False, stall=True),
    Case("unknown_op_everywhere", unknown_op_everywhere,
         everywhere("ArgumentError", "unknown reduction op 'median'")),
    Case("bool_dtype_everywhere", bool_dtype_everywhere,
         everywhere("DtypeError", r"dtype bool is not supported \(cast with")),
    Case("complex_max_everywhere", complex_max_everywhere,
         everywhere("DtypeError", "undefined for complex")),
    Case("bad_root_everywhere", bad_root_everywhere, everywhere("ArgumentError", "root=")),
    Case("noncontiguous_out_everywhere", noncontiguous_out_everywhere,
         everywhere("ArgumentError", "C-contiguous")),
    Case("unpicklable_on_root", unpicklable_on_root,
         lambda rank, size: (("AttributeError", "pickle") if rank == 0 else
                             ("CommunicationError", "rank 0, could not pickle"))),
    Case("nan_inf_propagate", nan_inf_propagate, everywhere(None)),
    Case("async_dtype_mismatch", async_dtype_mismatch,
         everywhere("MismatchError", r"'grad\.a' with different arguments.*float64\[1024\]")),
    Case("async_shape_mismatch", async_shape_mismatch,
         everywhere("MismatchError", r"'grad\.s' with different arguments.*float32\[32, 32\]")),
    Case("async_op_mismatch", async_op_mismatch,
         everywhere("MismatchError", r"allreduce max float32")),
    Case("async_bad_op_on_one_rank", async_bad_op_on_one_rank,
         lambda rank, size: (("ArgumentError", "unknown reduction op 'median'")
                             if last_differs(rank, size) else
                             ("MismatchError", f"'grad.op' is given up on every rank: its "
                              f"submission was refused on rank {size - 1}: ArgumentError"))),
    Case("async_unnamed_bad_dtype_on_one_rank", async_unnamed_bad_dtype_on_one_rank,
         lambda rank, size: (("DtypeError", "dtype bool is not supported")
                             if last_differs(rank, size) else
                             ("MismatchError", f"refused on rank {size - 1}: DtypeError"))),
    Case("async_read_only_on_one_rank", async_read_only_on_one_rank,
         lambda rank, size: (("ArgumentError", "read-only") if rank == 0 else
                             ("MismatchError", "refused on rank 0: ArgumentError.*read-only"))),
    Case("async_bad_root_on_one_rank", async_bad_root_on_one_rank,
         lambda rank, size: (("ArgumentError", "root=") if last_differs(rank, size) else
                             ("MismatchError", f"refused on rank {size - 1}: ArgumentError"))),
    Case("async_allgather_trailing_mismatch", async_allgather_trailing_mismatch,
         everywhere("MismatchError", r"'gather\.t' with different arguments.*int32\[\*, 4\]")),
    Case("async_duplicate_name", async_duplicate_name,
         everywhere("ArgumentError", "'dup' is already in flight")),
    Case("async_zero_size", async_zero_size, everywhere(None)),
    Case("async_nan_inf_propagate", async_nan_inf_propagate, everywhere(None)),
    Case("async_missing_rank", async_missing_rank,
         stalled_except(last_differs, pattern=r"the async engine's exchange \(rank \d+ has "
                        r"submitted 'grad\.w' \(allreduce sum float32\[1024\] [^)]*\)\)"
                        r".*rank {last} has not called it"),
         usable=False, stall=True),
    Case("async_engine_never_started_on_one_rank", async_engine_never_started_on_one_rank,
         stalled_except(last_differs, pattern=r"the async engine's start .*rank {last} has "
                        "not called it"), usable=False, stall=True),
    Case("async_different_names", async_different_names,
         lambda rank, size: ("StallError", (r"'bias'.*waited past the stall timeout.*rank\(s\) "
                                            rf"\[{', '.join(map(str, range(size - 1)))}\]")
                             if last_differs(rank, size) else
                             (r"'weight'.*waited past the stall timeout.*"
                              rf"rank\(s\) \[{size - 1}\]")),
         stall=True),
    Case("async_blocking_mixed", async_blocking_mixed,
         lambda rank, size: ("StallError", r"the async engine's exchange .*not called it"
                             if last_differs(rank, size) else
                             rf"allreduce .*rank {size - 1} has not called it"),
         usable=False, stall=True),
    Case("async_engine_stopped_on_one_rank", async_engine_stopped_on_one_rank,
         lambda rank, size: ((None, "") if last_differs(rank, size) else
                             ("CommunicationError", rf"rank\(s\) \[{size - 1}\] stopped their "
                              "async engine .*without submitting 'orphan'"))),
    Case("async_broadcast_from_joined_root", async_broadcast_from_joined_root,
         lambda rank, size: ((None, "") if rank == 0 else
                             ("CommunicationError", r"root 0, which is in join\(\)"))),
    Case("torch_dtype_mismatch", torch_dtype_mismatch,
         everywhere("MismatchError", r"'t\.dtype' with different arguments.*float64\[5\]")),
    Case("torch_shape_mismatch", torch_shape_mismatch,
         everywhere("MismatchError", r"'t\.shape' with different arguments.*float32\[6\]")),
    Case("torch_meta_tensor_everywhere", torch_meta_tensor_everywhere,
         everywhere("DtypeError", "meta")),
    *TORCH_REFUSALS,
]


class Context:
    """What a case may use: mpitrain, the default communicator, a stall communicator."""

    def __init__(self, mt: Any, world: Any) -> None:
        self.mt = mt
        self.world = world
        self.comm = mt.init()
        self._stall: Any = None
        self.after_stall_s = 0.0

    def hvd(self) -> Any:
        """``mpitrain.torch`` (imported on first use: torch is slow to import)."""
        import mpitrain.torch as hvd

        hvd.init()
        return hvd

    def new_stall_comm(self) -> None:
        """Create a communicator with a 1 s stall timeout (collective, before each stall
        case; the last one is left alone, broken or not)."""
        os.environ["MPITRAIN_STALL_TIMEOUT_S"] = STALL_TIMEOUT_S
        try:
            self._stall = self.mt.Communicator(self.world)
        finally:
            del os.environ["MPITRAIN_STALL_TIMEOUT_S"]

    def stall_comm(self) -> Any:
        """The communicator of :meth:`new_stall_comm`."""
        return self._stall

    def next_ok(self, case: Case) -> bool:
        """One allreduce gives the right sum: on the same communicator if ``case`` leaves
        it usable, else on a new one (the broken one is left alone: it may hold requests
        in flight)."""
        comm = self.comm
        if case.stall:
            self.new_stall_comm()
            comm = self.stall_comm()
        elif not case.usable:
            self.mt.shutdown()
            comm = self.comm = self.mt.init()
        want = np.full(3, float(self.comm.size))
        y = comm.allreduce(np.ones(3))
        if case.name.startswith(("async", "torch")):  # the engine goes on too
            z = comm.allreduce_async(np.ones(3), name="next").wait()
            if not (np.array_equal(y, want) and np.array_equal(z, want)):
                return False
        if case.name.startswith("torch"):  # unnamed ones too: the ranks' counts agree
            return self.next_torch_ok()
        return bool(np.array_equal(y, want))

    def next_torch_ok(self) -> bool:
        """An unnamed allreduce, allgather and alltoall of ``mpitrain.torch`` give the
        right answer (a refusal took its number of every kind on every rank)."""
        import torch

        hvd = self.hvd()
        n = hvd.size()
        summed = hvd.allreduce(torch.ones(3), op=hvd.Sum)
        gathered = hvd.synchronize(hvd.allgather_async(torch.ones(1)))
        swapped = hvd.alltoall(torch.ones(n))
        return bool(torch.equal(summed, torch.full((3,), float(n)))
                    and torch.equal(gathered, torch.ones(n))
                    and torch.equal(swapped, torch.ones(n)))


def main() -> None:
    from mpi4py import MPI

    import mpitrain as mt

    out = sys.argv[1]
    have_validation = _has_validation()
    ctx = Context(mt, MPI.COMM_WORLD)
    rank, size = ctx.comm.rank, ctx.comm.size
    results: dict[str, dict[str, Any]] = {}
    for case in CASES:
        if case.validation and not have_validation:
            results[case.name] = {"skipped": "needs cross-rank validation"}
            continue
        if case.stall:
            ctx.new_stall_comm()
        if case.name.startswith("torch_"):
            ctx.hvd()  # importing torch (seconds on shared cores) is not the case's time
        started = time.monotonic()
        error, message = None, ""
        try:
            case.run(ctx, rank, size)
        except Exception as exc:
            error, message = type(exc).__name__, str(exc)
        seconds = time.monotonic() - started
        want_error, pattern = case.expect(rank, size)
        ok = error == want_error and (not pattern or re.search(pattern, message) is not None)
        why = "" if ok else f"want {want_error} /{pattern}/, got {error}: {message}"
        if case.name == "call_after_stall" and ctx.after_stall_s > 0.5:
            ok, why = False, f"the call after the stall took {ctx.after_stall_s:.2f} s"
        results[case.name] = {"error": error, "message": message, "seconds": seconds,
                              "next_ok": ctx.next_ok(case),
                              "ok": ok, "why": why}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    mt.shutdown()


def _has_validation() -> bool:
    try:
        import mpitrain.comm.validation  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
