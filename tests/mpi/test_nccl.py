"""The ``nccl`` algorithms on the fake GPU (``tests/fake_device.py``) through the fake
NCCL of ``tests/fake_nccl.py``.

The fake queues each NCCL call on the stream it is given and runs it late, when the
fake device gets to it, moving the bytes with MPI between the ranks of the NCCL
communicator; it refuses what NCCL refuses (two ranks on one device and host, bad
pointers, counts and types, overlapping buffers) and defers grouped calls to
``groupEnd``. The tests check every collective against the numpy references of
``tests/helpers.py``, which NCCL-less dtypes must still meet through the fallback; and
which calls reached NCCL (the fake records every launch), where the device layout
lets ``auto`` or ``algorithm="nccl"`` take it.

Each test makes a new :class:`mpitrain.Communicator`: the device layout is found once
per communicator and backend name (every fake backend is ``"fake"``), so the default
one keeps whatever an earlier test found. Verdicts go through the default
communicator (``assert_all_ranks``), which a failed NCCL call cannot leave mid-call.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator, cast

import numpy as np
import pytest
from fake_device import FakeBackend, FakeDeviceArray, fake_backend, to_device
from fake_nccl import VERSION, FakeNccl, fake_nccl
from helpers import DTYPES, Checks, assert_all_ranks, crafted, ops_for, reference
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import nccl

NCCL_DTYPES = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "bfloat16"}
"""What NCCL reduces itself; the other dtypes (int16, uint16, complex) take the fallback."""
Setup = tuple[mt.Communicator, FakeBackend, FakeNccl]


def seed(comm: mt.Communicator, *salt: object) -> int:
    """A seed that differs by rank and by test case."""
    return comm.rank * 7919 + sum(ord(c) for c in "".join(map(str, salt)))


def host(checks: Checks, arr: Any, what: str) -> np.ndarray[Any, Any]:
    """A fake device array's contents (the collective has synchronized its stream); a
    result that is not a device array is recorded as a failure."""
    if not isinstance(arr, FakeDeviceArray):
        checks.failures.append(f"{what}: expected a device array, got {type(arr)}")
    return np.asarray(arr).view(np.ndarray)


@contextlib.contextmanager
def nccl_comm(comm: mt.Communicator, *salt: object, own_device: bool = True,
              version: int = VERSION, **settings: Any) -> Iterator[Setup]:
    """A new communicator over every rank, a fresh fake GPU (``own_device``: each rank
    its own, else all one) and the fake NCCL on it; ``settings`` change the default
    communicator's."""
    with fake_backend(seed(comm, *salt)) as be, fake_nccl(be, version) as fake:
        if own_device:
            be.fake.identity = f"fake-gpu:{comm.rank}"
        c = mt.Communicator(comm.mpi_comm, settings=comm.settings.changed(**settings))
        try:
            yield c, be, fake
        finally:
            c.free()


def reached(checks: Checks, fake: FakeNccl, before: int, want: list[tuple[str, int]],
            what: str) -> None:
    """Record a failure unless the NCCL calls queued since ``before`` are ``want``."""
    got = fake.launches[before:]
    if got != want:
        checks.failures.append(f"{what}: NCCL calls {got}, want {want}")


def raises_everywhere(comm: mt.Communicator, call: Callable[[], Any],
                      error: type[BaseException], pattern: str) -> None:
    """``call`` must raise ``error`` matching ``pattern`` on every rank."""
    try:
        call()
        problem = f"no {error.__name__}"
    except error as exc:
        problem = "" if re.search(pattern, str(exc)) else f"{exc!s} does not match {pattern!r}"
    except Exception as exc:  # the wrong error: report it on every rank, not just here
        problem = f"{type(exc).__name__} instead of {error.__name__}: {exc}"
    assert_all_ranks(comm, not problem, problem)


# -- every collective, against the references ----------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(comm: mt.Communicator, dtype: str) -> None:
    """Every op of ``dtype``, out of place and in place, counts 0, 1 and 101."""
    with nccl_comm(comm, "ar", dtype) as (c, _, fake):
        checks = Checks(comm)
        for op in ops_for(dtype):
            for count in (0, 1, 101):
                what = f"allreduce {dtype} {op} n={count}"
                expected = reference(c.size, count, dtype, op)
                before = len(fake.launches)
                x = to_device(crafted(c.rank, count, dtype, op))
                checks.equal(host(checks, c.allreduce(x, op=op, algorithm="nccl"), what),
                             expected, what)
                checks.equal(host(checks, x, what), crafted(c.rank, count, dtype, op),
                             f"{what}: the input changed")
                if c.allreduce_(x, op=op, algorithm="nccl") is not x:
                    checks.failures.append(f"{what}: allreduce_ returned another array")
                checks.equal(host(checks, x, what), expected, f"{what} in place")
                nccl_runs = c.size > 1 and count > 0 and dtype in NCCL_DTYPES
                reached(checks, fake, before, [("allReduce", count)] * 2 * nccl_runs, what)
        checks.verdict()


def row_counts(size: int, rows: int, width: int) -> list[int]:
    """Elements of each rank's reduce-scatter block (``np.array_split`` of the rows)."""
    return [len(block) * width for block in np.array_split(np.empty(rows), size)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(comm: mt.Communicator, dtype: str) -> None:
    """Even rows (one ncclReduceScatter), uneven rows and fewer rows than ranks (a
    group of ncclReduce, one per non-empty block)."""
    width = 3
    with nccl_comm(comm, "rs", dtype) as (c, _, fake):
        checks = Checks(comm)
        for op in ops_for(dtype):
            for rows in sorted({2 * c.size, 2 * c.size + 1, c.size - 1}):
                what = f"reduce_scatter {dtype} {op} rows={rows}"
                full = reference(c.size, rows * width, dtype, op).reshape(rows, width)
                x = to_device(crafted(c.rank, rows * width, dtype, op)).reshape(rows, width)
                before, groups = len(fake.launches), fake.groups
                got = c.reduce_scatter(x, op=op, algorithm="nccl")
                checks.equal(host(checks, got, what), np.array_split(full, c.size)[c.rank],
                             what)
                blocks = row_counts(c.size, rows, width)
                want: list[tuple[str, int]] = []
                if c.size > 1 and dtype in NCCL_DTYPES and rows:
                    want = [("reduceScatter", blocks[0])] if len(set(blocks)) == 1 else \
                        [("reduce", n) for n in blocks if n]
                reached(checks, fake, before, want, what)
                if (fake.groups - groups) != (len(want) > 0 and want[0][0] == "reduce"):
                    checks.failures.append(f"{what}: {fake.groups - groups} NCCL groups")
        checks.verdict()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(comm: mt.Communicator, dtype: str) -> None:
    """Even blocks (one ncclAllGather), uneven ones with empty blocks (a group of
    ncclBroadcast, one per non-empty block), and nothing at all."""
    item = np.dtype(dtype).itemsize
    cases: dict[str, Callable[[int], int]] = {
        "even": lambda r: 3,
        "uneven": lambda r: max(2 - r, 0),  # 2, 1, then empty blocks
        "last only": lambda r: int(r == comm.size - 1),
        "empty": lambda r: 0,
    }
    with nccl_comm(comm, "ag", dtype) as (c, _, fake):
        checks = Checks(comm)
        for name, rows_of in cases.items():
            what = f"allgather {dtype} {name}"

            def block(r: int, rows_of: Callable[[int], int] = rows_of) -> np.ndarray[Any, Any]:
                return crafted(r, rows_of(r) * 2, dtype, mt.Sum).reshape(-1, 2)

            before = len(fake.launches)
            got = c.allgather(to_device(block(c.rank)), algorithm="nccl")
            checks.equal(host(checks, got, what),
                         np.concatenate([block(r) for r in range(c.size)]), what)
            nbytes = [rows_of(r) * 2 * item for r in range(c.size)]
            want: list[tuple[str, int]] = []
            if c.size > 1 and any(nbytes):
                want = [("allGather", nbytes[0])] if len(set(nbytes)) == 1 else \
                    [("broadcast", n) for n in nbytes if n]
            reached(checks, fake, before, want, what)
        checks.verdict()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(comm: mt.Communicator, dtype: str) -> None:
    """Every root, counts 0, 1 and 57, into a new array and in place."""
    item = np.dtype(dtype).itemsize
    with nccl_comm(comm, "bc", dtype) as (c, _, fake):
        checks = Checks(comm)
        for root in range(c.size):
            for count in (0, 1, 57):
                what = f"broadcast {dtype} root={root} n={count}"
                want = crafted(root, count, dtype, mt.Sum)
                before = len(fake.launches)
                x = to_device(crafted(c.rank, count, dtype, mt.Sum))
                checks.equal(host(checks, c.broadcast(x, root=root, algorithm="nccl"), what),
                             want, what)
                checks.equal(host(checks, x, what), crafted(c.rank, count, dtype, mt.Sum),
                             f"{what}: the input changed")
                if c.broadcast_(x, root=root, algorithm="nccl") is not x:
                    checks.failures.append(f"{what}: broadcast_ returned another array")
                checks.equal(host(checks, x, what), want, f"{what} in place")
                runs = c.size > 1 and count > 0
                reached(checks, fake, before, [("broadcast", count * item)] * 2 * runs, what)
        checks.verdict()


@pytest.mark.mpi(min_size=1)
def test_average_scaling_and_side_stream(comm: mt.Communicator) -> None:
    """Average, prescale and postscale (the dispatcher's scaling around the NCCL sum),
    ``out=``, and an input produced on a side stream that the call then runs on (NCCL
    must queue on that stream, behind the producer)."""
    with nccl_comm(comm, "scaled") as (c, be, fake):
        checks = Checks(comm)
        side = be.fake.new_stream()
        with side:  # produced on the side stream: ready only in its order
            x = be.empty(101, np.float64)
            be.scale_into(x, to_device(crafted(c.rank, 101, "float64", mt.Sum)), 2.0)
        out = be.empty(101, np.float64)
        before = len(fake.launches)
        got = c.allreduce(x, op=mt.Average, algorithm="nccl", prescale_factor=0.25,
                          postscale_factor=3.0, out=out, stream=side)
        want = reference(c.size, 101, "float64", mt.Sum) * 2.0 * 0.25 * 3.0 / c.size
        if got is not out or not np.allclose(host(checks, out, "scaled"), want, rtol=1e-12):
            checks.failures.append(f"scaled Average on a side stream: got "
                                   f"{host(checks, out, 'scaled')[:4]}, want {want[:4]}")
        ints = to_device(crafted(c.rank, 101, "int32", mt.Sum))
        checks.equal(host(checks, c.allreduce(ints, algorithm="nccl", postscale_factor=0.25),
                          "ints"),
                     np.floor(reference(c.size, 101, "int32", mt.Sum) * 0.25).astype(np.int32),
                     "integer postscale")
        for dtype in ("int32", "uint8", "float32", "bfloat16", "int16", "complex64"):
            y = to_device(crafted(c.rank, 37, dtype, mt.Average))
            checks.equal(host(checks, c.allreduce(y, op=mt.Average, algorithm="nccl"), dtype),
                         reference(c.size, 37, dtype, mt.Average), f"{dtype} Average")
            rows = 2 * c.size + 1
            z = to_device(crafted(c.rank, rows * 2, dtype, mt.Average)).reshape(rows, 2)
            full = reference(c.size, rows * 2, dtype, mt.Average).reshape(rows, 2)
            checks.equal(host(checks, c.reduce_scatter(z, op=mt.Average, algorithm="nccl"),
                              dtype),
                         np.array_split(full, c.size)[c.rank], f"{dtype} Average reduce_scatter")
        if c.size > 1 and len(fake.launches) == before:
            checks.failures.append("no call reached NCCL")
        checks.verdict()


@pytest.mark.mpi(min_size=1)
def test_old_nccl_has_no_bfloat16(comm: mt.Communicator) -> None:
    """NCCL 2.8 refuses ncclBfloat16 (CuPy still names it): bfloat16 takes the fallback."""
    with nccl_comm(comm, "old", version=20804) as (c, _, fake):
        checks = Checks(comm)
        for dtype in ("bfloat16", "float16"):
            before = len(fake.launches)
            x = to_device(crafted(c.rank, 64, dtype, mt.Sum))
            checks.equal(host(checks, c.allreduce(x, algorithm="nccl"), dtype),
                         reference(c.size, 64, dtype, mt.Sum), f"{dtype} on NCCL 2.8")
            want = [("allReduce", 64)] if c.size > 1 and dtype == "float16" else []
            reached(checks, fake, before, want, f"{dtype} on NCCL 2.8")
        checks.verdict()


# -- which link a call takes -------------------------------------------------------------
# Where ``auto`` does not take NCCL on a device that CUDA IPC can map, it takes ``ipc``
# (tests/mpi/test_ipc.py runs it): here its choice is read from the dispatcher
# (``choices``), and the calls run end to end under MPITRAIN_DEVICE_LINKS=nccl, where
# ``auto`` has NCCL or MPI to choose from.
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
NCCL_CALLS = ["allReduce", "reduceScatter", "allGather", "broadcast"]


def run_each_collective(c: mt.Communicator, checks: Checks, algorithm: str | None,
                        dtype: str = "float32") -> None:
    """Allreduce, reduce_scatter, allgather and broadcast of ``dtype``, checked."""
    x = to_device(crafted(c.rank, 4 * c.size, dtype, mt.Sum))
    checks.equal(host(checks, c.allreduce(x, algorithm=algorithm), "allreduce"),
                 reference(c.size, 4 * c.size, dtype, mt.Sum), f"{algorithm} allreduce")
    full = reference(c.size, 4 * c.size, dtype, mt.Sum)
    checks.equal(host(checks, c.reduce_scatter(x, algorithm=algorithm), "reduce_scatter"),
                 np.array_split(full, c.size)[c.rank], f"{algorithm} reduce_scatter")
    checks.equal(host(checks, c.allgather(x, algorithm=algorithm), "allgather"),
                 np.concatenate([crafted(r, 4 * c.size, dtype, mt.Sum) for r in range(c.size)]),
                 f"{algorithm} allgather")
    root = c.size - 1
    checks.equal(host(checks, c.broadcast(x, root=root, algorithm=algorithm), "broadcast"),
                 crafted(root, 4 * c.size, dtype, mt.Sum), f"{algorithm} broadcast")


def choices(c: mt.Communicator, be: FakeBackend, dtype: str = "float32") -> dict[str, str]:
    """What ``auto`` chooses for each collective of 4 KiB of ``dtype`` on the fake GPU
    (the first asks finds the device layout: collective)."""
    dt = np.dtype(dtype)
    return {name: c.dispatcher.algorithm(name, None, 4096, be, dt) for name in COLLECTIVES}


def check_auto(checks: Checks, c: mt.Communicator, be: FakeBackend, nccl_wanted: bool) -> None:
    """Record a failure unless ``auto`` takes NCCL for every collective (``nccl_wanted``)
    or for none (at one rank nothing is checked: no call reaches an algorithm)."""
    if c.size == 1:
        return
    chosen = choices(c, be)
    takes = [name for name, algorithm in chosen.items() if algorithm == "nccl"]
    if takes != (list(COLLECTIVES) if nccl_wanted else []):
        layout = c.dispatcher.links.layout(be)
        checks.failures.append(f"auto chose {chosen} ({layout.describe() if layout else ''})")


@pytest.mark.mpi(min_size=1)
def test_auto_takes_nccl_where_every_rank_has_its_own_device(comm: mt.Communicator) -> None:
    with nccl_comm(comm, "own") as (c, be, fake):
        checks = Checks(comm)
        check_auto(checks, c, be, True)
        run_each_collective(c, checks, None)
        kinds = [k for k, _ in fake.launches]
        if kinds != NCCL_CALLS * (c.size > 1):
            checks.failures.append(f"auto on own devices: NCCL calls {kinds}")
        before = len(fake.launches)
        run_each_collective(c, checks, None, "int16")  # NCCL reduces no int16: fallback
        reached(checks, fake, before, [("allGather", 8 * c.size), ("broadcast", 8 * c.size)]
                if c.size > 1 else [], "auto int16")
        checks.verdict()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("links", ["auto", "nccl"])
def test_shared_device_without_hostids(comm: mt.Communicator, links: str) -> None:
    """Every rank on one fake GPU, no NCCL_HOSTID: NCCL cannot run; ``auto`` goes
    elsewhere and ``algorithm="nccl"`` raises ArgumentError on every rank."""
    with nccl_comm(comm, "shared", links, own_device=False, device_links=links) as \
            (c, be, fake):
        checks = Checks(comm)
        check_auto(checks, c, be, False)
        if links == "nccl":
            run_each_collective(c, checks, None)
        checks.verdict()
        x = to_device(crafted(c.rank, 8, "float32", mt.Sum))
        if c.size > 1:
            raises_everywhere(comm, lambda: c.allreduce(x, algorithm="nccl"), mt.ArgumentError,
                              "nccl allreduce cannot run here.*NCCL_HOSTID")
            raises_everywhere(comm, lambda: c.broadcast(x, algorithm="nccl"), mt.ArgumentError,
                              "nccl broadcast cannot run here.*NCCL_HOSTID")
        assert_all_ranks(comm, fake.launches == [] and fake.communicators == []
                         and fake.unique_ids == 0,
                         f"NCCL was used on a shared device: {fake.launches}, "
                         f"{len(fake.communicators)} communicator(s), {fake.unique_ids} id(s)")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("links", ["auto", "nccl"])
def test_shared_device_with_hostids(comm: mt.Communicator, env: pytest.MonkeyPatch,
                                    links: str) -> None:
    """Every rank on one fake GPU, each with its own NCCL_HOSTID: ``algorithm="nccl"``
    runs, ``auto`` still does not take it."""
    env.setenv("NCCL_HOSTID", f"fake-host-{comm.rank}")
    with nccl_comm(comm, "hostids", links, own_device=False, device_links=links) as \
            (c, be, fake):
        checks = Checks(comm)
        check_auto(checks, c, be, False)
        if links == "nccl":
            run_each_collective(c, checks, None)
            reached(checks, fake, 0, [], "auto on a shared device")
        run_each_collective(c, checks, "nccl")
        kinds = [k for k, _ in fake.launches]
        if kinds != NCCL_CALLS * (c.size > 1):
            checks.failures.append(f"nccl with NCCL_HOSTIDs: NCCL calls {kinds}")
        checks.verdict()




@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("hostids", [
    "same", "different"])
def test_two_ranks_sharing_a_device(comm: mt.Communicator, env: pytest.MonkeyPatch,
                                    hostids: str) -> None:
    """The last two ranks on one device, the others each on its own. With the same
    NCCL_HOSTID NCCL refuses the pair (duplicate GPU, as the fake does), so
    ``algorithm="nccl"`` must raise ArgumentError on every rank before NCCL is asked;
    with different ones it runs."""
    pair = comm.rank >= comm.size - 2
    env.setenv("NCCL_HOSTID", f"host-{comm.rank if hostids == 'different' or not pair else 'x'}")
    with nccl_comm(comm, "pair", hostids, own_device=False) as (c, be, fake):
        be.fake.identity = "fake-gpu:pair" if pair else f"fake-gpu:{c.rank}"
        checks = Checks(comm)
        check_auto(checks, c, be, False)
        checks.verdict()
        if hostids == "same":
            x = to_device(crafted(c.rank, 8, "float32", mt.Sum))
            raises_everywhere(comm, lambda: c.allreduce(x, algorithm="nccl"),
                              mt.ArgumentError, "nccl allreduce cannot run here.*NCCL_HOSTID")
            assert_all_ranks(comm, fake.communicators == [], "an NCCL communicator was made")
        else:
            run_each_collective(c, checks, "nccl")
            reached(checks, fake, 0, [("allReduce", 4 * c.size), ("reduceScatter", 4),
                                      ("allGather", 16 * c.size), ("broadcast", 16 * c.size)],
                    "the pair, each with its NCCL_HOSTID")
            checks.verdict()


@pytest.mark.mpi(min_size=1)
def test_device_links_none(comm: mt.Communicator, configure: Callable[..., Any]) -> None:
    """MPITRAIN_DEVICE_LINKS=none: no NCCL, by name or by ``auto``, even on own devices."""
    configure(device_links="none")
    with fake_backend(seed(comm, "none")) as be, fake_nccl(be) as fake:
        be.fake.identity = f"fake-gpu:{comm.rank}"
        checks = Checks(comm)
        check_auto(checks, comm, be, False)
        run_each_collective(comm, checks, None)
        checks.verdict()
        if comm.size > 1:
            x = to_device(crafted(comm.rank, 8, "float32", mt.Sum))
            raises_everywhere(comm, lambda: comm.allreduce(x, algorithm="nccl"),
                              mt.ArgumentError, "nccl allreduce cannot run here")
        assert_all_ranks(comm, fake.launches == [] and fake.communicators == [],
                         f"NCCL used with device_links=none: {fake.launches}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("links", ["ipc", "nccl"])
def test_device_links_limit(comm: mt.Communicator, links: str) -> None:
    """On own devices, MPITRAIN_DEVICE_LINKS=ipc leaves NCCL out (by name too); =nccl
    keeps it for ``auto``."""
    with nccl_comm(comm, "links", links, device_links=links) as (c, be, fake):
        checks = Checks(comm)
        check_auto(checks, c, be, links == "nccl")
        if links == "nccl":
            run_each_collective(c, checks, None)
        checks.verdict()
        if links == "ipc" and c.size > 1:
            x = to_device(crafted(c.rank, 8, "float32", mt.Sum))
            raises_everywhere(comm, lambda: c.allgather(x, algorithm="nccl"),
                              mt.ArgumentError, "nccl allgather cannot run here")
        used = [k for k, _ in fake.launches]
        assert_all_ranks(comm, used == NCCL_CALLS * (links == "nccl" and c.size > 1),
                         f"device_links={links}: NCCL calls {used}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("links", ["auto", "nccl"])
def test_nccl_missing_on_one_rank(comm: mt.Communicator, links: str) -> None:
    """The last rank has no cupy.cuda.nccl: no rank takes NCCL."""
    last = comm.rank == comm.size - 1
    with fake_backend(seed(comm, "missing")) as be, fake_nccl(be) as fake, \
            pytest.MonkeyPatch.context() as patch:
        be.fake.identity = f"fake-gpu:{comm.rank}"
        if last:
            patch.setattr(nccl, "module", lambda: None)
            nccl.nccl_version.cache_clear()
        c = mt.Communicator(comm.mpi_comm, settings=comm.settings.changed(device_links=links))
        try:
            checks = Checks(comm)
            check_auto(checks, c, be, False)
            if links == "nccl":
                run_each_collective(c, checks, None)
            checks.verdict()
            x = to_device(crafted(c.rank, 8, "float32", mt.Sum))
            raises_everywhere(comm, lambda: c.allreduce(x, algorithm="nccl"),
                              mt.ArgumentError, "cupy.cuda.nccl missing")
            assert_all_ranks(comm, fake.launches == [], f"NCCL calls {fake.launches}")
        finally:
            c.free()
    nccl.nccl_version.cache_clear()


@pytest.mark.mpi(min_size=1)
def test_one_nccl_communicator(comm: mt.Communicator) -> None:
    """Many calls of every collective, shapes and dtypes: one unique id (rank 0's), one
    NCCL communicator, destroyed when the mpitrain communicator is freed."""
    with fake_backend(seed(comm, "once")) as be, fake_nccl(be) as fake:
        be.fake.identity = f"fake-gpu:{comm.rank}"
        c = mt.Communicator(comm.mpi_comm)
        checks = Checks(comm)
        try:
            for n in (1, 5, 33):
                for dtype in ("float32", "int64", "bfloat16"):
                    run_each_collective(c, checks, "nccl", dtype)
                    x = to_device(crafted(c.rank, n * c.size + 1, dtype, mt.Max))
                    c.allreduce_(x, op=mt.Max, algorithm="nccl")
                    checks.equal(host(checks, x, "max"),
                                 reference(c.size, n * c.size + 1, dtype, mt.Max), "Max")
        finally:
            c.free()
        uses = c.size > 1
        ids = fake.unique_ids == (1 if uses and c.rank == 0 else 0)
        made = len(fake.communicators) == uses and fake.destroyed == uses
        if not (ids and made):
            checks.failures.append(f"{fake.unique_ids} unique id(s), "
                                   f"{len(fake.communicators)} communicator(s) made, "
                                   f"{fake.destroyed} destroyed")
        if uses and len(fake.launches) < 36:
            checks.failures.append(f"only {len(fake.launches)} NCCL calls")
        checks.verdict()


@pytest.mark.mpi(min_size=3)
def test_nccl_on_sub_communicators(comm: mt.Communicator) -> None:
    """Two communicators over halves of the ranks (even and odd), each with its NCCL
    communicator, made and used at the same time."""
    half = cast(MPI.Intracomm, comm.mpi_comm.Split(comm.rank % 2, comm.rank))
    with fake_backend(seed(comm, "halves")) as be, fake_nccl(be) as fake:
        be.fake.identity = f"fake-gpu:{comm.rank}"
        c = mt.Communicator(half)
        checks = Checks(comm)
        try:
            run_each_collective(c, checks, "nccl", "float64")
        finally:
            c.free()
            half.Free()
        if c.size > 1 and len(fake.communicators) != 1:
            checks.failures.append(f"{len(fake.communicators)} NCCL communicators")
        checks.verdict()
