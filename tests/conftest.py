"""Pytest configuration shared by the unit, MPI and integration suites."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zlib
from typing import Any, Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Ranks share few cores: one compute thread each (torch's OpenMP threads would spin).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "PYTEST_XDIST_WORKER" in os.environ:
    # Each pytest worker's jobs get a TMPDIR of their own: Open MPI's launcher keeps its
    # session files in a folder under TMPDIR that every job of the user shares, and two
    # jobs starting at once there failed a launch now and then ("The PMIx server's
    # listener thread failed to start").
    _WORKER_TMP = tempfile.mkdtemp(prefix=f"mpitrain-{os.environ['PYTEST_XDIST_WORKER']}-")
    os.environ["TMPDIR"] = _WORKER_TMP
    tempfile.tempdir = None
    atexit.register(shutil.rmtree, _WORKER_TMP, ignore_errors=True)


@pytest.fixture
def comm() -> Iterator[object]:
    """The default mpitrain communicator over every rank of the job (a test may shut it
    down: the next one gets a new one), with mpitrain's own join() rule (an earlier
    ``mpitrain.torch`` test may have set Horovod's on it)."""
    import mpitrain as mt
    from mpitrain import session
    from mpitrain.engine import JOIN_SERVES_ALL

    comm = mt.init()
    if unusable(comm):  # an earlier test stalled (make test-mpi sets a stall timeout):
        session.replace_default(None)  # leave it, as its collectives may be in flight
        comm = mt.init()
    comm.join_serves = JOIN_SERVES_ALL  # mpitrain.torch narrows it to Horovod's rule
    yield comm


def unusable(comm: Any) -> bool:
    """True if a stall broke ``comm`` (or its async engine): every call would raise."""
    dispatchers = [comm.dispatcher]
    if comm.engine_started:
        engine = comm.engine()
        if engine._closed is not None:  # failed (a stopped engine is no longer there)
            return True
        dispatchers.append(engine.dispatcher)
    return any(d.transport.broken is not None for d in dispatchers)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Set variables for one test (every rank must set the same). A communicator reads
    its MPITRAIN_* settings when it is created: to change those of ``comm``, use
    ``configure``."""
    return monkeypatch


@pytest.fixture
def configure(comm: Any) -> Iterator[Callable[..., Any]]:
    """``configure(**changes)``: run the rest of the test under changed settings of the
    default communicator (``Communicator.configure``: collective, every rank passes the
    same); its settings are put back afterwards."""
    import mpitrain as mt

    saved = comm.settings
    yield comm.configure
    if mt.is_initialized() and mt.init() is comm and comm.settings != saved:
        comm.configure(saved)



@pytest.fixture(params=["cpu", "fake-cuda"])
def torch_device(request: pytest.FixtureRequest, comm: Any) -> Iterator[str]:
    """Run a torch test twice: on CPU tensors, and with every CPU tensor taken for a
    tensor on the fake GPU of ``fake_device.py`` (the path of CUDA tensors: the GPU
    backend, its streams, the staging transport with rendezvous sends). A test marked
    ``host_only`` runs on CPU tensors only."""
    if request.param == "cpu":
        yield "cpu"
        return
    marker = request.node.get_closest_marker("host_only")
    if marker is not None:
        pytest.skip(f"host tensors only: {marker.args[0] if marker.args else ''}")
    from fake_device import fake_torch_device

    with fake_torch_device(seed=comm.rank * 7919 + 1):
        yield "fake-cuda"


SHARED_AT = (3, 4, 5)
"""The rank counts among which each parametrized test shares out its cases: each case
runs at 1 and 2 ranks and at one of these (:func:`pytest_collection_modifyitems`)."""


def world_size() -> int:
    """The number of ranks of the job this pytest runs in (1 outside ``mpirun``)."""
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))


def shared_out(item: pytest.Item) -> bool:
    """Whether ``item`` is a case that :data:`SHARED_AT` shares out: a case of a
    parametrized test, unless the test runs on power-of-two rank counts only (marked
    ``power_of_two``: 4 runs it whole, 3 and 5 skip it) or is one of those marked
    ``many_ranks`` (whose point is how the rank count shapes the algorithm) and not a
    sweep over ``dtype``."""
    params = getattr(item, "callspec", None)
    if params is None or not params.params or item.get_closest_marker("power_of_two"):
        return False
    return "dtype" in params.params or item.get_closest_marker("many_ranks") is None


def rank_count_of(item: pytest.Item) -> int:
    """Which of :data:`SHARED_AT` runs the case ``item``: a hash of its id (the same
    in every process), so that the cases of a sweep fall to the rank counts as at
    random. Numbering the cases in collection order instead gave each value of the last
    parameter one rank count (of a test over shared memory on and off, the first ran
    only at 4 ranks, the second only at 5)."""
    return SHARED_AT[zlib.crc32(item.nodeid.encode()) % len(SHARED_AT)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """At 3, 4 and 5 ranks, where ranks share the two cores of a small machine, a
    parametrized test (a sweep: dtype x op x algorithm x size; or variants: shared
    memory on and off, CPU and fake GPU tensors) runs a third of its cases
    (:func:`rank_count_of`; :func:`shared_out` names the exceptions). Every case runs
    at 1 and 2 ranks and at one of 3, 4 and 5; tests without parameters run at every
    rank count. ``MPITRAIN_TEST_EVERY_CASE=1`` runs every case at every rank count (the
    GPU scripts set it: a GPU machine has the cores)."""
    size = world_size()
    if size not in SHARED_AT or os.environ.get("MPITRAIN_TEST_EVERY_CASE") == "1":
        return
    kept, dropped = [], []
    for item in items:
        (kept if not shared_out(item) or rank_count_of(item) == size else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
