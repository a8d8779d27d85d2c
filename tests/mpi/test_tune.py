"""mpitrain-tune: measured rules that every rank loads and that select the winners."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

import pytest
from helpers import assert_all_ranks

import mpitrain as mt
from mpitrain import tune
from mpitrain.dispatch import selection


@pytest.mark.mpi(min_size=1)
def test_tune_writes_rules_that_select_the_measured_winner(comm: mt.Communicator,
                                                            configure: Callable[..., Any]
                                                            ) -> None:
    folder = comm.broadcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)
    path = os.path.join(folder, "tuning.json")
    argv = ["-o", path, "--collectives", "allreduce,allgather", "-b", "4", "-e", "64K",
            "-f", "128", "-n", "2", "-w", "1"]
    assert tune.main(argv) == 0
    comm.barrier()
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    rules = selection.load_rules(path)
    configure(tuning_file=path)
    table = comm.dispatcher.table
    problems = []
    for collective in ("allreduce", "allgather"):
        times = doc["meta"]["seconds_per_call"][collective]
        available = tuple(comm.algorithms(collective))
        assert set(times["4"]) == set(available)
        for size, by_algorithm in times.items():
            winner = min(by_algorithm, key=by_algorithm.__getitem__)
            chosen = table.select(collective, int(size), comm.size, "numpy", available)
            if chosen != winner:
                problems.append(f"{collective} {size} B: chose {chosen}, measured {winner}")
    assert all(r.min_ranks == r.max_ranks == comm.size for r in rules)
    assert_all_ranks(comm, not problems, "; ".join(problems))
    # --append keeps rules of other rank counts and replaces this one's
    other = selection.Rule("allreduce", "ring", min_ranks=comm.size + 1,
                           max_ranks=comm.size + 1)
    if comm.rank == 0:
        selection.dump_rules([*rules, other], path)
    comm.barrier()
    assert tune.main([*argv, "--append", "--collectives", "allreduce"]) == 0
    comm.barrier()
    kept = selection.load_rules(path)
    assert other in kept and all(r.collective == "allreduce" for r in kept)
    comm.barrier()


@pytest.mark.mpi(min_size=1)
def test_tune_rejects_bad_arguments(comm: mt.Communicator) -> None:
    assert tune.main(["--collectives", "gather"]) == 2
    assert tune.main(["-b", "1K", "-e", "4"]) == 2
