"""All of mpitrain's configuration, read in one place.

Precedence: keyword argument > ``MPITRAIN_*`` environment variable > default.
Each setting is read through :func:`get` so that a test can change the environment
and see the change without re-importing anything.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from .errors import ArgumentError

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _parse_size(text: str) -> int:
    """Parse a byte count with an optional K/M/G suffix (powers of 1024)."""
    stripped = text.strip().upper().removesuffix("B").removesuffix("I")
    factor = 1
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if stripped.endswith(suffix):
            stripped, factor = stripped[:-1], mult
            break
    value = int(float(stripped) * factor)
    if value < 0:
        raise ValueError(f"a size must be >= 0, got {text!r}")
    return value


def _parse_count(text: str) -> int:
    """Parse an integer >= 1."""
    value = int(text.strip())
    if value < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return value


# CPython keeps the environment in a dict of bytes on POSIX; reading it directly is several
# times faster than os.environ.get, which matters on the per-call path of small collectives.
_ENVIRON_BYTES: dict[bytes, bytes] | None = getattr(os.environ, "_data", None)
if os.name != "posix" or not isinstance(_ENVIRON_BYTES, dict):  # pragma: no cover
    _ENVIRON_BYTES = None


def _raw(name: str, key: bytes) -> str | None:
    if _ENVIRON_BYTES is None:  # pragma: no cover - non-POSIX
        return os.environ.get(name)
    value = _ENVIRON_BYTES.get(key)
    return None if value is None else os.fsdecode(value)


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One ``MPITRAIN_*`` variable: its name, parser, default and meaning.

    The variable is read on every :meth:`get` (so a changed environment is seen at
    once); the parsed value of each raw text is cached.
    """

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    _parsed: dict[str, T] = field(default_factory=dict, repr=False, compare=False)
    _key: bytes = field(default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", os.fsencode(self.name))

    def get(self, override: T | None = None) -> T:
        """Return ``override`` if given, else the parsed variable, else the default."""
        if override is not None:
            return override
        raw = _raw(self.name, self._key)
        if not raw:
            return self.default
        try:
            return self._parsed[raw]
        except KeyError:
            pass
        try:
            value = self.parse(raw)
        except ValueError as exc:
            raise ArgumentError(f"{self.name}={raw!r} is not valid: {exc}") from None
        if len(self._parsed) < 64:
            self._parsed[raw] = value
        return value


ALGORITHM = Setting("MPITRAIN_ALGORITHM", str, "auto",
                    "Default algorithm for every collective (auto, ring, mpi, ...).")
SEGMENT_BYTES = Setting("MPITRAIN_SEGMENT_BYTES", _parse_size, 0,
                        "Pipeline segment size of the ring in bytes; 0 chooses by size.")
TUNING_FILE = Setting("MPITRAIN_TUNING_FILE", str, "",
                      "JSON file written by mpitrain-tune that overrides the selection table.")
CHECK = Setting("MPITRAIN_CHECK", _parse_bool, True,
                "Cross-rank validation of every collective's arguments before data moves.")
SHM = Setting("MPITRAIN_SHM", _parse_bool, True,
              "Use shared-memory windows between the ranks of one node (validation, shm "
              "algorithm); read when a communicator is created.")
SINGLE_COPY = Setting("MPITRAIN_SINGLE_COPY", _parse_bool, True,
                      "Let ranks of one node read each other's buffers directly "
                      "(process_vm_readv) in the single_copy algorithm; read when a "
                      "communicator is created, off on every rank if off on any.")

FUSION_THRESHOLD = Setting("MPITRAIN_FUSION_THRESHOLD", _parse_size, 64 << 20,
                           "Async allreduces are packed into fusion buffers of up to this "
                           "many bytes; 0 turns fusion off.")
CYCLE_TIME_MS = Setting("MPITRAIN_CYCLE_TIME_MS", float, 1.0,
                        "Async engine: pause after a cycle in which nothing moved, and the "
                        "longest sleep while polling for other ranks (milliseconds).")
TIMELINE = Setting("MPITRAIN_TIMELINE", str, "",
                   "Chrome-trace file that rank 0 writes the async engine's timeline to.")
INTER_SEGMENT_BYTES = Setting("MPITRAIN_INTER_SEGMENT_BYTES", _parse_size, 60 << 10,
                              "Largest message of the inter-node phases of hierarchical "
                              "algorithms; 0: as MPITRAIN_SEGMENT_BYTES.")
CROSS_RANKS = Setting("MPITRAIN_CROSS_RANKS", int, 1,
                      "Hierarchical allreduce: how many ranks of each node exchange across "
                      "nodes; 1 sends each node's sum through its first rank (one connection "
                      "per pair of nodes), 0 every local rank its own shard in parallel.")


def _parse_seconds(text: str) -> float:
    """Seconds as a float; 0 (or ``off``/``none``) turns the feature off."""
    if text.strip().lower() in ("off", "none", "never"):
        return 0.0
    value = float(text)
    if value < 0:
        raise ValueError(f"seconds must be >= 0, got {text!r}")
    return value


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return lowered
    return parse


STALL_WARNING_S = Setting("MPITRAIN_STALL_WARNING_S", _parse_seconds, 60.0,
                          "Warn when a collective has waited this long for other ranks (0: "
                          "never); read when a Communicator is created.")
STALL_TIMEOUT_S = Setting("MPITRAIN_STALL_TIMEOUT_S", _parse_seconds, 0.0,
                          "Raise StallError (or abort) after this long; 0: wait forever.")
STALL_ACTION = Setting("MPITRAIN_STALL_ACTION", _parse_choice("raise", "abort"), "raise",
                       "At the stall timeout: raise mt.StallError, or abort the whole job.")
ABORT_ON_EXCEPTION = Setting("MPITRAIN_ABORT_ON_EXCEPTION", _parse_bool, True,
                             "mt.init() installs an excepthook that ends the whole job when "
                             "one rank raises an uncaught exception.")
ELASTIC = Setting("MPITRAIN_ELASTIC", _parse_bool, False,
                  "The job runs under ULFM (mpitrain-run --elastic): a failing rank kills "
                  "itself by signal so that the survivors are notified.")
MPIEXEC = Setting("MPITRAIN_MPIEXEC", str, "",
                  "mpiexec used by mpitrain-run (default: next to python, then PATH).")

CUDA_AWARE: Setting[bool | None] = Setting(
    "MPITRAIN_CUDA_AWARE", _parse_bool, None,
    "1: hand device buffers to MPI; 0: stage them through host memory; unset: ask MPI.")
STAGING_SLOTS = Setting("MPITRAIN_STAGING_SLOTS", _parse_count, 4,
                        "Pinned host segments per direction when staging device buffers.")
LOG_LEVEL = Setting("MPITRAIN_LOG_LEVEL",
                    _parse_choice("debug", "info", "warning", "error", "critical"), "",
                    "Level of the 'mpitrain' logger; when set, its lines go to stderr "
                    "prefixed with the rank (unset: Python's logging configuration).")


ALL_SETTINGS: tuple[Setting[Any], ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Setting))
OTHER_NAMES = frozenset({"MPITRAIN_RESTART", "MPITRAIN_COMPILE"})
"""Variables that are not settings: set by ``mpitrain-run --max-restarts`` for the
script, read by ``setup.py``."""


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Parse every ``MPITRAIN_*`` variable that is set; return a warning for each name
    that mpitrain does not know, with the closest known name.

    Raises:
        ArgumentError: naming the first variable whose value is not valid.
    """
    env = os.environ if environ is None else environ
    known = {setting.name: setting for setting in ALL_SETTINGS}
    warnings = []
    for name in sorted(n for n in env if n.startswith("MPITRAIN_")):
        setting = known.get(name)
        if setting is not None:
            if env[name]:
                try:
                    setting.parse(env[name])
                except ValueError as exc:
                    raise ArgumentError(f"{name}={env[name]!r} is not valid: {exc}; fix or "
                                        "unset it") from None
        elif name not in OTHER_NAMES:
            suffixes = {n.removeprefix("MPITRAIN_"): n for n in [*known, *OTHER_NAMES]}
            close = difflib.get_close_matches(name.removeprefix("MPITRAIN_"), suffixes, n=1,
                                              cutoff=0.6)
            hint = f"did you mean {suffixes[close[0]]}?" if close else \
                "python -c 'import mpitrain.config as c; print(c.describe())' lists them"
            warnings.append(f"{name} is not an mpitrain setting and is ignored ({hint})")
    return warnings


def describe() -> str:
    """Return a human-readable table of every setting and its current value."""
    lines = []
    for setting in ALL_SETTINGS:
        lines.append(f"{setting.name:32s} = {setting.get()!r:12}  {setting.doc}")
    return "\n".join(lines)


parse_size = _parse_size
parse_bool = _parse_bool
