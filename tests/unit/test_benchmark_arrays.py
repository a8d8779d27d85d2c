"""``--array``: where benchmark buffers live, run on one rank without a GPU.

The device path of the harness (placement, the ``mpi`` column through mpitrain's
``mpi`` algorithm, the copy-bandwidth column) runs here on the fake GPU of
``tests/fake_device.py``; with CuPy it runs the same way on a real one.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from fake_device import FakeDeviceArray, fake_backend, to_device
from mpi4py import MPI

import mpitrain as mt
from benchmarks import harness
from benchmarks.arrays import DevicePlacement, HostPlacement, PlacementError, placement_for
from benchmarks.hooks import Case


def gpu_usable() -> bool:
    """True if CuPy sees a CUDA device here."""
    try:
        DevicePlacement(0)
    except PlacementError:
        return False
    return True


class FakePlacement:
    """Benchmark buffers on the fake GPU."""

    name = "fake"
    is_device = True

    def __init__(self) -> None:
        self.settled = 0

    def settle(self) -> None:
        self.settled += 1

    def put(self, host: np.ndarray[Any, Any]) -> FakeDeviceArray:
        return to_device(host)

    def get(self, arr: Any) -> np.ndarray[Any, Any]:
        assert isinstance(arr, FakeDeviceArray), f"result left the device: {type(arr)}"
        return np.asarray(arr).view(np.ndarray)

    def describe(self, comm: mt.Communicator) -> str:
        return "fake"

    def copy_seconds(self, nbytes: int, iters: int, warmup: int) -> float:
        return 1e-6


def test_array_option() -> None:
    assert harness.parse_args(["allreduce"], 1).array == "numpy"
    assert harness.parse_args(["allreduce", "--array", "cupy"], 1).array == "cupy"
    with pytest.raises(SystemExit):
        harness.parse_args(["allreduce", "--array", "jax"], 1, quiet=True)


def test_host_placement_is_the_identity() -> None:
    x = np.arange(4)
    host = placement_for("numpy", 0, MPI.COMM_SELF)
    assert isinstance(host, HostPlacement) and host.put(x) is x and host.get(x) is x
    assert "host memory" in host.describe(None)  # type: ignore[arg-type]


@pytest.mark.skipif(gpu_usable(), reason="a GPU is usable here: the GPU checks run instead")
def test_array_cupy_without_a_gpu_fails_clearly() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks", "allreduce", "-b", "1K", "-e",
                           "1K", "--array", "cupy"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--array cupy needs" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_measure_on_device_buffers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPITRAIN_CUDA_AWARE", "0")
    comm = mt.Communicator(MPI.COMM_SELF)
    world = MPI.COMM_SELF.Dup()
    argv = [name, "-n", "2", "-w", "1", "--algorithm", "auto,ring" if name != "broadcast"
            else "auto", "--array", "cupy"]
    opts = harness.parse_args(argv, 1)
    placement = FakePlacement()
    with fake_backend(seed=3):
        results = []
        for count in (1, 1000):
            case = Case(count, opts.dtype, opts.op, opts.root, 0, 1)
            results += harness.measure(opts, case, comm, world, placement=placement)
    assert results and all(r.wrong == 0 for r in results)
    # every run (the cold one, warm-up, timed) waits for its reset's device work
    assert placement.settled == len(results) * (1 + 1 + 2)
    assert "mpi" in {r.impl for r in results} and len({r.impl for r in results}) >= 2
    world.Free()
    comm.free()


def test_device_copy_column_and_header() -> None:
    opts = harness.parse_args(["allreduce", "--array", "cupy"], 1)
    table = harness.Table(opts.impls, opts.variants, [harness.Column("d2d", "(GB/s)", 8)])
    header = table.header()
    assert header[2].rstrip().endswith("d2d") and header[3].rstrip().endswith("(GB/s)")
    result = harness.Result(1024, 256, "float32", "sum", -1, "mpitrain", False, 10.0, 9.0,
                            11.0, 0.1, 0.1, 0)
    line = table.row([result, dataclasses.replace(result, impl="mpi")], ["812.5"])
    assert line.rstrip().endswith("812.5")
    block = harness.header_block(opts, "cmd", {"mpi_library": "x", "ranks": 1, "hosts": ["h"],
                                               "python": "3", "numpy": "2", "mpi4py": "4",
                                               "mpitrain": "0", "date": "d"},
                                 "cupy on a GPU; policy staged")
    assert "# arrays    : cupy on a GPU; policy staged" in block
    assert any("device pointers if CUDA-aware" in line for line in block)
