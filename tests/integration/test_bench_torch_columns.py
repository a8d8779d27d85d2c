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


def test_latency_checks_torch_alltoall_and_barrier_at_odd_ranks() -> None:
    """``benchmarks.latency --dist`` times and checks torch.distributed's all_reduce,
    all_to_all_single and barrier over the backend beside MPI's own, at 3 ranks."""
    code, out = run(3, [sys.executable, "-m", "benchmarks.latency", "--sizes", "64,4096",
                        "--blocks", "3", "--iters", "2", "--dist"], 240)
    assert code == 0, out
    for line in ("torch.distributed all_to_all_single 60 B", "torch.distributed "
                 "all_to_all_single 4092 B", "MPI Alltoall 4092 B", "torch.distributed barrier",
                 "torch.distributed all_reduce 64 B"):
        assert any(row.startswith(line) and row.endswith("#wrong 0")
                   for row in out.splitlines()), f"{line}: {out}"
    assert "Out of bounds values : 0 OK" in out, out
