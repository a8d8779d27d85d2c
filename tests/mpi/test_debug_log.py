"""DEBUG logging: what a person debugging a slow or stuck job reads (the algorithm chosen
for each kind of call, the engine's cycles and fusion buckets, the stall inspector's
state), rank-tagged, once per new choice rather than per call, and nothing when off."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import assert_all_ranks
from mpi4py import MPI

import mpitrain as mt
from mpitrain.backends import NUMPY
from mpitrain.dispatch import Dispatcher


def _messages(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.DEBUG and needle in r.getMessage()]


@pytest.mark.mpi(min_size=1)
def test_each_new_choice_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mpitrain")
    comm = mt.Communicator(MPI.COMM_WORLD)
    try:
        sizes = (256, 512)
        for _ in range(5):
            for n in sizes:
                comm.allreduce(np.ones(n, np.float32))
        comm.allreduce(np.ones(64, np.float32), algorithm="mpi")
        d = comm.dispatcher
        chosen = [d.algorithm("allreduce", None, n * 4, NUMPY,
                              np.dtype(np.float32)) for n in sizes]
        auto = _messages(caplog, "allreduce of")
        auto = [m for m in auto if "float32 on numpy buffers" in m and "algorithm=" not in m]
        changes = len(set(chosen))
        requested = [m for m in _messages(caplog, "algorithm mpi, chosen by algorithm=")]
        made = _messages(caplog, "a communicator of")
        inspector = _messages(caplog, "stall inspector of a")
        ok = (len(auto) == changes and len(requested) == 1 and len(made) == 1
              and all(f"rank {comm.rank}:" in m for m in auto + requested + made)
              and f"algorithm {chosen[0]}, chosen by" in auto[0]
              and (comm.size == 1 or len(inspector) >= 1))
        assert_all_ranks(comm, ok, f"choices {auto}, requested {requested}, communicator "
                                   f"{made}, inspector {inspector}")
    finally:
        comm.free()


@pytest.mark.mpi(min_size=1)
def test_repeated_engine_cycles_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mpitrain")
    comm = mt.Communicator(MPI.COMM_WORLD)
    try:
        steps = 20
        for _ in range(steps):
            with comm.batch():
                handles = [comm.allreduce_async(np.ones(100, np.float32), name=f"g{i}")
                           for i in range(3)]
            for h in handles:
                h.wait()
        cycles = _messages(caplog, "engine cycle")
        fused = [m for m in cycles if "3 operation(s) agreed" in m and "1 bucket(s)" in m
                 and "3 op(s) in 1200 B" in m]
        # a step's three operations run in one cycle (batch()), one bucket; the same
        # cycle repeated is not logged again (timing may split a few steps)
        assert_all_ranks(comm, len(fused) == 1 and len(cycles) <= steps // 4,
                         f"{len(cycles)} cycle lines for {steps} steps: {cycles[:6]}")
    finally:
        comm.free()


@pytest.mark.mpi(min_size=1)
def test_nothing_is_logged_or_formatted_when_off(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="mpitrain")

    def forbidden(*args: object) -> None:
        raise AssertionError("a DEBUG line was formatted with DEBUG off")

    monkeypatch.setattr(Dispatcher, "_log_choice", forbidden)
    comm = mt.Communicator(MPI.COMM_WORLD)
    try:
        comm.allreduce(np.ones(10, np.float64))
        comm.allreduce_async(np.ones(10, np.float64), name="off").wait()
        debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
        assert_all_ranks(comm, not debug, f"DEBUG records with DEBUG off: {debug}")
    finally:
        comm.free()
