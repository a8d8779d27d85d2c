"""The ring allreduce's message pattern in plain mpi4py, without mpitrain: tells a stall
inside MPI from one in mpitrain (docs/reliability.md, "Tiny segments on large buffers").

Each collective is an optional 16-byte exchange with every rank (as mpitrain's argument
check does), then a ring allreduce of float64 in ``--segments`` segments per chunk, all
of a chunk's messages posted at once, every wait a ``Testall`` poll, while a second
thread tests a receive on another communicator every 20 ms (as mpitrain's stall
inspector does; ``--no-side-thread`` leaves it out). Rank 0 prints the
time taken; a wait past ``--stall-s`` prints what each stuck rank waits for and aborts
the job (exit code 3). Results are checked.

    mpitrain-run -np 5 python tools/ring_messages.py --segments 1024 --elems 16 --exchange p2p
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np
from mpi4py import MPI

RS_TAG, AG_TAG, EXCHANGE_TAG = 11, 12, 60


class Ring:
    """One rank's side of the pattern on ``comm``."""

    def __init__(self, comm: MPI.Intracomm, segments: int, elems: int, stall_s: float) -> None:
        self.comm, self.rank, self.n = comm, comm.Get_rank(), comm.Get_size()
        self.left, self.right = (self.rank - 1) % self.n, (self.rank + 1) % self.n
        self.k, self.elems, self.stall_s = segments, elems, stall_s
        self.chunk = segments * elems
        self.step = 0

    def poll(self, requests: list[Any], what: str) -> None:
        """Test ``requests`` until done (sleeping up to 5 ms between tests, as mpitrain's
        interruptible waits do); past the stall limit, report and abort."""
        start, pause = time.monotonic(), 0.0
        while not MPI.Request.Testall(requests):
            waited = time.monotonic() - start
            if waited > self.stall_s:
                print(f"rank {self.rank}: collective {self.step} waited {waited:.0f} s "
                      f"in {what}", flush=True)
                time.sleep(10)  # let the other stuck ranks report too
                MPI.COMM_WORLD.Abort(3)
            if waited > 1e-4:
                time.sleep(pause)
                pause = min(0.005, pause * 2 or 1e-5)

    def exchange(self, kind: str) -> None:
        """16 bytes from every rank to every rank."""
        mine = np.full(16, self.step % 251, np.uint8)
        table = np.empty((self.n, 16), np.uint8)
        if kind == "nbc":
            self.poll([self.comm.Iallgather(mine, table)], "the exchange (MPI_Iallgather)")
        elif kind == "block":
            self.comm.Allgather(mine, table)
        elif kind == "p2p":
            others = [r for r in range(self.n) if r != self.rank]
            self.poll([self.comm.Irecv(table[r], r, EXCHANGE_TAG) for r in others]
                      + [self.comm.Isend(mine, r, EXCHANGE_TAG) for r in others],
                      "the exchange (point-to-point)")

    def view(self, buf: np.ndarray, c: int, k: int) -> np.ndarray:
        lo = c * self.chunk + k * self.elems
        return buf[lo:lo + self.elems]

    def allreduce(self) -> None:
        """Reduce-scatter then all-gather, as mpitrain's ring posts them; check the sum."""
        n, k_all, comm = self.n, range(self.k), self.comm
        src = np.full(self.chunk * n, self.rank + 1.0)
        out = src.copy()
        scratch = np.empty(self.chunk)
        seg = [scratch[k * self.elems:(k + 1) * self.elems] for k in k_all]
        owned = (self.rank + 1) % n
        recvs = [comm.Irecv(seg[k], self.left, RS_TAG) for k in k_all]
        sends = [comm.Isend(self.view(src, (owned - 1) % n, k), self.right, RS_TAG)
                 for k in k_all]
        finished = []  # the owned chunk's segments: the all-gather's first sends
        for step in range(n - 1):
            c, last = (owned - 2 - step) % n, step == n - 2
            for k in k_all:
                self.poll([recvs[k]], f"reduce-scatter step {step}, segment {k}")
                dst = self.view(out, c, k)
                np.add(self.view(src, c, k), seg[k], out=dst)
                if last:
                    finished.append(comm.Isend(dst, self.right, AG_TAG))
                else:
                    recvs[k] = comm.Irecv(seg[k], self.left, RS_TAG)
                    sends.append(comm.Isend(dst, self.right, RS_TAG))
        # the reduce-scatter's sends read chunks the all-gather receives into
        self.poll(sends, "the reduce-scatter's sends")
        sends = finished
        rows = [[comm.Irecv(self.view(out, (owned - 1 - step) % n, k), self.left, AG_TAG)
                 for k in k_all] for step in range(n - 1)]
        for step in range(n - 1):
            c = (owned - 1 - step) % n
            for k in k_all:
                self.poll([rows[step][k]], f"all-gather step {step}, segment {k}")
                if step < n - 2:
                    sends.append(comm.Isend(self.view(out, c, k), self.right, AG_TAG))
        self.poll(sends, "the all-gather's sends")
        want = n * (n + 1) / 2
        if not (out == want).all():
            raise AssertionError(f"rank {self.rank}: collective {self.step} is wrong")


def side_thread(comm: MPI.Intracomm, stop: threading.Event) -> None:
    """Test a receive from any rank on ``comm`` every 20 ms."""
    box = np.zeros(1, np.int64)
    request = comm.Irecv(box, MPI.ANY_SOURCE, 1)
    while not stop.wait(0.02):
        request.Test()
    request.Cancel()
    request.Wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300, help="collectives (default 300)")
    parser.add_argument("--segments", type=int, default=1024, help="segments per chunk")
    parser.add_argument("--elems", type=int, default=16, help="float64 per segment")
    parser.add_argument("--exchange", choices=("none", "nbc", "block", "p2p"), default="p2p",
                        help="the exchange before each collective (default p2p)")
    parser.add_argument("--stall-s", type=float, default=30.0, help="a stall (default 30 s)")
    parser.add_argument("--no-side-thread", action="store_true",
                        help="no second thread calling MPI")
    args = parser.parse_args()
    ring = Ring(MPI.COMM_WORLD.Dup(), args.segments, args.elems, args.stall_s)
    stop = threading.Event()
    side = None
    if not args.no_side_thread:
        side = threading.Thread(target=side_thread, args=(MPI.COMM_WORLD.Dup(), stop),
                                daemon=True)
        side.start()
    start = time.perf_counter()
    for step in range(args.iters):
        ring.step = step
        if args.exchange != "none":
            ring.exchange(args.exchange)
        ring.allreduce()
    if ring.rank == 0:
        print(f"{args.iters} collectives of {args.segments} segments of {args.elems * 8} B "
              f"per chunk, exchange {args.exchange}: {time.perf_counter() - start:.1f} s",
              flush=True)
    stop.set()
    if side is not None:
        side.join()


if __name__ == "__main__":
    main()
