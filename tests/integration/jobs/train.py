"""Least-squares training under mpitrain.elastic, with a rank that fails on request.

Usage: train.py OUT_DIR [--victim RANK STEP] [--die-before-sync RANK] [--raise-at RANK STEP]
                       [--exit-at RANK STEP CODE] [--os-exit-at RANK STEP CODE]
                       [--return-at RANK STEP] [--checkpoint DIR] [--async]

Every step reduces the gradient of a fixed global batch of ``BATCH`` samples, split
over however many ranks there are, so the trajectory does not depend on the rank
count. ``--victim``: that rank writes ``OUT_DIR/victim.pid`` when it reaches STEP and
waits there to be killed (the test sends SIGKILL); ``--die-before-sync``: that rank kills
itself with SIGKILL after ``mt.init()``, while the others are in the elastic run's first
sync from rank 0. ``--raise-at``: that rank raises at
STEP in the first attempt of the job (``MPITRAIN_RESTART`` unset or 0); ``--exit-at``:
that rank calls ``sys.exit(CODE)`` there instead, ``--os-exit-at`` ``os._exit(CODE)``,
and ``--return-at`` leaves the training function and the script there (both after
writing the time to ``OUT_DIR/exited``) (every rank that reaches a step after a
recovery appends the time to ``OUT_DIR/recovered<r>``). ``--async``
reduces through the async engine (``allreduce_async``). Each rank
that finishes writes ``OUT_DIR/rank<r>.json``: the step it started from, the states it
resumed from after failures, the gradient of every step with the rank count that
produced it, and its final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

STEPS, BATCH, DIM, LR = 24, 12, 5, 0.05


def data() -> tuple[np.ndarray, np.ndarray]:
    """The whole data set: STEPS batches of BATCH samples."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((STEPS * BATCH, DIM))
    y = x @ np.arange(1.0, DIM + 1) + 0.1 * rng.standard_normal(STEPS * BATCH)
    return x, y


def gradient(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Sum over the samples of the squared-error gradient."""
    return x.T @ (x @ w - y)


def main() -> None:
    import mpitrain as mt  # here, so that the test can import data() without MPI

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--victim", type=int, nargs=2, default=(-1, -1))
    p.add_argument("--die-before-sync", type=int, default=-1)
    p.add_argument("--raise-at", type=int, nargs=2, default=(-1, -1))
    p.add_argument("--exit-at", type=int, nargs=3, default=(-1, -1, 0))
    p.add_argument("--os-exit-at", type=int, nargs=3, default=(-1, -1, 0))
    p.add_argument("--return-at", type=int, nargs=2, default=(-1, -1))
    p.add_argument("--checkpoint")
    p.add_argument("--async", dest="use_async", action="store_true")
    args = p.parse_args()
    attempt = int(os.environ.get("MPITRAIN_RESTART", "0"))
    x, y = data()
    first_rank = mt.init().rank
    state = mt.elastic.State(params=np.zeros(DIM), step=0, checkpoint=args.checkpoint)
    log: dict[str, Any] = {"resumed": [], "steps": [], "started": None, "returned": False}
    state.register_reset_callbacks([lambda: log["resumed"].append(
        {"step": state.step, "params": state.params.tolist(), "size": mt.size()})])

    @mt.elastic.run
    def train(state: Any) -> None:
        if log["started"] is None:
            log["started"] = state.step
        while state.step < STEPS:
            comm = mt.default_communicator()
            if (first_rank, state.step) == tuple(args.victim):
                with open(os.path.join(args.out, "victim.pid"), "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(60)  # killed here by the test
            if (first_rank, state.step) == tuple(args.raise_at) and attempt == 0:
                raise RuntimeError(f"rank {first_rank} fails at step {state.step} on purpose")
            if (first_rank, state.step) == tuple(args.exit_at[:2]) and attempt == 0:
                sys.exit(args.exit_at[2])
            if (first_rank, state.step) == tuple(args.os_exit_at[:2]) and attempt == 0:
                with open(os.path.join(args.out, "exited"), "w") as f:
                    f.write(repr(time.time()))
                os._exit(args.os_exit_at[2])
            if (first_rank, state.step) == tuple(args.return_at) and attempt == 0:
                with open(os.path.join(args.out, "exited"), "w") as f:
                    f.write(repr(time.time()))
                log["returned"] = True
                return
            lo = state.step * BATCH
            rows = np.array_split(np.arange(lo, lo + BATCH), comm.size)[comm.rank]
            local = gradient(x[rows], y[rows], state.params)
            if args.use_async:
                g = comm.allreduce_async(local, op=mt.Sum, name="grad").wait() / BATCH
            else:
                g = comm.allreduce(local, op=mt.Sum) / BATCH
            log["steps"].append({"step": state.step, "size": comm.size, "grad": g.tolist()})
            if log["resumed"] and len(log["steps"]) > 1 \
                    and log["steps"][-2]["size"] != comm.size:
                with open(os.path.join(args.out, f"recovered{first_rank}"), "a") as f:
                    f.write(f"{time.time()!r}\n")
            state.params -= LR * g
            state.step += 1
            state.commit()

    if first_rank == args.die_before_sync:
        os.kill(os.getpid(), signal.SIGKILL)
    train(state)
    if log["returned"]:
        return  # this rank leaves while the others train on
    log["final"] = state.params.tolist()
    log["size"] = mt.size()
    with open(os.path.join(args.out, f"rank{first_rank}.json"), "w") as f:
        json.dump(log, f)
    mt.shutdown()


if __name__ == "__main__":
    main()
