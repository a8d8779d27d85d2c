"""A stall is warned of once: a rank that waits in a shared-memory collective for a late
rank logs one stall warning, not one from the barrier and one from the inspector's
daemon."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
from helpers import assert_all_ranks
from mpi4py import MPI

import mpitrain as mt
from mpitrain.config import Settings


@pytest.mark.mpi(min_size=2)
def test_one_warning_per_stall(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mpitrain")
    comm = mt.Communicator(MPI.COMM_WORLD, settings=Settings.from_environment(
        stall_warning_s=0.25, stall_timeout_s=0.0))
    try:
        comm.barrier()
        if comm.rank == comm.size - 1:
            time.sleep(1.5)  # the others wait in the allreduce for six warning periods
        comm.allreduce(np.ones(8, np.float32))
        time.sleep(0.5)  # a second warning would come within the daemon's next survey
        warned = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        late = comm.rank == comm.size - 1
        assert_all_ranks(comm, len(warned) == (0 if late else 1),
                         f"{len(warned)} stall warnings: {warned}")
    finally:
        comm.free()


@pytest.mark.mpi(min_size=2)
def test_the_warning_says_where_a_late_rank_waits(caplog: pytest.LogCaptureFixture) -> None:
    """The late rank is not idle: it waits in another collective, on another transport
    (the async engine's exchange, another communicator's barrier), and the warning of
    each side says so."""
    caplog.set_level(logging.WARNING, logger="mpitrain")
    settings = Settings.from_environment(stall_warning_s=0.25, stall_timeout_s=60.0)
    comm = mt.Communicator(MPI.COMM_WORLD, settings=settings)
    other = mt.Communicator(MPI.COMM_WORLD, settings=settings)
    late = comm.size - 1
    try:
        comm.allreduce_async(np.ones(8, np.float32), name="warm").wait()  # starts the engine
        comm.barrier()
        if comm.rank == late:
            handle = comm.allreduce_async(np.ones(8, np.float32), name="grad.m")
            time.sleep(1.5)  # the engine waits in its exchange for the other ranks
            other.barrier()
        else:
            other.barrier()  # waits for the late rank
            handle = comm.allreduce_async(np.ones(8, np.float32), name="grad.m")
        total = handle.wait()
        time.sleep(0.1)
        warned = " | ".join(r.getMessage() for r in caplog.records
                            if "has waited" in r.getMessage())
        if comm.rank == late:
            expected = (r"the async engine's exchange \(rank \d+ has submitted 'grad\.m' "
                        r"\(allreduce sum float32\[8\] [^)]*\)\) .*"
                        r"rank 0 is at #\d+ [^;]*; it waits in barrier")
        else:
            expected = (rf"barrier .*rank {late} has not called it \(rank {late} is at "
                        rf"#\d+ [^;]*; it waits in the async engine's exchange \(rank {late} "
                        r"has submitted 'grad\.m' \(allreduce sum float32\[8\] [^)]*\)\)")
        assert_all_ranks(comm, bool(re.search(expected, warned)) and
                         float(total[0]) == comm.size, f"warnings: {warned!r}")
    finally:
        other.free()
        comm.free()
