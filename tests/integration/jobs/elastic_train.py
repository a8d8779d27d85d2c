"""Least-squares training under mpitrain.elastic; one rank may be killed mid-run.

Usage: elastic_train.py OUT_DIR [VICTIM_RANK VICTIM_STEP]

Every step reduces the gradient of a fixed global batch of ``BATCH`` samples, split
over however many ranks there are, so the trajectory does not depend on the rank
count. The victim writes ``OUT_DIR/victim.pid`` when it reaches ``VICTIM_STEP`` and
waits there to be killed (the test sends SIGKILL). Each survivor writes
``OUT_DIR/rank<r>.json``: the states it resumed from, the gradient of every step with
the rank count that produced it, and its final parameters.
"""

from __future__ import annotations

import json
import os
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

    out = sys.argv[1]
    victim = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    victim_step = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    x, y = data()
    comm = mt.init()
    first_rank = comm.rank
    state = mt.elastic.State(params=np.zeros(DIM), step=0)
    log: dict[str, list] = {"resumed": [], "steps": []}
    state.register_reset_callbacks([lambda: log["resumed"].append(
        {"step": state.step, "params": state.params.tolist(), "size": mt.size()})])

    @mt.elastic.run
    def train(state: Any) -> None:
        while state.step < STEPS:
            comm = mt.default_communicator()
            if first_rank == victim and state.step == victim_step:
                with open(os.path.join(out, "victim.pid"), "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(60)  # killed here by the test
            lo = state.step * BATCH
            rows = np.array_split(np.arange(lo, lo + BATCH), comm.size)[comm.rank]
            g = comm.allreduce(gradient(x[rows], y[rows], state.params), op=mt.Sum) / BATCH
            log["steps"].append({"step": state.step, "size": comm.size, "grad": g.tolist()})
            state.params -= LR * g
            state.step += 1
            state.commit()

    train(state)
    log["final"] = state.params.tolist()
    log["size"] = mt.size()
    with open(os.path.join(out, f"rank{first_rank}.json"), "w") as f:
        json.dump(log, f)
    mt.shutdown()


if __name__ == "__main__":
    main()
