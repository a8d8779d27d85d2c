"""Starting whole ``mpirun`` jobs from a test, with a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess

from jobrun import FLAGS, MPIRUN, NOT_STARTED, environment


def start(np_: int, argv: list[str], **env: str) -> subprocess.Popen[str]:
    """``mpirun -np np_ argv...`` with this checkout on PYTHONPATH and ``env`` exported."""
    full_env = environment(**env)
    exports = [a for k in ("PYTHONPATH", *env) for a in ("-x", k)]
    return subprocess.Popen([MPIRUN, *FLAGS, *exports, "-np", str(np_), *argv], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """Wait for the job; kill its whole process group if it outlives ``timeout``."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out + "\n[killed after timeout]"


def run(np_: int, argv: list[str], timeout: float, **env: str) -> tuple[int, str]:
    """:func:`start` then :func:`finish`; once more if MPI's launcher failed before
    starting any rank (:data:`jobrun.NOT_STARTED`: the job never ran)."""
    code, out = finish(start(np_, argv, **env), timeout)
    if NOT_STARTED in out:
        code, out = finish(start(np_, argv, **env), timeout)
    return code, out
