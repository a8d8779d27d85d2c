"""A stall is warned of once: a rank that waits in a shared-memory collective for a late
rank logs one stall warning, not one from the barrier and one from the inspector's
daemon."""

from __future__ import annotations

import logging
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
