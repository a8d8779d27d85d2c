"""A rank that dies of an uncaught exception, or exits, while the others are in collectives.

Usage: crash.py OUT_DIR RANK [thread | torch | exit CODE [async] | os_exit CODE]

RANK raises ValueError at step 5 (in a thread of its own with ``thread``; with ``exit``
it calls ``sys.exit(CODE)`` instead, with ``os_exit`` ``os._exit(CODE)``), after
writing the time to ``OUT_DIR/raised``;
every rank reduces every 10 ms meanwhile (through the async engine with ``async``).
With ``torch`` every rank first makes torch.distributed's default group over mpitrain's
backend, which wraps ``sys.excepthook`` in a hook of torch's own.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

import mpitrain as mt


def fail(step: int) -> None:
    raise ValueError(f"boom at step {step}")


def main() -> None:
    out, victim = sys.argv[1], int(sys.argv[2])
    in_thread = sys.argv[3:4] == ["thread"]
    exit_code = int(sys.argv[4]) if sys.argv[3:4] in (["exit"], ["os_exit"]) else None
    exit_now = os._exit if sys.argv[3:4] == ["os_exit"] else sys.exit
    in_engine = sys.argv[5:6] == ["async"]
    comm = mt.init()
    if sys.argv[3:4] == ["torch"]:
        import torch.distributed as dist

        import mpitrain.torch  # noqa: F401  (registers the backend)

        dist.init_process_group("mpitrain")
    x = np.ones(100)
    for step in range(3000):
        if comm.rank == victim and step == 5:
            with open(os.path.join(out, "raised"), "w") as f:
                f.write(repr(time.time()))
            if exit_code is not None:
                exit_now(exit_code)
            if in_thread:
                worker = threading.Thread(target=fail, args=(step,), name="loader")
                worker.start()
                worker.join()
            else:
                fail(step)
        if in_engine:
            comm.allreduce_async(x, name="grad").wait()
        else:
            comm.allreduce(x)
        time.sleep(0.01)
    print(f"rank {comm.rank} finished all steps", flush=True)


if __name__ == "__main__":
    main()
