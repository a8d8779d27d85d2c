"""``python -m mpitrain`` (and ``mpitrain-run --check-build``): what this installation runs.

Prints, one ``name: value`` line each, what a person checking an installation asks
first: mpitrain's version and where it is imported from, whether the engine core and
the host copy extension are compiled (and why not), the MPI library, its version and
the ``mpiexec`` that ``mpitrain-run`` would start, whether MPI takes device (CUDA)
buffers, which of CuPy, NCCL and torch are found, and the algorithms of each
collective. ``--smoke`` then runs a small allreduce, allgather and broadcast on
``-np`` ranks (2 by default), each result checked element by element: started through
``mpitrain-run`` when this process is not a rank of an MPI job, run in place when it is.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

from . import __version__, config, launcher
from . import engine as _engine
from ._builds import why_not_compiled
from .algorithms import ALGORITHMS
from .backends import cuda_aware, hostcopy

JOB_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
"""Variables that an ``mpiexec`` sets on every rank (Open MPI, MPICH): their presence
says that this process is a rank of a job."""
SMOKE_ELEMENTS = 1000
"""Elements per rank of the smoke collectives: more than any rank count, not divisible
by most."""


def under_mpiexec(environ: dict[str, str] | None = None) -> bool:
    """True when this process was started by an ``mpiexec`` (a rank of a job)."""
    env = os.environ if environ is None else environ
    return any(name in env for name in JOB_VARIABLES)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _module_version(name: str) -> str | None:
    """``name``'s version if it can be imported, else ``None`` (also when it is there but
    fails to import: the reason is what a user needs)."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # a broken install: say why instead of failing the report
        return f"found but not importable ({type(exc).__name__}: {exc})"
    return str(getattr(module, "__version__", "unknown version"))


def _nccl(torch_version: str | None, cupy_version: str | None) -> str:
    """The NCCL versions that torch and CuPy carry, if any, and whether mpitrain can use
    one (CuPy's, for device buffers where no two ranks share a GPU)."""
    found = []
    usable = False
    if torch_version and torch_version[0].isdigit():
        try:
            import torch

            if torch.cuda.is_available():
                found.append("torch's " + ".".join(map(str, torch.cuda.nccl.version())))
        except Exception:  # no CUDA build of torch: nothing to say
            pass
    if cupy_version and cupy_version[0].isdigit():
        try:
            from cupy.cuda import nccl

            found.append(f"CuPy's {nccl.get_version()}")
            usable = True
        except Exception:  # CuPy built without NCCL
            pass
    where = ", ".join(found) if found else "not found"
    if usable:
        return (f"{where} (mpitrain runs device collectives on CuPy's where no two ranks "
                "share a GPU; docs/gpu.md)")
    return (f"{where} (mpitrain uses CuPy's NCCL only; device collectives run over CUDA IPC "
            "and MPI)")


def _cupy(version: str | None) -> str:
    if version is None:
        return "not found (pip install 'mpitrain[cuda13]' for device buffers)"
    if not version[0].isdigit():
        return version
    try:
        import cupy

        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"{version}, no usable GPU ({type(exc).__name__}: {exc})"
    return f"{version}, {devices} GPU(s)"


def _torch(version: str | None) -> str:
    if version is None:
        return "not found (pip install 'mpitrain[torch]' for mpitrain.torch)"
    if not version[0].isdigit():
        return version
    import torch

    return f"{version}, CUDA {'available' if torch.cuda.is_available() else 'not available'}"


def report() -> list[tuple[str, str]]:
    """The ``(name, value)`` lines of the install check, in the order printed."""
    from mpi4py import MPI

    package = Path(__file__).resolve().parent
    engine, copies = _engine.compiled(), hostcopy.compiled()
    why = why_not_compiled(engine, copies, package)
    try:
        mpiexec = launcher.find_mpiexec()
    except SystemExit as exc:
        mpiexec = f"none ({exc})"
    library = MPI.Get_library_version().strip().splitlines()[0]
    aware = cuda_aware.decision(config.CUDA_AWARE.get())
    algorithms = []
    for collective, names in ALGORITHMS.items():
        shown = [name + (" (needs the host copy extension)"
                         if name == "single_copy" and not copies else "") for name in names]
        algorithms.append((f"  {collective}", ", ".join(shown)))
    torch_version = _module_version("torch")
    cupy_version = _module_version("cupy")
    bf16 = _module_version("ml_dtypes")
    return [
        ("mpitrain", f"{__version__} ({package})"),
        ("python", f"{sys.version.split()[0]} ({sys.executable})"),
        ("engine core compiled", _yes(engine)),
        ("host copies compiled", _yes(copies)),
        *([("why not", why)] if why else []),
        ("mpi4py", _module_version("mpi4py") or "not found"),
        ("MPI library", library),
        ("MPI standard", "{}.{}".format(*MPI.Get_version())),
        ("mpiexec", mpiexec),
        ("CUDA-aware MPI", f"{_yes(bool(aware.aware))} ({aware.how})"),
        ("CuPy", _cupy(cupy_version)),
        ("NCCL", _nccl(torch_version, cupy_version)),
        ("torch", _torch(torch_version)),
        ("bfloat16 (ml_dtypes)", bf16 or "not found (pip install 'mpitrain[bf16]')"),
        ("algorithms", "(collective: names for algorithm=...; auto picks among them)"),
        *algorithms,
    ]


def smoke() -> int:
    """Run the smoke collectives as one rank of this job; rank 0 prints the outcome.

    Returns:
        0 if every result is right on every rank, else 1.
    """
    import mpitrain as mt

    comm = mt.init()
    rank, size = comm.rank, comm.size
    start = time.perf_counter()
    x = np.arange(SMOKE_ELEMENTS, dtype=np.float32) + rank
    wrong = []
    total = comm.allreduce(x)
    expected = size * np.arange(SMOKE_ELEMENTS, dtype=np.float32) + size * (size - 1) / 2
    if not np.array_equal(total, expected):
        wrong.append("allreduce")
    gathered = comm.allgather(np.full(3, rank, dtype=np.int64))
    if not np.array_equal(gathered, np.repeat(np.arange(size, dtype=np.int64), 3)):
        wrong.append("allgather")
    sent = comm.broadcast(np.arange(7, dtype=np.float64) * (rank + 1), root=0)
    if not np.array_equal(sent, np.arange(7, dtype=np.float64)):
        wrong.append("broadcast")
    failed = comm.allgather_object(wrong)
    elapsed = time.perf_counter() - start
    if rank == 0:
        bad = {r: w for r, w in enumerate(failed) if w}
        if bad:
            print(f"smoke test: FAILED at {size} ranks: wrong results {bad} (rank: "
                  "collectives)", flush=True)
        else:
            print(f"smoke test: allreduce, allgather and broadcast at {size} ranks: every "
                  f"element right ({elapsed * 1e3:.0f} ms)", flush=True)
    mt.shutdown()
    return 1 if any(failed) else 0


def launch_smoke(ranks: int, environ: dict[str, str]) -> int:
    """Start ``mpitrain-run -np ranks python -m mpitrain --smoke``; its exit code.

    ``environ``: the environment to start it with (this process's, as it was before MPI
    was loaded here: a launched job must not see this process's own MPI variables).
    """
    import subprocess

    cmd = [sys.executable, "-m", "mpitrain.run", "-np", str(ranks), sys.executable, "-m",
           "mpitrain", "--smoke"]
    print(f"smoke test: mpitrain-run -np {ranks} python -m mpitrain --smoke", flush=True)
    # the report above has said whether the compiled core runs: the ranks need not
    return subprocess.call(cmd, env={**environ, config.FALLBACK_NOTICE.name: "0"})


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mpitrain``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="python -m mpitrain",
        description="Print what this installation of mpitrain runs (compiled core, MPI, "
                    "GPU support, algorithms); with --smoke, also run a checked collective "
                    "on a few ranks.",
        epilog="Examples: python -m mpitrain; python -m mpitrain --smoke -np 3; "
               "mpitrain-run --check-build")
    p.add_argument("--smoke", action="store_true",
                   help="also run a small allreduce, allgather and broadcast on -np ranks "
                        "(through mpitrain-run unless already a rank of an MPI job)")
    p.add_argument("-np", "-n", dest="np", type=int, default=2,
                   help="ranks of the smoke test (default 2)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.np < 1:
        p.error("-np must be >= 1")
    if args.smoke and under_mpiexec():
        return smoke()
    environ = dict(os.environ)  # before MPI is loaded below
    lines = report()
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name + ':':{width + 1}} {value}")
    sys.stdout.flush()
    if args.smoke:
        return launch_smoke(args.np, environ)
    return 0
