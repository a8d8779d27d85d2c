"""The timeline that rank 0 writes: rows per operation, phases, valid JSON."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from helpers import assert_all_ranks

import mpitrain as mt


def problems(path: str, rows: set[str]) -> list[str]:
    """What is wrong with the timeline file (empty if nothing)."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)
    found = []
    tids = {}
    for e in events:
        if e["name"] == "thread_name":
            tids[(e["pid"], e["tid"])] = e["args"]["name"]
    phases: dict[str, set[str]] = {}
    for e in events:
        if e["ph"] == "X":
            if e["dur"] < 0:
                found.append(f"negative duration: {e}")
            phases.setdefault(tids[(e["pid"], e["tid"])], set()).add(e["name"].split("(")[0])
    if not rows <= set(phases):
        found.append(f"rows {sorted(rows - set(phases))} missing")
    if phases.get("tl/group") != {"QUEUE", "PACK", "ALLREDUCE", "UNPACK"}:
        found.append(f"fused phases: {phases.get('tl/group')}")
    if phases.get("tl/gather") != {"QUEUE", "ALLGATHER"}:
        found.append(f"allgather phases: {phases.get('tl/gather')}")
    return found


@pytest.mark.mpi(min_size=1)
def test_timeline_rows_and_phases(comm: mt.Communicator) -> None:
    folder = tempfile.mkdtemp(prefix="mpitrain-timeline-") if comm.rank == 0 else None
    path = comm.broadcast_object(os.path.join(folder or "", "timeline.json"))
    mt.start_timeline(path)
    try:
        handles = [comm.allreduce_async(np.ones(100), name=f"tl/{i}") for i in range(3)]
        handles.append(comm.grouped_allreduce_async([np.ones(10), np.ones(20)], name="tl/group"))
        handles.append(comm.allgather_async(np.ones(3), name="tl/gather"))
        for h in handles:
            h.wait()
    finally:
        mt.stop_timeline()
    found = []
    if folder is not None:
        found = problems(path, {"tl/0", "tl/1", "tl/2", "tl/group", "tl/gather"})
        shutil.rmtree(folder)
    assert_all_ranks(comm, not comm.broadcast_object(found), f"timeline: {found}")
