"""No deadlock on a crashing rank: an uncaught exception ends the whole job.

Under plain ``python``, a rank that dies of an uncaught exception leaves the other
ranks waiting forever inside their next collective. :func:`install` (called by
:func:`mpitrain.init` unless ``MPITRAIN_ABORT_ON_EXCEPTION=0``) replaces
``sys.excepthook`` and ``threading.excepthook`` with a hook that prints the traceback,
every line prefixed with the rank, and then ends the job:

* normally with ``MPI.COMM_WORLD.Abort(1)``, which makes ``mpiexec`` kill every rank;
* under ULFM (``MPITRAIN_ELASTIC=1``, set by ``mpitrain-run --elastic``) by killing
  its own process with ``SIGKILL``: survivors are only notified of deaths by signal,
  and they go on without this rank (see :mod:`mpitrain.elastic`);
* alone (``COMM_WORLD`` of one rank: a plain ``python script.py``), by exiting with
  status 1 as Python does, MPI finalized: no other rank waits, and ``Abort`` outside
  ``mpiexec`` (the pip Open MPI wheel's singleton) prints only that it cannot find its
  help text.

``sys.exit(code)`` is not an exception in this sense (Python calls no hook): a rank
that exits on its own while the others wait is caught by the exit guard
(:mod:`mpitrain.comm.exitguard`) instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from types import TracebackType
from typing import Any

from mpi4py import MPI

from . import config

_installed = False


def install() -> None:
    """Install the hooks (idempotent; a no-op if ``MPITRAIN_ABORT_ON_EXCEPTION=0``)."""
    global _installed
    if _installed or not config.ABORT_ON_EXCEPTION.get():
        return
    _installed = True
    previous = sys.excepthook
    previous_thread = threading.excepthook

    def excepthook(etype: type[BaseException], value: BaseException,
                   tb: TracebackType | None) -> None:
        if not _mpi_alive():
            previous(etype, value, tb)
            return
        _report(etype, value, tb, "")
        if not _alone():
            end_job()
        # alone: the interpreter exits with status 1 and finalizes MPI

    def thread_excepthook(args: Any) -> None:
        if args.exc_type is SystemExit or not _mpi_alive():
            previous_thread(args)
            return
        name = args.thread.name if args.thread is not None else "?"
        _report(args.exc_type, args.exc_value, args.exc_traceback, f" in thread {name!r}")
        end_job()

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


def end_job() -> None:
    """End this job now: SIGKILL this process under ULFM, else ``Abort`` every rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    if config.ELASTIC.get():
        os.kill(os.getpid(), signal.SIGKILL)
    if _alone():
        os._exit(1)
    MPI.COMM_WORLD.Abort(1)


def _mpi_alive() -> bool:
    return MPI.Is_initialized() and not MPI.Is_finalized()


def _alone() -> bool:
    """True when this process is the whole job (no other rank waits for it) and not
    elastic."""
    return MPI.COMM_WORLD.Get_size() == 1 and not config.ELASTIC.get()


def _report(etype: type[BaseException], value: BaseException | None,
            tb: TracebackType | None, where: str) -> None:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    how = ("killing this rank so the others go on without it (elastic mode)"
           if config.ELASTIC.get() else "exiting (no other rank to stop)" if _alone()
           else "aborting the whole job")
    lines = [f"mpitrain: rank {rank} of {size} (pid {os.getpid()}) died of an uncaught "
             f"exception{where}; {how} (MPITRAIN_ABORT_ON_EXCEPTION=0 turns this off)\n"]
    lines += traceback.format_exception(etype, value, tb)
    text = "".join(lines)
    stream = _terminal()
    stream.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    stream.flush()


def _terminal() -> Any:
    """``sys.stderr``, unless it is not a file (``torch.distributed``'s hook swaps in a
    ``StringIO`` while it calls the hook it wraps, and writes the text out after: never,
    when that hook ends the job): then the process's own ``sys.__stderr__``."""
    stream = sys.stderr
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return sys.__stderr__ if sys.__stderr__ is not None else stream
    return stream
