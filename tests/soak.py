"""Soak test: thousands of randomized collectives, every result checked against numpy.

``python tests/soak.py`` (``make soak``) runs one ``mpirun`` job per rank count
(``--ranks 2,3,4,5``) sharing ``--total`` collectives, and prints one line per job and
a total; it exits non-zero if any result was wrong or any job failed.

Each job (``--worker``) draws the same sequence of cases on every rank from
``--seed``: collective (allreduce, in place or into ``out=``, reduce-scatter,
allgather with rows that differ by rank, broadcast, broadcast in place, object
collectives, barrier, and batches of async allreduces named in a different order on
every rank), dtype, op, element count (0, 1, fewer than the ranks, and
log-uniform up to ``--max-count``), shape, algorithm, power-of-two scaling,
non-contiguous input and the ring's segment size. Inputs come from
``helpers.crafted``, whose reductions are exact in every dtype, so every rank checks
its result bit for bit against a numpy reference it computes from every rank's input.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import DTYPES, crafted, ops_for, reference

KINDS = ("allreduce", "allreduce_", "allreduce_out", "reduce_scatter", "allgather",
         "broadcast", "broadcast_", "broadcast_object", "allgather_object", "barrier",
         "async")
HUNG = None
"""The exit status :func:`run_job` gives a job it had to kill."""
WEIGHTS = np.array([6, 3, 2, 5, 4, 3, 2, 1, 1, 1, 2], float)
SMALL_SEGMENTS = ("", "", "", "64", "1K", "24")  # many segments: only for small counts
LARGE_SEGMENTS = ("", "", "64K", "256K")
RECONFIGURE = 0.1
"""How often a case takes the segment size it drew (Communicator.configure stops and
restarts the async engine); a large count always leaves a tiny segment."""


def draw_count(rng: np.random.Generator, size: int, max_count: int) -> int:
    """0, 1, fewer than the ranks, or log-uniform up to ``max_count``."""
    pick = rng.integers(8)
    if pick == 0:
        return 0
    if pick == 1:
        return 1
    if pick == 2:
        return int(rng.integers(max(size - 1, 1) + 1))
    return int(np.exp(rng.uniform(0, np.log(max_count))))


def one_case(comm: Any, rng: np.random.Generator, max_count: int,
             note: Callable[[str], None]) -> tuple[str, bool]:
    """Run one randomized collective; return its description and whether it was right.
    ``note`` gets the description before any message moves (a hang is then known by it)."""
    import mpitrain as mt
    from mpitrain import config
    from mpitrain.algorithms import ALGORITHMS

    size, rank = comm.size, comm.rank
    kind = str(rng.choice(KINDS, p=WEIGHTS / WEIGHTS.sum()))
    dtype = str(rng.choice(DTYPES))
    count = draw_count(rng, size, max_count)
    segments = SMALL_SEGMENTS if count <= 4096 else LARGE_SEGMENTS
    segment = config.parse_size(str(segments[rng.integers(len(segments))]) or "0")
    tiny = 0 < comm.settings.segment_bytes < 4096 < count  # a large count in tiny segments
    if segment != comm.settings.segment_bytes and (rng.random() < RECONFIGURE or tiny):
        comm.configure(segment_bytes=segment)  # collective: the rng is every rank's
    base = kind.rstrip("_").removesuffix("_out")
    # the ones this communicator runs (no shm under MPITRAIN_SHM=0 or across nodes)
    algorithms = ("auto", *(comm.algorithms(base) if base in ALGORITHMS else ()))
    algorithm = str(rng.choice(algorithms))
    what = f"{kind} {dtype}[{count}] {algorithm} seg={comm.settings.segment_bytes}"

    if kind not in ("async", "allreduce", "allreduce_", "allreduce_out", "reduce_scatter"):
        note(what)  # (the reductions once their op is drawn)
    if kind == "barrier":
        comm.barrier()
        return what, True
    if kind == "async":
        return async_batch(comm, rng, max_count, note)
    if kind == "broadcast_object":
        root = int(rng.integers(size))
        got = comm.broadcast_object({"root": root, "rank": rank, "data": list(range(count % 50))},
                                    root=root)
        return what, got == {"root": root, "rank": root, "data": list(range(count % 50))}
    if kind == "allgather_object":
        got = comm.allgather_object(("x" * (count % 40), rank))
        return what, got == [("x" * (count % 40), r) for r in range(size)]
    if kind.startswith("broadcast"):
        root = int(rng.integers(size))
        what += f" root={root}"
        x = crafted(rank, count, dtype, mt.Sum)
        want = crafted(root, count, dtype, mt.Sum)
        got = comm.broadcast(x, root=root, algorithm=algorithm) if kind == "broadcast" \
            else comm.broadcast_(x, root=root, algorithm=algorithm)
        return what, _same(got, want)
    if kind == "allgather":
        row = int(rng.integers(1, 4))
        rows = [int(rng.integers(count // row + 1)) for _ in range(size)]
        what += f" rows={rows}x{row}"
        blocks = [crafted(r, rows[r] * row, dtype, mt.Sum).reshape(rows[r], row)
                  for r in range(size)]
        return what, _same(comm.allgather(blocks[rank], algorithm=algorithm),
                           np.concatenate(blocks))
    ops = ops_for(dtype)
    op = ops[rng.integers(len(ops))]
    float_like = np.dtype(dtype).kind == "f" or dtype == "bfloat16"
    pre, post = (float(2.0 ** rng.integers(-1, 2)), float(2.0 ** rng.integers(-1, 2))) \
        if float_like and op in (mt.Sum, mt.Average) else (1.0, 1.0)
    what += f" {op.value} pre={pre:g} post={post:g}"
    note(what)
    x = crafted(rank, count, dtype, op)
    want = expected(size, count, dtype, op, pre, post)
    if kind == "reduce_scatter":
        row = int(rng.integers(1, 4))
        n = count // row * row
        x, want = x[:n].reshape(-1, row), want[:n].reshape(-1, row)
        got = comm.reduce_scatter(x, op=op, algorithm=algorithm, prescale_factor=pre,
                                  postscale_factor=post)
        return what + f" row={row}", _same(got, np.array_split(want, size)[rank])
    if rng.integers(4) == 0 and count:  # non-contiguous input: every other element
        wide = np.repeat(x, 2)
        x = wide[::2]
        what += " strided"
    if kind == "allreduce":
        got = comm.allreduce(x, op=op, algorithm=algorithm, prescale_factor=pre,
                             postscale_factor=post)
    elif kind == "allreduce_out":
        out = np.empty(x.shape, x.dtype)
        got = comm.allreduce(x, op=op, algorithm=algorithm, prescale_factor=pre,
                             postscale_factor=post, out=out)
        if got is not out:
            return what, False
    else:
        got = comm.allreduce_(x, op=op, algorithm=algorithm, prescale_factor=pre,
                              postscale_factor=post)
    return what, _same(got, want)


def async_batch(comm: Any, rng: np.random.Generator, max_count: int,
                note: Callable[[str], None]) -> tuple[str, bool]:
    """A batch of async allreduces (some in place, some of those into strided views, one
    maybe a grouped allreduce), named ones submitted and waited in an order of each
    rank's own, unnamed ones in the common order (in a third of the batches all alike,
    so that they are announced as runs), some polled with ``test()``; every result
    checked."""
    import mpitrain as mt

    size, rank = comm.size, comm.rank
    n = int(rng.integers(1, 31))
    burst = rng.integers(3) == 0  # unnamed ones alike: announced as runs
    specs = []
    for i in range(n):
        dtype = str(rng.choice(DTYPES))
        ops = ops_for(dtype)
        op = ops[rng.integers(len(ops))]
        count = draw_count(rng, size, max_count // 8 or 1)
        specs.append((dtype, op, count, bool(rng.integers(2)), bool(rng.integers(4)),
                      f"soak/{rng.integers(1 << 62)}/{i}"))
        if burst and not specs[-1][4]:
            alike = next(s for s in specs if not s[4])
            specs[-1] = (*alike[:4], False, specs[-1][5])
    note(f"async {n} allreduces (" + ", ".join(
        f"{'' if s[4] else 'unnamed '}{s[0]}[{s[2]}] {s[1].value}{' in place' if s[3] else ''}"
        for s in specs) + ")")
    mine = np.random.default_rng([int(rng.integers(1 << 31)), rank])  # this rank's orders
    named = [i for i, s in enumerate(specs) if s[4]]
    unnamed = [i for i, s in enumerate(specs) if not s[4]]
    mine.shuffle(named)
    handles: dict[int, Any] = {}
    inputs: dict[int, Any] = {}
    strided = {i for i, s in enumerate(specs) if s[3] and rng.integers(4) == 0}
    for i in named + unnamed:
        dtype, op, count, inplace, has_name, name = specs[i]
        x = inputs[i] = crafted(rank, count, dtype, op)
        if i in strided:  # in place into every other element of a bigger array
            holder = np.zeros(2 * count, x.dtype)
            holder[::2] = x
            x = inputs[i] = holder[::2]
        call = comm.allreduce_async_ if inplace else comm.allreduce_async
        handles[i] = call(x, op=op, name=name if has_name else None)
    group = None
    if rng.integers(3) == 0:
        counts = [draw_count(rng, size, 2000) for _ in range(int(rng.integers(1, 5)))]
        group = (counts, comm.grouped_allreduce_async(
            [crafted(rank + k, c, "float64", mt.Sum) for k, c in enumerate(counts)]))
    waits = list(handles)
    mine.shuffle(waits)
    ok = True
    for i in waits:
        dtype, op, count, inplace, _, _ = specs[i]
        if mine.integers(3) == 0:
            while not handles[i].test():
                time.sleep(0.0001)
        got = handles[i].wait()
        if inplace and got is not inputs[i]:
            ok = False
        ok = ok and _same(got, expected(size, count, dtype, op))
    if group is not None:
        counts, handle = group
        for k, (c, got) in enumerate(zip(counts, handle.wait())):
            want = sum(crafted(r + k, c, "float64", mt.Sum) for r in range(size))
            ok = ok and _same(got, np.asarray(want, np.float64).reshape(c))
    return f"async {n} allreduces{' + group' if group else ''}", ok


def expected(size: int, count: int, dtype: str, op: Any, pre: float = 1.0,
             post: float = 1.0) -> np.ndarray:
    """The allreduce of ``crafted`` inputs over ``size`` ranks, scaled and averaged."""
    import mpitrain as mt

    return _scaled(reference(size, count, dtype, mt.Sum if op is mt.Average else op),
                   op, size, pre, post)


def _scaled(acc: np.ndarray, op: Any, size: int, pre: float, post: float) -> np.ndarray:
    """The reference of ``reference()`` with Average and the scaling factors applied."""
    import mpitrain as mt

    acc = acc.copy()
    if pre != 1.0:
        np.multiply(acc, pre, out=acc, casting="unsafe")
    if op is mt.Average:
        if acc.dtype.kind in "iu":
            np.floor_divide(acc, size, out=acc)
        else:
            np.multiply(acc, post / size, out=acc, casting="unsafe")
    elif post != 1.0:
        np.multiply(acc, post, out=acc, casting="unsafe")
    return acc


def _same(got: Any, want: np.ndarray) -> bool:
    got = np.asarray(got)
    return (got.shape == want.shape and got.dtype == want.dtype
            and bool(np.array_equal(got, want, equal_nan=True)))


def worker(count: int, seed: int, max_count: int) -> int:
    """One job: ``count`` cases; rank 0 prints each case as it begins (``case i: ...``,
    so that the driver can name the case a hung job stopped in) and a JSON summary as
    its last line."""
    import mpitrain as mt

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's call on a hang
    comm = mt.init()
    rng = np.random.default_rng(seed)
    wrong: list[str] = []
    kinds: dict[str, int] = {}
    started = time.perf_counter()
    current = [0, ""]

    def note(what: str) -> None:
        current[1] = what
        if comm.rank == 0:
            print(f"case {current[0]}: {what}", flush=True)

    for i in range(count):
        current[0] = i
        try:
            what, ok = one_case(comm, rng, max_count, note)
        except Exception:
            sys.stderr.write(f"rank {comm.rank}: case {i} ({current[1]}) raised:\n"
                             f"{traceback.format_exc()}")
            raise
        kinds[what.split()[0]] = kinds.get(what.split()[0], 0) + 1
        if not ok:
            wrong.append(f"rank {comm.rank} case {i}: {what}")
    all_wrong = [w for ws in comm.allgather_object(wrong) for w in ws]
    stats = comm.async_stats() if comm.engine_started else None
    if comm.rank == 0:
        print(json.dumps({"ranks": comm.size, "collectives": count, "wrong": all_wrong,
                          "kinds": kinds, "seconds": round(time.perf_counter() - started, 1),
                          "fused": stats.fused if stats else 0,
                          "cycles": stats.cycles if stats else 0}), flush=True)
    mt.shutdown()
    return 1 if all_wrong else 0


def run_job(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, str]:
    """Run one mpirun job in a session of its own; past ``timeout`` seconds have every
    process of it print its threads' stacks (SIGUSR1, see :func:`worker`), then kill
    them all. Returns the exit status (:data:`HUNG`: killed), stdout and stderr."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        _signal_session(proc.pid, signal.SIGUSR1)
        time.sleep(3)
        _signal_session(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return HUNG, stdout, stderr + f"\n[the job hung: killed after {timeout:g} s]"


def _signal_session(sid: int, signum: int) -> None:
    """Send ``signum`` to every process of session ``sid`` (mpirun, its leader, only
    SIGKILL: it would forward other signals to the ranks a second time); Open MPI puts
    the ranks in process groups of their own, so a process group is not enough."""
    pids = {sid} if signum == signal.SIGKILL else set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and int(stat.parent.name) != sid:  # state ppid pgrp session
            pids.add(int(stat.parent.name))
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def driver(ranks: list[int], total: int, seed: int, max_count: int,
           job_timeout: float) -> int:
    """One mpirun job per rank count; print each job's line and the total. A job that
    fails or hangs (killed after ``job_timeout`` s) is reported with the case it
    stopped in and the command that runs it again."""
    venv_bin = Path(sys.executable).parent
    mpirun = str(venv_bin / "mpirun") if (venv_bin / "mpirun").exists() else "mpirun"
    flags = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
             "--mca", "threads_pthreads_yield_strategy", "nanosleep", "--mca", "osc", "^ucx",
             "-x", "PYTHONPATH"]
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    # a stalled job says where every rank is (the job's timeout still ends it)
    env.setdefault("MPITRAIN_STALL_WARNING_S", "30")
    done, failures = 0, 0
    shares = [total // len(ranks) + (i < total % len(ranks)) for i in range(len(ranks))]
    for i, (n, share) in enumerate(zip(ranks, shares)):
        cmd = [mpirun, *flags, "-np", str(n), sys.executable, __file__, "--worker",
               "--count", str(share), "--seed", str(seed + i), "--max-count", str(max_count)]
        rc, stdout, stderr = run_job(cmd, env, job_timeout)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if rc is HUNG or not lines:
            failures += 1
            cases = [ln for ln in stdout.splitlines() if ln.startswith("case ")]
            again = (f"MPITRAIN_SHM={os.environ.get('MPITRAIN_SHM', '1')} python tests/soak.py "
                     f"--ranks {n} --total {share} --seed {seed + i} --max-count {max_count}")
            print(f"soak: the job at {n} ranks (seed {seed + i}) "
                  f"{'HUNG' if rc is HUNG else f'failed (exit {rc})'} in "
                  f"{cases[-1] if cases else 'its start'} of {share}; run it again with: "
                  f"{again}\n{stderr[-12000:]}", flush=True)
            continue
        summary = json.loads(lines[-1])
        done += summary["collectives"]
        failures += len(summary["wrong"])
        print(f"soak: {summary['collectives']} collectives at {n} ranks (seed {seed + i}) in "
              f"{summary['seconds']} s, {len(summary['wrong'])} wrong; async: "
              f"{summary['fused']} arrays fused in {summary['cycles']} cycles; by kind: "
              + ", ".join(f"{k} {v}" for k, v in sorted(summary["kinds"].items())), flush=True)
        for w in summary["wrong"][:20]:
            print(f"  WRONG {w}")
    print(f"soak: {done} collectives verified against numpy, {failures} wrong or failed "
          f"(ranks {','.join(map(str, ranks))}, seed {seed})")
    return 1 if failures or done != total else 0


def main() -> int:
    """Parse the command line and run the driver or a worker."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,3,4,5", help="rank counts, one job each")
    p.add_argument("--total", type=int, default=10_000, help="collectives over all jobs")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--max-count", type=int, default=1 << 18, help="largest element count")
    p.add_argument("--job-timeout", type=float, default=900.0,
                   help="seconds after which a job counts as hung and is killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.count, args.seed, args.max_count)
    return driver([int(n) for n in args.ranks.split(",")], args.total, args.seed,
                  args.max_count, args.job_timeout)


if __name__ == "__main__":
    sys.exit(main())
