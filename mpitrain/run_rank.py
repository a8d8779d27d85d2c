"""What ``mpitrain-run`` starts on every rank: ``python run_rank.py COMMAND [ARGS...]``.

It sets torchrun's per-rank variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``) from the ones the MPI gives each rank, then replaces itself with
``COMMAND`` (``os.execvp``: the same process, the same pid), so that code written for
``torchrun`` finds them in ``os.environ`` from its first line. ``MASTER_ADDR`` and
``MASTER_PORT`` are the same on every rank and come from the launcher.

It imports only the standard library, never MPI (a rank must not initialise MPI before
its command does), and runs as a file (``python -I .../run_rank.py``) so that it needs no
``mpitrain`` on the rank's ``sys.path``; ``python -m mpitrain.run_rank`` works too.

Under ``mpitrain-run --elastic`` (``MPITRAIN_ELASTIC=1``) it stays, as a *supervisor*:
the MPI runtime started this process, so this is the process it watches as the rank,
and ULFM tells the other ranks of its death only when it dies *by a signal*. The
command runs in a child process (it dies with the supervisor), and mpitrain reports
to the supervisor through a pipe (``MPITRAIN_SUPERVISOR_FD``): ``I`` when it has
initialised, ``C`` when every rank has reached its exit (:mod:`mpitrain.comm.exitguard`).
When the child ends, the supervisor

* kills itself with SIGKILL if the child died by a signal, or if it had initialised
  mpitrain and exited (``os._exit()``, ``sys.exit()``, a return from the script) before
  every rank reached its exit: the other ranks see a rank failure and recover;
* otherwise exits with the child's status, and when that is 0 reports the clean exit
  to the launcher (``MPITRAIN_ELASTIC_REPORT``, its ``host:port``): under ULFM
  ``mpiexec`` exits 0 even when every rank died, so the launcher counts these reports.

Signals sent to the supervisor (SIGTERM, SIGINT, ...) are passed on to the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from types import FrameType
from typing import Mapping

TORCH_VARIABLES: dict[str, tuple[str, ...]] = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}
"""Each torchrun variable, taken from the first of these that is set: Open MPI's, then
MPICH's (Hydra, PMI-1), then PMIx's."""


def torch_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's per-rank variables for a rank whose environment is ``environ``.

    A variable that no MPI variable gives is left out (the rank then keeps whatever it
    had, usually nothing).
    """
    found = {}
    for name, sources in TORCH_VARIABLES.items():
        for source in sources:
            if environ.get(source):
                found[name] = environ[source]
                break
    return found


SUPERVISOR_FD = "MPITRAIN_SUPERVISOR_FD"
"""The variable naming the pipe through which mpitrain reports to the supervisor."""
INITIALISED, CLEAN_EXIT = b"I", b"C"
"""What mpitrain writes to the pipe: it has initialised; every rank has reached its exit."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)
PR_SET_PDEATHSIG = 1
REPORT = "MPITRAIN_ELASTIC_REPORT"
REPORT_TIMEOUT_S = 10.0


def elastic(environ: Mapping[str, str]) -> bool:
    """Whether ``mpitrain-run --elastic`` started this rank (``MPITRAIN_ELASTIC`` true)."""
    return environ.get("MPITRAIN_ELASTIC", "").strip().lower() in ("1", "true", "yes", "on")


def run(command: list[str]) -> int:
    """Replace this process with ``command``; returns only if it cannot be started."""
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"mpitrain-run: rank {os.environ.get('RANK', '?')} cannot run {command[0]!r}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


def die_with(parent: int) -> None:
    """Make the kernel SIGKILL this process when ``parent`` ends (Linux; else nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def verdict(status: int, marks: bytes) -> int | None:
    """The supervisor's exit code for a child that ended with wait ``status`` after
    writing ``marks``; None when the rank has failed (the supervisor kills itself)."""
    if os.WIFSIGNALED(status):
        return None
    if INITIALISED in marks and CLEAN_EXIT not in marks:
        return None
    return os.waitstatus_to_exitcode(status)


def report_clean_exit(environ: Mapping[str, str]) -> None:
    """Tell the launcher at ``MPITRAIN_ELASTIC_REPORT`` (``host:port``; this host's
    loopback if ``host`` cannot be reached) that this rank's command exited 0, and wait
    for its acknowledgement; nothing if it is unset or cannot be reached (the launcher
    then counts this rank as failed)."""
    address = environ.get(REPORT, "")
    host, _, port = address.rpartition(":")
    if not (host and port.isdigit()):
        return
    for name in (host, "127.0.0.1"):
        with contextlib.suppress(OSError), \
                socket.create_connection((name, int(port)), timeout=REPORT_TIMEOUT_S) as sock:
            sock.sendall(b"0")
            sock.recv(1)
            return


def supervise(command: list[str]) -> int:
    """Run ``command`` in a child process and stand for it as the rank (see above)."""
    parent = os.getpid()
    marks_in, marks_out = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(marks_in)
        die_with(parent)
        os.set_inheritable(marks_out, True)
        os.environ[SUPERVISOR_FD] = str(marks_out)
        os._exit(run(command))
    os.close(marks_out)

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in FORWARDED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, forward)
    _, status = os.waitpid(pid, 0)
    os.set_blocking(marks_in, False)
    marks = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(marks_in, 4096):
            marks += chunk
    code = verdict(status, marks)
    if code == 0:
        report_clean_exit(os.environ)
    if code is not None:
        return code
    rank = os.environ.get("RANK", "?")
    how = (f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
           if os.WIFSIGNALED(status) else
           f"exited with code {os.waitstatus_to_exitcode(status)} while other ranks went on")
    print(f"mpitrain-run: rank {rank} (pid {pid}) {how}; ending its rank process by SIGKILL "
          "so that the other ranks recover without it (--elastic)", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 137  # not reached


def main(argv: list[str] | None = None) -> int:
    """Set torchrun's variables and run the command: in this process, or under
    ``--elastic`` in a child of this supervisor.

    Returns only if the command cannot be started: 127 if it is not found, 126 if it
    cannot be executed, 2 if there is none; under ``--elastic`` the child's exit code.
    """
    command = sys.argv[1:] if argv is None else argv
    if not command:
        print("usage: python -m mpitrain.run_rank COMMAND [ARGS...] (started by mpitrain-run "
              "on every rank)", file=sys.stderr)
        return 2
    os.environ.update(torch_variables(os.environ))
    if elastic(os.environ):
        return supervise(command)
    return run(command)


if __name__ == "__main__":
    sys.exit(main())
