"""The collectives benchmark's torch.distributed columns across ranks: mpitrain's backend
and the torch-mpi baseline (a Python backend calling MPI's own collectives) give every
rank the right elements at odd and even rank counts, or the benchmark exits 1."""

from __future__ import annotations

import sys

import pytest
from mpirun import run

pytest.importorskip("torch")


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("collective", ["allreduce", "allgather", "reduce_scatter",
                                        "broadcast"])
def test_torch_columns_verify_at_several_ranks(collective: str, nranks: int) -> None:
    code, out = run(nranks, [sys.executable, "-m", "benchmarks", collective, "-b", "64",
                             "-e", "64K", "-f", "32", "-n", "2", "-w", "1", "--impl",
                             "mpi,torch-mpitrain,torch-mpi", "-r", str(nranks - 1)], 240)
    assert code == 0, out
    assert "torch-mpi/torch-mpitrain" in out, out
    assert "Out of bounds values : 0 OK" in out, out
