"""Write checkpoints until killed: ``checkpoint_writer.py DIR MODE``.

MODE ``fsync``: save step 1, then kill this process with SIGKILL inside step 2's save,
after its temporary file is written and before the rename. MODE ``loop``: save steps
1, 2, 3, ... of a 32 MiB state forever (the test kills it at a random moment). The
state of step ``s`` is ``{"w": arange(4M) * s, "step": s}``, so a loaded checkpoint
can be checked against its own step.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

from mpitrain import checkpoint

N = 4 << 20


def state(step: int) -> dict[str, object]:
    return {"w": np.arange(N, dtype=np.float64) * step, "step": step}


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    checkpoint.save(directory, state(1), step=1, keep=0)
    print("saved 1", flush=True)
    if mode == "fsync":
        def die(fd: int) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
        os.fsync = die  # the next save dies between writing and renaming
        checkpoint.save(directory, state(2), step=2, keep=0)
    step = 2
    while True:
        checkpoint.save(directory, state(step), step=step, keep=2)
        step += 1


if __name__ == "__main__":
    main()
