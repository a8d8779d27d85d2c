"""Async engine edge cases: fused buckets cut into pipeline segments of a few bytes
without shared memory, and the engine's caches (the negotiation's name numbers, the
specs, the plans) emptied mid-run while ranks submit in orders of their own.

Every test runs on a communicator with a stall timeout, so a hang ends as
:class:`mpitrain.StallError` (a failure) instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import numpy as np
import pytest
from helpers import assert_all_ranks, assert_equal_all_ranks, crafted, reference

import mpitrain as mt
from mpitrain.dispatch import dispatcher as dispatcher_module
from mpitrain.engine import engine as engine_module
from mpitrain.engine import negotiation

STALL_TIMEOUT_S = "60"


@pytest.fixture
def watched(env: pytest.MonkeyPatch, comm: mt.Communicator) -> Iterator[pytest.MonkeyPatch]:
    """A stall timeout for the communicators a test makes (read when they are made)."""
    env.setenv("MPITRAIN_STALL_TIMEOUT_S", STALL_TIMEOUT_S)
    yield env


def fused_rounds(c: mt.Communicator, sizes: list[int], dtype: str, rounds: int,
                 algorithm: str | None = None, op: mt.ReduceOp = mt.Sum,
                 tag: str = "t") -> None:
    """``rounds`` rounds of named async allreduces of arrays of ``sizes`` (one bucket
    per round when submitted together), each rank submitting and waiting in its own
    order, alternating in place and out of place; every result checked on every rank."""
    wants = [reference(c.size, n, dtype, op) for n in sizes]
    for it in range(rounds):
        order = np.random.default_rng([it, c.rank]).permutation(len(sizes))
        arrays = {int(i): crafted(c.rank, sizes[i], dtype, op) for i in order}
        handles = {}
        for i in order:
            i = int(i)
            call = c.allreduce_async_ if (i + it) % 2 else c.allreduce_async
            handles[i] = call(arrays[i], op=op, name=f"{tag}{i}", algorithm=algorithm)
        for i in order[::-1]:
            i = int(i)
            assert_equal_all_ranks(c, handles[i].wait(), wants[i],
                                   f"round {it}, {dtype}[{sizes[i]}] with {algorithm}")


def segment_cases() -> list[Any]:
    """(dtype, segment bytes): one byte, one less than an element, an element, one
    more, three elements, and the 64 bytes of the reported hang."""
    cases = []
    for dtype in ("int8", "float32", "complex128"):
        item = np.dtype(dtype).itemsize
        for seg in sorted({1, max(item - 1, 1), item, item + 1, 3 * item, 64}):
            cases.append(pytest.param(dtype, seg, id=f"{dtype}-seg{seg}"))
    return cases


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", None])
@pytest.mark.parametrize("dtype,segment", segment_cases())
def test_fused_buckets_in_tiny_segments_without_shared_memory(
        watched: pytest.MonkeyPatch, comm: mt.Communicator, dtype: str, segment: int,
        algorithm: str | None) -> None:
    """Fused buckets through the pipelined ring (and the default choice) without shared
    memory, with segments smaller than, equal to and just above one element: bucket
    sizes that are exact multiples of the segment and of the rank count, one element
    off either way, fewer elements than ranks, and empty arrays."""
    watched.setenv("MPITRAIN_SEGMENT_BYTES", str(segment))
    c = mt.Communicator(comm.mpi_comm, shared_memory=False)
    try:
        per_segment = max(segment // np.dtype(dtype).itemsize, 1)
        exact = c.size * per_segment * 3  # a bucket of whole segments in every chunk
        sizes = [exact // 3, exact // 3 - 1, exact // 3 + 1, 0, c.size - 1, 1]
        fused_rounds(c, sizes, dtype, 8, algorithm)
        fused_rounds(c, [exact, 0], dtype, 2, algorithm, tag="whole")
    finally:
        c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["no-shm", "shm"])
def test_fused_allreduces_with_64_byte_segments(watched: pytest.MonkeyPatch,
                                                comm: mt.Communicator,
                                                shared_memory: bool) -> None:
    """A training-like loop: the same few small tensors, fused every step, submitted in
    a different order by every rank, with 64-byte pipeline segments (the configuration
    of a reported hang; there, without shared memory)."""
    watched.setenv("MPITRAIN_SEGMENT_BYTES", "64")
    c = mt.Communicator(comm.mpi_comm, shared_memory=shared_memory)
    try:
        fused_rounds(c, [20, 30, 38, 5], "float32", 150)
        fused_rounds(c, [20, 30, 38, 5], "float64", 50, "ring", mt.Average)
    finally:
        c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["no-shm", "shm"])
def test_engine_caches_emptied_mid_run(watched: pytest.MonkeyPatch, comm: mt.Communicator,
                                       shared_memory: bool) -> None:
    """The negotiation's name numbers wrap (every rank empties them in the same cycle),
    the engine forgets its specs (ranks then hold different spec objects for one
    bucket) and the dispatcher keeps one plan: many times in a run of named and unnamed
    async allreduces submitted in orders of each rank's own, some polled with test()."""
    watched.setattr(negotiation, "CACHE_LIMIT", 5)
    watched.setattr(engine_module, "_SPEC_CACHE_SIZE", 2)
    watched.setattr(dispatcher_module, "PLAN_CACHE_SIZE", 1)
    c = mt.Communicator(comm.mpi_comm, shared_memory=shared_memory)
    try:
        before = c.async_stats().cycles
        for it in range(40):
            rng = np.random.default_rng(it)  # the same on every rank
            sizes = [int(n) for n in rng.integers(0, 300, int(rng.integers(1, 9)))]
            dtypes = [str(rng.choice(["float32", "int64", "float16"])) for _ in sizes]
            order = np.random.default_rng([it, c.rank]).permutation(len(sizes))
            handles = {int(i): c.allreduce_async(crafted(c.rank, sizes[i], dtypes[i], mt.Sum),
                                                 name=f"w{i}")
                       for i in order}
            unnamed = [c.allreduce_async(crafted(c.rank, n, "float64", mt.Sum))
                       for n in sizes[:3]]
            for k, i in enumerate(order[::-1]):
                i = int(i)
                if k % 3 == 0:
                    while not handles[i].test():
                        pass
                assert_equal_all_ranks(c, handles[i].wait(),
                                       reference(c.size, sizes[i], dtypes[i], mt.Sum),
                                       f"step {it}: {dtypes[i]}[{sizes[i]}]")
            for n, h in zip(sizes, unnamed):
                assert_equal_all_ranks(c, h.wait(), reference(c.size, n, "float64", mt.Sum),
                                       f"step {it}: unnamed float64[{n}]")
        assert_all_ranks(c, c.async_stats().cycles - before >= 40, "cycles ran")
    finally:
        c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["no-shm", "shm"])
def test_buckets_at_the_fusion_threshold(watched: pytest.MonkeyPatch, comm: mt.Communicator,
                                         shared_memory: bool) -> None:
    """Buckets that fill the fusion threshold exactly, one element past it, arrays of
    exactly the threshold (never fused) and one element under it, with a threshold
    that differs by rank, in one cycle and in cycles that ranks reach with different
    parts of the batch. The smallest threshold (the last rank's) cuts the buckets on
    every rank: rank 0's timeline, whose own threshold is the largest, shows no fused
    bucket above it."""
    item = 8  # float64
    threshold = 12 * item
    watched.setenv("MPITRAIN_FUSION_THRESHOLD",
                   str(threshold + 8 * item * (comm.size - 1 - comm.rank)))
    folder = tempfile.mkdtemp(prefix="mpitrain-fusion-") if comm.rank == 0 else None
    path = comm.broadcast_object(os.path.join(folder or "", "timeline.json"))
    c = mt.Communicator(comm.mpi_comm, shared_memory=shared_memory)
    mt.start_timeline(path)
    try:
        batches = [[4, 4, 4], [4, 4, 4, 1], [12], [11, 1], [11, 2], [12, 12, 0, 6, 6],
                   [1] * 12 + [1], [13, 3, 9]]
        for it, sizes in enumerate(batches):
            fused_rounds(c, sizes, "float64", 3, tag=f"b{it}.")
    finally:
        mt.stop_timeline()
        c.free()
    buckets: dict[str, tuple[int, int]] = {}  # id -> (arrays, bytes)
    if folder is not None:
        with open(path, encoding="utf-8") as f:
            for event in json.load(f):
                args = event.get("args", {})
                if "bucket" in args:
                    buckets[args["bucket"]] = (args["tensors"], args["bytes"])
        shutil.rmtree(folder)
    fused = [nbytes for arrays, nbytes in comm.broadcast_object(buckets).values() if arrays > 1]
    assert_all_ranks(comm, bool(fused) and max(fused) <= threshold,
                     f"fused buckets of {sorted(set(fused))} bytes; threshold {threshold}")
